"""decode_worker/scheduler.py: D's prefix cache (only the blocks D lacks are filled by
prefill) and local prefill on D (short uncached prompts skip the prefill worker).

No model: the tests play the transport and the step thread, as in test_decode_scheduler.
Every test ends with no block held.
"""

import pytest

from pdserve.decode_worker.scheduler import DecodeScheduler
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.request import RequestState, TokenEvent
from pdserve.engine.sampling_params import SamplingParams

BS = 4
NUM_BLOCKS = 32
EOS = 2


@pytest.fixture
def pool():
    return BlockPool(NUM_BLOCKS)


def prefills(out):
    """Rows of a SchedulerOutput computing more than one token (prefill rows)."""
    return tuple(r for r, n in zip(out.requests, out.num_scheduled_tokens) if n > 1)


def ends(out):
    """Where each prefill row's tokens end after the step (call before the update)."""
    return tuple(r.num_computed_tokens + n for r, n in zip(out.requests, out.num_scheduled_tokens)
                 if n > 1)


def make_sched(pool, local=0, caching=True) -> DecodeScheduler:
    return DecodeScheduler(pool, BS, 128, (EOS,), enable_prefix_caching=caching,
                           local_prefill_max_tokens=local)


def reserve(sched, rid, ids, max_tokens=4):
    return sched.reserve(rid, len(ids), SamplingParams(max_tokens=max_tokens), 30.0, ids)


def finish_all(sched):
    for rid in list(sched._requests):
        sched.abort(rid)
    sched.schedule()
    sched.drain_events()


def serve_remote(sched, rid, ids, first=10):
    """reserve, KV arrives, run to max_tokens=1 (finishes at once); returns the reservation."""
    r = reserve(sched, rid, ids, max_tokens=1)
    sched.on_kv_complete(rid, True, first)
    sched.schedule()
    sched.drain_events()
    return r


PROMPT = list(range(100, 130))           # 30 tokens: 7 full blocks + 2 tokens


def test_second_request_fills_only_the_blocks_d_lacks(pool):
    sched = make_sched(pool)
    first = serve_remote(sched, "a", PROMPT)
    assert first.num_cached_blocks == 0 and len(first.block_ids) == 8
    assert pool.num_cached == 7 and pool.all_free()       # full prompt blocks, evictable

    shared = PROMPT[:22] + [7, 7, 7, 7, 7]                # 5 full blocks in common
    r = reserve(sched, "b", shared)
    assert r.num_cached_blocks == 5 and not r.local_prefill
    req = sched._requests["b"]
    assert req.block_table[:5] == first.block_ids[:5]     # shared, read only
    assert r.block_ids == req.block_table[5:] and len(r.block_ids) == 2
    assert all(pool.ref_count(b) == 1 for b in req.block_table)
    assert sched.prompt_cache.cached_tokens == 5 * BS
    finish_all(sched)
    assert pool.all_free()


def test_the_last_tokens_block_is_never_taken_from_the_cache(pool):
    sched = make_sched(pool)
    ids = PROMPT[:16]                                     # exactly 4 full blocks
    serve_remote(sched, "a", ids)
    r = reserve(sched, "b", ids)
    assert r.num_cached_blocks == 3 and len(r.block_ids) == 1
    finish_all(sched)
    assert pool.all_free()


def test_without_prefix_caching_nothing_is_shared(pool):
    sched = make_sched(pool, caching=False)
    serve_remote(sched, "a", PROMPT)
    r = reserve(sched, "b", PROMPT)
    assert r.num_cached_blocks == 0 and len(r.block_ids) == 8 and pool.num_cached == 0
    finish_all(sched)
    assert pool.all_free()


def test_a_failed_transfer_caches_nothing(pool):
    sched = make_sched(pool)
    reserve(sched, "a", PROMPT)
    sched.on_kv_complete("a", False, None, "connection lost")
    sched.schedule()
    sched.drain_events()
    assert pool.num_cached == 0 and pool.all_free()


