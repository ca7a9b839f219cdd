"""decode_worker/scheduler.py: reservation → KV arrival → continuous batch → stops.

No model, no sockets: the tests play the transport (on_kv_complete), the router (abort)
and the step thread (schedule / update_from_output). Every test ends with the pool free.
"""

import pytest

from pdserve.decode_worker.scheduler import DecodeScheduler, SchedulerOutput, RequestTooLargeError
from pdserve.engine.block_pool import BlockPool, NoFreeBlocksError, blocks_needed
from pdserve.engine.request import RequestState, TokenEvent
from pdserve.decode_worker.step_budget import MAX_BUDGET_WAITS
from pdserve.engine.sampling_params import SamplingParams

BLOCK_SIZE = 4
NUM_BLOCKS = 32
MAX_MODEL_LEN = 64
EOS = 2
EOS_ALT = 3
LEASE_S = 30.0


@pytest.fixture
def pool():
    return BlockPool(NUM_BLOCKS)


def make_sched(pool, max_model_len=MAX_MODEL_LEN, **kw) -> DecodeScheduler:
    return DecodeScheduler(pool, BLOCK_SIZE, max_model_len, (EOS, EOS_ALT), **kw)


def params(max_tokens=16, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, **kw)


def prompt(n: int) -> list[int]:
    """n prompt token ids (none of them EOS)."""
    return list(range(100, 100 + n))


def admit(sched, rid, prompt_len=8, first_token=10, **kw):
    """reserve + KV arrives + schedule; returns the batch."""
    sched.reserve(rid, prompt_len, params(**kw), LEASE_S, prompt_token_ids=prompt(prompt_len))
    sched.on_kv_complete(rid, True, first_token)
    return sched.schedule()


def ids(batch: SchedulerOutput) -> list[str]:
    return [r.request_id for r in batch.requests]


def finish_all(sched):
    """Abort whatever is left and apply it (the step thread's next schedule)."""
    for rid in list(sched._requests):
        sched.abort(rid)
    sched.schedule()
    sched.drain_events()


# --- reserve ----------------------------------------------------------------------------

def test_reserve_takes_only_the_prompt_blocks(pool):
    sched = make_sched(pool)
    r = sched.reserve("a", 10, params(max_tokens=7), LEASE_S, prompt_token_ids=prompt(10))
    prompt_blocks = r.block_ids
    assert r.num_cached_blocks == 0 and not r.local_prefill
    assert len(prompt_blocks) == blocks_needed(10, BLOCK_SIZE) == 3
    assert pool.num_free == NUM_BLOCKS - 3               # not prompt + max_tokens (5)
    req = sched._requests["a"]
    assert req.block_table == prompt_blocks
    assert req.prompt_token_ids == prompt(10) and req.prompt_len == 10
    assert req.state == RequestState.WAITING_FOR_REMOTE_KV
    assert sched.counts() == (0, 1)
    finish_all(sched)
    assert pool.all_free()


def test_reserve_refuses_a_request_the_whole_pool_could_not_hold(pool):
    sched = make_sched(pool, max_model_len=1000)
    with pytest.raises(RequestTooLargeError) as ei:          # 130 tokens: 33 blocks > 32
        sched.reserve("a", 10, params(max_tokens=120), LEASE_S, prompt_token_ids=prompt(10))
    assert (ei.value.needed, ei.value.total) == (33, NUM_BLOCKS)
    assert "max_tokens (120)" in str(ei.value) and f"has {NUM_BLOCKS} in all" in str(ei.value)
    assert pool.all_free() and sched.counts() == (0, 0)
    sched.reserve("b", 10, params(max_tokens=118), LEASE_S,   # 128 tokens: fits alone
                  prompt_token_ids=prompt(10))
    finish_all(sched)
    assert pool.all_free()


def test_reserve_limit_is_capped_by_model_context(pool):
    sched = make_sched(pool, max_model_len=20)
    sched.reserve("a", 10, params(max_tokens=1000), LEASE_S,  # the context caps it: 20 tokens
                  prompt_token_ids=prompt(10))
    assert pool.num_free == NUM_BLOCKS - blocks_needed(10, BLOCK_SIZE)
    finish_all(sched)
    assert pool.all_free()


