"""The bookkeeping between a tensor-parallel worker's rank 0 and its other ranks, with
fakes where a process group would be: prefill_worker/rank.py (a rank's failed send
reaches rank 0, which aborts the request on the decode worker; rank 0 gives a request's
blocks back only once every rank sent it), kv_transfer/tp_receiver.py
(TPReceiver: a completion once every rank's is in, a release once every rank released,
a repeated reserve, no poll when nothing is outstanding), tp_executor's heartbeat."""

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from pdserve.engine.parallel import TensorParallel
from pdserve.engine.tp_executor import TPGroupBroken, TPLeader
from pdserve.kv_transfer import (KVCompletion, KVFinished, KVLayout, KVTransferError,
                                 make_sender)
from pdserve.prefill_worker.rank import PrefillRankKV, PrefillRanks
from pdserve.prefill_worker.requests import FinishCause, fail
from pdserve.prefill_worker.worker import PrefillWorker


class FakeRequest:
    def __init__(self, rid):
        self.request_id, self.epoch = rid, 7
        self.kv_address, self.kv_rank_addresses = ("127.0.0.1", 9), ()
        self.num_cached_blocks, self.block_table = 0, [0, 1]


def test_a_ranks_failed_send_is_aborted_on_the_decode_worker():
    """Rank 1 cannot reach decode rank 0 (nothing listens): its kv_poll answer names
    the request, and rank 0 sends ABORT to the decode worker, once, naming the rank."""
    kv = torch.zeros(2, 2, 4, 1, 4, 8)
    sender = make_sender("tcp", kv, KVLayout.for_cache(kv, "m", kv_head_start=1,
                                                       model_kv_heads=2, tp_size=2),
                         connect_timeout_s=1.0)
    rank = PrefillRankKV(sender, 2, lambda d_size: ((0, range(1, 2)),))
    try:
        addr = ("127.0.0.1", 9)
        assert rank.kv_sends([("r", 7, [addr], 0, [0, 1], 0, 2)]) == ([], [])
        rank.on_layer_done(0)
        rank.on_layer_done(1)
        rank.kv_finish([("r", 7, [addr], 0, True), ("gone", 7, [addr], 0, False)])
        deadline, answers = time.monotonic() + 10, ([], [])
        while not (answers[0] and answers[1]):      # done: "gone"; failed: "r"
            assert time.monotonic() < deadline, answers
            done, failed = rank.kv_poll()
            answers = (answers[0] + done, answers[1] + failed)
            time.sleep(0.01)
        assert answers[0] == ["gone"]               # an abort is no failure to report
        [(rid, epoch, address, error)] = answers[1]
        assert (rid, epoch, address) == ("r", 7, addr) and "127.0.0.1:9" in error
    finally:
        rank.close()

    aborts = []

    class Leader:
        def __init__(self):
            self.answers = [([], [("r", 7, addr, "refused")])]

        def order(self, name, **kw):
            assert name == "kv_finish"

        def gather(self, name, **kw):
            answers, self.answers = self.answers, [([], [])]
            return answers

    class Sender:
        def send_abort(self, *args):
            aborts.append(args)

    ranks = PrefillRanks(Leader(), Sender(), 2, on_broken=pytest.fail)
    ranks.finish([(FakeRequest("r"), True)])
    ranks.poll()
    assert aborts == [(addr, "r", 7, "prefill rank 1: refused")]
    ranks.poll()                                   # "r" left every rank: no poll now
    assert ranks._open == {} and len(aborts) == 1


def test_rank_0_releases_a_request_only_once_every_rank_sent_it():
    """Rank 0's transfers of "r" and of the failed "f" ended while ranks 1 and 2 still
    send their heads: their blocks stay out of the pool until both ranks reported them
    (so no step, tier load or pull takes a block a rank reads); the failed one's call
    is answered at once all the same; at shutdown, once the ranks stopped, every one
    goes back."""
    class Leader:
        def __init__(self):
            self.answers = []

        def order(self, name, **kw):
            assert name == "kv_finish"

        def gather(self, name, **kw):
            answers, self.answers = self.answers or [([], [])] * 2, []
            return answers

    r, f = FakeRequest("r"), FakeRequest("f")
    r.finish = f.finish = None
    fail(f, FinishCause.TRANSFER, "decode worker gone")
    leader, released, answered = Leader(), [], []
    finished = [r, f]
    worker = SimpleNamespace(
        tp_ranks=PrefillRanks(leader, None, 3, on_broken=pytest.fail), _sent=[],
        connector=SimpleNamespace(get_finished=lambda: [finished.pop() for _ in finished[:]]),
        scheduler=SimpleNamespace(release=lambda req, state: released.append(
            (req.request_id, state.name))),
        _resolve=lambda req, error: answered.append((req.request_id, type(error))))
    worker.tp_ranks.finish([(r, True), (f, False)])
    assert worker.tp_ranks.wants_poll
    PrefillWorker._finish_sent(worker)
    assert released == [] and answered == [("f", KVTransferError)]
    leader.answers = [(["r", "f"], []), (["f"], [])]         # rank 2 still sends "r"
    worker.tp_ranks.poll()
    PrefillWorker._finish_sent(worker)
    assert released == [("f", "FINISHED_ERROR")]
    leader.answers = [([], []), (["r"], [])]
    worker.tp_ranks.poll()
    PrefillWorker._finish_sent(worker)
    assert released == [("f", "FINISHED_ERROR"), ("r", "FINISHED_STOPPED")]
    assert worker._sent == [] and not worker.tp_ranks.wants_poll
    assert answered == [("f", KVTransferError)]
    s = FakeRequest("s")                                      # at shutdown: the ranks
    s.finish = None                                           # stopped, cannot report
    finished.append(s)
    worker.tp_ranks.finish([(s, True)])
    PrefillWorker._finish_sent(worker)
    assert released[-1][0] == "r"
    PrefillWorker._finish_sent(worker, ranks_stopped=True)
    assert released[-1] == ("s", "FINISHED_STOPPED") and worker._sent == []


