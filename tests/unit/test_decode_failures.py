"""decode_worker/scheduler.py, continued from test_decode_scheduler.py: KV failures,
aborts, lease expiry, the KV connector (decode_worker/connector.py): forget, then release;
the counts.

No model, no sockets. Every test ends with the pool free.
"""

import time

import pytest

import torch

from pdserve.decode_worker.connector import DecodeKVConnector
from pdserve.engine.request import TokenEvent
from pdserve.kv_transfer import KVCompletion, KVFinished, KVLayout
from pdserve.kv_transfer.reservations import ReservationTable
from test_decode_scheduler import (  # noqa: F401  (pool: the fixture)
    BLOCK_SIZE, EOS, LEASE_S, NUM_BLOCKS, admit, finish_all, ids, make_sched,
    params, pool, prompt,
)


# --- failures, aborts, leases ------------------------------------------------------------

def test_kv_failure_is_error_event_after_schedule(pool):
    sched = make_sched(pool)
    sched.reserve("a", 8, params(), LEASE_S, prompt_token_ids=prompt(8))
    sched.on_kv_complete("a", False, None, error="peer reset")
    assert not pool.all_free()                     # only schedule() frees
    assert sched.drain_events() == []
    assert sched.schedule().requests == ()
    assert sched.drain_events() == [TokenEvent("a", (), "error", "peer reset")]
    assert pool.all_free()


def test_kv_failure_without_message_gets_default_error(pool):
    sched = make_sched(pool)
    sched.reserve("a", 8, params(), LEASE_S, prompt_token_ids=prompt(8))
    sched.on_kv_complete("a", False, None)
    sched.schedule()
    (ev,) = sched.drain_events()
    assert ev.finish_reason == "error" and ev.error
    assert pool.all_free()


def test_abort_waiting_request(pool):
    sched = make_sched(pool)
    sched.reserve("a", 8, params(), LEASE_S, prompt_token_ids=prompt(8))
    sched.abort("a")
    assert not pool.all_free()                     # recorded, applied by schedule()
    sched.on_kv_complete("a", True, 10)            # KV landing after the abort: not admitted
    assert sched.schedule().requests == ()
    assert sched.drain_events() == [TokenEvent("a", (), "cancelled")]
    assert sched.counts() == (0, 0)
    assert pool.all_free()


def test_abort_running_request(pool):
    sched = make_sched(pool)
    batch = admit(sched, "a")
    sched.update_from_output(batch, [20])
    sched.abort("a")
    sched.abort("a", reason="again")               # second abort is a no-op
    assert not pool.all_free()
    assert sched.schedule().requests == ()
    assert sched.drain_events() == [TokenEvent("a", (), "cancelled")]
    assert pool.all_free()


def test_abort_in_flight_frees_blocks_only_at_next_schedule(pool):
    sched = make_sched(pool)
    admit(sched, "a")
    batch = admit(sched, "b")
    assert ids(batch) == ["a", "b"]
    free_in_step = pool.num_free
    sched.abort("a")                               # arrives while the step runs
    assert pool.num_free == free_in_step
    events = sched.update_from_output(batch, [20, 21])
    assert events == [TokenEvent("b", (21,))]      # no token for the aborted row
    assert batch.requests[0].output_ids == [10]    # and nothing appended to it
    assert pool.num_free == free_in_step
    batch = sched.schedule()
    assert ids(batch) == ["b"]
    assert pool.num_free > free_in_step
    assert sched.drain_events() == [TokenEvent("a", (), "cancelled")]
    finish_all(sched)
    assert pool.all_free()


def test_abort_of_unknown_request_is_ignored(pool):
    sched = make_sched(pool)
    sched.abort("nope")
    sched.on_kv_complete("nope", True, 1)
    assert sched.schedule().requests == ()
    assert sched.drain_events() == []
    assert pool.all_free()


