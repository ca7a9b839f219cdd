"""router/routing.py: prefill worker choice by policy, and the prefix-cache mirror."""

from dataclasses import dataclass

import pytest

from pdserve.engine.block_pool import BlockPool, block_hashes
from pdserve.messages import CacheEvents
from pdserve.router.routing import PrefillRouter, PrefixIndex

BS = 4


@dataclass
class W:
    worker_id: str
    total_queued_tokens: int = 0


def holding(router: PrefillRouter, worker_id: str, tokens: list[int]) -> None:
    """Mirror `worker_id` as holding the full blocks of `tokens` (through a real pool)."""
    pool = BlockPool(64)
    hashes = block_hashes(tokens, BS)
    pool.cache_blocks(pool.allocate(len(hashes)), hashes)
    seq, events, _ = pool.cache_events(0)
    router.index.apply(worker_id, CacheEvents(0, seq, events=events))


def test_kv_aware_prefers_the_worker_holding_the_prefix():
    r = PrefillRouter("kv_aware", BS)
    a, b = W("a"), W("b")
    prefix = list(range(100, 140))                      # 10 blocks
    holding(r, "b", prefix)
    w, cached = r.pick([a, b], prefix + [1, 2, 3])
    assert (w, cached) == (b, 40)
    # the block holding the last token is never counted as cached
    assert r.pick([a, b], prefix)[1] == 36
    # a long queue on the holder outweighs the saved tokens: 43 - 40 + 50 > 43 + 0
    b.total_queued_tokens = 50
    assert r.pick([a, b], prefix + [1, 2, 3])[0] is a
    # no cache anywhere: least loaded, then first
    assert r.pick([a, b], [7] * 20)[0] is a
    a.total_queued_tokens = 60
    assert r.pick([a, b], [7] * 20)[0] is b


def test_load_weight_zero_ignores_queues_and_other_policies():
    r = PrefillRouter("kv_aware", BS, load_weight=0.0)
    a, b = W("a"), W("b", total_queued_tokens=10**6)
    holding(r, "b", list(range(8)))
    assert r.pick([a, b], list(range(8)) + [9])[0] is b
    rr = PrefillRouter("round_robin", BS)
    assert [rr.pick([a, b], [1])[0].worker_id for _ in range(4)] == ["a", "b", "a", "b"]
    assert PrefillRouter("least_loaded", BS).pick([b, a], [1])[0] is a
    with pytest.raises(ValueError, match="routing_policy"):
        PrefillRouter("random", BS)
    with pytest.raises(ValueError, match="kv_load_weight"):
        PrefillRouter("kv_aware", BS, load_weight=-1)


def test_prefix_index_follows_events_and_snapshots():
    idx = PrefixIndex()
    h = block_hashes(list(range(12)), BS)
    idx.apply("p", CacheEvents(0, 3, events=[(True, x) for x in h]))
    assert idx.since("p") == 3 and idx.matched_blocks("p", h) == 3
    idx.apply("p", CacheEvents(0, 4, events=[(False, h[1])]))
    assert idx.matched_blocks("p", h) == 1                # a gap ends the run
    idx.apply("p", CacheEvents(0, 9, snapshot=[h[2]]))
    assert idx.matched_blocks("p", h) == 0 and idx.matched_blocks("p", h[2:]) == 1
    assert idx.matched_blocks("unknown", h) == 0 and idx.since("unknown") == 0
