"""KV tiers of a tensor-parallel worker: every rank keeps its own KV heads of each entry
in its own host tier and disk slab (engine/kv_tiers.py; its own fingerprint, so its own
file), and rank 0 decides what they hold. The scheduler, the block pool, the prefix
cache and the tiers' index the router mirrors are rank 0's alone, so rank 0 hands its
ranks each store and load as an order (engine/tp_executor.py TPLeader.order), in the
order its own tiers thread gets them; every rank's tiers then make the same LRU and
disk choices::

    rank 0 (TPTiers, its step thread)           rank i (RankTiers, in follow())
    store(blocks, hashes): rank 0's KVTiers
      takes those no tier holds; one more ref
      each for the ranks' copies
    load(key, hashes, blocks)  [any thread]
    poll() [step thread, every schedule]:
      the queued stores and loads, to rank 0's
      KVTiers and                     order ──▶  tier_store / tier_load: queued on
                                                 this rank's tiers thread
      while a rank's copy is out:    gather ──▶  tier_poll: the blocks copied, the
                                            ◀──  loads done (key, blocks loaded)
      a stored block goes back to the pool once every rank copied it; a load is
      done once every rank's is, with the fewest blocks any rank loaded

A rank can lack an entry rank 0 holds (its disk write failed, its entry failed its
checksum, a restart read back a slot one rank's write never finished): that load then
stops there on every rank (the rest is computed) and the entry is forgotten on every
rank, so the router stops counting it. At start, rank 0 gathers what each rank's disk
tier read back and forgets, everywhere, every entry not held by all.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from .block_pool import BlockHash
from .kv_tiers import KVTiers, LoadDone, TierStats

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _RankLoad:
    hashes: list[BlockHash]
    ranks_left: int                   # follower ranks yet to report it
    num_loaded: int                   # the fewest blocks a follower loaded so far
    rank0_loaded: int | None = None   # rank 0's, once done


@dataclass(slots=True)
class _Op:
    name: str                    # "store" | "load"
    kwargs: dict = field(default_factory=dict)


class TPTiers:
    """Rank 0's side (see the module docstring), KVTiers' interface to the schedulers:
    `tiers` is rank 0's own, over the pool; `leader` the TPLeader runner whose order and
    gather reach ranks 1..size-1. store and poll are called from the step thread, load
    from any (it is queued for the next poll); `notify` wakes the step loop.
    `on_broken(error)`: a rank did not answer (the worker exits; does not return).

    Raises (at start): what TPLeader.gather raises, the group broken."""

    def __init__(self, tiers: KVTiers, leader, size: int,
                 on_broken: Callable[[Exception], None],
                 notify: Callable[[], None] | None = None):
        self.local, self.leader, self.size = tiers, leader, size
        self._on_broken = on_broken
        self._notify = notify or (lambda: None)
        self._lock = threading.Lock()           # _ops (load() comes from RPC threads)
        self._ops: list[_Op] = []
        self._storing: Counter[int] = Counter()  # block -> ranks yet to copy it
        self._loads: dict[str, _RankLoad] = {}
        self._reconcile()

    # KVTiers' read side: rank 0's index, counters and tiers
    @property
    def host(self):
        return self.local.host

    @property
    def disk(self):
        return self.local.disk

    @property
    def stats(self) -> TierStats:
        """Rank 0's counters, bytes loaded counted for every rank (each holds as many
        KV heads of a block)."""
        st = self.local.stats
        return replace(st, bytes_loaded=st.bytes_loaded * self.size)

    def lookup(self, hashes: Sequence[BlockHash]) -> int:
        return self.local.lookup(hashes)

    def cache_events(self, since: int):
        return self.local.cache_events(since)

    def held(self) -> set[BlockHash]:
        return self.local.held()

    # --- what the schedulers call -------------------------------------------------------

    def store(self, block_ids: Sequence[int], hashes: Sequence[BlockHash]) -> None:
        """KVTiers.store on every rank, from the next poll(); the blocks are held (one
        more ref each) from now until every rank copied them, or the next poll() when a
        tier holds their hashes already."""
        self.local.pool.incref(block_ids)
        with self._lock:
            self._ops.append(_Op("store", {"block_ids": list(block_ids),
                                           "hashes": list(hashes)}))

    def load(self, key: str, hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> None:
        """KVTiers.load on every rank, from the next poll(); poll() reports `key` once
        every rank's is done."""
        with self._lock:
            self._ops.append(_Op("load", {"key": key, "hashes": list(hashes),
                                          "block_ids": list(block_ids)}))
        self._notify()

    def poll(self) -> list[LoadDone]:
        """Send the queued stores and loads, then what every rank finished: the loads
        done (each with the fewest blocks a rank loaded), the blocks every rank copied
        given back to the pool."""
        self._flush()
        for done in self.local.poll():
            self._loads[done.key].rank0_loaded = done.num_loaded
        if self.wants_poll:
            freed = []
            for stored, loaded in self._gather("tier_poll"):
                for b in stored:
                    self._storing[b] -= 1
                    if not self._storing[b]:
                        del self._storing[b]
                        freed.append(b)
                for key, n in loaded:
                    load = self._loads[key]
                    load.ranks_left -= 1
                    load.num_loaded = min(load.num_loaded, n)
            if freed:
                self.local.pool.free(freed)
        out = []
        for key, load in list(self._loads.items()):
            if load.ranks_left or load.rank0_loaded is None:
                continue
            del self._loads[key]
            out.append(LoadDone(key, min(load.num_loaded, load.rank0_loaded)))
            if load.num_loaded < load.rank0_loaded:      # a rank lacks this entry
                logger.warning("KV tiers: a rank lacks an entry rank 0 holds; forgotten "
                               "on every rank")
                self._forget(load.hashes[load.num_loaded:load.num_loaded + 1])
        return out

    @property
    def wants_poll(self) -> bool:
        """A rank's copy is out: the step loop polls soon, as ranks cannot wake it."""
        return bool(self._storing) or any(load.ranks_left for load in self._loads.values())

    def idle(self) -> bool:
        """Nothing queued or in flight on any rank (tests: every held block back)."""
        with self._lock:
            ops = bool(self._ops)
        return self.local.idle() and not ops and not self._storing and not self._loads

    def close(self) -> None:
        """Rank 0's tiers; each rank closes its own when its loop ends."""
        self.local.close()

    # --- inside ---------------------------------------------------------------------------

    def _flush(self) -> None:
        with self._lock:
            ops, self._ops = self._ops, []
        for op in ops:
            if op.name == "store":
                blocks, hashes = self.local.store(**op.kwargs)
                # store()'s ref stays until every rank copied, one ref per block: a
                # block still held for an earlier store (its entry lost on rank 0
                # meanwhile, stored again) counts the new copies on that ref
                held = set(blocks) - self._storing.keys()
                self.local.pool.free([b for b in op.kwargs["block_ids"] if b not in held])
                if blocks:
                    self._storing.update({b: self.size - 1 for b in blocks})
                    self._order("tier_store", block_ids=blocks, hashes=hashes)
            else:
                hashes = op.kwargs["hashes"]
                self._loads[op.kwargs["key"]] = _RankLoad(hashes, self.size - 1, len(hashes))
                self.local.load(**op.kwargs)
                self._order("tier_load", **op.kwargs)

    def _forget(self, hashes: list[BlockHash]) -> None:
        self.local.forget(hashes)
        self._order("tier_forget", hashes=hashes)

    def _reconcile(self) -> None:
        """Forget, on every rank, the entries read back from disk that some rank lacks."""
        held = [self.local.held(), *(set(h) for h in self._gather("tier_held"))]
        common = set.intersection(*held)
        uneven = set.union(*held) - common
        if uneven:
            logger.warning("KV tiers: %d disk entries not on every rank; forgotten",
                           len(uneven))
            self._forget(sorted(uneven))

    def _order(self, name: str, **kwargs) -> None:
        try:
            self.leader.order(name, **kwargs)
        except Exception as e:          # TPGroupBroken
            self._on_broken(e)
            raise

    def _gather(self, name: str) -> list:
        try:
            return self.leader.gather(name)
        except Exception as e:          # TPGroupBroken
            self._on_broken(e)
            raise


