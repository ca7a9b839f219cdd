"""Choosing a prefill worker for a prompt: `round_robin`, `least_loaded` or `kv_aware`.

`kv_aware` (the default) scores every prefill worker P by the work the prompt would cost
there, the cost model of Dynamo's KV router and SGLang's cache-aware router::

    cost(P) = uncached_prefill_tokens(prompt, P) + load_weight * queued_tokens(P)

where the uncached tokens are the prompt's tokens after the longest run of its leading
full blocks that P holds in its prefix cache (never the block of the last token, which
P always computes), and queued_tokens are the prompt tokens the router has sent to P
and not yet got a first token back for. Lowest cost wins; ties go to the less loaded,
then to the first worker.

Which blocks P holds comes from PrefixIndex, a mirror of each P's cache that the router
refreshes by polling the workers' cache events every `cache_sync_interval_s` (not per
request), so it may lag by that much: a stale entry costs a wrong guess, never a wrong
answer (P looks the prefix up itself).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Protocol

from ..engine.block_pool import BlockHash, block_hashes
from ..messages import CacheEvents

POLICIES = ("round_robin", "least_loaded", "kv_aware")


class PrefillTarget(Protocol):
    worker_id: str
    total_queued_tokens: int  # this router's count + other replicas' reported


class PrefixIndex:
    """The block hashes each prefill worker holds, as of its last cache_events reply."""

    def __init__(self) -> None:
        self._hashes: dict[str, set[BlockHash]] = {}
        self._seq: dict[str, int] = {}

    def since(self, worker_id: str) -> int:
        """The event number to ask `worker_id` for changes after."""
        return self._seq.get(worker_id, 0)

    def apply(self, worker_id: str, reply: CacheEvents) -> None:
        """Fold in a PrefillWorker.cache_events reply: events, or a full snapshot."""
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

    def forget(self, worker_id: str) -> None:
        """Drop what `worker_id` held (it restarted with an empty cache); its next
        cache_events poll starts from event 0."""
        self._hashes.pop(worker_id, None)
        self._seq.pop(worker_id, None)

    def matched_blocks(self, worker_id: str, hashes: Sequence[BlockHash]) -> int:
        """How many of `hashes`, from the first, `worker_id` holds without a gap."""
        held = self._hashes.get(worker_id, ())
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n


class PrefillRouter:
    """Picks the prefill worker for each prompt by `policy` (one of POLICIES).

    Raises:
        ValueError: unknown policy, or a negative load_weight.
    """

    def __init__(self, policy: str, block_size: int, load_weight: float = 1.0) -> None:
        if policy not in POLICIES:
            raise ValueError(f"routing_policy={policy!r}: choose one of {list(POLICIES)}")
        if load_weight < 0:
            raise ValueError(f"kv_load_weight={load_weight}: must be >= 0")
        self.policy, self.block_size, self.load_weight = policy, block_size, load_weight
        self.index = PrefixIndex()
        self._turn = itertools.count()

    def pick(self, workers: Sequence[PrefillTarget], token_ids: Sequence[int]
             ) -> tuple[PrefillTarget, int]:
        """(worker, prompt tokens it is expected to find cached) for a prompt."""
        if self.policy == "round_robin":
            return workers[next(self._turn) % len(workers)], 0
        if self.policy == "least_loaded":
            return min(workers, key=lambda w: w.total_queued_tokens), 0
        n, bs = len(token_ids), self.block_size
        hashes = block_hashes(token_ids[: (n - 1) // bs * bs], bs)
        best = None
        for i, w in enumerate(workers):
            cached = self.index.matched_blocks(w.worker_id, hashes) * bs
            key = (n - cached + self.load_weight * w.total_queued_tokens, w.total_queued_tokens, i)
            if best is None or key < best[0]:
                best = (key, w, cached)
        return best[1], best[2]
