"""decode_worker/scheduler.py: on-demand blocks, preemption (newest first), resume by
recompute (oldest first, before new reservations).

No model: the tests play the transport (on_kv_complete), the router (reserve, abort) and
the step thread (schedule / update_from_output). Block size 4, so a request's next
position enters a new block at positions 4, 8, 12, ... Every test ends with the pool free.
"""

import time

import pytest

from pdserve.decode_worker.scheduler import DecodeScheduler, SchedulerOutput
from pdserve.engine.block_pool import BlockPool, NoFreeBlocksError, blocks_needed
from pdserve.engine.request import RequestState, TokenEvent
from pdserve.engine.sampling_params import SamplingParams
from pdserve.decode_worker.connector import DecodeKVConnector
from test_decode_failures import ScriptedReceiver, release

BLOCK_SIZE = 4
MAX_MODEL_LEN = 64
EOS = 2
LEASE_S = 30.0
TOKEN = 50             # what the fake model samples (never EOS)


def make(num_blocks: int, **kw) -> tuple[BlockPool, DecodeScheduler]:
    pool = BlockPool(num_blocks)
    return pool, DecodeScheduler(pool, BLOCK_SIZE, MAX_MODEL_LEN, (EOS,), **kw)


def prompt(n: int, base: int = 100) -> list[int]:
    return list(range(base, base + n))


def reserve(sched, rid, prompt_len, max_tokens=12, lease_s=LEASE_S):
    return sched.reserve(rid, prompt_len, SamplingParams(max_tokens=max_tokens), lease_s,
                         prompt_token_ids=prompt(prompt_len))


def arrive(sched, rid, prompt_len, first_token=10, **kw):
    """reserve + every layer arrived with the prefill worker's first token."""
    reserve(sched, rid, prompt_len, **kw)
    sched.on_kv_complete(rid, True, first_token)


def step(sched, batch: SchedulerOutput, token=TOKEN) -> SchedulerOutput:
    """The step thread: one token for every row, then the next schedule()."""
    sched.update_from_output(batch, [token] * len(batch.requests))
    return sched.schedule()


def ids(rows) -> list[str]:
    return [r.request_id for r in rows]


def recomputing(out: SchedulerOutput) -> list[str]:
    """Rows computing their tokens again after preemption (a prefill with output)."""
    return [r.request_id for r, n in zip(out.requests, out.num_scheduled_tokens)
            if n > 1 and r.output_ids]


def counts(out: SchedulerOutput) -> dict[str, int]:
    return {r.request_id: n for r, n in zip(out.requests, out.num_scheduled_tokens)}


def req(sched, rid):
    return sched._requests[rid]


def covers_next_position(r) -> bool:
    return len(r.block_table) * BLOCK_SIZE > r.num_tokens - 1


def finish_all(sched):
    for rid in list(sched._requests):
        sched.abort(rid)
    sched.schedule()
    sched.drain_events()


def arrive_abc(sched):
    """a (prompt 8: its first position needs a third block), b and c (prompt 7): 2
    blocks each."""
    for rid, n in (("a", 8), ("b", 7), ("c", 7)):
        arrive(sched, rid, n)


def full_pool(reserved: str, lease_s=LEASE_S, max_batch_size=256):
    """8 blocks: a, b, c arrived (arrive_abc) and `reserved` (prompt 7) waiting for its
    KV; nothing free. Returns (pool, sched)."""
    pool, sched = make(8, max_batch_size=max_batch_size)
    arrive_abc(sched)
    reserve(sched, reserved, 7, lease_s=lease_s)
    assert pool.num_free == 0
    return pool, sched


def preempt_c(**kw):
    """arrive_abc into 6 blocks: a's first position needs a third block, so the first
    schedule() preempts c, the newest. Returns (pool, sched, batch)."""
    pool, sched = make(6, **kw)
    arrive_abc(sched)
    assert pool.num_free == 0
    batch = sched.schedule()
    assert ids(batch.requests) == ["a", "b"] and req(sched, "c").state == RequestState.PREEMPTED
    return pool, sched, batch


