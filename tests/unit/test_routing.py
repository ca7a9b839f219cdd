"""router/routing.py: prefill worker choice by policy, decode worker order
(least_loaded, cache_aware), and the prefix-cache mirror."""

from dataclasses import dataclass

import pytest

from pdserve.engine.block_pool import BlockPool, block_hashes
from pdserve.messages import CacheEvents
from pdserve.router.routing import PrefillRouter, PrefixIndex, decode_order

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


def test_a_salted_prompt_matches_only_blocks_of_its_salt():
    """The mirror holds "b"'s unsalted prefix and "a"'s salted one: a prompt under salt
    "s" is cached on "a" only, unsalted on "b" only, under another salt on neither."""
    r = PrefillRouter("kv_aware", BS)
    a, b = W("a"), W("b")
    prefix = list(range(100, 140))
    holding(r, "b", prefix)
    pool = BlockPool(64)
    hashes = block_hashes(prefix, BS, "s")
    pool.cache_blocks(pool.allocate(len(hashes)), hashes)
    seq, events, _ = pool.cache_events(0)
    r.index.apply("a", CacheEvents(0, seq, events=events))
    assert r.pick([a, b], prefix + [1], "s") == (a, 40)
    assert r.pick([a, b], prefix + [1]) == (b, 40)
    assert r.pick([a, b], prefix + [1], "t")[1] == 0
    assert r.pull_peer([a, b], b, prefix + [1], "s") == (a, 10)
    order = decode_order([D("b"), D("a")], r.index, prefix + [1], BS, salt="s")
    assert [w.worker_id for w in order.workers] == ["a", "b"] and order.cached_blocks == 10


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
    assert idx.since("p") == 3 and idx.matched("p", h) == (3, 0, 0)
    idx.apply("p", CacheEvents(0, 4, events=[(False, h[1])]))
    assert idx.matched("p", h) == (1, 0, 0)                # a gap ends the run
    idx.apply("p", CacheEvents(0, 9, snapshot=[h[2]]))
    assert idx.matched("p", h) == (0, 0, 0) and idx.matched("p", h[2:]) == (1, 0, 0)
    assert idx.matched("unknown", h) == (0, 0, 0) and idx.since("unknown") == 0


def test_kv_aware_counts_tier_blocks_at_their_load_cost():
    """Blocks a worker holds in its host or disk tier, after those in its pool, count as
    cached less their load cost; a tier block after a gap counts for nothing."""
    r = PrefillRouter("kv_aware", BS, host_load_cost=0.1, disk_load_cost=0.5)
    a, b, c = W("a"), W("b"), W("c")
    prompt = list(range(200, 240)) + [1]             # 10 full blocks and 1 token
    h = block_hashes(prompt, BS)
    holding(r, "a", prompt[:8])                      # a: 2 in its pool
    r.index.apply("a", CacheEvents(0, r.index.since("a"), tier_seq=2,
                                   tier_events=[("host", True, x) for x in h[2:4]]))
    r.index.apply("b", CacheEvents(0, 0, tier_seq=10, tier_events=[
        *(("disk", True, x) for x in h[:10]), ("disk", False, h[9])]))
    r.index.apply("c", CacheEvents(0, 0, tier_snapshot=[("host", x) for x in h[1:10]]))
    assert r.index.matched("a", h) == (2, 2, 0)
    assert r.index.matched("b", h) == (0, 0, 9)
    assert r.index.matched("c", h) == (0, 0, 0)      # no block 0: nothing loads
    # a: 41 - 16 + 0.1 * 8 = 25.8; b: 41 - 36 + 0.5 * 36 = 23
    assert r.pick([a, b, c], prompt) == (b, 36)
    r.disk_load_cost = 0.7                           # b: 5 + 25.2 = 30.2 > 25.8
    assert r.pick([a, b, c], prompt) == (a, 16)
    r.index.forget("a")
    assert r.index.matched("a", h) == (0, 0, 0) and r.index.tier_since("a") == 0
    with pytest.raises(ValueError, match="kv_disk_load_cost"):
        PrefillRouter("kv_aware", BS, disk_load_cost=-0.1)


