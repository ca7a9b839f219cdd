"""A pull between tensor-parallel workers, with real senders and receivers: the
worker holding a prompt's blocks (a decode worker, or another prefill worker) sends
from each of its ranks the KV heads that rank holds to the pulling prefill worker's
ranks that hold them (prefill_worker/kv_pull.py send_held_blocks), then a DONE for those
heads (over NIXL too, where it imports). The pulling worker's rank 0 sees the pull through TPReceiver with the ``pull``
prefix (kv_transfer/tp_receiver.py): done once every rank's share is, failed at the
first rank whose holder aborted, released once every rank released. Every pulling
rank must end with exactly the model's K/V of its heads in its blocks."""

import asyncio
import functools
import threading

import pytest
import torch

from pdserve.engine.parallel import kv_head_range
from pdserve.kv_transfer import KVTransferError, make_receiver
from pdserve.kv_transfer.nixl import find_module
from pdserve.kv_transfer.tp_plan import rank_targets
from pdserve.kv_transfer.tp_receiver import RankPullReceiver, TPReceiver
from pdserve.messages import KVPullOrder
from pdserve.prefill_worker.kv_pull import send_held_blocks

from kvtest import EPOCH, Completions
from test_tp_transfer import DST, LAYERS, SRC, layout, model_cache, rank_senders

PULL = "r/pull"
NIXL = pytest.mark.skipif(find_module() is None, reason="NIXL (nixl-cu12) not installed")


class Call:
    """An actor method as TPReceiver calls it: `.remote(...)` runs it at once and gives
    an awaitable of its result (awaited for an expect, dropped for a forget)."""

    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return Done(self.fn(*args))


class Done:
    def __init__(self, value):
        self.value = value

    def __await__(self):
        return self.value
        yield   # a generator: awaitable


class PullRank:
    """A TPRank's pull methods over its real RankPullReceiver."""

    def __init__(self, handler: RankPullReceiver):
        self.pull_expect, self.pull_forget = Call(handler.kv_expect), Call(handler.kv_forget)


class Leader:
    """TPLeader.gather over the ranks' handlers, in this process."""

    def __init__(self, handlers):
        self.handlers, self.polls = handlers, 0

    def gather(self, name):
        assert name == "pull_poll", name
        self.polls += 1
        return [getattr(h, name)() for h in self.handlers]


