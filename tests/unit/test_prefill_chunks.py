"""prefill_worker/scheduler.py, continued from test_prefill_scheduler.py: the prefix
cache and chunked prefill (which blocks each chunk computes and sends).

No model, no sockets. Every test ends with the pool free.
"""

import pytest

from pdserve.engine.block_pool import BlockPool
from pdserve.engine.outputs import ModelRunnerOutput
from pdserve.engine.request import RequestState
from pdserve.engine.sampling_params import SamplingParams
from pdserve.prefill_worker.requests import PrefillRequest
from pdserve.prefill_worker.scheduler import PrefillScheduler
from test_prefill_scheduler import BLOCK_SIZE, KV_ADDRESS, make, release_all, rids

FIRST_TOKEN = 7


def _tokens_req(rid: str, tokens: list[int]) -> PrefillRequest:
    return PrefillRequest(rid, tokens, SamplingParams(), KV_ADDRESS, epoch=1)


def chunks(out) -> list[tuple[str, int, int]]:
    """(request id, first token, end) of each row's chunk (call before the update)."""
    return [(r.request_id, r.num_computed_tokens, r.num_computed_tokens + n)
            for r, n in zip(out.requests, out.num_scheduled_tokens)]


def advance(sched, out, ok=True) -> list[PrefillRequest]:
    """update_from_output after `out` ran (ok) or raised: the requests it returns done.
    A row that completes its prompt samples FIRST_TOKEN."""
    n = len(out.requests)
    result = ModelRunnerOutput(
        tuple(FIRST_TOKEN if r.num_computed_tokens + k == r.prompt_len else None
              for r, k in zip(out.requests, out.num_scheduled_tokens)),
        (None,) * n, (None,) * n, (None,) * n) if ok else None
    done = sched.update_from_output(out, result)
    assert all(t == (FIRST_TOKEN if ok else None) for _, t in done), done
    return [r for r, _ in done]


def run_whole(sched, out) -> None:
    """`out`'s rows computed to their prompts' ends, one step each (their full blocks
    then enter the prefix cache)."""
    while out.requests:
        advance(sched, out)
        out = sched.schedule()


def test_prefix_cache_shares_computed_blocks_but_never_the_last_tokens_block():
    pool, sched = make(num_blocks=16, budget=64)
    first = _tokens_req("a", list(range(1, 11)))            # blocks [1-4][5-8][9,10]
    sched.add(first)
    out = sched.schedule()
    [a] = out.requests
    assert a.num_cached == 0 and sched.computed_tokens == 10
    advance(sched, out)                                      # 2 full blocks registered
    assert pool.num_cached == 2
    same = _tokens_req("b", list(range(1, 9)))               # 8 tokens: 2 full blocks
    longer = _tokens_req("c", list(range(1, 10)) + [42, 43])
    sched.add(same)
    sched.add(longer)
    b, c = sched.schedule().requests
    # "b": its last token's block is block 2 of the prompt, so only block 1 is shared
    assert (b.num_cached, b.block_table[0], b.block_table[1] != a.block_table[1]) == \
        (4, a.block_table[0], True)
    assert (c.num_cached, c.block_table[:2]) == (8, a.block_table[:2])
    assert sched.computed_tokens == 10 + 4 + 3 and sched.cached_tokens == 12
    assert (sched.prefix_queries, sched.prefix_hits) == (2 + 1 + 2, 0 + 1 + 2)
    assert pool.ref_count(a.block_table[0]) == 3
    for r in (a, b, c):
        sched.release(r, RequestState.FINISHED_STOPPED)
    assert pool.all_free() and pool.num_cached == 2


def test_budget_counts_uncached_tokens_and_back_off_drops_the_match():
    pool, sched = make(num_blocks=16, budget=8)
    a = _tokens_req("a", list(range(1, 10)))                 # 9 tokens: over budget alone
    sched.add(a)
    out = sched.schedule()
    [a] = out.requests
    advance(sched, out)
    sched.release(a, RequestState.FINISHED_STOPPED)
    warm = _tokens_req("warm", list(range(1, 9)) + [7, 7, 7])  # 11 tokens, 8 cached
    cold = _tokens_req("cold", [9] * 6)
    sched.add(warm)
    sched.add(cold)
    batch = sched.schedule()
    assert rids(batch) == ["warm"]             # 3 + 6 new tokens > budget 8
    assert batch.requests[0].num_cached == 8
    assert all(pool.ref_count(b) == 1 for b in batch.requests[0].block_table)  # cold's undone
    release_all(sched, batch)
    release_all(sched, sched.schedule())
    assert pool.all_free()


def test_prefix_caching_off_shares_nothing():
    pool = BlockPool(16)
    sched = PrefillScheduler(pool, BLOCK_SIZE, 64, enable_prefix_caching=False,
                             schedule_policy="fcfs")
    for rid in "ab":
        sched.add(_tokens_req(rid, list(range(1, 10))))
        out = sched.schedule()
        [r] = out.requests
        advance(sched, out)
        assert r.num_cached == 0
        sched.release(r, RequestState.FINISHED_STOPPED)
    assert pool.num_cached == 0 and pool.all_free()


def chunked(num_blocks=256, budget=16, chunk=8):
    pool = BlockPool(num_blocks)
    return pool, PrefillScheduler(pool, BLOCK_SIZE, budget, prefill_chunk_size=chunk,
                                  schedule_policy="fcfs")