def test_reserve_prompt_token_ids_must_match_prompt_len(pool):
    sched = make_sched(pool)
    with pytest.raises(ValueError, match="prompt_len=9 but 8 prompt_token_ids"):
        sched.reserve("a", 9, params(), LEASE_S, prompt_token_ids=prompt(8))
    assert pool.all_free() and sched.counts() == (0, 0)


def test_reserve_is_idempotent_per_request_id(pool):
    sched = make_sched(pool)
    first = sched.reserve("a", 9, params(max_tokens=4), LEASE_S, prompt_token_ids=prompt(9))
    free_after_first = pool.num_free
    again = sched.reserve("a", 9, params(max_tokens=4), LEASE_S, prompt_token_ids=prompt(9))
    assert again == first
    assert pool.num_free == free_after_first
    assert sched.counts() == (0, 1)
    finish_all(sched)
    assert pool.all_free()


def test_a_reserve_of_a_live_id_with_another_prompt_or_params_is_refused(pool):
    """Two requests under one id never share a reservation (and so its KV): only the
    same prompt and params reserve again (a retried prefill)."""
    from pdserve.decode_worker.requests import ReservationConflictError

    sched = make_sched(pool)
    first = sched.reserve("a", 9, params(max_tokens=4), LEASE_S, prompt_token_ids=prompt(9))
    free = pool.num_free
    other = list(reversed(prompt(9)))
    with pytest.raises(ReservationConflictError, match="'a' is reserved already"):
        sched.reserve("a", 9, params(max_tokens=4), LEASE_S, prompt_token_ids=other)
    with pytest.raises(ReservationConflictError):
        sched.reserve("a", 9, params(max_tokens=4, temperature=0.5), LEASE_S,
                      prompt_token_ids=prompt(9))
    assert pool.num_free == free and sched.counts() == (0, 1)
    assert sched.reserve("a", 9, params(max_tokens=4), LEASE_S,
                         prompt_token_ids=prompt(9)) == first
    finish_all(sched)
    assert pool.all_free()


def test_reserve_when_full_raises_and_takes_nothing(pool):
    sched = make_sched(pool)
    sched.reserve("big", 60, params(max_tokens=4), LEASE_S, prompt_token_ids=prompt(60))   # 15
    sched.reserve("big2", 56, params(max_tokens=2), LEASE_S, prompt_token_ids=prompt(56))  # 14
    assert pool.num_free == 3
    with pytest.raises(NoFreeBlocksError) as ei:
        sched.reserve("c", 13, params(max_tokens=4), LEASE_S, prompt_token_ids=prompt(13))  # 4
    assert ei.value.requested == 4 and ei.value.free == 3
    assert pool.num_free == 3
    assert sched.counts() == (0, 2)
    assert "c" not in sched._requests
    # a request the scheduler never took is ignored by later calls
    sched.on_kv_complete("c", True, 10)
    sched.abort("c")
    assert sched.schedule().requests == ()
    assert sched.drain_events() == []
    # still fits what is left
    sched.reserve("d", 12, params(max_tokens=8), LEASE_S, prompt_token_ids=prompt(12))    # 3
    assert pool.num_free == 0
    finish_all(sched)
    assert pool.all_free()


# --- KV arrival and admission --------------------------------------------------------------

def test_kv_complete_then_schedule_runs_request(pool):
    sched = make_sched(pool)
    sched.reserve("a", 8, params(), LEASE_S, prompt_token_ids=prompt(8))
    sched.on_kv_complete("a", True, 11)
    assert sched.counts() == (0, 1)          # arrived, not admitted until schedule()
    batch = sched.schedule()
    assert ids(batch) == ["a"]
    req = batch.requests[0]
    assert req.state == RequestState.RUNNING
    assert req.output_ids == [11] and req.num_tokens == 9
    assert sched.counts() == (1, 0)
    assert sched.drain_events() == []
    finish_all(sched)
    assert pool.all_free()


