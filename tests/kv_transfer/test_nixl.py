"""What only the NIXL transport has: the BEGIN lease that keeps a forgotten request's
blocks out of D's pool while P may still write them unseen, DONE waiting for the
notifications of P's writes, pairing with a TCP-only peer, and an idle receiver that
does not spin. The scenarios both transports share are in test_transport.py."""

import logging
import socket
import threading
import time

import pytest
import torch

from pdserve.kv_transfer import KVLayout, KVLayoutMismatch, KVTransferError, frames, nixl
from pdserve.kv_transfer import nixl_receiver, nixl_sender
from pdserve.kv_transfer.frames import FrameType
from kvtest import (  # noqa: E402
    DST_IDS, EPOCH, MODEL, NUM_LAYERS, PER_LAYER, SRC_IDS, TIMEOUT_S, TRANSPORTS,
    assert_copied, make_cache, send_request,
)
from test_transport import env  # noqa: F401  (the fixture, parametrized below)

pytestmark = pytest.mark.parametrize("env", [p for p in TRANSPORTS if "nixl" in str(p)],
                                     indirect=True)


@pytest.mark.parametrize("end", ["done", "abort", "connection-lost"])
def test_forgotten_request_keeps_its_blocks_until_the_writer_ends(env, end, monkeypatch):
    monkeypatch.setattr(nixl_receiver, "LOST_WRITER_GRACE_S", 1.0)
    src, dst = make_cache(8, seed=1), make_cache(10, seed=2)
    rx, addr, done = env.receiver(dst)
    tx = env.sender(src)
    rx.expect("r", DST_IDS)
    tx.send_layers(addr, "r", EPOCH, 0, 1, SRC_IDS)   # BEGIN: P holds a lease on the blocks
    rx.forget("r")
    assert not done.released_within("r", 0.3)         # P may still write: not yet
    if end == "done":
        tx.send_layers(addr, "r", EPOCH, 1, NUM_LAYERS, SRC_IDS)  # lands in held blocks
        tx.send_done(addr, "r", EPOCH, 42, NUM_LAYERS)
    elif end == "abort":
        tx.send_abort(addr, "r", EPOCH, "cancelled")
    else:
        tx.close()
        # held a grace period (1 s here) past the loss, which D saw before close()
        # returned, for a WRITE still in flight
        assert not done.released_within("r", 0.3)
    assert done.released_within("r", TIMEOUT_S)
    assert done.ids() == []                           # forget() never reports a completion


def test_a_lease_whose_writer_falls_silent_ends_with_the_forgets_timeout(env):
    """A writer that BEGINs and then falls silent, its connection open (a holder frozen
    or gone without a FIN: a pull): forget(lease_timeout_s) releases the blocks then, and
    closes that writer's connection. Both ends of a paired connection keep TCP alive."""
    import socket as socket_mod

    src, dst = make_cache(8, seed=1), make_cache(10, seed=2)
    rx, addr, done = env.receiver(dst)
    tx = env.sender(src)
    rx.expect("r", DST_IDS)
    tx.send_layers(addr, "r", EPOCH, 0, 1, SRC_IDS)   # BEGIN: a lease on the blocks
    [conn] = list(rx._control._conns.values())
    assert conn.getsockopt(socket_mod.SOL_SOCKET, socket_mod.SO_KEEPALIVE) == 1
    rx.forget("r", lease_timeout_s=0.5)
    assert not done.released_within("r", 0.3)         # the writer may still write
    assert done.released_within("r", TIMEOUT_S)       # then not: released
    deadline = time.monotonic() + TIMEOUT_S
    while rx._control._conns:                         # its connection closed
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert done.ids() == []


