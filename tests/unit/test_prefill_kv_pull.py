"""prefill_worker/kv_pull.py with prefill_worker/scheduler.py, over the real KV
transports (TCP, and NIXL where it imports): a prompt whose leading blocks its decode
worker holds reads them into its own blocks (D's sender → P's pull receiver), caches
them and computes only the rest; a pull D cannot serve, one never answered, and one
whose request is aborted each leave the request to compute (or end) once the receiver
released its blocks; the cost model refuses a pull slower than computing, times a pull
to the holder's answer, counts an overdue one as slow and probes again after a while; a
holder sends nothing of a pull its puller gave up. Reading from another prefill worker:
test_prefill_kv_pull_peer.py. No model: cache tensors stand in for the workers'. Every
test ends with P's pool free and the receiver idle."""

import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
import torch

from pdserve.engine.block_pool import BlockPool
from pdserve.engine.request import RequestState
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kv_transfer import KVLayout, KVTransferError, make_receiver, make_sender
from pdserve.kv_transfer.nixl import find_module
from pdserve.prefill_worker import kv_pull
from pdserve.prefill_worker.kv_pull import KVPulls, PullCost, send_held_blocks
from pdserve.prefill_worker.requests import PrefillRequest
from pdserve.prefill_worker.scheduler import PrefillScheduler
from test_prefill_chunks import advance

BS, POOL, LAYERS, MODEL = 4, 16, 3, "pull-test"
P_KV = torch.zeros(LAYERS, 2, POOL, 1, BS, 8)
D_KV = torch.zeros(LAYERS, 2, 32, 1, BS, 8)
D_BLOCKS = [20, 3, 11, 7, 5]              # where D holds the prompt's first 5 blocks
PROMPT = list(range(1, 6 * BS + 3))       # 6 full blocks and 2 tokens
BLOCK_BYTES = LAYERS * 2 * BS * 8 * 4
TRANSPORTS = ["tcp", pytest.param("nixl", marks=pytest.mark.skipif(
    find_module() is None, reason="NIXL (nixl-cu12) not installed"))]


def one_rank(num_pulling_ranks: int) -> tuple:
    """tp_plan.rank_targets with both workers at TP 1: every head to P's rank 0."""
    return ((0, None),)


class FakeD:
    """D's side of send_prompt_kv with a real sender of transport `kind` over D's cache
    (no Ray)."""

    def __init__(self, kind, serve=True):
        self.sender = make_sender(kind, D_KV, KVLayout.for_cache(D_KV, MODEL), checksum=True)
        self.serve, self.orders, self.threads, self.answers = serve, [], [], []
        self.delay_s = 0.0        # between the order's arrival and the send

    def ask(self, source, order) -> Future:
        """What the worker's ask gives KVPulls: a Future of the bytes D says it sent."""
        assert source is self
        self.orders.append(order)
        answer = Future()
        self.answers.append(answer)
        t = threading.Thread(target=self._send, args=(order, answer))
        self.threads.append(t)
        t.start()
        return answer

    def _send(self, order, answer: Future):
        addr, pid = order.kv_address, order.pull_id
        if self.serve is None:
            return                                           # never answers
        if self.serve == "silent":                           # begins, then freezes
            blocks = D_BLOCKS[order.first_block:order.first_block + order.num_blocks]
            self.sender.send_layers(addr, pid, order.epoch, 0, 1, blocks)
            return
        if self.serve == "zero":
            answer.set_result(0)                             # sends nothing, says so
            return
        if not self.serve:
            self.sender.send_abort(addr, pid, order.epoch, "not held")
            answer.set_result(0)
            return
        blocks = D_BLOCKS[order.first_block:order.first_block + order.num_blocks]
        expires = kv_pull.pull_expiry(order)
        time.sleep(self.delay_s)
        try:
            answer.set_result(send_held_blocks(self.sender, order, blocks, LAYERS, one_rank,
                                               expires))
        except Exception as e:
            answer.set_exception(e)

    def join(self):
        """Every send returned (its blocks given back)."""
        for t in self.threads:
            t.join(5)
            assert not t.is_alive(), "a send never returned"

    def close(self):
        self.join()
        self.sender.close()


@pytest.fixture(params=TRANSPORTS)
def pull(request):
    """(pool, scheduler, KVPulls, transport) around P's cache, its receiver of that
    transport; the pool and receiver are checked free and idle afterwards."""
    pool = BlockPool(POOL)
    rx = make_receiver(request.param, P_KV, KVLayout.for_cache(P_KV, MODEL), 7)
    pulls = KVPulls(rx, rx.start(), 7, pool, BS, BLOCK_BYTES, ask=None, timeout_s=5.0)
    yield pool, PrefillScheduler(pool, BS, 64, pulls=pulls), pulls, request.param
    try:
        assert pool.all_free() and rx.num_active() == 0 and not pulls.loading()
    finally:
        rx.close()