class FakeReceiver:
    def __init__(self):
        self.news = KVFinished([], [])
        self.expected, self.forgotten = [], []

    def expect(self, rid, blocks):
        self.expected.append(rid)

    def forget(self, rid, lease_timeout_s=None):
        self.forgotten.append(rid)

    def get_finished(self):
        news, self.news = self.news, KVFinished([], [])
        return news


class FakeRank:
    def __init__(self):
        self.calls = []
        outer = self

        class Method:
            def __init__(self, name):
                self.name = name

            def remote(self, *args):
                outer.calls.append((self.name, args))
        self.kv_expect, self.kv_forget = Method("expect"), Method("forget")


class FakeLeader:
    def __init__(self):
        self.answers, self.polls = [], 0

    def gather(self, name):
        self.polls += 1
        answers, self.answers = self.answers or [KVFinished([], [])], []
        return answers


def ok(rid, token=None):
    return KVCompletion(rid, True, token, None)


def test_tp_receiver_reports_once_every_rank_is_in():
    from pdserve.kv_transfer.tp_receiver import TPReceiver

    own, leader, rank1 = FakeReceiver(), FakeLeader(), FakeRank()
    rx = TPReceiver(own, leader, [rank1], on_broken=pytest.fail)
    assert rx.get_finished() == KVFinished([], []) and leader.polls == 0   # idle: no poll
    rx.expect("a", [1, 2])
    own.news = KVFinished([ok("a", 5)], [])
    assert rx.get_finished().completions == []      # rank 1's not in
    rx.expect("a", [1, 2])                          # a repeated reserve changes nothing:
    assert rx._expects == {"a": ([1, 2], 1)}        # the ranks' order keeps its seq,
    assert rx.wants_poll                            # rank 0's completion is kept
    leader.answers = [KVFinished([ok("a")], [])]
    assert rx.get_finished().completions == [ok("a", 5)]            # rank 0's token
    assert not rx.wants_poll
    rx.forget("a")
    assert rank1.calls[-1] == ("forget", ("a", 1, None)) and rx.wants_poll
    leader.answers = [KVFinished([], ["a"])]
    assert rx.get_finished().released == []         # rank 0 has not released yet
    own.news = KVFinished([], ["a"])
    assert rx.get_finished().released == ["a"] and not rx.wants_poll


def test_tp_receiver_fails_at_the_first_rank_that_fails():
    from pdserve.kv_transfer.tp_receiver import TPReceiver

    own, leader = FakeReceiver(), FakeLeader()
    rx = TPReceiver(own, leader, [FakeRank(), FakeRank()], on_broken=pytest.fail)
    rx.expect("b", [3])
    leader.answers = [KVFinished([], []), KVFinished([KVCompletion("b", False, None, "x")], [])]
    [c] = rx.get_finished().completions
    assert not c.ok and c.error == "decode rank 2: x"
    own.news = KVFinished([ok("b", 1)], [])         # rank 0's success comes later: dropped
    assert rx.get_finished().completions == []


def test_an_idle_leaders_failed_heartbeat_reports_the_group_broken(monkeypatch):
    broken = []
    done = threading.Event()

    def lost(self, order):      # in place before the heartbeat thread starts
        raise RuntimeError("connection reset by rank 1")
    monkeypatch.setattr(TPLeader, "_order", lost)
    TPLeader(None, TensorParallel(0, 2, group=object()), heartbeat_s=0.05,
             on_broken=lambda e: (broken.append(e), done.set()))
    assert done.wait(5)
    assert len(broken) == 1 and isinstance(broken[0], TPGroupBroken), broken
    assert "rank 1" in str(broken[0])