# --- on-demand blocks ------------------------------------------------------------------------

def test_block_table_grows_by_one_block_when_the_next_position_enters_a_new_block():
    pool, sched = make(16)
    arrive(sched, "a", 6)                          # positions 0..5: 2 blocks
    assert pool.num_free == 14
    batch = sched.schedule()                       # next position 6: still block 1
    a = batch.requests[0]
    first_two = list(a.block_table)
    assert len(a.block_table) == 2
    batch = step(sched, batch)                     # next position 7
    assert len(a.block_table) == 2 and pool.num_free == 14
    batch = step(sched, batch)                     # next position 8: block 2, taken now
    assert len(a.block_table) == 3 and pool.num_free == 13
    assert a.block_table[:2] == first_two          # grown at the end, never moved
    for _ in range(3):                             # positions 9, 10, 11
        batch = step(sched, batch)
    assert len(a.block_table) == 3
    batch = step(sched, batch)                     # position 12
    assert len(a.block_table) == 4 and covers_next_position(a)
    assert sched.num_preemptions == 0
    finish_all(sched)
    assert pool.all_free()


def test_prompt_filling_its_last_block_gets_a_block_at_admission():
    pool, sched = make(16)
    arrive(sched, "a", 8)                          # 2 full blocks; first position 8
    assert pool.num_free == 14
    (a,) = sched.schedule().requests
    assert len(a.block_table) == 3 and pool.num_free == 13
    finish_all(sched)
    assert pool.all_free()


# --- preemption --------------------------------------------------------------------------------

def test_preempts_the_newest_running_request_and_frees_all_its_blocks():
    pool, sched, _ = preempt_c()                   # a needed a block; c, the newest, went
    c = req(sched, "c")
    assert c.state == RequestState.PREEMPTED and c.block_table == []
    assert c.output_ids == [10] and c.prompt_token_ids == prompt(7)   # nothing lost
    assert sched.num_preemptions == 1
    assert len(req(sched, "a").block_table) == 3 and pool.num_free == 1
    assert sched.counts() == (2, 1) and sched.num_waiting_to_resume() == 1
    assert sched.drain_events() == []              # no event: the stream only pauses
    finish_all(sched)
    assert pool.all_free()


def test_the_newest_request_preempts_itself():
    pool, sched = make(4)
    arrive(sched, "a", 6, max_tokens=8)
    arrive(sched, "b", 7, max_tokens=8)            # 2 blocks each: the pool is full
    batch = sched.schedule()                       # next positions: a 6, b 7
    assert ids(batch.requests) == ["a", "b"]
    batch = step(sched, batch)                     # a 7, b 8: b needs a block, none free
    assert ids(batch.requests) == ["a"]            # b is the newest: it gave its own up
    assert req(sched, "b").state == RequestState.PREEMPTED and pool.num_free == 2
    assert req(sched, "a").output_ids == [10, TOKEN]
    batch = step(sched, batch)                     # a 8: takes one of b's old blocks
    assert len(req(sched, "a").block_table) == 3 and pool.num_free == 1
    assert sched.num_preemptions == 1
    finish_all(sched)
    assert pool.all_free()