def test_with_pulls_an_idle_worker_reads_a_busy_holders_prefix():
    """With pull_cost (kv_pull), a worker lacking the prefix counts the run another
    worker's cache holds at that cost: a busy holder's prompt goes to an idle worker,
    which pull_peer tells where to read it; an idle holder keeps it. A worker that
    would read it counts its own tier blocks at that cost too (it reads them as well)."""
    r = PrefillRouter("kv_aware", BS, pull_cost=0.2)
    a, b = W("a"), W("b")
    prompt = list(range(300, 340)) + [1]             # 10 full blocks and 1 token
    holding(r, "b", prompt[:40])
    assert r.pick([a, b], prompt) == (b, 40)         # 1 < 41 - 40 + 0.2 * 40
    b.total_queued_tokens = 30                       # b: 1 + 30 > a: 9
    assert r.pick([a, b], prompt) == (a, 40)
    assert r.pull_peer([a, b], a, prompt) == (b, 10)
    assert r.pull_peer([a, b], b, prompt) == (None, 0)         # b holds the most
    holding(r, "a", prompt[:40])
    assert r.pull_peer([a, b], a, prompt) == (None, 0)         # a holds as many
    r.index.forget("a")
    r.index.apply("a", CacheEvents(0, 0, tier_snapshot=[("disk", x) for x in
                                                       block_hashes(prompt[:24], BS)]))
    # a's disk tier holds 6 blocks, but a reads all 10 from b, those 6 too: a costs
    # 1 + 0.2 * 40 = 9 (not 1 + 0.2 * 16 + 0 * 24 = 4.2); b costs 1 + its queue
    b.total_queued_tokens = 6
    assert r.index.matched("a", block_hashes(prompt[:40], BS)) == (0, 0, 6)
    assert r.pick([a, b], prompt) == (b, 40)
    b.total_queued_tokens = 8.5
    assert r.pick([a, b], prompt) == (a, 40)
    plain = PrefillRouter("kv_aware", BS)            # no pulls: the holder, however busy
    holding(plain, "b", prompt[:40])
    b.total_queued_tokens = 35
    assert plain.pick([a, b], prompt)[0] is b


def test_with_pulls_a_peer_s_tier_blocks_count_in_its_run_at_their_load_cost_too():
    """A peer holding 4 blocks in its pool and the next 6 in its host tier holds a run of
    10 (it loads the 6 to send them): pull_peer names it, and a worker reading from it
    counts the pull and the peer's loads."""
    r = PrefillRouter("kv_aware", BS, host_load_cost=0.05, pull_cost=0.2)
    a, b = W("a"), W("b", total_queued_tokens=30)
    prompt = list(range(400, 440)) + [1]             # 10 full blocks and 1 token
    h = block_hashes(prompt, BS)
    holding(r, "b", prompt[:16])
    r.index.apply("b", CacheEvents(0, r.index.since("b"), tier_snapshot=[
        ("host", x) for x in h[4:10]]))
    assert r.index.matched("b", h) == (4, 6, 0)
    assert r.pull_peer([a, b], a, prompt) == (b, 10)
    # a: 1 + 0.2 * 40 + 0.05 * 24 = 10.2; b: 1 + 0.05 * 24 + 30 = 32.2
    assert r.pick([a, b], prompt) == (a, 40)
    b.total_queued_tokens = 9                        # b: 11.2 > a: 10.2
    assert r.pick([a, b], prompt) == (a, 40)
    b.total_queued_tokens = 7                        # b: 9.2 < a: 10.2
    assert r.pick([a, b], prompt) == (b, 40)


@dataclass
class D:
    worker_id: str
    total_streams: int = 0
    free_blocks: int = 100


def test_decode_order_least_loaded_then_cache_aware():
    """least_loaded: fewest streams, then most free blocks. cache_aware: the decode
    worker holding the prompt's leading blocks first while the loads are balanced
    (SGLang's thresholds), else the load order; a run under cache_threshold of the
    prompt's blocks does not choose."""
    prompt = list(range(40))                                   # 10 full blocks
    d0, d1, d2 = D("d0", 3), D("d1", 1, 50), D("d2", 1, 80)
    assert [d.worker_id for d in decode_order([d0, d1, d2]).workers] == ["d2", "d1", "d0"]
    index = PrefixIndex()
    pool = BlockPool(64)
    hashes = block_hashes(prompt[:24], BS)                      # 6 of the 10 blocks
    pool.cache_blocks(pool.allocate(len(hashes)), hashes)
    seq, events, _ = pool.cache_events(0)
    index.apply("d0", CacheEvents(0, seq, events=events))

    def order(**kw):
        return [d.worker_id for d in decode_order([d0, d1, d2], index, prompt, BS, **kw).workers]

    assert order() == ["d0", "d2", "d1"]                        # 3 vs 1 streams: balanced
    assert decode_order([d0, d1, d2], index, prompt, BS).cached_blocks == 6
    assert decode_order([d0, d1, d2], index, prompt, BS, cache_threshold=0.7
                        ).cached_blocks is None                 # by load
    assert order(cache_threshold=0.7) == ["d2", "d1", "d0"]     # 6 of 10 blocks: too few
    d0.total_streams = 70                                       # 70 vs 1: unbalanced
    assert order() == ["d2", "d1", "d0"]
    assert order(balance_abs_threshold=80) == ["d0", "d2", "d1"]
    assert order(balance_rel_threshold=100.0) == ["d0", "d2", "d1"]
    d0.total_streams = 3
    assert [d.worker_id for d in decode_order([d0, d1, d2], index, [7] * 40, BS).workers] == [
        "d2", "d1", "d0"]                                       # held by none