def test_chunked_prefill_lets_short_prompts_in_between_chunks():
    pool, sched = chunked(budget=16, chunk=8)
    long = _tokens_req("long", list(range(1, 31)))        # 30 tokens: chunks of 8
    sched.add(long)
    steps = []

    def step():
        batch = sched.schedule()
        steps.append(chunks(batch))
        return batch, advance(sched, batch)

    _, done = step()
    assert steps[-1] == [("long", 0, 8)] and done == []
    short = _tokens_req("short", [5, 6, 7])
    sched.add(short)
    _, done = step()
    assert steps[-1] == [("long", 8, 16), ("short", 0, 3)]   # the long one keeps its turn
    assert [r.request_id for r in done] == ["short"]          # first token after 2 steps
    release_all(sched, done)
    _, done = step()
    _, done = step()
    assert steps[-2:] == [[("long", 16, 24)], [("long", 24, 30)]]
    assert done == [long] and long.num_computed_tokens == 30
    assert sched.computed_tokens == 33
    release_all(sched, done)
    assert pool.all_free() and sched.schedule().requests == ()


def test_a_chunk_as_large_as_the_budget_leaves_half_of_it_to_waiting_prompts():
    """Budget == chunk size (a CPU prefill worker's 512 / 512): the long prompt runs
    whole chunks while alone, half a budget while others wait, so they are not stuck
    behind all its chunks."""
    pool, sched = chunked(budget=16, chunk=16)
    long = _tokens_req("long", list(range(1, 61)))        # 60 tokens
    sched.add(long)
    batch = sched.schedule()
    assert chunks(batch) == [("long", 0, 16)]
    advance(sched, batch)
    short = _tokens_req("short", [5, 6, 7])
    sched.add(short)
    batch = sched.schedule()
    assert chunks(batch) == [("long", 16, 24), ("short", 0, 3)]
    done = advance(sched, batch)
    assert done == [short]
    release_all(sched, done)
    steps, done = [], []                                   # alone again: whole chunks
    while not done:
        batch = sched.schedule()
        steps.append(chunks(batch))
        done = advance(sched, batch)
    assert steps == [[("long", 24, 40)], [("long", 40, 56)], [("long", 56, 60)]]
    assert done == [long]
    release_all(sched, [long])
    assert pool.all_free() and sched.schedule().requests == ()


def test_chunks_end_on_block_boundaries_within_the_budget():
    pool, sched = chunked(budget=16, chunk=16)
    a, b = _tokens_req("a", list(range(1, 11))), _tokens_req("b", list(range(50, 80)))
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    # a: 10 tokens; b gets the 6 left, cut to a block boundary: 4
    assert chunks(batch) == [("a", 0, 10), ("b", 0, 4)]
    assert advance(sched, batch) == [a]
    sched.release(a, RequestState.FINISHED_STOPPED)
    batch = sched.schedule()
    assert chunks(batch) == [("b", 4, 20)]
    advance(sched, batch)
    assert chunks(sched.schedule()) == [("b", 20, 30)]
    release_all(sched, [b])
    assert pool.all_free()


def test_abort_between_chunks_hands_the_request_back_once():
    pool, sched = chunked(budget=8, chunk=8)
    r = _tokens_req("r", list(range(1, 21)))
    sched.add(r)
    advance(sched, sched.schedule())
    assert sched.abort("r") is None          # computing: the worker ends it
    assert sched.schedule().requests == ()
    assert sched.take_aborted() == [r] and sched.take_aborted() == []
    sched.release(r, RequestState.FINISHED_ABORTED)
    assert pool.all_free()


def test_failed_step_requeues_nothing():
    pool, sched = chunked(budget=8, chunk=8)
    r = _tokens_req("r", list(range(1, 21)))
    sched.add(r)
    assert advance(sched, sched.schedule(), ok=False) == [r]   # done here, as failed
    assert sched.schedule().requests == ()
    sched.release(r, RequestState.FINISHED_ERROR)
    assert pool.all_free()


def test_chunk_size_must_be_block_aligned_and_within_budget():
    for bad in (6, 2, 32):
        with pytest.raises(ValueError, match="prefill_chunk_size"):
            PrefillScheduler(BlockPool(4), BLOCK_SIZE, 16, prefill_chunk_size=bad)


def test_kv_is_sent_per_chunk_and_never_the_blocks_d_holds():
    pool, sched = chunked(budget=16, chunk=8)
    warm = _tokens_req("warm", list(range(1, 13)))         # 12 tokens: 2 full blocks cached
    sched.add(warm)
    out = sched.schedule()
    [w] = out.requests
    run_whole(sched, out)
    sched.release(w, RequestState.FINISHED_STOPPED)
    # 30 tokens = 8 blocks; P has blocks 0-1 cached, D holds blocks 0 (num_cached_blocks=1)
    r = _tokens_req("r", list(range(1, 9)) + list(range(100, 122)))
    r.num_cached_blocks = 1
    sched.add(r)
    sent = []
    while True:
        batch = sched.schedule()
        sent += [(lo, hi) for _, lo, hi in sched.kv_send_ranges(batch)]
        if advance(sched, batch):
            break
    # first chunk computes tokens 8..15 (blocks 2-3) and sends P's cached block 1 too;
    # block 0 is D's; the last chunk ends mid-block 7
    assert sent == [(1, 4), (4, 6), (6, 8)]
    assert r.num_cached == 8 and r.num_computed_tokens == 30
    sched.release(r, RequestState.FINISHED_STOPPED)
    assert pool.all_free()