def test_resume_is_oldest_first_recomputes_and_keeps_every_token():
    pool, sched, batch = preempt_c()
    for _ in range(3):                             # a: positions 9..11, b: 8..10
        batch = step(sched, batch)
    assert pool.num_free == 0 and ids(batch.requests) == ["a", "b"]
    batch = step(sched, batch)                     # a 12: b (newer than a) is preempted
    b, c = req(sched, "b"), req(sched, "c")
    assert ids(batch.requests) == ["a"] and b.state == RequestState.PREEMPTED
    assert sched.num_preemptions == 2
    b_tokens = list(b.output_ids)
    assert b.num_tokens == 12 and b_tokens == [10] + [TOKEN] * 4
    for _ in range(2):                             # c needs 2 blocks and 2 are free, but b,
        assert pool.num_free == 2                  # older, comes first and needs 3
        assert b.state == c.state == RequestState.PREEMPTED
        batch = step(sched, batch)
    assert ids(batch.requests) == ["a"]

    sched.update_from_output(batch, [EOS])         # a finishes: 4 blocks back
    batch = sched.schedule()
    assert ids(batch.requests) == ["b", "c"]       # resumed in admission order
    assert recomputing(batch) == ["b", "c"]
    assert b.output_ids == b_tokens and c.output_ids == [10]
    assert b.num_computed_tokens == c.num_computed_tokens == 0
    assert counts(batch) == {"b": 12, "c": 8}      # every token again, then sample
    assert b.token_ids(12) == prompt(7) + b_tokens
    assert len(b.block_table) == blocks_needed(12, BLOCK_SIZE) and covers_next_position(b)
    assert len(c.block_table) == blocks_needed(8, BLOCK_SIZE) and covers_next_position(c)
    assert pool.num_free == 1 and sched.num_waiting_to_resume() == 0
    events = sched.update_from_output(batch, [61, 62])
    assert events == [TokenEvent("b", (61,)), TokenEvent("c", (62,))]
    assert (b.num_computed_tokens, c.num_computed_tokens) == (12, 8)
    out = sched.schedule()                         # recomputed once, then decode (c, the
    assert counts(out)["b"] == 1 and recomputing(out) == []   # newest, preempted again)
    finish_all(sched)
    assert pool.all_free()


def test_reserve_leaves_the_blocks_preempted_requests_need_to_resume():
    pool, sched, _ = preempt_c()
    assert pool.num_free == 1                      # c needs 2 to resume
    with pytest.raises(NoFreeBlocksError) as ei:
        reserve(sched, "d", 3)                     # 1 block: free, but c's
    assert (ei.value.requested, ei.value.free) == (1, 0)
    assert "d" not in sched._requests and pool.num_free == 1
    sched.abort("a")
    batch = sched.schedule()                       # a's 3 blocks back: c resumes
    assert ids(batch.requests) == ["b", "c"] and pool.num_free == 2
    reserve(sched, "d", 3)
    assert pool.num_free == 1
    finish_all(sched)
    assert pool.all_free()


def late_arrival(max_batch_size: int = 256):
    """c is preempted (while beyond the batch when max_batch_size is 2); d, reserved
    before that, arrives after it; then a is aborted, freeing 3 blocks."""
    pool, sched = full_pool("d", max_batch_size=max_batch_size)
    batch = sched.schedule()                       # a's position 8: c, the newest, goes
    assert ids(batch.requests) == ["a", "b"] and req(sched, "c").state == RequestState.PREEMPTED
    sched.on_kv_complete("d", True, 10)
    batch = step(sched, batch)                     # d admitted; b's position 8 takes the
    assert ids(batch.requests) == ["a", "b", "d"][:max_batch_size]   # last free block
    assert pool.num_free == 0
    sched.abort("a")
    return pool, sched, sched.schedule()


def test_a_resumed_request_goes_before_requests_admitted_after_it():
    pool, sched, batch = late_arrival()
    assert ids(batch.requests) == ["b", "c", "d"]  # c by its first admission, not last
    assert recomputing(batch) == ["c"] and pool.num_free == 1
    for _ in range(4):                             # until b, c or d runs short of blocks
        batch = step(sched, batch)
        if sched.num_preemptions > 1:
            break
    assert sched.num_preemptions == 2
    assert req(sched, "d").state == RequestState.PREEMPTED     # the newest: not c
    assert ids(batch.requests) == ["b", "c"]
    finish_all(sched)
    assert pool.all_free()


def test_resume_order_is_first_admission_not_preemption_order():
    pool, sched = full_pool("d")
    batch = sched.schedule()                       # c preempted
    sched.on_kv_complete("d", True, 10)
    batch = step(sched, batch)                     # d admitted after c's preemption
    assert ids(batch.requests) == ["a", "b", "d"] and pool.num_free == 0
    batch = step(sched, batch)                     # d's position 8: d preempts itself,
    assert req(sched, "d").state == RequestState.PREEMPTED   # freeing 2 blocks, which
    assert ids(batch.requests) == ["a", "b", "c"]  # go to c: admitted before d
    assert recomputing(batch) == ["c"] and sched.num_preemptions == 2
    finish_all(sched)
    assert pool.all_free()


