"""Choosing a prefill worker for a prompt: `round_robin`, `least_loaded` or `kv_aware`.

`kv_aware` (the default) scores every prefill worker P by the work the prompt would cost
there, the cost model of Dynamo's KV router and SGLang's cache-aware router::

    cost(P) = uncached_prefill_tokens(prompt, P)
              + host_load_cost * host_tier_tokens(prompt, P)
              + disk_load_cost * disk_tier_tokens(prompt, P)
              + load_weight * queued_tokens(P)

as P itself would serve the prompt: the longest run of its leading full blocks that P
holds in its prefix cache (never the block of the last token, which P always computes)
is shared, the run of the next ones its KV tiers hold (engine/kv_tiers.py) is loaded,
host tier first, and the rest is computed. A loaded token costs a share of a computed
one: `host_load_cost` and `disk_load_cost` (RouterConfig.kv_host_load_cost,
kv_disk_load_cost). Where prefill workers pull KV (`pull_cost`), a longer run that
another prefill worker's prefix cache and tiers hold is read from it instead, every
block past P's own cache at `pull_cost` (its tiers' blocks too, as P then reads those as
well), the peer's tier blocks also at their load cost (the peer loads them to send):

    cost(P) = uncached_prefill_tokens(prompt, peer) + pull_cost * (peer_run - P's run)
              + host_load_cost * peer_host_tokens + disk_load_cost * peer_disk_tokens
              + load_weight * queued_tokens(P)

queued_tokens are the prompt tokens the router has sent to P and not yet got a first
token back for. Lowest cost wins; ties go to the less loaded, then to the first worker.

Which blocks P holds, and where, comes from PrefixIndex, a mirror of each P's cache and
tiers that the router refreshes by polling the workers' cache events every
`cache_sync_interval_s` (not per request), so it may lag by that much: a stale entry
costs a wrong guess, never a wrong answer (P looks the prefix up itself).

The decode worker D is chosen by `decode_order`: `least_loaded` (fewest streams, then
most free KV blocks), or `cache_aware`, SGLang's cache-aware rule over a PrefixIndex of
the decode workers' prefix caches and tiers (a conversation's next turn finds its history
where its last turn ran): while the loads are balanced, the D holding the longest run of
the prompt's leading blocks, when that run is at least `cache_threshold` of them.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ..engine.block_pool import BlockHash, block_hashes
from ..messages import CacheEvents

POLICIES = ("round_robin", "least_loaded", "kv_aware")
DECODE_POLICIES = ("least_loaded", "cache_aware")


class DecodeTarget(Protocol):
    worker_id: str
    total_streams: int       # this router's streams on it + other replicas' reported
    free_blocks: int


@dataclass(frozen=True, slots=True)
class DecodeOrder:
    """The decode workers in the order a reservation asks them; `cached_blocks`: the run
    of the prompt's leading blocks the first holds when it comes first for holding them
    (cache_aware), None when the order is by load."""

    workers: list
    cached_blocks: int | None = None


def decode_order(workers: Sequence[DecodeTarget], index: PrefixIndex | None = None,
                 token_ids: Sequence[int] = (), block_size: int = 16,
                 cache_threshold: float = 0.3, balance_abs_threshold: int = 64,
                 balance_rel_threshold: float = 1.5, salt: str = "") -> DecodeOrder:
    """`workers`, best first for a prompt's reservation: by fewest streams, then most
    free blocks (least_loaded); with `index` (cache_aware, a mirror of the decode
    workers' prefix caches and tiers) SGLang's cache-aware rule (sgl-model-gateway
    `cache_aware`): when the loads are balanced (most streams - fewest <=
    balance_abs_threshold, or most <= fewest * balance_rel_threshold) and the worker
    holding the longest run of the prompt's leading full blocks (pool, then host and
    disk tiers) holds at least `cache_threshold` of them, it comes first, the rest in
    load order."""
    by_load = sorted(workers, key=lambda w: (w.total_streams, -w.free_blocks))
    if index is None or len(by_load) < 2:
        return DecodeOrder(by_load)
    fewest, most = by_load[0].total_streams, max(w.total_streams for w in by_load)
    if most - fewest > balance_abs_threshold and most > fewest * balance_rel_threshold:
        return DecodeOrder(by_load)
    hashes = block_hashes(token_ids, block_size, salt)     # the request's cache_salt
    if not hashes:
        return DecodeOrder(by_load)
    runs = [sum(index.matched(w.worker_id, hashes)) for w in by_load]
    best = max(range(len(by_load)), key=lambda i: (runs[i], -i))   # ties: the less loaded
    if runs[best] < cache_threshold * len(hashes) or runs[best] == 0:
        return DecodeOrder(by_load)
    return DecodeOrder([by_load[best]] + by_load[:best] + by_load[best + 1:], runs[best])


class PrefillTarget(Protocol):
    worker_id: str
    total_queued_tokens: int  # this router's count + other replicas' reported


class PrefixIndex:
    """The block hashes each prefill worker holds in its prefix cache and in each of its
    KV tiers, as of its last cache_events reply."""

    def __init__(self) -> None:
        self._hashes: dict[str, set[BlockHash]] = {}
        self._seq: dict[str, int] = {}
        self._tiers: dict[str, dict[str, set[BlockHash]]] = {}   # worker -> tier -> hashes
        self._tier_seq: dict[str, int] = {}

    def since(self, worker_id: str) -> int:
        """The event number to ask `worker_id` for changes after."""
        return self._seq.get(worker_id, 0)

    def tier_since(self, worker_id: str) -> int:
        """The tier event number to ask `worker_id` for changes after."""
        return self._tier_seq.get(worker_id, 0)

    def apply(self, worker_id: str, reply: CacheEvents) -> None:
        """Fold in a PrefillWorker.cache_events reply: events, or a full snapshot, of the
        prefix cache and of the tiers."""
        held = self._hashes.setdefault(worker_id, set())
        if reply.snapshot is not None:
            held.clear()
            held.update(reply.snapshot)
        for stored, h in reply.events or ():
            if stored:
                held.add(h)
            else:
                held.discard(h)
        self._seq[worker_id] = reply.seq
        tiers = self._tiers.setdefault(worker_id, {})
        if reply.tier_snapshot is not None:
            tiers.clear()
            for tier, h in reply.tier_snapshot:
                tiers.setdefault(tier, set()).add(h)
        for tier, stored, h in reply.tier_events or ():
            if stored:
                tiers.setdefault(tier, set()).add(h)
            else:
                tiers.get(tier, set()).discard(h)
        self._tier_seq[worker_id] = reply.tier_seq

    def forget(self, worker_id: str) -> None:
        """Drop what `worker_id` held (it restarted with an empty cache); its next
        cache_events poll starts from event 0."""
        for d in (self._hashes, self._seq, self._tiers, self._tier_seq):
            d.pop(worker_id, None)

    def matched(self, worker_id: str, hashes: Sequence[BlockHash]) -> tuple[int, int, int]:
        """(pool, host, disk): how many of `hashes`, from the first, `worker_id` holds in
        its prefix cache without a gap, then how many of the next its host and disk
        tiers hold (host first, as KVTiers loads), up to the first none holds."""
        held = self._hashes.get(worker_id, ())
        n = 0
        while n < len(hashes) and hashes[n] in held:
            n += 1
        tiers = self._tiers.get(worker_id, {})
        host, disk = tiers.get("host", ()), tiers.get("disk", ())
        in_host = in_disk = 0
        for h in hashes[n:]:
            if h in host:
                in_host += 1
            elif h in disk:
                in_disk += 1
            else:
                break
        return n, in_host, in_disk


class PrefillRouter:
    """Picks the prefill worker for each prompt by `policy` (one of POLICIES).

    load_weight, host_load_cost, disk_load_cost: the cost model's weights (module
    docstring), in computed prompt tokens per queued or loaded token. pull_cost: the
    same for a token read from another prefill worker's prefix cache or tiers, when
    prefill workers pull KV (WorkerConfig.kv_pull; pull_peer); None when they do not.

    Raises:
        ValueError: unknown policy, or a negative weight.
    """

    def __init__(self, policy: str, block_size: int, load_weight: float = 1.0,
                 host_load_cost: float = 0.0, disk_load_cost: float = 0.0,
                 pull_cost: float | None = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"routing_policy={policy!r}: choose one of {list(POLICIES)}")
        for name, v in (("kv_load_weight", load_weight), ("kv_host_load_cost", host_load_cost),
                        ("kv_disk_load_cost", disk_load_cost),
                        ("kv_pull_load_cost", 0.0 if pull_cost is None else pull_cost)):
            if not v >= 0:
                raise ValueError(f"{name}={v}: must be >= 0")
        self.policy, self.block_size, self.load_weight = policy, block_size, load_weight
        self.host_load_cost, self.disk_load_cost = host_load_cost, disk_load_cost
        self.pull_cost = pull_cost
        self.index = PrefixIndex()
        self._turn = itertools.count()

    @classmethod
    def of(cls, config) -> PrefillRouter:
        """The router's, from a ClusterConfig (its router section's policy and weights;
        pull_cost with the prefill workers' kv_pull)."""
        rc = config.router
        return cls(rc.routing_policy, config.prefill.block_size, rc.kv_load_weight,
                   rc.kv_host_load_cost, rc.kv_disk_load_cost,
                   rc.kv_pull_load_cost if config.prefill.kv_pull else None)

    def _hashes(self, token_ids: Sequence[int], salt: str) -> list[BlockHash]:
        """The hashes of a prompt's full blocks but the one of its last token, salted
        with its cache_salt."""
        bs = self.block_size
        return block_hashes(token_ids[: (len(token_ids) - 1) // bs * bs], bs, salt)

    def pick(self, workers: Sequence[PrefillTarget], token_ids: Sequence[int],
             salt: str = "") -> tuple[PrefillTarget, int]:
        """(worker, prompt tokens it is expected to find in its prefix cache or tiers, or
        to read from another prefill worker's cache) for a prompt of cache_salt `salt`."""
        if self.policy == "round_robin":
            return workers[next(self._turn) % len(workers)], 0
        if self.policy == "least_loaded":
            return min(workers, key=lambda w: w.total_queued_tokens), 0
        n, bs = len(token_ids), self.block_size
        hashes = self._hashes(token_ids, salt)
        matched = [self.index.matched(w.worker_id, hashes) for w in workers]
        best = None
        for i, (w, (pool, host, disk)) in enumerate(zip(workers, matched)):
            got = pool + host + disk
            loaded = (self.host_load_cost * host + self.disk_load_cost * disk) * bs
            if self.pull_cost is not None:
                peer = max((m for j, m in enumerate(matched) if j != i), key=sum,
                           default=(0, 0, 0))
                if sum(peer) > got:  # P reads every block past its own cache from the
                    # peer (pull_peer), its tiers' too (prefill_worker/scheduler.py);
                    # the peer loads those its tiers hold first
                    got = sum(peer)
                    loaded = (self.pull_cost * (got - pool) + self.host_load_cost * peer[1]
                              + self.disk_load_cost * peer[2]) * bs
            cost = n - got * bs + loaded + self.load_weight * w.total_queued_tokens
            key = (cost, w.total_queued_tokens, i)
            if best is None or key < best[0]:
                best = (key, w, got * bs)
        return best[1], best[2]

    def pull_peer(self, workers: Sequence[PrefillTarget], chosen: PrefillTarget,
                  token_ids: Sequence[int], salt: str = ""
                  ) -> tuple[PrefillTarget | None, int]:
        """(the worker of `workers`, other than `chosen`, whose prefix cache and KV tiers
        hold the longest run of the prompt's leading full blocks (never its last
        token's), that run in blocks) when the run is longer than what `chosen` holds in
        its cache and tiers; else (None, 0). `chosen` may read those blocks from it
        (kv_pull), as PrefillOrder.kv_peer and peer_blocks; the peer loads the run's
        tier blocks into its pool first. From the mirror, so a guess: the peer sends
        nothing when it lost any of them since. `salt`: the prompt's cache_salt."""
        hashes = self._hashes(token_ids, salt)
        best, run = None, sum(self.index.matched(chosen.worker_id, hashes))
        for w in workers:
            if w is not chosen and (n := sum(self.index.matched(w.worker_id, hashes))) > run:
                best, run = w, n
        return (best, run) if best is not None else (None, 0)