def test_done_waits_for_the_notifications_of_every_write(env, monkeypatch):
    """A DONE on the control connection can overtake the notifications of P's last
    WRITEs: D counts them against the DONE's write count before judging the request."""
    src, dst = make_cache(8, seed=1), make_cache(10, seed=2)
    before = dst.clone()
    rx, addr, done = env.receiver(dst)
    tx = env.sender(src)
    held, gate = [], threading.Event()
    real = rx._agent.get_new_notifs

    def late_notifs():           # notifications reach the poll thread only once `gate` is set
        for agent, msgs in real().items():
            held.extend((agent, m) for m in msgs)
        if not gate.is_set():
            return {}
        out = {}
        for agent, msg in held:
            out.setdefault(agent, []).append(msg)
        held.clear()
        return out

    monkeypatch.setattr(rx._agent, "get_new_notifs", late_notifs)
    rx.expect("r", DST_IDS)
    send_request(tx, addr, "r", PER_LAYER)
    assert done.none_within("r", 0.3)                  # DONE in, writes not counted
    gate.set()
    c = done.wait("r")
    assert (c.ok, c.first_token) == (True, 42), c
    assert_copied(src, dst, before)


def test_pairs_only_with_a_nixl_receiver_and_takes_tcp_frames(env):
    src, dst = make_cache(8, seed=1), make_cache(10, seed=2)
    _, tcp_addr, _ = env.receiver(make_cache(10), kind="tcp")
    with pytest.raises(KVLayoutMismatch, match="takes no NIXL writes.*same --transport"):
        env.sender(src).connect(tcp_addr)
    before = dst.clone()
    rx, addr, done = env.receiver(dst)        # a NIXL receiver still takes TCP KV frames
    rx.expect("r", DST_IDS)
    send_request(env.sender(src, kind="tcp"), addr, "r", PER_LAYER)
    assert done.wait("r").ok
    assert_copied(src, dst, before)


def test_notifications_of_unpaired_or_unbegun_writers_change_nothing(env, caplog):
    caplog.set_level(logging.WARNING, logger="pdserve.kv_transfer")
    src, dst = make_cache(8, seed=1), make_cache(10, seed=2)
    rx, addr, done = env.receiver(dst)
    layout = KVLayout.for_cache(dst, MODEL)
    rx.expect("r", DST_IDS)
    notif = frames.pack_header(
        FrameType.KV, "r", epoch=EPOCH, layer_start=0, layer_end=1, num_blocks=3,
        dtype_code=frames.dtype_code(layout.dtype), payload_len=layout.payload_bytes(1, 3))
    rx._on_notif("stranger", notif)
    assert "unpaired agent" in caplog.text
    tx = env.sender(src)
    tx.connect(addr)                            # paired, but no BEGIN for "r"
    rx._on_notif(tx._lanes[0].agent.name, notif)
    c = done.wait("r")
    assert not c.ok and "without a BEGIN" in c.error


def test_a_paired_idle_receiver_does_not_spin(env):
    """The poll thread sleeps when nothing arrives (NIXL's own progress thread, which
    spins a core, is off): well under a tenth of a core over an idle second."""
    src, dst = make_cache(8, seed=1), make_cache(10, seed=2)
    rx, addr, done = env.receiver(dst)
    tx = env.sender(src)
    rx.expect("r", DST_IDS)
    send_request(tx, addr, "r", PER_LAYER)
    assert done.wait("r").ok
    time.sleep(nixl.BUSY_WINDOW_S)
    t0 = time.process_time()      # every thread of this process: the poll thread included
    time.sleep(1.0)
    assert time.process_time() - t0 < 0.1