def test_resume_waits_for_a_slot_in_the_batch():
    pool, sched, batch = late_arrival(max_batch_size=2)
    c = req(sched, "c")
    assert ids(batch.requests) == ["b", "d"]       # 3 blocks free, c needs 2: no slot
    assert c.state == RequestState.PREEMPTED and c.block_table == [] and pool.num_free == 3
    sched.update_from_output(batch, [TOKEN, EOS])  # d finishes
    batch = sched.schedule()
    assert ids(batch.requests) == ["b", "c"] and recomputing(batch) == ["c"]
    finish_all(sched)
    assert pool.all_free()


# --- aborts and leases --------------------------------------------------------------------------

def test_abort_of_a_preempted_request_frees_nothing_twice():
    rx = ScriptedReceiver()
    pool, sched, _ = preempt_c(connector=DecodeKVConnector(rx))
    assert pool.num_free == 1
    sched.abort("c")
    batch = sched.schedule()
    assert ids(batch.requests) == ["a", "b"]
    assert sched.drain_events() == [TokenEvent("c", (), "cancelled")]
    assert rx.forgotten == ["c"]                   # the receiver forgets it ...
    release(sched, rx, "c")
    assert pool.num_free == 1                      # ... and no block is freed: it held none
    assert sched.counts() == (2, 0) and sched.num_waiting_to_resume() == 0
    sched.abort("c")                               # gone: ignored
    sched.on_kv_complete("c", True, 10)
    assert ids(sched.schedule().requests) == ["a", "b"] and sched.drain_events() == []
    finish_all(sched)
    assert rx.forgotten == ["c", "a", "b"]
    release(sched, rx, "a", "b")
    assert pool.all_free()


def test_abort_of_a_resumed_request_before_its_recompute_frees_its_new_blocks_once():
    pool, sched, _ = preempt_c()
    sched.abort("a")
    batch = sched.schedule()
    c = req(sched, "c")
    assert recomputing(batch) == ["c"] and len(c.block_table) == 2
    sched.abort("c")                               # arrives while the recompute step runs
    events = sched.update_from_output(batch, [TOKEN, TOKEN])
    assert events == [TokenEvent("a", (), "cancelled"), TokenEvent("b", (TOKEN,))]
    assert c.output_ids == [10]
    sched.schedule()
    assert sched.drain_events() == [TokenEvent("c", (), "cancelled")]
    assert pool.num_free == 6 - len(req(sched, "b").block_table)
    finish_all(sched)
    assert pool.all_free()


def test_lease_does_not_apply_to_a_preempted_request():
    pool, sched, _ = preempt_c()
    sched.schedule(now=time.monotonic() + 10 * LEASE_S)
    assert req(sched, "c").state == RequestState.PREEMPTED
    assert sched.num_reclaimed == 0 and sched.drain_events() == []
    assert sched.num_reservations_active() == 0   # c holds no lease
    assert sched.has_work()
    finish_all(sched)
    assert pool.all_free()


def test_expired_lease_returns_blocks_that_a_preempted_request_resumes_in():
    pool, sched = full_pool("w", lease_s=1.0)    # prefill's KV for w never comes
    sched.schedule()                               # a needs a block: c is preempted
    assert req(sched, "c").state == RequestState.PREEMPTED and pool.num_free == 1
    batch = sched.schedule(now=time.monotonic() + 10.0)
    (ev,) = sched.drain_events()
    assert ev.request_id == "w" and ev.finish_reason == "error" and "lease" in ev.error
    assert sched.num_reclaimed == 1
    assert ids(batch.requests) == ["a", "b", "c"] and recomputing(batch) == ["c"]
    assert pool.num_free == 1
    finish_all(sched)
    assert pool.all_free()