class Pull:
    """`h_size` holder ranks (senders over their heads of `full`) and a pulling prefill
    worker of `p_size` ranks: rank 0's receiver behind a TPReceiver, ranks 1.. each a
    RankPullReceiver."""

    def __init__(self, heads, h_size, p_size, kind="tcp"):
        self.heads, self.h_size, self.p_size = heads, h_size, p_size
        self.full = model_cache(heads)
        self.caches, self.made = [], []
        receivers = []
        for p in range(p_size):
            mine = kv_head_range(heads, p_size, p)
            kv = torch.zeros(LAYERS, 2, 16, len(mine), 4, 8)
            self.caches.append(kv)
            receivers.append(make_receiver(kind, kv, layout(kv, heads, p_size, p), EPOCH,
                                           io_timeout_s=2.0))
        self.news = Completions()
        self.addresses = [receivers[0].start()]
        self.handlers = [RankPullReceiver(rx) for rx in receivers[1:]]   # started there
        self.addresses += [h.address for h in self.handlers]
        self.leader = Leader(self.handlers)
        self.rx = TPReceiver(receivers[0], self.leader, [PullRank(h) for h in self.handlers],
                             on_broken=pytest.fail, prefix="pull", role="prefill")
        self.news.attach(self.rx)
        self.made += [receivers[0], *self.handlers]
        self.senders = rank_senders(self.full, heads, h_size, kind, checksum=True)
        self.made += self.senders
        self.order = KVPullOrder("r", PULL, 0, len(SRC), self.addresses[0], EPOCH,
                                 kv_rank_addresses=tuple(self.addresses[1:]))

    def expect(self):
        self.rx.expect(PULL, DST)
        asyncio.run(self.rx.expect_ranks(PULL))

    def send(self, h, sender=None):
        """Holder rank h's share; returns its bytes, or the exception it raised."""
        targets = functools.partial(rank_targets, self.heads, self.h_size, h)
        try:
            return send_held_blocks(sender or self.senders[h], self.order, SRC, LAYERS, targets)
        except Exception as e:
            return e

    def send_all(self, senders=None):
        """Every holder rank's share at once, as the holder's ranks send them."""
        out = [None] * self.h_size
        threads = [threading.Thread(target=lambda h=h: out.__setitem__(
            h, self.send(h, senders and senders.get(h)))) for h in range(self.h_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        return out

    def close(self):
        for obj in self.made:
            obj.close()


@pytest.mark.parametrize("heads,h_size,p_size,kind", [
    (4, 1, 2, "tcp"), (4, 2, 1, "tcp"), (4, 2, 2, "tcp"), (2, 4, 2, "tcp"), (3, 3, 1, "tcp"),
    (3, 1, 3, "tcp"), (1, 2, 2, "tcp"),
    pytest.param(4, 2, 2, "nixl", marks=NIXL), pytest.param(2, 1, 2, "nixl", marks=NIXL),
    pytest.param(4, 2, 1, "nixl", marks=NIXL)])
def test_every_pulling_rank_gets_exactly_its_heads(heads, h_size, p_size, kind):
    """(holder TP, puller TP) pairs the model's KV heads allow, one head replicated
    included, over TCP and NIXL (one-sided writes of head runs): the pull is done on
    rank 0 only once every rank's share arrived, and released once every rank forgot
    it."""
    w = Pull(heads, h_size, p_size, kind)
    try:
        w.expect()
        sent = w.send_all()
        assert all(isinstance(b, int) for b in sent), sent
        c = w.news.wait(PULL)
        assert c.ok and c.first_token is None, c
        idx = torch.tensor(DST)
        for p in range(p_size):
            mine = kv_head_range(heads, p_size, p)
            want = w.full[:, :, torch.tensor(SRC)][:, :, :, mine.start:mine.stop]
            assert torch.equal(w.caches[p][:, :, idx], want), f"pulling rank {p}"
        w.rx.forget(PULL)
        assert w.news.released_within(PULL, 5)
        assert not w.rx.wants_poll
    finally:
        w.close()


class FailsAfterOneLayer:
    """A sender whose second send_layers raises (its link lost mid-pull)."""

    def __init__(self, sender):
        self.sender, self.calls = sender, 0

    def send_layers(self, *args, **kw):
        self.calls += 1
        if self.calls > 1:
            raise KVTransferError("connection reset")
        return self.sender.send_layers(*args, **kw)

    def __getattr__(self, name):
        return getattr(self.sender, name)


def test_a_holder_rank_that_fails_mid_pull_fails_the_pull_and_its_blocks_come_back():
    """Holder rank 1 of 2 loses its link after one layer: it sends ABORT to pulling rank
    1 (its heads' only holder), whose failure is the pull's on rank 0 (naming the rank)
    even though rank 0's own share arrived; forgotten, it is released on every rank."""
    w = Pull(4, 2, 2)
    try:
        w.expect()
        ok, failed = w.send_all({1: FailsAfterOneLayer(w.senders[1])})
        assert isinstance(ok, int) and isinstance(failed, KVTransferError), (ok, failed)
        c = w.news.wait(PULL)
        assert not c.ok and c.error.startswith("prefill rank 1: ") and \
            "connection reset" in c.error, c
        w.rx.forget(PULL)
        assert w.news.released_within(PULL, 5)
        assert not w.rx.wants_poll
        assert all(h.receiver.num_active() == 0 for h in w.handlers)
    finally:
        w.close()