def test_a_nixl_error_fails_that_request_and_the_lanes_go_on(env, monkeypatch):
    """NIXL reports a failed WRITE by raising (not only by "ERR"): that request fails on
    P (its connection dropped, so D fails it too), and the next one goes through."""
    src, dst = make_cache(8, seed=1), make_cache(10, seed=2)
    rx, addr, done = env.receiver(dst)
    tx = env.sender(src)
    lane = tx._lanes[0]
    real, calls = lane.agent.check_xfer_state, []

    def fails_once(handle):
        calls.append(handle)
        if len(calls) == 1:
            raise RuntimeError("nixlBackendError: transfer failed")
        return real(handle)

    monkeypatch.setattr(lane.agent, "check_xfer_state", fails_once)
    rx.expect("bad", DST_IDS)
    rx.expect("good", [0, 3, 8])
    with pytest.raises(KVTransferError, match="NIXL WRITE failed"):
        send_request(tx, addr, "bad", PER_LAYER)
    assert not done.wait("bad").ok
    before = dst.clone()
    send_request(tx, addr, "good", PER_LAYER)        # a new connection, a new BEGIN
    assert done.wait("good").ok
    assert_copied(src, dst, before, SRC_IDS, [0, 3, 8])
    assert all(lane.thread is None or lane.thread.is_alive() for lane in tx._lanes)


def test_the_sender_sees_that_d_closed_the_control_connection(env):
    a, b = socket.socketpair()
    try:
        assert not nixl_sender._peer_closed(a)
        b.close()
        assert nixl_sender._peer_closed(a)
    finally:
        a.close()


def test_shares_queued_behind_a_busy_lane_go_out_as_one_write(env, monkeypatch):
    """A lane posts every share that queued while it was busy as one WRITE whose
    notification concatenates their KV headers; D marks each, for every request."""
    src, dst = make_cache(8, seed=1), make_cache(10, seed=2)
    before = dst.clone()
    rx, addr, done = env.receiver(dst)
    tx = env.sender(src)
    posted = []
    for lane in tx._lanes:
        real = lane.post
        monkeypatch.setattr(lane, "post", lambda jobs, real=real: (posted.append(len(jobs)),
                                                                    real(jobs)))
    tables = {"a": [7, 2, 9], "b": [0, 3, 8]}
    for rid, table in tables.items():
        rx.expect(rid, table)
    tx.connect(addr)
    for lane in tx._lanes:            # busy: whatever a lane took waits for its lock
        lane.lock.acquire()
    try:
        for layer in range(NUM_LAYERS):
            for rid in tables:
                tx.send_layers(addr, rid, EPOCH, layer, layer + 1, SRC_IDS)
    finally:
        for lane in tx._lanes:
            lane.lock.release()
    for rid in tables:
        tx.send_done(addr, rid, EPOCH, 42, NUM_LAYERS)
    assert all(done.wait(rid).ok for rid in tables)
    assert sum(posted) == 2 * NUM_LAYERS and max(posted) > 1, posted
    assert rx.num_writes == 2 * NUM_LAYERS          # one KV header per send_layers
    u8 = lambda t: t.contiguous().view(torch.uint8)
    for table in tables.values():
        assert torch.equal(u8(dst[:, :, table]), u8(src[:, :, SRC_IDS]))
    untouched = [b for b in range(10) if b not in sum(tables.values(), [])]
    assert torch.equal(u8(dst[:, :, untouched]), u8(before[:, :, untouched]))


def test_shares_of_a_request_whose_writes_timed_out_are_never_posted(env, monkeypatch):
    """send_done gives up on WRITEs that outlast io_timeout_s (the connection drops and
    D hands the blocks on a grace period later): shares still queued then must not be
    posted, ever."""
    src, dst = make_cache(8, seed=1), make_cache(10, seed=2)
    before = dst.clone()
    rx, addr, done = env.receiver(dst)
    tx = env.sender(src)                      # io_timeout_s 2 s
    stuck, real = threading.Event(), tx._lanes[0].post
    monkeypatch.setattr(tx._lanes[0], "post", lambda jobs: (stuck.wait(), real(jobs)))
    rx.expect("r", DST_IDS)
    for layer in range(NUM_LAYERS):
        tx.send_layers(addr, "r", EPOCH, layer, layer + 1, SRC_IDS)
    with pytest.raises(KVTransferError, match="WRITEs not done"):
        tx.send_done(addr, "r", EPOCH, 42, NUM_LAYERS)
    stuck.set()                               # the lane comes back to its queue
    assert not done.wait("r").ok
    time.sleep(0.2)
    assert torch.equal(dst, before)
