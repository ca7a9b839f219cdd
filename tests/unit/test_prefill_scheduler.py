"""prefill_worker/scheduler.py: varlen batches under a token budget, blocks, aborts, in
arrival order (fcfs, the default) or shortest prompt first (sjf).

No model, no sockets. Every test ends with the pool free.
"""

import time

import pytest

from pdserve.engine.block_pool import BlockPool, blocks_needed
from pdserve.engine.request import RequestState
from pdserve.engine.sampling_params import SamplingParams
from pdserve.prefill_worker.requests import FinishCause, PrefillRequest
from pdserve.prefill_worker.scheduler import PrefillScheduler

BLOCK_SIZE = 4
KV_ADDRESS = ("127.0.0.1", 5555)


def req(rid: str, num_tokens: int) -> PrefillRequest:
    return PrefillRequest(rid, list(range(1, num_tokens + 1)), SamplingParams(), KV_ADDRESS, epoch=1)


def make(num_blocks=64, budget=16, policy="fcfs"):
    pool = BlockPool(num_blocks)
    return pool, PrefillScheduler(pool, BLOCK_SIZE, max_num_batched_tokens=budget,
                                  schedule_policy=policy)


def rids(out) -> list[str]:
    """The request ids of a SchedulerOutput's rows."""
    return [r.request_id for r in out.requests]


def release_all(sched, out, state=RequestState.FINISHED_STOPPED):
    """Release a SchedulerOutput's rows, or a list of requests."""
    for r in getattr(out, "requests", out):
        sched.release(r, state)


def test_fifo_batches_under_token_budget():
    pool, sched = make(budget=16)
    reqs = [req("a", 8), req("b", 6), req("c", 4), req("d", 3), req("e", 16)]
    for r in reqs:
        sched.add(r)
    first = sched.schedule()
    assert rids(first) == ["a", "b"]                 # 14 tokens; +4 would be 18 > 16
    second = sched.schedule()
    assert rids(second) == ["c", "d"]                # 7; +16 would be 23
    third = sched.schedule()
    assert rids(third) == ["e"]                      # exactly the budget
    assert sched.schedule().requests == ()
    for batch in (first, second, third):
        assert sum(r.prompt_len for r in batch.requests) <= 16
        release_all(sched, batch)
    assert pool.all_free()


def test_sjf_takes_the_shortest_prompts_first_and_a_starved_one_before_them():
    pool, sched = make(budget=16, policy="sjf")
    reqs = [req("a", 8), req("b", 6), req("c", 4), req("d", 3), req("e", 16)]
    for r in reqs:
        sched.add(r)
    first = sched.schedule()
    assert rids(first) == ["d", "c", "b"]            # 13 tokens; +8 would be 21 > 16
    sched.add(late := req("f", 2))
    reqs[0].arrived = time.monotonic() - 6.0         # "a" has waited past MAX_WAIT_S
    second = sched.schedule()
    assert rids(second) == ["a", "f"]                # the starved one first, then shortest
    third = sched.schedule()
    assert rids(third) == ["e"]
    assert late.state == RequestState.PREFILLING
    for batch in (first, second, third):
        release_all(sched, batch)
    assert pool.all_free()


def test_unknown_schedule_policy_is_refused():
    with pytest.raises(ValueError, match="'lifo'.*fcfs, sjf"):
        PrefillScheduler(BlockPool(4), BLOCK_SIZE, 16, schedule_policy="lifo")


def test_budget_is_inclusive():
    pool, sched = make(budget=16)
    sched.add(req("a", 10))
    sched.add(req("b", 6))
    batch = sched.schedule()
    assert rids(batch) == ["a", "b"]
    release_all(sched, batch)
    assert pool.all_free()


def test_over_budget_prompt_runs_alone():
    pool, sched = make(budget=16)
    sched.add(req("small", 4))
    sched.add(req("big", 40))
    sched.add(req("small2", 2))
    b1 = sched.schedule()
    assert rids(b1) == ["small"]                     # big does not join a non-empty batch
    b2 = sched.schedule()
    assert rids(b2) == ["big"]                       # but runs alone
    b3 = sched.schedule()
    assert rids(b3) == ["small2"]
    for b in (b1, b2, b3):
        release_all(sched, b)
    assert pool.all_free()


def test_blocks_are_allocated_per_batched_request():
    pool, sched = make(num_blocks=32, budget=64)
    sizes = {"a": 1, "b": 4, "c": 5, "d": 13}
    for rid, n in sizes.items():
        sched.add(req(rid, n))
    for r in sched._waiting:
        assert r.block_table == [] and r.state == RequestState.WAITING
    batch = sched.schedule()
    assert rids(batch) == list(sizes)
    total = 0
    for r in batch.requests:
        assert r.state == RequestState.PREFILLING
        assert len(r.block_table) == blocks_needed(sizes[r.request_id], BLOCK_SIZE)
        assert all(pool.ref_count(b) == 1 for b in r.block_table)
        total += len(r.block_table)
    all_blocks = [b for r in batch.requests for b in r.block_table]
    assert len(set(all_blocks)) == len(all_blocks) == total == 1 + 1 + 2 + 4
    assert pool.num_free == 32 - total
    release_all(sched, batch)
    assert all(r.block_table == [] for r in batch.requests)
    assert pool.all_free()


