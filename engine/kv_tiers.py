"""KV tiers below a worker's block pool: host memory, then a local disk.

The pool's prefix cache forgets a block when it evicts it; the tiers keep it, as vLLM's
KV offloading and SGLang's HiCache (host L2, storage L3) do, keyed by the block's hash
(engine/block_pool.block_hashes: chained, so a hash names its whole prefix):

    store(blocks, hashes)   write-through: blocks just registered in the prefix cache
                            are copied to the host tier by the tiers thread, each held
                            in the pool (one more ref) until copied; poll() frees them
    host tier full          its least recently used entry moves to the disk tier (one
                            slot of a slab file; NIXL's POSIX backend moves the bytes)
    lookup(hashes)          how many leading hashes a tier holds
    load(key, hashes, ids)  the tiers thread copies those entries into pool blocks while
                            the step thread runs other steps; poll() reports the key
                            with how many leading blocks arrived (a missing or damaged
                            entry ends the run, and so does the load's deadline,
                            load_timeout_s after load(): the rest is computed)

The disk tier's I/O runs on its own thread (engine/kv_disk_tier.py): a block moved to it
is queued, or dropped when the disk is behind, never waited on; a load waits for a disk
read until its deadline at most; a disk stalled past XFER_TIMEOUT_S is turned off.

On CPU the pool and the host tier share DRAM: the host tier holds up to its cap of what
the pool may evict, and the disk tier is where capacity grows. On CUDA the host tier is
pinned host memory.

Each disk slot starts with a header naming the entry: its block hash, the fingerprint of
model, dtype and KV layout (`fingerprint`), a sequence number (the LRU order across a
restart) and an HMAC of it all and its bytes, keyed from the cluster secret. A restarted
worker reads the headers back and serves their hits; an entry whose MAC fails when
loaded is dropped, never served.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .block_pool import BlockHash, BlockPool, EventLog
from .kv_disk_tier import DiskTier, SlabDirectory, fingerprint, slot_bytes

__all__ = ["KVTiers", "LoadDone", "TierStats", "fingerprint"]

logger = logging.getLogger(__name__)

GIB = 1 << 30
WATCH_S = 1.0          # the tiers thread looks at its disk tier's health this often


def block_view(kv_cache: torch.Tensor, block: int) -> torch.Tensor:
    """Block `block` of a cache [num_layers, 2, num_blocks, ...]: a strided view
    [num_layers, 2, num_kv_heads, block_size, head_dim]."""
    return kv_cache[:, :, block]


@dataclass(slots=True)
class TierStats:
    """Counters of a worker's tiers (blocks unless named bytes or seconds)."""

    host_hits: int = 0           # blocks loaded from the host tier
    disk_hits: int = 0           # ... from the disk tier
    stored_host: int = 0         # blocks copied into the host tier
    stored_disk: int = 0         # blocks moved from the host tier to the disk tier
    bytes_loaded: int = 0        # into the pool, from either tier
    load_seconds: float = 0.0    # tiers-thread seconds of every load, summed
    num_loads: int = 0           # load() calls completed
    dropped: int = 0             # disk entries whose MAC check failed (recomputed)
    disk_writes_dropped: int = 0  # blocks not moved to disk: it was behind or off
    loads_timed_out: int = 0     # loads cut at their deadline, a disk read abandoned


@dataclass(frozen=True, slots=True)
class LoadDone:
    """A load() finished: the first `num_loaded` of its blocks hold their entries."""

    key: str
    num_loaded: int


class HostTier:
    """`num_blocks` block slots in host memory (a [num_blocks, *block shape] slab) and
    their LRU index by hash. Not thread-safe: the KVTiers lock guards it."""

    def __init__(self, num_blocks: int, block_shape: tuple[int, ...], dtype: torch.dtype,
                 pin: bool):
        self.slab = torch.empty((num_blocks, *block_shape), dtype=dtype, pin_memory=pin)
        self.index: OrderedDict[BlockHash, int] = OrderedDict()   # LRU first
        self.free = list(range(num_blocks - 1, -1, -1))

    def slot_of(self, h: BlockHash) -> int | None:
        slot = self.index.get(h)
        if slot is not None:
            self.index.move_to_end(h)
        return slot