def test_schedule_without_arrival_is_empty(pool):
    sched = make_sched(pool)
    sched.reserve("a", 8, params(), LEASE_S, prompt_token_ids=prompt(8))
    assert sched.schedule().requests == ()
    assert sched.counts() == (0, 1)
    finish_all(sched)
    assert pool.all_free()


def test_batch_is_capped_by_max_batch_size(pool):
    sched = make_sched(pool, max_batch_size=2)
    for rid in "abc":
        sched.reserve(rid, 4, params(max_tokens=4), LEASE_S, prompt_token_ids=prompt(4))
        sched.on_kv_complete(rid, True, 10)
    batch = sched.schedule()
    assert ids(batch) == ["a", "b"]
    assert sched.counts() == (3, 0)
    sched.update_from_output(batch, [EOS, EOS])
    assert ids(sched.schedule()) == ["c"]
    finish_all(sched)
    assert pool.all_free()


# --- update_from_output and stops -------------------------------------------------------------

def test_update_appends_tokens_and_finishes_on_eos(pool):
    sched = make_sched(pool)
    batch = admit(sched, "a")
    events = sched.update_from_output(batch, [20])
    assert events == [TokenEvent("a", (20,))]
    batch = sched.schedule()
    assert batch.requests[0].output_ids == [10, 20]
    events = sched.update_from_output(batch, [21])
    assert events == [TokenEvent("a", (21,))]
    batch = sched.schedule()
    free_before = pool.num_free
    events = sched.update_from_output(batch, [EOS])
    assert events == [TokenEvent("a", (EOS,), "stop")]
    assert pool.num_free > free_before           # freed at once, on the step thread
    assert sched.counts() == (0, 0)
    assert sched.schedule().requests == ()
    assert pool.all_free()


def test_any_of_several_eos_ids_stops(pool):
    sched = make_sched(pool)
    batch = admit(sched, "a")
    assert sched.update_from_output(batch, [EOS_ALT]) == [TokenEvent("a", (EOS_ALT,), "stop")]
    assert pool.all_free()


def test_ignore_eos_keeps_going_until_max_tokens(pool):
    sched = make_sched(pool)
    batch = admit(sched, "a", first_token=EOS, max_tokens=3, ignore_eos=True)
    assert ids(batch) == ["a"]                    # first token EOS did not finish it
    assert sched.update_from_output(batch, [EOS]) == [TokenEvent("a", (EOS,))]
    batch = sched.schedule()
    assert sched.update_from_output(batch, [EOS]) == [TokenEvent("a", (EOS,), "length")]
    assert pool.all_free()


def test_stop_token_ids_stop_even_with_ignore_eos(pool):
    sched = make_sched(pool)
    batch = admit(sched, "a", stop_token_ids=(77, 78), ignore_eos=True)
    assert sched.update_from_output(batch, [5]) == [TokenEvent("a", (5,))]
    batch = sched.schedule()
    assert sched.update_from_output(batch, [78]) == [TokenEvent("a", (78,), "stop")]
    assert pool.all_free()


def test_max_tokens_finishes_with_length(pool):
    sched = make_sched(pool)
    batch = admit(sched, "a", max_tokens=4)       # first token counts: 3 more
    got = []
    for tok in (30, 31, 32):
        assert ids(batch) == ["a"]
        got += sched.update_from_output(batch, [tok])
        batch = sched.schedule()
    assert got == [TokenEvent("a", (30,)), TokenEvent("a", (31,)),
                   TokenEvent("a", (32,), "length")]
    assert batch.requests == ()
    assert pool.all_free()


def test_model_context_limit_finishes_with_length(pool):
    sched = make_sched(pool, max_model_len=12)
    batch = admit(sched, "a", prompt_len=9, max_tokens=100)     # room for 3 tokens
    assert pool.num_free == NUM_BLOCKS - blocks_needed(9 + 1, BLOCK_SIZE)   # next position: 9
    assert sched.update_from_output(batch, [40]) == [TokenEvent("a", (40,))]
    batch = sched.schedule()
    assert sched.update_from_output(batch, [41]) == [TokenEvent("a", (41,), "length")]
    assert pool.all_free()