def test_local_prefill_computes_the_prompt_and_samples_the_first_token(pool):
    sched = make_sched(pool, local=8)
    ids = PROMPT[:6]
    r = reserve(sched, "a", ids, max_tokens=3)
    assert r.local_prefill and r.block_ids == [] and r.num_cached_blocks == 0
    assert sched.num_local_prefills == 1
    batch = sched.schedule()
    (req,) = batch.requests
    # the step prefills the prompt and samples its first token: a prefill row, no decode
    assert prefills(batch) == (req,)
    assert req.num_computed_tokens == 0 and req.output_ids == []
    events = sched.update_from_output(batch, [11])
    assert events == [TokenEvent("a", (11,))]             # the first token, on D's stream
    batch = sched.schedule()
    assert prefills(batch) == () and batch.requests[0].output_ids == [11]
    assert pool.num_cached == 1                           # its one full prompt block
    finish_all(sched)
    assert pool.all_free()


def test_local_prefill_after_a_prefix_cache_hit(pool):
    sched = make_sched(pool, local=8)
    serve_remote(sched, "a", PROMPT)                      # 30 tokens: remote (> 8)
    ids = PROMPT[:28] + [5, 6, 7]                         # 7 blocks cached, 3 tokens new
    r = reserve(sched, "b", ids)
    assert r.local_prefill and r.num_cached_blocks == 7
    (req,) = prefills(sched.schedule())
    assert req.num_computed_tokens == 28 and req.prompt_token_ids[28:] == [5, 6, 7]
    finish_all(sched)
    assert pool.all_free()


def test_uncached_prompt_over_the_threshold_goes_to_the_prefill_worker(pool):
    sched = make_sched(pool, local=8)
    r = reserve(sched, "a", PROMPT[:9])
    assert not r.local_prefill and len(r.block_ids) == 3
    assert sched._requests["a"].state == RequestState.WAITING_FOR_REMOTE_KV
    finish_all(sched)
    assert pool.all_free()


def test_local_prefill_aborted_before_its_step_frees_its_blocks(pool):
    sched = make_sched(pool, local=8)
    reserve(sched, "a", PROMPT[:6])
    sched.abort("a")
    batch = sched.schedule()
    assert batch.requests == ()
    assert [e.finish_reason for e in sched.drain_events()] == ["cancelled"]
    assert pool.all_free()


def test_local_prefill_preempted_before_its_first_token_prefills_again(pool):
    sched = DecodeScheduler(pool, BS, 128, (EOS,), enable_prefix_caching=True,
                            local_prefill_max_tokens=8)
    serve_remote(sched, "warm", PROMPT)                   # D caches 7 blocks
    reserve(sched, "a", PROMPT[:28] + [5, 6, 7])          # local, 28 tokens cached
    sched.schedule()                                      # admitted: RUNNING, no output
    req = sched._requests["a"]
    with sched._lock:
        sched._batch.preempt(req)                               # as if the pool ran short
    assert req.num_computed_tokens == 0 and req.block_table == []
    batch = sched.schedule()                              # resumes: prefill row again
    assert prefills(batch) == (req,) and req.num_computed_tokens == 0 and len(req.block_table) == 8
    sched.update_from_output(batch, [9])
    assert req.output_ids == [9]
    finish_all(sched)
    assert pool.all_free()


def test_reserve_of_a_local_prefill_is_idempotent(pool):
    sched = make_sched(pool, local=8)
    assert reserve(sched, "a", PROMPT[:6]) == reserve(sched, "a", PROMPT[:6])
    assert sched.num_local_prefills == 1 and sched.counts() == (0, 1)
    finish_all(sched)
    assert pool.all_free()


def test_chunked_local_prefill_spreads_a_prompt_over_steps_beside_decode(pool):
    sched = DecodeScheduler(pool, BS, 128, (EOS,), local_prefill_max_tokens=64,
                            prefill_chunk_size=12)
    reserve(sched, "run", PROMPT[:5], max_tokens=10)
    batch = sched.schedule()
    sched.update_from_output(batch, [11])                 # 5 tokens: one chunk, first token
    reserve(sched, "long", PROMPT[:25], max_tokens=2)
    batch = sched.schedule()
    run, long = sched._requests["run"], sched._requests["long"]
    # the decode row counts first: 12 - 1 = 11 prompt tokens this step, cut back to
    # end on a block boundary (schedule_policy.chunk_tokens): 8
    assert batch.requests == (run, long) and prefills(batch) == (long,)
    assert ends(batch) == (8,)
    events = sched.update_from_output(batch, [12, None])  # no token for a partial chunk
    assert events == [TokenEvent("run", (12,))] and long.num_computed_tokens == 8
    batch = sched.schedule()
    assert ends(batch) == (16,)                    # 8 + 11 -> 16
    sched.update_from_output(batch, [13, None])
    batch = sched.schedule()
    assert ends(batch) == (25,)                    # the rest; then its first token
    events = sched.update_from_output(batch, [14, 40])
    assert TokenEvent("long", (40,)) in events and long.output_ids == [40]
    assert long.num_computed_tokens == 25 == long.num_tokens - 1   # a decode row from now on
    finish_all(sched)
    assert pool.all_free()


