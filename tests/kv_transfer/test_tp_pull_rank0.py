"""Rank 0's side of a pull between tensor-parallel workers, with fakes where Ray's actor
calls would be and a real TCP receiver where the pulling worker's is:

- the holder (EngineActor._send_held_kv): its blocks go back only once every rank's
  share returned, a slow one included; a rank that fails makes the answer 0 and the
  puller is sent ABORT naming that rank;
- the puller (kv_pull.asker): the holder is asked only once every rank
  expects the pull; a rank that cannot expect it fails the ask (the pull is given up,
  kv_pull.answered_nothing), and a pull forgotten before its ranks expected it asks no
  one."""

import asyncio
import threading
from types import SimpleNamespace

import pytest
import torch

from pdserve.engine_actor import EngineActor
from pdserve.kv_transfer import KVLayout, make_receiver, make_sender
from pdserve.kv_transfer.tp_receiver import TPReceiver
from pdserve.messages import KVPullOrder
from pdserve.prefill_worker.kv_pull import answered_nothing, asker

from kvtest import Completions

LAYERS, MODEL, EPOCH = 2, "m", 7
KV = torch.randn(LAYERS, 2, 8, 1, 4, 8)


class Rank:
    """A TPRank handle: `send_held_kv.remote` an awaitable that waits `delay_s` (the
    event loop runs meanwhile), then returns `result` or raises it."""

    def __init__(self, events: list, name: str, result, delay_s: float = 0.0):
        self.events, self.name, self.result, self.delay_s = events, name, result, delay_s
        self.send_held_kv = SimpleNamespace(remote=self._remote)

    def _remote(self, order, blocks, expires):
        self.expires = expires
        async def share():
            await asyncio.sleep(self.delay_s)
            self.events.append(self.name)
            if isinstance(self.result, BaseException):
                raise self.result
            return self.result
        return share()


def test_a_holder_gives_its_blocks_back_after_every_rank_and_a_failed_rank_aborts_the_pull():
    events: list[str] = []
    done = Completions()
    rx = make_receiver("tcp", torch.zeros_like(KV), KVLayout.for_cache(KV, MODEL), EPOCH,
                       notify=done)
    done.attach(rx)
    tx = make_sender("tcp", KV, KVLayout.for_cache(KV, MODEL))
    try:
        address = rx.start()
        rx.expect("r/pull", [1, 2])
        holder = SimpleNamespace(
            worker_id="decode-0", _pull_sender=lambda: tx,
            runner=SimpleNamespace(config=SimpleNamespace(num_layers=LAYERS)),
            _pull_targets=lambda n: (),       # rank 0 holds no head P lacks: ranks send
            _ranks=[Rank(events, "rank 1", RuntimeError("link lost")),
                    Rank(events, "rank 2", 1024, delay_s=0.2)])
        order = KVPullOrder("r", "r/pull", 0, 2, address, EPOCH)
        sent = asyncio.run(EngineActor._send_held_kv(
            holder, order, [3, 4], lambda blocks: events.append(f"release {blocks}")))
        assert sent == 0
        assert events == ["rank 1", "rank 2", "release [3, 4]"]   # the slow one first
        c = done.wait("r/pull")
        assert not c.ok and "rank 1: RuntimeError: link lost" in c.error, c
        rx.forget("r/pull")
        assert done.released_within("r/pull", 5)
    finally:
        tx.close()
        rx.close()


class PullRank:
    """A prefill rank's pull_expect / pull_forget as actor calls; expect raises
    `error` when set (the rank is gone)."""

    def __init__(self, error: Exception | None = None):
        self.error, self.expected = error, []
        self.pull_expect = SimpleNamespace(remote=self._expect)
        self.pull_forget = SimpleNamespace(remote=lambda rid, seq, lease_timeout_s=None: None)

    def _expect(self, rid, blocks, seq):
        async def expect():
            if self.error is not None:
                raise self.error
            self.expected.append(rid)
        return expect()


class Own:
    """Rank 0's own receiver (only what TPReceiver calls of it here)."""

    def expect(self, rid, blocks):
        pass

    def forget(self, rid, lease_timeout_s=None):
        pass


class Holder:
    def __init__(self):
        self.asked = []
        self.send_prompt_kv = SimpleNamespace(remote=self._send)

    def _send(self, order):
        async def send():
            self.asked.append(order.pull_id)
            return 512
        return send()


@pytest.fixture
def loop():
    """An event loop on its own thread, as the actor's."""
    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    t.join(5)
    loop.close()


@pytest.mark.parametrize("case", ["expected", "rank-gone", "forgotten"])
def test_a_puller_asks_the_holder_only_once_every_rank_expects_the_pull(loop, case):
    rank = PullRank(RuntimeError("rank 1 gone") if case == "rank-gone" else None)
    rx = TPReceiver(Own(), leader=None, ranks=[rank], on_broken=pytest.fail, prefix="pull",
                    role="prefill")
    holder = Holder()
    rx.expect("r/pull", [1, 2])
    if case == "forgotten":            # given up before the ask ran
        rx.forget("r/pull")
    order = KVPullOrder("r", "r/pull", 0, 2, ("127.0.0.1", 1), EPOCH)
    answer = asker(rx, lambda: loop)(holder, order)
    if case == "rank-gone":
        with pytest.raises(RuntimeError, match="rank 1 gone"):
            answer.result(5)
        assert holder.asked == [] and answered_nothing(answer)
    elif case == "forgotten":
        assert answer.result(5) == 0 and holder.asked == [] and answered_nothing(answer)
    else:
        assert answer.result(5) == 512 and not answered_nothing(answer)
        assert rank.expected == ["r/pull"] and holder.asked == ["r/pull"]
