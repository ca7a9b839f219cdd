"""decode_worker/scheduler.py with KV tiers (engine/kv_tiers.py): a prompt whose K/V
arrived from a prefill worker is stored to D's host tier; once D's pool evicted it, a
longer prompt with that prefix is prefilled on D (the tier's hit counts as cached for
local_prefill_max_tokens), waits while the hit loads, then computes only its tail; an
abort while loading finishes the request only after the load. A prompt prefilled
elsewhere has its tier hit loaded before reserve answers, and the prefill worker fills
only the rest; D lends those blocks (export) to a prefill worker that reads them. No model: a cache tensor stands in. Every test ends
with the pool free and the tiers idle."""

import threading
import time

import torch

from pdserve.decode_worker.scheduler import DecodeScheduler
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.kv_tiers import KVTiers, fingerprint
from pdserve.engine.request import RequestState
from test_decode_local_prefill import finish_all, prefills, reserve, serve_remote
from tier_helpers import settle

BS, POOL, EOS = 4, 12, 2
KV = torch.zeros(2, 2, POOL, 1, BS, 8)
BLOCK_BYTES = 2 * 2 * 1 * BS * 8 * 4
HISTORY = list(range(100, 100 + 6 * BS + 1))       # 6 full blocks and 1 token


def make(local=8, on_loaded=None):
    pool = BlockPool(POOL)
    tiers = KVTiers(pool, KV, fingerprint("m", KV), 32 * BLOCK_BYTES / (1 << 30))
    return pool, tiers, DecodeScheduler(pool, BS, 128, (EOS,), enable_prefix_caching=True,
                                        local_prefill_max_tokens=local, tiers=tiers,
                                        on_loaded=on_loaded)


def evict_history(sched, tiers):
    """HISTORY served (its K/V from a prefill worker, stored to the tier), then pushed
    out of D's pool by another prompt's blocks."""
    serve_remote(sched, "a", HISTORY)
    settle(tiers)
    assert tiers.stats.stored_host == 6
    serve_remote(sched, "b", list(range(500, 500 + 11 * BS)))
    settle(tiers)


def test_a_turn_past_an_evicted_history_loads_it_and_computes_only_the_tail():
    pool, tiers, sched = make()
    try:
        KV.normal_()
        evict_history(sched, tiers)
        turn = HISTORY[:6 * BS] + [9, 9, 9, 9, 9]      # the history's 6 blocks + 5 new
        r = reserve(sched, "t2", turn)
        assert r.local_prefill and r.num_cached_blocks == 0    # not in the pool any more
        req = sched._requests["t2"]
        assert req.state == RequestState.WAITING and sched.schedule().requests == ()
        deadline = time.monotonic() + 5
        while not (out := sched.schedule()).requests:
            assert time.monotonic() < deadline, "the tier load never finished"
            time.sleep(0.005)
        assert prefills(out) == (req,) and out.num_scheduled_tokens == (5,)
        assert req.num_computed_tokens == 6 * BS and req.num_cached_blocks == 6
        assert sched.prompt_cache.cached_tokens >= 6 * BS and tiers.stats.host_hits == 6
        for b in range(6):      # the blocks hold the history's K/V again
            assert torch.equal(KV[:, :, req.block_table[b]],
                               tiers.host.slab[tiers.host.index[req.block_hashes[b]]])
        sched.update_from_output(out, [7])
        assert sched.computed_tokens == 5
        finish_all(sched)
        settle(tiers)
    finally:
        tiers.close()
    assert pool.all_free() and tiers.idle()


def test_an_abort_while_loading_frees_the_blocks_only_after_the_load():
    pool, tiers, sched = make()
    load, go = tiers._load, threading.Event()
    tiers._load = lambda job: (go.wait(5), load(job))     # the tiers thread held back
    try:
        evict_history(sched, tiers)
        reserve(sched, "t2", HISTORY[:6 * BS] + [9, 9])
        blocks = list(sched._requests["t2"].block_table)
        sched.abort("t2")
        for _ in range(3):                  # being written: kept, its blocks held
            assert sched.schedule().requests == () and "t2" in sched._requests
            assert all(pool.ref_count(b) == 1 for b in blocks)
        go.set()
        deadline = time.monotonic() + 5
        while "t2" in sched._requests:
            assert time.monotonic() < deadline
            sched.schedule()
            time.sleep(0.005)
        assert tiers.stats.num_loads == 1 and all(pool.ref_count(b) == 0 for b in blocks)
        assert [e.finish_reason for e in sched.drain_events()] == ["cancelled"]
        settle(tiers)
    finally:
        go.set()
        tiers.close()
    assert pool.all_free() and tiers.idle()


def wait_loaded(sched, rid):
    """reserved() of `rid` once its tier load is done (the step thread's schedule()
    reports loads)."""
    deadline = time.monotonic() + 5
    while (r := sched.reserved(rid)).loading:
        assert time.monotonic() < deadline, "the tier load never finished"
        sched.schedule()
        time.sleep(0.005)
    return r


def test_a_prompt_prefilled_elsewhere_loads_the_tier_hit_before_the_answer():
    """...and the schedule() that sees the load done calls on_loaded (the worker's
    reserve() waits on it)."""
    woken = []                                 # under the scheduler's lock: no reserved()
    pool, tiers, sched = make(local=0, on_loaded=lambda: woken.append(
        sched.prompt_cache.loading(sched._requests["t2"])))
    try:
        KV.normal_()
        evict_history(sched, tiers)
        assert woken == []                     # the history's own blocks loaded nothing
        r = reserve(sched, "t2", HISTORY[:6 * BS] + [9, 9])
        assert not r.local_prefill and r.loading and r.block_ids == []
        r = wait_loaded(sched, "t2")
        assert woken == [False]                # once, with the load done
        assert r.num_cached_blocks == 6 and len(r.block_ids) == 1   # P fills the tail only
        req = sched._requests["t2"]
        assert req.state == RequestState.WAITING_FOR_REMOTE_KV
        assert sched.schedule().requests == ()          # loaded, not arrived: not admitted
        for b in range(6):
            assert torch.equal(KV[:, :, req.block_table[b]],
                               tiers.host.slab[tiers.host.index[req.block_hashes[b]]])
        sched.on_kv_complete("t2", True, 7)
        assert prefills(sched.schedule()) == () and req.state == RequestState.RUNNING
        finish_all(sched)
        settle(tiers)
    finally:
        tiers.close()
    assert pool.all_free() and tiers.idle()


def test_exported_blocks_stay_held_until_sent_even_after_the_request_ends():
    pool, tiers, sched = make(local=0)
    try:
        evict_history(sched, tiers)
        reserve(sched, "t2", HISTORY[:6 * BS] + [9, 9])
        wait_loaded(sched, "t2")
        assert sched.export("t2", 0, 7) is None        # the last block is not D's yet
        assert sched.export("nope", 0, 1) is None
        blocks = sched.export("t2", 2, 4)
        assert blocks == sched._requests["t2"].block_table[2:6]
        finish_all(sched)                              # aborted: its refs dropped
        assert all(pool.ref_count(b) == 1 for b in blocks)      # the export's
        assert sched.export("t2", 0, 1) is None
        sched.end_export(blocks)
        assert sched.has_work()
        sched.schedule()
        assert all(pool.ref_count(b) == 0 for b in blocks)
        settle(tiers)
    finally:
        tiers.close()
    assert pool.all_free() and tiers.idle()