def test_lease_expiry_reclaims_waiting_request(pool):
    sched = make_sched(pool)
    t0 = time.monotonic()
    sched.reserve("a", 8, params(), lease_s=5.0, prompt_token_ids=prompt(8))
    assert sched._requests["a"].lease_deadline == pytest.approx(t0 + 5.0, abs=1.0)
    sched.schedule(now=t0 + 1.0)                   # before the deadline: kept
    assert sched.counts() == (0, 1) and sched.num_reclaimed == 0
    assert sched.drain_events() == []
    sched.schedule(now=t0 + 60.0)
    (ev,) = sched.drain_events()
    assert ev.request_id == "a" and ev.finish_reason == "error" and "lease" in ev.error
    assert ev.token_ids == ()
    assert sched.num_reclaimed == 1
    assert sched.counts() == (0, 0) and sched.num_reservations_active() == 0
    # the transport's completion after reclaim is ignored
    sched.on_kv_complete("a", True, 10)
    assert sched.schedule().requests == ()
    assert pool.all_free()


def test_lease_does_not_apply_once_running(pool):
    sched = make_sched(pool)
    sched.reserve("a", 8, params(), lease_s=1.0, prompt_token_ids=prompt(8))
    sched.on_kv_complete("a", True, 10)
    batch = sched.schedule(now=time.monotonic() + 100.0)   # arrived: admitted, not reclaimed
    assert ids(batch) == ["a"]
    assert sched.num_reclaimed == 0
    assert sched.drain_events() == []
    finish_all(sched)
    assert pool.all_free()


def test_a_lease_extended_while_the_prefill_worker_has_the_prompt_is_kept_past_its_first_end(pool):
    """The router renews a lease while P has the prompt queued (router/attempt.py,
    _hold_lease): extended, the reservation outlives its first deadline; a lease is
    never shortened; a request no longer waiting for KV is not extended (False)."""
    sched = make_sched(pool)
    t0 = time.monotonic()
    sched.reserve("a", 8, params(), lease_s=5.0, prompt_token_ids=prompt(8))
    assert sched.extend_lease("a", 30.0)
    assert sched._requests["a"].lease_deadline == pytest.approx(t0 + 30.0, abs=1.0)
    assert sched.extend_lease("a", 1.0)                    # never shorter
    assert sched._requests["a"].lease_deadline == pytest.approx(t0 + 30.0, abs=1.0)
    sched.schedule(now=t0 + 20.0)                          # past the first 5 s: kept
    assert sched.num_reclaimed == 0 and sched.drain_events() == []
    assert not sched.extend_lease("nobody", 30.0)
    sched.on_kv_complete("a", True, 10)
    assert ids(sched.schedule()) == ["a"]                  # its KV arrived: running
    assert not sched.extend_lease("a", 30.0)
    finish_all(sched)
    sched.reserve("b", 8, params(), lease_s=1.0, prompt_token_ids=prompt(8))
    sched.schedule(now=time.monotonic() + 60.0)            # reclaimed: not extended
    assert sched.num_reclaimed == 1 and not sched.extend_lease("b", 30.0)
    sched.drain_events()
    assert pool.all_free()


# --- the KV connector (decode_worker/connector.py): forget, then release --------------------

class ScriptedReceiver:
    """The KVReceiver calls DecodeKVConnector makes, recorded; the test says what
    get_finished() reports (``completions``, ``released``)."""

    def __init__(self, lock=None):
        self.lock = lock                  # the scheduler's, to see it held at expect()
        self.expected, self.forgotten = [], []
        self.completions, self.released = [], []

    def expect(self, rid, block_ids):
        self.expected.append((rid, list(block_ids), self.lock is not None and self.lock.locked()))

    def forget(self, rid, lease_timeout_s=None):
        self.forgotten.append(rid)

    def get_finished(self):
        out = KVFinished(self.completions, self.released)
        self.completions, self.released = [], []
        return out


def with_connector(pool, **kw):
    rx = ScriptedReceiver()
    sched = make_sched(pool, connector=DecodeKVConnector(rx), **kw)
    rx.lock = sched._lock
    return sched, rx


def release(sched, rx, *rids):
    rx.released = list(rids)
    sched.update_from_connector()


