"""A NIXL WRITE that outlasts its request (fault injection): P posts it, the WRITE stays
in flight past io_timeout_s, P gives the request up and drops the control connection,
and D hands the blocks on a grace period after the loss. No byte of the late WRITE may
land in them once D did: P ends every WRITE to that D (cancels it, or waits for it to
complete) before the connection closes (nixl_sender.NixlKVSender._drop, Lane.kill),
and keeps the connection, so D keeps the blocks, while one can still write.

The injection is a proxy of P's lane agent whose transfer() posts the real WRITE only
`delay_s` later (what a congested link or a stalled NIC does to a posted one-sided
write), and whose handle release() cancels it before then, or refuses while it is
pending when `cancellable` is False (NIXL: "if it cannot be canceled, an error")."""

import threading
import time

import pytest
import torch

from pdserve.kv_transfer import KVTransferError
from kvtest import (EPOCH, NUM_LAYERS, PER_LAYER, SRC_IDS, TIMEOUT_S, TRANSPORTS, make_cache,
                    send_request)
from test_transport import env  # noqa: F401  (the fixture, parametrized below)

pytestmark = pytest.mark.parametrize("env", [p for p in TRANSPORTS if "nixl" in str(p)],
                                     indirect=True)
DST_IDS = [7, 2, 9]


class _Handle:
    """A WRITE posted `delay_s` after transfer(); see the module docstring."""

    def __init__(self, proxy: "DelayedAgent", real):
        self.proxy, self.real = proxy, real
        self.timer: threading.Timer | None = None
        self.posted = threading.Event()

    def post(self) -> None:
        with self.proxy.lock:
            self.proxy.agent.transfer(self.real)
            self.posted.set()
            self.proxy.landed_at = time.monotonic()

    def release(self) -> None:
        if not self.posted.is_set():
            if not self.proxy.cancellable:
                raise RuntimeError("NIXL_ERR: transfer in progress, cannot be cancelled")
            self.timer.cancel()
            self.proxy.cancelled_at = time.monotonic()
        else:   # the real WRITE: wait for it as NIXL would not release it in flight
            while self.proxy.agent.check_xfer_state(self.real) == "PROC":
                time.sleep(0.001)
        self.real.release()


class DelayedAgent:
    """P lane's agent, its WRITEs delayed (the module docstring); the rest passes on."""

    def __init__(self, lane, delay_s: float, cancellable: bool):
        self.agent, self.lock, self.delay_s = lane.agent, threading.RLock(), delay_s
        self.cancellable = cancellable
        self.handles: list[_Handle] = []
        self.landed_at = self.cancelled_at = None

    def __getattr__(self, name):
        return getattr(self.agent, name)

    def make_prepped_xfer(self, *args, **kw):
        return _Handle(self, self.agent.make_prepped_xfer(*args, **kw))

    def transfer(self, handle: _Handle) -> str:
        handle.timer = threading.Timer(self.delay_s, handle.post)
        handle.timer.daemon = True
        handle.timer.start()
        self.handles.append(handle)
        return "PROC"

    def check_xfer_state(self, handle: _Handle) -> str:
        if not handle.posted.is_set():
            return "PROC"
        return self.agent.check_xfer_state(handle.real)

    def stop(self) -> None:
        for h in self.handles:
            h.timer.cancel()


def late_write(env, delay_s: float, cancellable: bool):
    """Receiver, a one-lane sender whose WRITEs land `delay_s` late, and a request of
    every layer sent through it whose send_done gave up (io_timeout_s 2 s)."""
    src, dst = make_cache(8, seed=1), make_cache(10, seed=2)
    rx, addr, done = env.receiver(dst)
    tx = env.sender(src, lanes=1)
    proxy = tx._lanes[0].agent = DelayedAgent(tx._lanes[0], delay_s, cancellable)
    rx.expect("late", DST_IDS)
    with pytest.raises(KVTransferError, match="WRITEs not done"):
        send_request(tx, addr, "late", [(0, NUM_LAYERS)])
    if proxy.landed_at is not None or proxy.cancelled_at is not None:
        assert not done.wait("late").ok        # its connection was lost
    rx.forget("late")                          # (what the router's abort does)
    return rx, addr, done, tx, proxy, dst


def reuse(env, rx, addr, done, dst) -> torch.Tensor:
    """Another request into the same blocks from another sender; its source."""
    src2 = make_cache(8, seed=7)
    rx.expect("reuse", DST_IDS)
    tx2 = env.sender(src2)
    send_request(tx2, addr, "reuse", PER_LAYER)
    assert done.wait("reuse").ok
    return src2


def same(a, b) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def test_a_late_write_is_cancelled_before_d_hands_its_blocks_on(env):
    rx, addr, done, tx, proxy, dst = late_write(env, delay_s=4.0, cancellable=True)
    try:
        assert proxy.cancelled_at is not None  # ended before the connection closed
        assert done.released_within("late", TIMEOUT_S)
        src2 = reuse(env, rx, addr, done, dst)
        time.sleep(4.5)                        # past when the WRITE would have landed
        assert proxy.landed_at is None
        assert same(dst[:, :, DST_IDS], src2[:, :, SRC_IDS])
    finally:
        proxy.stop()


def test_a_write_that_cannot_be_cancelled_lands_before_d_hands_its_blocks_on(env):
    rx, addr, done, tx, proxy, dst = late_write(env, delay_s=3.0, cancellable=False)
    try:
        assert proxy.landed_at is not None     # waited for, before the connection closed
        assert done.released_within("late", TIMEOUT_S)
        src2 = reuse(env, rx, addr, done, dst)
        assert same(dst[:, :, DST_IDS], src2[:, :, SRC_IDS])
    finally:
        proxy.stop()


def test_a_write_that_never_ends_keeps_its_blocks_held_until_the_sender_closes(env):
    rx, addr, done, tx, proxy, dst = late_write(env, delay_s=60.0, cancellable=False)
    try:
        assert proxy.landed_at is None
        assert not done.released_within("late", 2.0)   # D keeps the blocks it leased
        proxy.stop()                           # the WRITE is dead now: the sender may close
        proxy.cancellable = True
        tx.close()
        assert done.released_within("late", TIMEOUT_S)
    finally:
        proxy.stop()
