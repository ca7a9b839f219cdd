"""prefill_worker/scheduler.py with KV tiers (engine/kv_tiers.py): a prompt's computed
blocks are stored to the host tier; once the pool evicted them, the same prompt waits
while they load back, then computes only its last block's tokens; an abort while loading
hands the request back once. No model: a cache tensor stands in. Every test ends with
the pool free and the tiers idle."""

import time

import torch

from pdserve.engine.block_pool import BlockPool
from pdserve.engine.kv_tiers import KVTiers, fingerprint
from pdserve.engine.request import RequestState
from pdserve.prefill_worker.scheduler import PrefillScheduler
from test_prefill_chunks import _tokens_req, advance, chunks
from tier_helpers import settle

BS, POOL = 4, 8
KV = torch.zeros(2, 2, POOL, 1, BS, 8)
BLOCK_BYTES = 2 * 2 * 1 * BS * 8 * 4


def make(host_blocks=16):
    pool = BlockPool(POOL)
    tiers = KVTiers(pool, KV, fingerprint("m", KV), host_blocks * BLOCK_BYTES / (1 << 30))
    return pool, tiers, PrefillScheduler(pool, BS, 64, tiers=tiers)


def until_loaded(sched, timeout_s=5.0):
    """schedule() until a step has rows (the load finished), 5 s at most."""
    deadline = time.monotonic() + timeout_s
    while not (out := sched.schedule()).requests:
        assert time.monotonic() < deadline, "the tier load never finished"
        time.sleep(0.005)
    return out


def run(sched, req) -> None:
    """`req` added, computed whole (one step) and released."""
    sched.add(req)
    out = sched.schedule()
    assert [r for r in out.requests] == [req]
    advance(sched, out)
    sched.release(req, RequestState.FINISHED_STOPPED)


def test_an_evicted_prefix_loads_back_from_the_host_tier():
    pool, tiers, sched = make()
    try:
        tokens = list(range(1, 4 * BS + 2))                 # 4 full blocks and 1 token
        KV.normal_()
        run(sched, _tokens_req("a", tokens))
        settle(tiers)                                       # 4 blocks stored
        assert tiers.lookup(sched_hashes(tokens)) == 4
        run(sched, _tokens_req("b", list(range(100, 100 + 7 * BS))))   # evicts a's
        settle(tiers)
        again = _tokens_req("a2", tokens)
        sched.add(again)
        assert sched.schedule().requests == ()             # loading: no step for it yet
        assert sched.loading()
        out = until_loaded(sched)
        assert chunks(out) == [("a2", 4 * BS, 4 * BS + 1)]   # only the last token computed
        assert sched.loads.loaded_tokens == 4 * BS and tiers.stats.host_hits == 4
        assert advance(sched, out) == [again]
        sched.release(again, RequestState.FINISHED_STOPPED)
        settle(tiers)
    finally:
        tiers.close()
    assert pool.all_free() and tiers.idle()


def test_an_abort_while_loading_hands_the_request_back_once():
    pool, tiers, sched = make()
    try:
        tokens = list(range(1, 3 * BS + 2))
        run(sched, _tokens_req("a", tokens))
        settle(tiers)                       # a's blocks held until stored, then evictable
        run(sched, _tokens_req("b", list(range(100, 100 + 7 * BS))))
        settle(tiers)
        sched.add(again := _tokens_req("a2", tokens))
        assert sched.schedule().requests == ()
        assert sched.abort("a2") is None                    # its blocks are held: loading
        deadline = time.monotonic() + 5
        while not (dropped := sched.take_aborted()):
            assert time.monotonic() < deadline
            sched.schedule()
            time.sleep(0.005)
        assert dropped == [again] and sched.take_aborted() == []
        sched.release(again, RequestState.FINISHED_ABORTED)
        settle(tiers)
    finally:
        tiers.close()
    assert pool.all_free()


def sched_hashes(tokens):
    from pdserve.engine.block_pool import block_hashes
    return block_hashes(tokens, BS)