def test_finished_remote_requests_are_forgotten_and_freed_only_when_released(pool):
    sched, rx = with_connector(pool)
    # 7-token prompts: 2 blocks each, enough for the first decode position (7) too
    sched.reserve("err", 7, params(max_tokens=8), LEASE_S, prompt_token_ids=prompt(7))
    sched.reserve("cancel", 7, params(max_tokens=8), LEASE_S, prompt_token_ids=prompt(7))
    batch = admit(sched, "stop", prompt_len=7, max_tokens=8)
    sched.reserve("lease", 7, params(max_tokens=8), lease_s=1.0, prompt_token_ids=prompt(7))
    assert pool.num_free == NUM_BLOCKS - 8
    rx.completions = [KVCompletion("err", False, None, "x")]
    sched.update_from_connector()
    assert sched.connector.num_failed == 1
    sched.abort("cancel")

    sched.schedule(now=time.monotonic() + 10.0)
    assert rx.forgotten == ["err", "cancel", "lease"]
    assert pool.num_free == NUM_BLOCKS - 8             # nothing back before the release
    release(sched, rx, "cancel", "nobody")
    assert pool.num_free == NUM_BLOCKS - 6             # an unknown id changes nothing
    release(sched, rx, "err", "lease")
    assert pool.num_free == NUM_BLOCKS - 2

    sched.update_from_output(batch, [EOS])
    assert rx.forgotten[-1] == "stop" and pool.num_free == NUM_BLOCKS - 2
    release(sched, rx, "stop")
    assert pool.all_free()


def test_local_prefills_are_freed_at_once_with_a_connector(pool):
    sched, rx = with_connector(pool, local_prefill_max_tokens=16)
    sched.reserve("local", 8, params(max_tokens=8), LEASE_S, prompt_token_ids=prompt(8))
    sched.abort("local")
    sched.schedule()
    assert rx.expected == rx.forgotten == [] and pool.all_free()


def test_reserve_has_the_receiver_expect_the_blocks_under_its_lock(pool):
    """expect() runs inside reserve(), so no schedule() (a lease expiring, say) can
    finish and forget the request before the receiver expects it."""
    sched, rx = with_connector(pool, local_prefill_max_tokens=4)
    r = sched.reserve("remote", 8, params(), LEASE_S, prompt_token_ids=prompt(8))
    assert rx.expected == [("remote", r.block_ids, True)]
    sched.reserve("local", 3, params(), LEASE_S, prompt_token_ids=prompt(3))
    assert len(rx.expected) == 1                   # a local prefill: nothing to expect
    finish_all(sched)
    release(sched, rx, *rx.forgotten)
    assert pool.all_free()


def test_blocks_under_a_writers_lease_wait_for_it_over_the_real_reservation_table(pool):
    """With the receivers' own ReservationTable: a request that finishes on D while a
    one-sided writer holds its lease (NIXL's BEGIN) keeps its blocks until end_writer."""
    kv = torch.zeros(2, 2, NUM_BLOCKS, 1, BLOCK_SIZE, 4)
    table = ReservationTable(kv, KVLayout.for_cache(kv, "m"), epoch=1)
    sched = make_sched(pool, connector=DecodeKVConnector(table))
    sched.reserve("a", 8, params(), LEASE_S, prompt_token_ids=prompt(8))
    res = table.lookup("a", 1, "BEGIN")
    assert table.begin_writer(res)
    sched.abort("a")
    sched.schedule()
    sched.update_from_connector()
    assert pool.num_free == NUM_BLOCKS - 2             # the writer may still land in them
    table.end_writer(res)
    sched.update_from_connector()
    assert pool.all_free()


# --- counts ------------------------------------------------------------------------------------

def test_counts_track_running_and_waiting(pool):
    sched = make_sched(pool)
    assert sched.counts() == (0, 0)
    sched.reserve("w1", 4, params(), LEASE_S, prompt_token_ids=prompt(4))
    sched.reserve("w2", 4, params(), LEASE_S, prompt_token_ids=prompt(4))
    admit(sched, "r1")
    batch = admit(sched, "r2")
    assert sched.counts() == (2, 2)
    assert sched.has_work()
    sched.update_from_output(batch, [EOS, 5])
    assert sched.counts() == (1, 2)
    sched.abort("w1")
    sched.schedule()
    assert sched.counts() == (1, 1)
    finish_all(sched)
    assert sched.counts() == (0, 0)
    assert not sched.has_work()
    assert pool.all_free()