@dataclass(slots=True)
class _Store:
    blocks: list[int]
    hashes: list[BlockHash]
    done: int = 0             # blocks copied (each handed back through _stored)


@dataclass(slots=True)
class _Forget:
    hashes: list[BlockHash]


@dataclass(slots=True)
class _Load:
    key: str
    hashes: list[BlockHash]
    blocks: list[int]
    deadline: float              # time.monotonic(): the rest is computed after it
    done: list = field(default_factory=list)


class KVTiers:
    """A worker's host and disk tiers under `pool`, whose blocks live in `kv_cache`
    [num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim]; see the module
    docstring. host_gib: the host tier's size (GiB, > 0); disk_dir / disk_gib: the disk
    tier's directory and the directory's bound, shared with every other tier using it
    (kv_disk_files.SlabDirectory: each live one an equal share; None / 0: no disk tier);
    reclaim_after_s: how long a slab whose tier is gone is kept for a new tier of its
    fingerprint to adopt before another may reclaim it; name: the worker's, naming its
    NIXL agent; key: the
    disk entries' MAC key (kv_disk_tier.disk_key of the cluster secret; None: a random
    one, so nothing is read back after a restart); load_timeout_s: a load's budget, from
    load() to its report (seconds; what is not loaded by then is computed). `notify`
    wakes the step loop when a load or store finishes. store, lookup, load and poll are
    called from the step thread. `pool` None: a tensor-parallel follower rank's tiers,
    whose blocks rank 0 holds and frees (store_exactly, take_finished; tp_tiers.py).

    Raises:
        ValueError: host_gib holds no block.
        RuntimeError, OSError: as DiskTier."""

    wants_poll = False      # a tensor-parallel worker's ranks cannot wake the step loop

    def __init__(self, pool: BlockPool | None, kv_cache: torch.Tensor, fp: bytes, host_gib: float,
                 disk_dir: str | Path | None = None, disk_gib: float = 0.0,
                 name: str = "worker", notify: Callable[[], None] | None = None,
                 key: bytes | None = None, load_timeout_s: float = 2.0,
                 reclaim_after_s: float = 60.0):
        self.pool, self.kv_cache = pool, kv_cache
        shape = (kv_cache.shape[0], kv_cache.shape[1], *kv_cache.shape[3:])
        self.block_bytes = block_view(kv_cache, 0).numel() * kv_cache.element_size()
        host_blocks = int(host_gib * GIB // self.block_bytes)
        if host_blocks < 1:
            raise ValueError(f"kv_host_cache_gib={host_gib}: less than one KV block "
                             f"({self.block_bytes} bytes)")
        self.host = HostTier(host_blocks, shape, kv_cache.dtype, kv_cache.device.type == "cuda")
        self.disk = None
        self.load_timeout_s = load_timeout_s
        self._lock = threading.Lock()   # the tiers' indexes, events, _pending, _stored, _loaded
        disk_blocks = 0               # the most the disk tier can hold: the whole budget
        if disk_dir is not None and disk_gib > 0:
            disk_blocks = int(disk_gib * GIB) // slot_bytes(self.block_bytes)
        # (tier, stored?, hash) per change to a tier's index (cache_events)
        self._events = EventLog(4 * (host_blocks + disk_blocks))
        if disk_dir is not None and disk_gib > 0:
            self.disk = DiskTier(SlabDirectory(Path(disk_dir), int(disk_gib * GIB),
                                               reclaim_after_s), name, self.block_bytes, fp,
                                 self._lock,
                                 on_change=lambda stored, h: self._events.append(
                                     ("disk", stored, h)), key=key)
        self._stats = TierStats()
        self._notify = notify or (lambda: None)
        self._pending: set[BlockHash] = set()   # queued to store
        self._stored: list[int] = []           # blocks copied: their refs go back (poll)
        self._loaded: list[LoadDone] = []
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kv-tiers", daemon=True)
        self._thread.start()

    # --- the step thread --------------------------------------------------------------

    def store(self, block_ids: Sequence[int], hashes: Sequence[BlockHash]
              ) -> tuple[list[int], list[BlockHash]]:
        """Copy the blocks (held, computed, registered under `hashes` pairwise) to the
        host tier, those of hashes no tier holds nor has queued; each held once more
        until copied. Returns those taken: (block ids, hashes)."""
        with self._lock:
            new = [(b, h) for b, h in zip(block_ids, hashes) if not self._holds(h)
                   and h not in self._pending]
            self._pending.update(h for _, h in new)
        blocks, taken = [b for b, _ in new], [h for _, h in new]
        if new:
            self._queue_store(blocks, taken)
        return blocks, taken

    def store_exactly(self, block_ids: Sequence[int], hashes: Sequence[BlockHash]) -> None:
        """Copy these blocks to the host tier, each hash's entry once (a follower rank's
        store: rank 0 chose them, engine/tp_tiers.py); one already in the host tier is
        only made most recently used."""
        with self._lock:
            self._pending.update(hashes)
        self._queue_store(list(block_ids), list(hashes))

    def _queue_store(self, blocks: list[int], hashes: list[BlockHash]) -> None:
        if self.pool is not None:
            self.pool.incref(blocks)
        self._jobs.put(_Store(blocks, hashes))

    def lookup(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading `hashes` a tier holds now."""
        with self._lock:
            n = 0
            for h in hashes:
                if not self._holds(h):
                    break
                n += 1
            return n

    def load(self, key: str, hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> None:
        """Copy the tiers' entries of `hashes` into the held blocks `block_ids` (pairwise)
        on the tiers thread; poll() reports `key` once done."""
        self._jobs.put(_Load(key, list(hashes), list(block_ids),
                             time.monotonic() + self.load_timeout_s))

    @property
    def stats(self) -> TierStats:
        """The counters (the disk tier's brought up to date)."""
        if self.disk is not None:
            with self._lock:
                d, st = self.disk, self._stats
                st.stored_disk, st.dropped = d.num_written, d.num_dropped
                st.disk_writes_dropped, st.loads_timed_out = d.num_write_drops, d.num_timed_out
        return self._stats

    def poll(self) -> list[LoadDone]:
        """The loads finished since the last call; the blocks whose copy to the host tier
        finished go back to the pool (one ref each)."""
        stored, loaded = self.take_finished()
        if stored:
            self.pool.free(stored)
        return loaded

    def take_finished(self) -> tuple[list[int], list[LoadDone]]:
        """(the blocks whose copy to the host tier finished, the loads finished) since
        the last call; poll() without giving the blocks back (a follower rank's, whose
        blocks are rank 0's to free)."""
        with self._lock:
            stored, self._stored = self._stored, []
            loaded, self._loaded = self._loaded, []
        return stored, loaded

    def forget(self, hashes: Sequence[BlockHash]) -> None:
        """Drop the entries of `hashes` from both tiers (those held), on the tiers thread
        after what is queued: a tensor-parallel worker's entry that some rank lacks."""
        self._jobs.put(_Forget(list(hashes)))

    def held(self) -> set[BlockHash]:
        """Every hash a tier holds now."""
        with self._lock:
            return set(self.host.index) | (set() if self.disk is None else set(self.disk.index))

    def cache_events(self, since: int) -> tuple[int, list[tuple[str, bool, BlockHash]] | None,
                                                 list[tuple[str, BlockHash]] | None]:
        """What changed in the tiers' indexes after event number `since`, as
        BlockPool.cache_events: ``(seq, events, None)`` with events ``(tier, stored, hash)``
        oldest first (tier "host" or "disk"; stored False: the tier dropped it), or ``(seq,
        None, snapshot)`` with every ``(tier, hash)`` held when `since` is out of the log.
        A disk tier's entries read back after a restart are logged as stored."""
        with self._lock:
            events = self._events.since(since)
            if events is not None:
                return self._events.seq, events, None
            held = [("host", h) for h in self.host.index]
            if self.disk is not None:
                held += [("disk", h) for h in self.disk.index]
            return self._events.seq, None, held

    def close(self) -> None:
        """Stop the tiers thread after what is queued; the disk tier's file stays (closed
        only once the thread ended: a thread still writing keeps its file open)."""
        self._jobs.put(None)
        self._thread.join(30)
        if self._thread.is_alive():
            logger.warning("KV tiers: the tiers thread is still running; its disk tier "
                           "stays open")
        elif self.disk is not None:
            self.disk.close()

    def idle(self, disk: bool = True) -> bool:
        """Nothing queued or in flight (tests: every held block back); with `disk`
        False, nothing but the disk tier's own I/O."""
        with self._lock:
            idle = not self._pending and not self._stored and self._jobs.empty()
        return idle and (not disk or self.disk is None or self.disk.idle())

    # --- the tiers thread -------------------------------------------------------------

    def _holds(self, h: BlockHash) -> bool:
        return h in self.host.index or (self.disk is not None and self.disk.has(h))

    def _run(self) -> None:
        while True:
            try:        # with a disk tier, waits no longer than WATCH_S: disk.check()
                job = self._jobs.get(timeout=None if self.disk is None else WATCH_S)
            except queue.Empty:
                self.disk.check()
                continue
            if job is None:
                return
            if self.disk is not None:
                self.disk.check()
            try:
                if isinstance(job, _Store):
                    self._store(job)
                elif isinstance(job, _Forget):
                    self._forget(job)
                else:
                    self._load(job)
            except Exception:     # a tier fault costs hits, never a request
                logger.exception("KV tier %s failed", type(job).__name__)
                if isinstance(job, _Store):       # the blocks not copied go back too
                    with self._lock:
                        self._pending.difference_update(job.hashes[job.done:])
                        self._stored += job.blocks[job.done:]
                elif isinstance(job, _Load):
                    with self._lock:
                        self._loaded.append(LoadDone(job.key, len(job.done)))
            self._notify()

    def _store(self, job: _Store) -> None:
        for block, h in zip(job.blocks, job.hashes):
            with self._lock:
                held = self.host.slot_of(h) is not None      # store_exactly's only
            if not held:
                slot = self._host_slot()
                try:
                    self.host.slab[slot].copy_(block_view(self.kv_cache, block))
                except BaseException:
                    with self._lock:              # the slot stays this tier's
                        self.host.free.append(slot)
                    raise
            with self._lock:
                if not held:
                    self.host.index[h] = slot
                    self._events.append(("host", True, h))
                    self._stats.stored_host += 1
                self._pending.discard(h)
                self._stored.append(block)
                job.done += 1

    def _forget(self, job: _Forget) -> None:
        for h in job.hashes:
            with self._lock:
                slot = self.host.index.pop(h, None)
                if slot is not None:
                    self.host.free.append(slot)
                    self._events.append(("host", False, h))
            if self.disk is not None:
                self.disk.drop(h)

    def _host_slot(self) -> int:
        """A free host slot: the least recently used entry's when none is free, its
        bytes queued to the disk tier first when there is one (DiskTier.write: copied,
        never waited on; dropped when the disk is behind or off)."""
        with self._lock:
            if self.host.free:
                return self.host.free.pop()
            h, slot = self.host.index.popitem(last=False)
            self._events.append(("host", False, h))
        if self.disk is not None:
            self.disk.write(h, self.host.slab[slot])
        return slot

    def _load(self, job: _Load) -> None:
        """Only this thread moves host entries, so a slot found stays its hash's while
        it is copied (outside the lock)."""
        t0 = time.perf_counter()
        for h, block in zip(job.hashes, job.blocks):
            if time.monotonic() > job.deadline:
                break
            with self._lock:
                slot = self.host.slot_of(h)
            if slot is not None:
                block_view(self.kv_cache, block).copy_(self.host.slab[slot])
                self._stats.host_hits += 1
            elif self.disk is not None and self.disk.load_into(
                    h, block_view(self.kv_cache, block), job.deadline):
                self._stats.disk_hits += 1
            else:
                break
            job.done.append(block)
        with self._lock:
            self._stats.bytes_loaded += len(job.done) * self.block_bytes
            self._stats.load_seconds += time.perf_counter() - t0
            self._stats.num_loads += 1
            self._loaded.append(LoadDone(job.key, len(job.done)))
