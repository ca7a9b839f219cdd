"""decode_worker/scheduler.py under overload (continued from test_decode_preemption.py):
many requests through a pool that cannot hold them all, preempted and resumed over and
over, each still finishing with every token, the scheduler's invariants checked after
every step. Every test ends with the pool free.
"""

import itertools

from pdserve.engine.block_pool import NoFreeBlocksError
from pdserve.engine.request import RequestState
from test_decode_preemption import covers_next_position, make, recomputing, req, reserve

# --- a whole overloaded run -------------------------------------------------------------------

def fake_token(r) -> int:
    """A deterministic 'model': the token depends only on the request and its step."""
    return 60 + (hash(r.request_id) + 7 * len(r.output_ids)) % 30


def test_overloaded_pool_preempts_and_still_finishes_every_request_with_every_token():
    """Six requests whose prompt + max_tokens together need 3x the pool: all finish with
    all their tokens, newest-first preemption only, no livelock, nothing leaked."""
    pool, sched = make(12, max_batch_size=4)
    max_tokens = 20
    pending = [(f"r{i}", 5 + i) for i in range(6)]   # each alone: at most 8 of 12 blocks
    got = {rid: [] for rid, _ in pending}
    finished = {}
    seen_resume_and_wait = False
    batch = sched.schedule()
    for _ in range(400):
        still = []
        for rid, n in pending:                     # the router retries a refused reserve
            try:
                reserve(sched, rid, n, max_tokens=max_tokens)
            except NoFreeBlocksError:
                still.append((rid, n))
                continue
            sched.on_kv_complete(rid, True, 10 + n)
        pending = still
        before = {r.request_id: r.state for r in sched._requests.values()}
        preemptions = sched.num_preemptions
        batch = sched.schedule()
        _check_invariants(sched, pool, batch)
        if sched.num_preemptions > preemptions:    # victims are newer than every survivor
            victims = [r for r in sched._requests.values()
                       if r.state == RequestState.PREEMPTED
                       and before[r.request_id] == RequestState.RUNNING]
            assert min(v.admitted_seq for v in victims) > max(
                (r.admitted_seq for r in batch.requests), default=-1)
        resumed = [req(sched, rid).admitted_seq for rid in recomputing(batch)]
        waiting = [r.admitted_seq for r in sched._batch.preempted]
        if resumed and waiting:                    # oldest first: a prefix of the queue
            assert max(resumed) < min(waiting)
        seen_resume_and_wait |= bool(resumed and waiting)
        for ev in sched.update_from_output(batch, [fake_token(r) for r in batch.requests]) \
                + sched.drain_events():
            got[ev.request_id] += ev.token_ids
            if ev.finish_reason:
                finished[ev.request_id] = ev.finish_reason
        if len(finished) == 6:
            break
    assert finished == {rid: "length" for rid in got}
    assert sched.num_preemptions > 0 and seen_resume_and_wait
    for rid, tokens in got.items():                # decode streams tokens 2..max_tokens
        want = [60 + (hash(rid) + 7 * k) % 30 for k in range(1, max_tokens)]
        assert tokens == want, rid
    assert sched.counts() == (0, 0) and not sched.has_work()
    assert pool.all_free()


def _check_invariants(sched, pool, batch):
    live = list(sched._requests.values())
    held = list(itertools.chain.from_iterable(r.block_table for r in live))
    assert len(held) == len(set(held)), "a block in two block tables"
    assert len(held) + pool.num_free == pool.num_blocks, "blocks leaked"
    for r in live:
        if r.state == RequestState.PREEMPTED:
            assert r.block_table == [] and r not in batch.requests
    for r in batch.requests:
        assert r.state == RequestState.RUNNING and covers_next_position(r), r.request_id
    for r in sched._batch.running:                       # resumed only with a slot in the batch
        assert r.num_computed_tokens == r.num_tokens - 1 or r in batch.requests, r.request_id