class RankTiers:
    """A follower rank's part (see the module docstring): its own KVTiers (pool None),
    driven by rank 0's orders in follow() (engine/tp_executor.py)."""

    ORDERS = ("tier_store", "tier_load", "tier_forget")
    GATHERS = ("tier_poll", "tier_held")

    def __init__(self, tiers: KVTiers):
        assert tiers.pool is None, "a follower rank's tiers hold no pool refs"
        self.tiers = tiers

    def tier_store(self, block_ids: list[int], hashes: list[BlockHash]) -> None:
        self.tiers.store_exactly(block_ids, hashes)

    def tier_load(self, key: str, hashes: list[BlockHash], block_ids: list[int]) -> None:
        self.tiers.load(key, hashes, block_ids)

    def tier_forget(self, hashes: list[BlockHash]) -> None:
        self.tiers.forget(hashes)

    def tier_poll(self) -> tuple[list[int], list[tuple[str, int]]]:
        """(blocks copied to the host tier, (key, blocks loaded) of each load done) since
        the last poll."""
        stored, loaded = self.tiers.take_finished()
        return stored, [(d.key, d.num_loaded) for d in loaded]

    def tier_held(self) -> list[BlockHash]:
        return sorted(self.tiers.held())

    def close(self) -> None:
        self.tiers.close()
