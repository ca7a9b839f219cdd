"""decode_worker/fork.py through the decode scheduler: sampling n > 1 reserves and
receives one prompt, then forks it into its samples, sharing the prompt's blocks by
reference and copying the last prompt token's block into each sample's own.

No model: the tests play the transport (on_kv_complete), the router (reserve, abort) and
the step thread (schedule / update_from_output). Block size 4. Every test ends with the
pool free.
"""

import pytest

from pdserve.decode_worker.connector import DecodeKVConnector
from pdserve.decode_worker.fork import sample_id
from pdserve.decode_worker.scheduler import DecodeScheduler, SchedulerOutput
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.request import RequestState
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kv_transfer.base import KVCompletion
from test_decode_failures import ScriptedReceiver, release

BS, EOS, TOKEN = 4, 2, 50


def make(num_blocks=32, **kw):
    pool = BlockPool(num_blocks)
    return pool, DecodeScheduler(pool, BS, 64, (EOS,), **kw)


def params(n=3, **kw):
    return SamplingParams(max_tokens=kw.pop("max_tokens", 4), n=n, **kw)


def reserve(sched, rid, prompt_len, p, **kw):
    return sched.reserve(rid, prompt_len, p, 30.0, list(range(100, 100 + prompt_len)), **kw)


def rows(out: SchedulerOutput) -> dict[str, tuple[int, int]]:
    """request id -> (num_computed_tokens, tokens scheduled)."""
    return {r.request_id: (r.num_computed_tokens, n)
            for r, n in zip(out.requests, out.num_scheduled_tokens)}


def run_to_end(sched, out, token=TOKEN, limit=50):
    events = []
    for _ in range(limit):
        if not out.requests and not sched.has_work():
            return events
        events += sched.update_from_output(out, [token if out.samples(i) else None
                                                 for i in range(len(out.requests))])
        out = sched.schedule()
    raise AssertionError("did not finish")


@pytest.mark.parametrize("prompt_len", [6, 8])      # last block partial / full
def test_samples_share_the_prompt_blocks_and_copy_the_last_one(prompt_len):
    pool, sched = make()
    r = reserve(sched, "a", prompt_len, params(n=3, seed=7))
    table = list(r.block_ids)
    sched.on_kv_complete("a", True, 10)
    *shared, last = table
    # 3 holders of every prompt block until the samples copy theirs
    assert [pool.ref_count(b) for b in table] == [3] * len(table)
    out = sched.schedule()
    assert rows(out) == {"a": (prompt_len, 1), "a/1": (prompt_len - 1, 1),
                         "a/2": (prompt_len - 1, 1)}
    by_id = {q.request_id: q for q in out.requests}
    assert [q.params.seed for q in out.requests] == [7, 8, 9]
    assert all(q.params.n == 1 for q in out.requests)
    assert list(out.blocks_to_copy) == [(last, by_id["a/1"].block_table[-1]),
                                        (last, by_id["a/2"].block_table[-1])]
    assert len({dst for _, dst in out.blocks_to_copy} | {last}) == 3   # blocks of their own
    for rid in ("a/1", "a/2"):
        assert by_id[rid].block_table[:-1] == shared and by_id[rid].output_ids == []
    events = sched.update_from_output(out, [TOKEN] * 3)
    assert [e.request_id for e in events] == ["a", "a/1", "a/2"]
    out = sched.schedule()                               # the copies ran: sources let go
    assert pool.ref_count(last) == 1 and all(pool.ref_count(b) == 3 for b in shared)
    run_to_end(sched, out)
    assert pool.all_free()


def test_a_sample_preempted_before_its_copy_lets_its_source_go_and_recomputes():
    """3 blocks: b (1) and a (2) hold them all, so sample a/1 finds no block for its
    copy and is preempted (the newest); it resumes by recompute once they finish."""
    pool, sched = make(3)
    reserve(sched, "b", 3, SamplingParams(max_tokens=2))
    sched.on_kv_complete("b", True, 10)
    reserve(sched, "a", 6, params(n=2, max_tokens=2))
    sched.on_kv_complete("a", True, 10)
    child = sched._requests["a/1"]
    src = child.cow_src
    out = sched.schedule()
    assert child.state == RequestState.PREEMPTED and out.blocks_to_copy == ()
    assert child.cow_src is None and child.block_table == [] and pool.ref_count(src) == 1
    events = run_to_end(sched, out)
    assert [len(e.token_ids) for e in events if e.request_id == "a/1"] == [1, 1]
    assert any(e.request_id == "a/1" and e.finish_reason for e in events)
    assert pool.all_free()