def test_prefill_rows_beyond_the_chunk_budget_wait_their_turn(pool):
    sched = DecodeScheduler(pool, BS, 128, (EOS,), local_prefill_max_tokens=64,
                            prefill_chunk_size=8)
    reserve(sched, "a", PROMPT[:6])
    reserve(sched, "b", PROMPT[10:16])
    batch = sched.schedule()
    a, b = sched._requests["a"], sched._requests["b"]
    # a's 6 tokens leave 2, short of b's first block boundary: b sits the step out
    assert prefills(batch) == (a,) and ends(batch) == (6,)
    sched.update_from_output(batch, [20])
    assert a.output_ids == [20] and b.num_computed_tokens == 0
    batch = sched.schedule()
    assert prefills(batch) == (b,) and ends(batch) == (6,)
    sched.update_from_output(batch, [20, 21])
    many = DecodeScheduler(BlockPool(NUM_BLOCKS), BS, 128, (EOS,),
                           local_prefill_max_tokens=64, prefill_chunk_size=8)
    for i in range(3):
        reserve(many, f"r{i}", PROMPT[4 * i:4 * i + 8])
    batch = many.schedule()                               # the budget covers r0 only
    assert [r.request_id for r in batch.requests] == ["r0"] and ends(batch) == (8,)
    finish_all(sched)
    finish_all(many)
    assert pool.all_free() and many.pool.all_free()


def test_sjf_gives_the_chunk_budget_to_the_shortest_prompt_but_keeps_batch_order(pool):
    sched = DecodeScheduler(pool, BS, 128, (EOS,), local_prefill_max_tokens=64,
                            prefill_chunk_size=10, schedule_policy="sjf")
    reserve(sched, "long", PROMPT[:20])
    reserve(sched, "short", PROMPT[20:26])
    batch = sched.schedule()
    long, short = sched._requests["long"], sched._requests["short"]
    # the 6-token prompt first; the 4 tokens left (a block) go to the long one; rows in
    # batch order, as the step's tokens come back
    assert prefills(batch) == (long, short) and ends(batch) == (4, 6)
    events = sched.update_from_output(batch, [None, 30])
    assert events == [TokenEvent("short", (30,))] and long.num_computed_tokens == 4
    fcfs = DecodeScheduler(BlockPool(NUM_BLOCKS), BS, 128, (EOS,), local_prefill_max_tokens=64,
                           prefill_chunk_size=10)               # the default: fcfs
    reserve(fcfs, "long", PROMPT[:20])
    reserve(fcfs, "short", PROMPT[20:26])
    assert ends(fcfs.schedule()) == (8,)       # arrival order: long only, to a block's end
    finish_all(sched)
    finish_all(fcfs)
    assert pool.all_free() and fcfs.pool.all_free()


def test_a_partly_prefilled_request_preempted_starts_its_prompt_again(pool):
    sched = DecodeScheduler(pool, BS, 128, (EOS,), local_prefill_max_tokens=64,
                            prefill_chunk_size=8)
    reserve(sched, "a", PROMPT[:20])
    batch = sched.schedule()
    sched.update_from_output(batch, [None])
    req = sched._requests["a"]
    assert req.num_computed_tokens == 8
    with sched._lock:
        sched._batch.preempt(req)
    batch = sched.schedule()
    assert prefills(batch) == (req,) and req.num_computed_tokens == 0 and ends(batch) == (8,)
    finish_all(sched)
    assert pool.all_free()