@pytest.mark.parametrize("kw, first, reason", [
    (dict(), EOS, "stop"),
    (dict(stop_token_ids=(55,)), 55, "stop"),
    (dict(max_tokens=1), 10, "length"),
])
def test_first_token_can_finish_at_admission(pool, kw, first, reason):
    sched = make_sched(pool)
    batch = admit(sched, "a", first_token=first, **kw)
    assert batch.requests == ()
    assert sched.drain_events() == [TokenEvent("a", (), reason)]
    assert sched.counts() == (0, 0)
    assert pool.all_free()


def test_events_from_schedule_ride_on_next_update(pool):
    sched = make_sched(pool)
    admit(sched, "a")
    sched.reserve("b", 4, params(), LEASE_S, prompt_token_ids=prompt(4))
    sched.on_kv_complete("b", True, EOS)
    batch = sched.schedule()                       # b finishes at admission
    events = sched.update_from_output(batch, [EOS])
    assert events == [TokenEvent("b", (), "stop"), TokenEvent("a", (EOS,), "stop")]
    assert sched.drain_events() == []
    assert pool.all_free()


def test_update_from_output_length_mismatch_raises(pool):
    sched = make_sched(pool)
    batch = admit(sched, "a")
    with pytest.raises(ValueError):
        sched.update_from_output(batch, [1, 2])
    finish_all(sched)
    assert pool.all_free()


def test_a_step_budget_caps_prefill_beside_decode_rows_only(pool):
    """A TPOT SLO's step budget bounds a step's rows and prefill chunk together while
    streams decode beside a prefill; it is asked with each decode row's (tokens so far,
    ITL seconds so far); a step with no decode row, or no prefill, is not capped. A
    budget short of a block leaves the prefill out, MAX_BUDGET_WAITS steps in a row at
    most, then a block runs."""
    s = make_sched(pool, prefill_chunk_size=32)
    asked = []

    def budget(cap):
        return lambda streams: asked.append(streams) or cap

    s.reserve("d", 3, params(max_tokens=40), LEASE_S, prompt(3), prefill_locally=True)
    out = s.schedule(step_budget=budget(6))
    assert out.num_scheduled_tokens == (3,) and not asked    # alone: its whole prompt
    s.update_from_output(out, [7], step_s=0.5)
    out = s.schedule(step_budget=budget(6))
    assert out.num_scheduled_tokens == (1,) and not asked    # decode alone: no cap
    s.update_from_output(out, [8], step_s=0.02)
    s.reserve("p", 40, params(), LEASE_S, prompt(40), prefill_locally=True)
    out = s.schedule(step_budget=budget(6))
    assert out.num_scheduled_tokens == (1, BLOCK_SIZE)  # 6 - 1 decode row, to a block's end
    assert asked == [[(2, 0.02, 37)]]  # its prefill step is not an ITL; one gap of 20 ms;
    #                                    40 - 2 - 1 tokens after the step's
    s.update_from_output(out, [9, None], step_s=0.03)
    out = s.schedule(step_budget=budget(3))
    assert out.num_scheduled_tokens == (1,)                 # 3 - 1 < a block: it waits
    assert asked[-1] == [(3, pytest.approx(0.05), 36)]
    for k in range(MAX_BUDGET_WAITS - 1):
        s.update_from_output(out, [20 + k])
        out = s.schedule(step_budget=budget(3))
        assert out.num_scheduled_tokens == (1,)
    s.update_from_output(out, [40])
    out = s.schedule(step_budget=budget(3))                 # waited its most: a block
    assert out.num_scheduled_tokens == (1, BLOCK_SIZE)
    s.update_from_output(out, [41, None])
    out = s.schedule(step_budget=budget(None))               # not learned yet
    # the chunk, less the row, ending on a block boundary: 8 + 31 -> 36
    assert out.num_scheduled_tokens == (1, 28)
    s.update_from_output(out, [42, None])
    for r in ("d", "p"):
        s.abort(r)
    s.schedule()
    assert pool.num_free == NUM_BLOCKS