def test_the_group_abort_reaches_every_sample_and_a_sample_abort_only_its_own():
    pool, sched = make()
    reserve(sched, "a", 6, params(n=3, max_tokens=20))
    sched.on_kv_complete("a", True, 10)
    out = sched.schedule()
    sched.update_from_output(out, [TOKEN] * 3)
    sched.abort("a/2")                                   # a stop string ended sample 2
    sched.schedule()
    assert set(sched._requests) == {"a", "a/1"}
    sched.abort("a", group=True)
    sched.schedule()
    assert sched._requests == {}
    sched.schedule()
    assert pool.all_free()


def test_a_group_aborted_before_its_kv_arrived_never_forks():
    pool, sched = make()
    reserve(sched, "a", 6, params(n=3))
    sched.abort("a", group=True)
    sched.on_kv_complete("a", True, 10)
    sched.schedule()
    assert sched._requests == {} and pool.all_free()


def test_samples_go_on_when_the_first_token_ended_sample_0():
    pool, sched = make()
    reserve(sched, "a", 6, params(n=2))
    sched.on_kv_complete("a", True, EOS)                 # sample 0 ends at P's token
    out = sched.schedule()
    assert list(rows(out)) == ["a/1"]
    events = run_to_end(sched, out)
    assert [e.finish_reason for e in events if e.request_id == "a"] == ["stop"]
    assert [len(e.token_ids) for e in events if e.request_id == "a/1"] == [1, 1, 1, 1]
    assert pool.all_free()


def test_a_local_prefill_forks_once_its_prompt_is_computed():
    pool, sched = make(local_prefill_max_tokens=16)
    r = reserve(sched, "a", 6, params(n=2, max_tokens=2))
    assert r.local_prefill
    out = sched.schedule()
    assert rows(out) == {"a": (0, 6)}
    events = sched.update_from_output(out, [TOKEN])
    assert [e.request_id for e in events] == ["a"]
    child = sched._requests["a/1"]
    assert child.state == RequestState.WAITING and child.num_computed_tokens == 5
    out = sched.schedule()
    assert rows(out) == {"a": (6, 1), "a/1": (5, 1)}
    run_to_end(sched, out)
    assert pool.all_free()


def test_a_remote_kv_request_frees_through_the_connector_and_its_samples_directly():
    """Sample 0 holds the transfer's blocks until the receiver releases them (a NIXL
    writer's lease); its samples' references go back to the pool at their finish."""
    pool = BlockPool(32)
    rx = ScriptedReceiver()
    sched = DecodeScheduler(pool, BS, 64, (EOS,), connector=DecodeKVConnector(rx))
    r = reserve(sched, "a", 6, params(n=2, max_tokens=1))
    rx.completions = [KVCompletion("a", True, 10, None)]
    sched.update_from_connector()                       # arrival and fork
    out = sched.schedule()                               # max_tokens=1: sample 0 done
    assert list(rows(out)) == ["a/1"] and rx.forgotten == ["a"]
    run_to_end(sched, out)
    assert [pool.ref_count(b) for b in r.block_ids] == [1, 1]    # the transfer's only
    release(sched, rx, "a")
    assert pool.all_free()


def test_a_transfer_that_failed_forks_nothing():
    pool = BlockPool(32)
    rx = ScriptedReceiver()
    sched = DecodeScheduler(pool, BS, 64, (EOS,), connector=DecodeKVConnector(rx))
    reserve(sched, "a", 6, params(n=3))
    rx.completions = [KVCompletion("a", False, None, "connection lost")]
    sched.update_from_connector()
    sched.schedule()
    assert sched._requests == {}
    assert [e.finish_reason for e in sched.drain_events()] == ["error"]
    release(sched, rx, "a")
    assert pool.all_free()


def test_sample_ids():
    assert sample_id("x#1", 0) == "x#1" and sample_id("x#1", 3) == "x#1/3"