def test_waits_for_blocks_without_overtaking():
    pool, sched = make(num_blocks=8, budget=100)
    sched.add(req("a", 24))                          # 6 blocks
    first = sched.schedule()
    assert rids(first) == ["a"] and pool.num_free == 2
    sched.add(req("b", 16))                          # 4 blocks: must wait
    sched.add(req("c", 4))                           # 1 block: would fit, must not overtake
    assert sched.schedule().requests == ()
    assert pool.num_free == 2                        # nothing taken while waiting
    assert sched.counts() == (1, 2)
    sched.release(first.requests[0], RequestState.FINISHED_STOPPED)
    second = sched.schedule()
    assert rids(second) == ["b", "c"]
    release_all(sched, second)
    assert pool.all_free()


def test_batch_stops_at_first_request_without_blocks():
    pool, sched = make(num_blocks=5, budget=100)
    sched.add(req("a", 8))                           # 2 blocks
    sched.add(req("b", 16))                          # 4 blocks: 3 left after a
    sched.add(req("c", 4))
    batch = sched.schedule()
    assert rids(batch) == ["a"]
    release_all(sched, batch)
    batch = sched.schedule()
    assert rids(batch) == ["b", "c"]
    release_all(sched, batch)
    assert pool.all_free()


def test_abort_of_queued_request_returns_it_and_it_is_skipped():
    pool, sched = make()
    a, b, c = req("a", 4), req("b", 4), req("c", 4)
    for r in (a, b, c):
        sched.add(r)
    assert sched.abort("b") is b
    assert b.finish.cause is FinishCause.ABORTED and b.block_table == []
    assert sched.abort("b") is None                  # already gone
    batch = sched.schedule()
    assert rids(batch) == ["a", "c"]
    assert b.block_table == []                       # never given blocks
    release_all(sched, batch)
    assert sched.counts() == (0, 0)
    assert pool.all_free()


def test_aborted_head_of_queue_does_not_block_others():
    pool, sched = make(num_blocks=4, budget=100)
    sched.add(req("a", 16))                          # would take the whole pool
    sched.add(req("b", 4))
    assert sched.abort("a") is not None
    batch = sched.schedule()
    assert rids(batch) == ["b"]
    release_all(sched, batch)
    assert pool.all_free()


def test_abort_of_scheduled_request_marks_it_and_returns_none():
    pool, sched = make()
    sched.add(req("a", 8))
    (a,) = sched.schedule().requests
    assert sched.abort("a") is None
    assert a.finish.cause is FinishCause.ABORTED
    assert a.block_table                             # the worker still owns the blocks
    assert not pool.all_free()
    sched.release(a, RequestState.FINISHED_ABORTED)
    assert a.state == RequestState.FINISHED_ABORTED
    assert sched.counts() == (0, 0)
    assert sched.abort("a") is None
    assert pool.all_free()


def test_abort_unknown_request_returns_none():
    pool, sched = make()
    assert sched.abort("nope") is None
    assert pool.all_free()


def test_release_frees_blocks_once():
    pool, sched = make()
    sched.add(req("a", 9))
    (a,) = sched.schedule().requests
    assert pool.num_free == 64 - 3
    sched.release(a, RequestState.SENDING_KV)
    assert a.state == RequestState.SENDING_KV
    assert a.block_table == []
    assert pool.all_free()
    sched.release(a, RequestState.FINISHED_STOPPED)  # second release: nothing to free
    assert pool.all_free()


def test_add_rejects_prompt_larger_than_pool():
    pool, sched = make(num_blocks=4)
    with pytest.raises(ValueError, match=r"17 tokens needs 5 KV blocks.*has 4"):
        sched.add(req("a", 17))
    assert sched.counts() == (0, 0)
    sched.add(req("b", 16))                          # exactly the pool: accepted
    (b,) = sched.schedule().requests
    assert pool.num_free == 0
    sched.release(b, RequestState.FINISHED_STOPPED)
    assert pool.all_free()


def test_counts_and_queued_tokens():
    pool, sched = make(budget=10)
    assert sched.counts() == (0, 0) and sched.queued_tokens() == 0
    for rid, n in (("a", 6), ("b", 4), ("c", 5)):
        sched.add(req(rid, n))
    assert sched.counts() == (0, 3)
    assert sched.queued_tokens() == 15
    batch = sched.schedule()
    assert rids(batch) == ["a", "b"]
    assert sched.counts() == (2, 1)
    assert sched.queued_tokens() == 5
    sched.release(batch.requests[0], RequestState.FINISHED_STOPPED)
    assert sched.counts() == (1, 1)
    for r in batch.requests[1:] + sched.schedule().requests:
        sched.release(r, RequestState.FINISHED_STOPPED)
    assert sched.counts() == (0, 0) and sched.queued_tokens() == 0
    assert pool.all_free()


def test_counts_after_abort_of_queued_request():
    pool, sched = make(num_blocks=4, budget=100)
    sched.add(req("a", 16))
    (a,) = sched.schedule().requests                          # holds the whole pool
    sched.add(req("b", 8))
    sched.add(req("c", 4))
    assert sched.abort("c") is not None
    try:
        assert sched.counts() == (1, 1)              # actual: (0, 2)
        assert sched.queued_tokens() == 8            # actual: 12
        sched.abort("b")
        assert sched.counts() == (1, 0)              # actual: (-1, 2)
    finally:
        sched.abort("b")
        sched.release(a, RequestState.FINISHED_STOPPED)
        release_all(sched, sched.schedule())
        assert pool.all_free()