def request(d, cached=5):
    return PrefillRequest("r", list(PROMPT), SamplingParams(), ("127.0.0.1", 1), epoch=1,
                          num_cached_blocks=cached, kv_source=d)


def until_rows(sched, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not (out := sched.schedule()).requests:
        assert time.monotonic() < deadline, "the pull never ended"
        time.sleep(0.005)
    return out


def finish(sched, req, out):
    advance(sched, out)
    sched.release(req, RequestState.FINISHED_STOPPED)


def compute_rest(sched, req, out):
    """Step `req` (scheduled in `out`) through its last chunk, then finish it."""
    while req.num_computed_tokens + out.num_scheduled_tokens[0] < req.prompt_len:
        advance(sched, out)
        out = sched.schedule()
    finish(sched, req, out)


def test_a_prefix_its_decode_worker_holds_is_read_not_computed(pull):
    pool, sched, pulls, kind = pull
    d = FakeD(kind)
    pulls.ask = d.ask
    try:
        D_KV.normal_()
        req = request(d)
        sched.add(req)
        assert sched.schedule().requests == ()           # its blocks taken, pulling
        assert [(o.first_block, o.num_blocks) for o in d.orders] == [(0, 5)]
        out = until_rows(sched)
        assert out.requests == (req,) and out.num_scheduled_tokens == (BS + 2,)
        for i in range(5):                               # D's K/V, every layer, in P's blocks
            assert torch.equal(P_KV[:, :, req.block_table[i]], D_KV[:, :, D_BLOCKS[i]])
        assert pulls.pulled_blocks == 5 and pulls.bytes_pulled == 5 * BLOCK_BYTES
        assert sched.cached_tokens == 5 * BS and sched.computed_tokens == BS + 2
        assert sched.kv_send_range(req, req.prompt_len) == (5, 7)   # D lacks only these
        finish(sched, req, out)
        again = request(None, cached=0)                  # the pulled blocks are P's cache now
        again.request_id = "r2"
        sched.add(again)
        out = sched.schedule()
        assert again.num_cached == 6 * BS and out.num_scheduled_tokens == (2,)
        finish(sched, again, out)
    finally:
        d.close()


@pytest.mark.parametrize("serve", [False, "zero", None],
                         ids=["aborted", "answered-nothing", "never-answered"])
def test_a_pull_that_fails_leaves_the_prefix_to_compute(pull, serve):
    """D sends ABORT, or answers 0 bytes sent (refused: given up at once), or never
    answers (given up after timeout_s)."""
    pool, sched, pulls, kind = pull
    d = FakeD(kind, serve)
    pulls.ask = d.ask
    pulls.timeout_s = 0.3 if serve is None else 60.0
    try:
        req = request(d)
        sched.add(req)
        out = until_rows(sched, timeout_s=5.0)
        assert out.requests == (req,) and req.num_computed_tokens == 0
        assert pulls.num_failed == 1 and pulls.pulled_blocks == 0
        compute_rest(sched, req, out)
    finally:
        d.close()


def test_a_holder_that_freezes_mid_pull_holds_the_pullers_blocks_no_longer_than_its_expiry(pull):
    """D sends its first layer (over NIXL: BEGIN, a lease on P's blocks) and then falls
    silent, its connection open: the pull is given up after timeout_s, and its blocks
    come back (the lease ends) timeout_s later at the latest: the prompt computes them."""
    pool, sched, pulls, kind = pull
    d = FakeD(kind, "silent")
    pulls.ask, pulls.timeout_s = d.ask, 0.3
    try:
        req = request(d)
        sched.add(req)
        out = until_rows(sched, timeout_s=3.0)
        assert out.requests == (req,) and req.num_computed_tokens == 0
        assert pulls.num_failed == 1 and pulls.pulled_blocks == 0
        compute_rest(sched, req, out)
    finally:
        d.close()


def test_a_holder_sends_nothing_of_a_pull_its_puller_gave_up(pull):
    """D gets to the send after the puller's timeout_s (queued behind other sends): it
    sends no layer, only ABORT, and the prompt computes its blocks."""
    pool, sched, pulls, kind = pull
    d = FakeD(kind)
    d.delay_s, pulls.timeout_s = 0.4, 0.2
    pulls.ask = d.ask
    try:
        req = request(d)
        sched.add(req)
        out = until_rows(sched)
        assert [o.timeout_s for o in d.orders] == [0.2]
        d.join()
        assert out.requests == (req,) and req.num_computed_tokens == 0
        assert pulls.num_failed == 1 and pulls.pulled_blocks == 0
        with pytest.raises(KVTransferError, match="overdue"):
            d.answers[0].result()
        compute_rest(sched, req, out)
    finally:
        d.close()


def test_an_abort_while_pulling_hands_the_request_back_once_released(pull):
    pool, sched, pulls, kind = pull
    d = FakeD(kind, serve=None)
    pulls.ask = d.ask
    try:
        req = request(d)
        sched.add(req)
        sched.schedule()
        assert sched.abort("r") is None and req.request_id in pulls
        deadline = time.monotonic() + 5
        while not (dropped := sched.take_aborted()):
            assert time.monotonic() < deadline
            assert sched.schedule().requests == ()
            time.sleep(0.005)
        assert dropped == [req] and not pulls.loading()
        sched.release(req, RequestState.FINISHED_ABORTED)
    finally:
        d.close()


def test_the_cost_model_computes_when_reading_is_slower():
    cost = PullCost(tokens_per_s=1000.0, bytes_per_s=1e6, latency_s=0.004)
    assert not cost.worth(4, 40_000)          # 0.044 s to read, 0.004 s to compute
    assert cost.worth(400, 40_000)            # 0.044 s against 0.4 s
    pool = BlockPool(POOL)
    pulls = KVPulls(None, ("127.0.0.1", 1), 7, pool, BS, 10_000_000, ask=None, cost=cost)
    assert pulls.count(request(object()), 0, 0) == 0       # 5 blocks of 10 MB: compute
    pulls.block_bytes = 100
    assert pulls.count(request(object()), 0, 0) == 5
    assert pulls.count(request(object()), 0, 5) == 0       # P's tiers hold as many
    assert pulls.count(request(None), 0, 0) == 0           # no decode worker to ask


class Clock:
    """kv_pull's time.monotonic (its module's only: the transports keep theirs), set by
    the test."""

    def __init__(self, monkeypatch, now=100.0):
        self.now = now
        monkeypatch.setattr(kv_pull, "time", SimpleNamespace(monotonic=lambda: self.now,
                                                             time=time.time))


def test_the_cost_model_times_a_pull_to_the_holders_answer_not_to_the_next_poll(
        pull, monkeypatch):
    """D answers 0.02 s after the ask, the step loop sees it 1 s after (a prefill step
    ran meanwhile): the prompt waited 1 s (pull_seconds), the transport took 0.02."""
    pool, sched, pulls, kind = pull
    clock, d = Clock(monkeypatch), FakeD(kind)
    pulls.cost = PullCost(latency_s=0.01, alpha=1.0)
    answers = []

    def ask(source, order):
        answers.append((d.ask(source, order), Future()))
        return answers[-1][1]
    pulls.ask = ask
    try:
        req = request(d)
        sched.add(req)
        assert sched.schedule().requests == ()           # pulling
        (sent, answer), = answers
        assert sent.result(5) == 5 * BLOCK_BYTES
        clock.now = 100.02
        answer.set_result(sent.result())
        clock.now = 101.0
        out = until_rows(sched)
        assert pulls.pulled_blocks == 5 and pulls.pull_seconds == pytest.approx(1.0)
        assert pulls.cost.bytes_per_s == pytest.approx(5 * BLOCK_BYTES / 0.01)
        finish(sched, req, out)
    finally:
        d.close()


def test_an_overdue_pull_counts_as_slow_and_a_pull_is_probed_after_probe_s(
        pull, monkeypatch):
    """A pull never answered is given up after timeout_s and observed as taking that
    long; the rates then say compute, until probe_s passed without a pull."""
    pool, sched, pulls, kind = pull
    clock, d = Clock(monkeypatch), FakeD(kind, serve=None)
    pulls.ask, pulls.timeout_s = d.ask, 5.0
    pulls.cost = cost = PullCost(tokens_per_s=1000.0, latency_s=0.01, alpha=1.0,
                                 last_pull=clock.now)
    try:
        req = request(d)
        assert cost.worth(4 * BS, 4 * BLOCK_BYTES)       # 16 ms to compute, 11 to read
        sched.add(req)
        assert sched.schedule().requests == ()           # pulling
        clock.now = 106.0                                # seen 1 s past timeout_s
        out = until_rows(sched)
        assert pulls.num_failed == 1 and req.num_computed_tokens == 0
        assert cost.bytes_per_s == pytest.approx(5 * BLOCK_BYTES / (5.0 - 0.01))
        assert not cost.worth(4 * BS, 4 * BLOCK_BYTES)   # 4.01 s to read now
        clock.now = 100.0 + cost.probe_s + 0.1
        assert cost.worth(4 * BS, 4 * BLOCK_BYTES)       # no pull for probe_s: try one
        compute_rest(sched, req, out)
    finally:
        d.close()
