"""The KV port under connections that never pair (kv_transfer/control_server.py): they hold no
thread, each is closed once io_timeout_s passed since its accept however slowly it
sends, at most MAX_PENDING_PER_HOST are held from one address (MAX_PENDING in all), and a
legitimate sender still pairs among them, also one whose handshake was pending while
another address flooded the port; a thread that cannot start costs its connection only;
refusals are logged once per peer.
Over both transports (the NIXL receiver pairs over the same port)."""

import logging
import socket
import threading
import time

import pytest

from pdserve.kv_transfer import control_server
from pdserve.kv_transfer.control_server import THREAD_PREFIX
from kvtest import (EPOCH, MODEL, PER_LAYER, TIMEOUT_S, TransportEnv, TRANSPORTS, make_cache,
                    send_request)
from tcp_client import handshake_bytes, read_frame, wait_closed
from pdserve.kv_transfer import control
from pdserve.kv_transfer.frames import FrameType

DST_IDS = [7, 2, 9]


@pytest.fixture(params=TRANSPORTS)
def env(request):
    e = TransportEnv(request.param)
    yield e
    e.close()


def conn_threads(port: int) -> list[str]:
    """The receiver's connection threads (besides its accept thread, and NIXL's poll)."""
    return [t.name for t in threading.enumerate()
            if t.name.startswith(f"{THREAD_PREFIX}-conn-{port}-")]


def round_trip(env, rx, addr, done, rid: str) -> None:
    src = make_cache(8, seed=1)
    tx = env.sender(src)
    rx.expect(rid, DST_IDS)
    send_request(tx, addr, rid, PER_LAYER)
    assert done.wait(rid).ok
    rx.forget(rid)
    tx.close()


def test_slow_connections_that_never_pair_hold_no_thread_and_a_sender_still_pairs(env):
    rx, addr, done = env.receiver(make_cache(10, seed=2))
    slow = []
    try:
        for _ in range(2000):                 # each sends one byte of a header, then stalls
            s = socket.create_connection(addr, timeout=TIMEOUT_S)
            s.sendall(b"P")
            slow.append(s)
        time.sleep(0.2)                        # let the accept thread take the backlog
        assert conn_threads(addr[1]) == []
        round_trip(env, rx, addr, done, "among-the-slow")
        # the oldest were evicted (closed by D); at most MAX_PENDING are held
        assert wait_closed(slow[0]) and wait_closed(slow[-control_server.MAX_PENDING - 1])
        threads = conn_threads(addr[1])
        assert len(threads) <= 1, threads     # at most the paired one, still ending
    finally:
        for s in slow:
            s.close()


def test_a_flood_from_another_address_never_evicts_a_pending_real_handshake(env):
    """A peer that has its challenge and has not answered yet (127.0.0.1), then 300
    connections from 127.0.0.2 that never pair (more than MAX_PENDING): they evict only
    their own, so the peer's handshake, sent after the flood, still pairs. The receiver
    gives a handshake 20 s (opening 300 connections takes seconds here)."""
    from kvtest import Completions

    from pdserve.kv_transfer import KVLayout, make_receiver

    cache = make_cache(10, seed=2)
    layout = KVLayout.for_cache(cache, MODEL)
    done = Completions()
    rx = make_receiver(env.kind, cache, layout, EPOCH, notify=done, io_timeout_s=20.0)
    env.made.append(rx)
    addr = rx.start()
    done.attach(rx)
    real = socket.create_connection(addr, timeout=TIMEOUT_S)
    h, nonce_d = read_frame(real)
    assert h.frame_type == FrameType.CHALLENGE
    flood = []
    try:
        for _ in range(300):
            s = socket.socket()
            s.bind(("127.0.0.2", 0))
            s.settimeout(TIMEOUT_S)
            s.connect(addr)
            flood.append(s)
        time.sleep(0.3)                        # the accept thread takes the backlog
        assert wait_closed(flood[0])           # its own oldest went
        real.sendall(handshake_bytes(layout, nonce_d))
        h, body = read_frame(real)
        assert h.frame_type == FrameType.HANDSHAKE_ACK, h
        assert control.decode_handshake(body, ack=True).error is None
    finally:
        real.close()
        for s in flood:
            s.close()
    round_trip(env, rx, addr, done, "after-the-flood")


def test_a_handshake_is_bounded_in_all_not_per_read(env):
    """One byte every 0.5 s never lets a read time out; the 2 s budget still ends it."""
    rx, addr, done = env.receiver(make_cache(10, seed=2))   # io_timeout_s 2 s
    s = socket.create_connection(addr, timeout=TIMEOUT_S)
    start = time.monotonic()
    try:
        s.settimeout(0.1)
        for _ in range(20):
            try:
                s.sendall(b"P")
            except OSError:
                break                          # D closed it
            time.sleep(0.5)
        assert wait_closed(s)
        assert 1.5 < time.monotonic() - start < 4.5
    finally:
        s.close()


def test_a_thread_that_cannot_start_costs_its_connection_only(env, monkeypatch):
    rx, addr, done = env.receiver(make_cache(10, seed=2))
    start, failed = threading.Thread.start, []

    def start_or_fail(self):
        if self.name.startswith(f"{THREAD_PREFIX}-conn-{addr[1]}") and not failed:
            failed.append(self.name)
            raise RuntimeError("can't start new thread")
        return start(self)

    monkeypatch.setattr(threading.Thread, "start", start_or_fail)
    src = make_cache(8, seed=1)
    tx = env.sender(src)
    rx.expect("first", DST_IDS)
    with pytest.raises(Exception):             # its connection was closed unpaired
        send_request(tx, addr, "first", PER_LAYER)
    tx.close()
    assert failed
    round_trip(env, rx, addr, done, "second")  # the accept loop goes on


def test_a_refused_peer_is_logged_once(env, caplog):
    rx, addr, done = env.receiver(make_cache(10, seed=2))
    with caplog.at_level(logging.WARNING, logger="pdserve.kv_transfer.control_server"):
        for _ in range(5):
            with socket.create_connection(addr, timeout=TIMEOUT_S) as s:
                s.sendall(b"X" * 56)           # a header with a bad magic
                assert wait_closed(s)
    refusals = [r for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusals) == 1, [r.getMessage() for r in refusals]
    assert "bad magic" in refusals[0].getMessage()
    round_trip(env, rx, addr, done, "after")
