"""UCX transport end to end, sender and receiver in one process (they share the
process's one UCX runtime: one loop thread, one worker; see kv_transfer/ucx.py).
Mirrors test_tcp.py; host caches only (the CUDA path needs a GPU)."""

import logging
import threading
import time

import numpy as np
import pytest
import torch

pytest.importorskip("ucxx")

from pdserve.kv_transfer import (  # noqa: E402
    KVLayout,
    KVLayoutMismatch,
    KVTransferError,
    TransferState,
    frames,
    make_receiver,
    make_sender,
)
from pdserve.kv_transfer import ucx, ucx_wire  # noqa: E402
from pdserve.kv_transfer.ucx import UcxKVReceiver, UcxKVSender  # noqa: E402
from ucx_client import RawClient  # noqa: E402
from kvtest import (  # noqa: E402  (shared with the other transport's tests)
    DST_IDS, EPOCH, MODEL, NUM_LAYERS, PER_LAYER, SRC_IDS,
    TIMEOUT_S, Completions, assert_copied, make_cache, send_request,
    CHUNK_CASES, INCONSISTENT_CASES, check_chunked_round_trip, check_inconsistent_frames_fail,
)

UCX_THREADS = (f"{ucx.THREAD_PREFIX}-", "UCX-Py Async Notifier Thread")


def ucx_threads():
    return [t.name for t in threading.enumerate() if t.name.startswith(UCX_THREADS)]


@pytest.fixture
def env():
    made = []

    class Env:
        def receiver(self, kv, epoch=EPOCH, **kw):
            done = Completions()
            rx = UcxKVReceiver(
                kv, KVLayout.for_cache(kv, MODEL), epoch, on_complete=done, io_timeout_s=2.0, **kw
            )
            made.append(rx)
            return rx, rx.start(), done

        def sender(self, kv, **kw):
            tx = UcxKVSender(
                kv, KVLayout.for_cache(kv, MODEL), connect_timeout_s=2.0, io_timeout_s=2.0, **kw
            )
            made.append(tx)
            return tx

    yield Env()
    errors = []
    for obj in made:
        try:
            obj.close()
        except Exception as e:  # close the rest, then report
            errors.append(e)
    assert not errors
    assert ucx_threads() == []  # the last close() stopped the shared runtime


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ranges", [PER_LAYER, [(0, NUM_LAYERS)]], ids=["per-layer", "all-layers"])
@pytest.mark.parametrize("src_ids", [SRC_IDS, [2, 3, 4]], ids=["gathered", "one-run"])
def test_round_trip(env, dtype, ranges, src_ids):
    src, dst = make_cache(8, dtype, seed=1), make_cache(10, dtype, seed=2)
    before = dst.clone()
    rx, addr, done = env.receiver(dst)
    tx = env.sender(src)
    rx.expect("r1", DST_IDS)
    assert rx.state("r1") == TransferState.WAITING
    sent = send_request(tx, addr, "r1", ranges, src_ids=src_ids)
    c = done.wait("r1")
    assert (c.ok, c.first_token, c.error) == (True, 42, None)
    assert sent == KVLayout.for_cache(src, MODEL).payload_bytes(NUM_LAYERS, 3)
    assert rx.state("r1") == TransferState.DONE
    assert_copied(src, dst, before, src_ids)
    assert done.ids() == ["r1"]


@pytest.mark.parametrize("src_ids", [SRC_IDS, [2, 3, 4]], ids=["gathered", "one-run"])
@pytest.mark.parametrize("dst_ids", [DST_IDS, [3, 4, 5]], ids=["staged", "direct"])
def test_payload_cut_to_slots(env, src_ids, dst_ids):
    """One block per message, one staging slot and two receives in flight: every
    frame's K and V arrive block by block, straight into consecutive blocks or through
    the slot, which is reused while the frame arrives."""
    src, dst = make_cache(8, seed=1, block_size=64), make_cache(10, seed=2, block_size=64)
    before = dst.clone()
    layout = KVLayout.for_cache(dst, MODEL)
    rx, addr, done = env.receiver(dst, slot_bytes=1, max_inflight=2, staging_slots=1)
    assert rx.slot_bytes == layout.kv_bytes_per_block_layer // 2
    assert ucx_wire.chunk_blocks(layout, rx.slot_bytes) == 1
    tx = env.sender(src)
    rx.expect("r1", dst_ids)
    send_request(tx, addr, "r1", [(0, 2), (2, NUM_LAYERS)], src_ids=src_ids)
    assert done.wait("r1").ok
    assert_copied(src, dst, before, src_ids, dst_ids)
    rx.expect("r2", [0, 1, 6])  # an abort after cut payloads still lines up
    send_request(tx, addr, "r2", [(0, 1)], src_ids=src_ids, done=False)
    tx.send_abort(addr, "r2", EPOCH, "x" * frames.MAX_REASON_BYTES)
    c = done.wait("r2")
    assert not c.ok and "x" * 100 in c.error


@pytest.mark.parametrize("slots", ["whole", "one-block"])
@pytest.mark.parametrize("dst_ids, seed", CHUNK_CASES)
def test_chunked_round_trip(env, dst_ids, seed, slots):
    """Several frames per layer (block_start), shuffled: each payload message lands at
    its frame's block_start, straight into consecutive blocks or through a slot, in one
    message per K/V or one per block."""
    rx_kw = {"slot_bytes": 1, "max_inflight": 2, "staging_slots": 1} if slots == "one-block" else {}
    check_chunked_round_trip(env, dst_ids, seed, rx_kw=rx_kw)


def test_payload_chunks_cover_payload_in_wire_order():
    chunks = list(ucx_wire.payload_chunks(2, 5, 2))
    assert chunks[:3] == [(0, 0, 0, 2), (0, 0, 2, 2), (0, 0, 4, 1)]
    assert len(chunks) == 2 * 2 * 3 and chunks[-1] == (1, 1, 4, 1)
    assert sum(n for *_, n in chunks) == 2 * 2 * 5


def test_registry_connect_and_close(env):
    src, dst = make_cache(8, seed=1), make_cache(10, seed=2)
    before = dst.clone()
    done = Completions()
    rx = make_receiver("ucx", dst, KVLayout.for_cache(dst, MODEL), EPOCH, done)
    tx = make_sender("ucx", src, KVLayout.for_cache(src, MODEL), epoch=3)
    try:
        addr = rx.start()
        assert rx.start() == addr  # idempotent
        assert tx.connect(addr) == EPOCH  # D's epoch, from the handshake
        rx.expect("r1", DST_IDS)
        send_request(tx, addr, "r1", [(0, 1), (1, 4)])
        assert done.wait("r1").ok
        assert_copied(src, dst, before)
    finally:
        tx.close()
        tx.close()
        rx.close()
        rx.close()
    assert ucx_threads() == []
    with pytest.raises(KVTransferError, match="closed"):
        tx.send_layers(addr, "r2", EPOCH, 0, 1, [0])
    with pytest.raises(KVTransferError, match="closed"):
        rx.start()


def test_interleaved_requests_one_connection(env):
    src, dst = make_cache(8, seed=1), make_cache(10, seed=2)
    before = dst.clone()
    rx, addr, done = env.receiver(dst)
    tx = env.sender(src)
    rx.expect("a", [7, 2, 9])
    rx.expect("b", [0, 4])
    for layer in range(NUM_LAYERS):
        tx.send_layers(addr, "a", EPOCH, layer, layer + 1, [5, 1, 6])
        tx.send_layers(addr, "b", EPOCH, layer, layer + 1, [3, 0])
    tx.send_done(addr, "b", EPOCH, 11, NUM_LAYERS)
    tx.send_done(addr, "a", EPOCH, 10, NUM_LAYERS)
    assert done.wait("a").first_token == 10
    assert done.wait("b").first_token == 11
    assert_copied(src, dst, before, [5, 1, 6, 3, 0], [7, 2, 9, 0, 4])


def test_one_sender_two_threads(env):
    src, dst = make_cache(8, seed=1), make_cache(10, seed=2)
    rx, addr, done = env.receiver(dst)
    tx = env.sender(src)
    rx.expect("p0", [7, 2, 9])
    rx.expect("p1", [0, 4, 3])
    errors = []

    def run(i, src_ids):
        try:
            send_request(tx, addr, f"p{i}", PER_LAYER, src_ids=src_ids, first_token=i)
        except Exception as e:  # surfaced by the assert below
            errors.append(e)

    threads = [threading.Thread(target=run, args=a) for a in ((0, [5, 1, 6]), (1, [2, 4, 0]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
        assert not t.is_alive()
    assert not errors
    assert done.wait("p0").ok and done.wait("p1").ok
    assert torch.equal(dst[:, :, [7, 2, 9]], src[:, :, [5, 1, 6]])
    assert torch.equal(dst[:, :, [0, 4, 3]], src[:, :, [2, 4, 0]])


def test_handshake_mismatch_names_field(env):
    dst = make_cache(10)
    rx, addr, done = env.receiver(dst)
    tx = env.sender(make_cache(8, block_size=8))
    with pytest.raises(KVLayoutMismatch, match="block_size: prefill has 8, decode has 4"):
        tx.send_layers(addr, "r", EPOCH, 0, 1, [0])
    with pytest.raises(KVLayoutMismatch, match="block_size"):
        tx.connect(addr)
    # the receiver keeps serving well-matched peers
    src = make_cache(8, seed=1)
    before = dst.clone()
    rx.expect("r2", DST_IDS)
    send_request(env.sender(src), addr, "r2", PER_LAYER)
    assert done.wait("r2").ok
    assert_copied(src, dst, before)


def test_unexpected_and_forgotten_frames_are_discarded(env):
    src, dst = make_cache(8, seed=1), make_cache(10, seed=2)
    before = dst.clone()
    rx, addr, done = env.receiver(dst)
    tx = env.sender(src)
    rx.expect("gone", DST_IDS)
    released = threading.Event()
    rx.forget("gone", released.set)
    assert released.is_set()  # no write in flight: the blocks are free at once
    with pytest.raises(KeyError):
        rx.state("gone")
    send_request(tx, addr, "ghost", PER_LAYER)  # never expected
    send_request(tx, addr, "gone", [(0, NUM_LAYERS)])
    tx.send_abort(addr, "ghost", EPOCH, "whatever")
    # a valid request after them on the same connection proves they were read fully
    rx.expect("real", [0])
    send_request(tx, addr, "real", PER_LAYER, src_ids=[3])
    assert done.wait("real").ok
    assert done.ids() == ["real"]
    assert torch.equal(dst[:, :, 0], src[:, :, 3])
    assert torch.equal(dst[:, :, 1:], before[:, :, 1:])


def test_stale_epoch_fails(env):
    src, dst = make_cache(8, seed=1), make_cache(10, seed=2)
    before = dst.clone()
    rx, addr, done = env.receiver(dst)
    rx.expect("r", DST_IDS)
    send_request(env.sender(src), addr, "r", PER_LAYER, epoch=EPOCH - 1)
    c = done.wait("r")
    assert not c.ok and "stale epoch" in c.error
    assert torch.equal(dst, before)


@pytest.mark.parametrize("ranges, src_ids, match", INCONSISTENT_CASES)
def test_inconsistent_frames_fail(env, ranges, src_ids, match):
    check_inconsistent_frames_fail(env, ranges, src_ids, match)


def test_abort_and_sender_close_fail(env):
    src, dst = make_cache(8, seed=1), make_cache(10, seed=2)
    rx, addr, done = env.receiver(dst)
    tx = env.sender(src)
    rx.expect("ab", DST_IDS)
    rx.expect("lost", [0, 1, 3])
    tx.send_layers(addr, "ab", EPOCH, 0, 1, SRC_IDS)
    tx.send_abort(addr, "ab", EPOCH, "prefill OOM")
    c = done.wait("ab")
    assert not c.ok and "prefill OOM" in c.error
    tx.send_layers(addr, "lost", EPOCH, 0, 1, SRC_IDS)
    tx.close()
    c = done.wait("lost")
    assert not c.ok and "connection lost" in c.error
    with pytest.raises(KVTransferError, match="closed"):
        tx.send_layers(addr, "lost", EPOCH, 0, 1, SRC_IDS)


def test_garbage_connection_is_closed_and_others_unaffected(env, caplog):
    caplog.set_level(logging.WARNING, logger="pdserve.kv_transfer")
    src, dst = make_cache(8, seed=1), make_cache(10, seed=2)
    before = dst.clone()
    rx, addr, done = env.receiver(dst)
    tx = env.sender(src)
    rx.expect("r", DST_IDS)
    tx.send_layers(addr, "r", EPOCH, 0, 1, SRC_IDS)  # connection open and mid-request
    rng = np.random.default_rng(0)
    junks = [rng.integers(0, 256, 1000, dtype=np.uint8).tobytes(),  # longer than a header
             frames.MAGIC + b"\xff" * 60]
    for junk in junks:
        g = RawClient(addr)
        try:
            g.run(g.connect())
            g.run(g.send_ctl(junk))
            g.run(g.wait_hung_up())  # receiver hung up on us
        finally:
            g.close()
    send_request(tx, addr, "r", [(1, NUM_LAYERS)])
    assert done.wait("r").ok
    assert_copied(src, dst, before)
    assert sum("closing KV connection" in r.getMessage() for r in caplog.records) == 2


def test_dropped_endpoint_fails_only_its_requests(env):
    src, dst = make_cache(8, seed=1), make_cache(10, seed=2)
    before = dst.clone()
    layout = KVLayout.for_cache(dst, MODEL)
    rx, addr, done = env.receiver(dst)
    tx = env.sender(src)
    rx.expect("dies", [0, 1, 3])
    rx.expect("lives", DST_IDS)
    tx.send_layers(addr, "lives", EPOCH, 0, 1, SRC_IDS)
    p = RawClient(addr)
    try:
        p.run(p.connect())
        p.run(p.handshake(layout))
        p.run(p.send_kv(layout, "dies", 0, src[:, :, [4, 0, 2]]))
    finally:
        p.close()  # both endpoints gone without an EOS
    c = done.wait("dies")
    assert not c.ok and "connection lost" in c.error, c.error
    assert rx.state("lives") == TransferState.TRANSFERRING
    send_request(tx, addr, "lives", [(1, NUM_LAYERS)])
    assert done.wait("lives").ok
    assert torch.equal(dst[:, :, DST_IDS], src[:, :, SRC_IDS])
    # layer 0 of "dies" did land in its blocks 0, 1, 3 (D reclaims them); nothing else
    assert torch.equal(dst[0, :, [0, 1, 3]], src[0, :, [4, 0, 2]])
    assert torch.equal(dst[1:, :, [0, 1, 3]], before[1:, :, [0, 1, 3]])
    untouched = [b for b in range(dst.shape[2]) if b not in DST_IDS + [0, 1, 3]]
    assert torch.equal(dst[:, :, untouched], before[:, :, untouched])


def test_receiver_close_fails_pending_and_stops_threads(env):
    src, dst = make_cache(8, seed=1), make_cache(10, seed=2)
    rx, addr, done = env.receiver(dst)
    tx = env.sender(src)
    rx.expect("pending", DST_IDS)
    tx.send_layers(addr, "pending", EPOCH, 0, 1, SRC_IDS)
    assert ucx_threads()
    rx.close()
    rx.close()
    c = done.wait("pending")
    assert not c.ok and "closed" in c.error
    # The sender notices D went away (a small frame may still be taken by UCX before
    # the hang-up is seen, as a TCP socket's first send after the peer closed succeeds)
    deadline = time.monotonic() + TIMEOUT_S
    with pytest.raises(KVTransferError):
        while time.monotonic() < deadline:
            tx.send_done(addr, "pending", EPOCH, 1, NUM_LAYERS)
            time.sleep(0.05)
    with pytest.raises(KVTransferError):  # then it reconnects and finds nobody serving
        tx.send_layers(addr, "pending", EPOCH, 1, 2, SRC_IDS)
    tx.close()
    tx.close()
    assert ucx_threads() == []


def test_env_defaults_are_set_and_explicit_env_wins(monkeypatch):
    import os

    for name, value in ucx.ucx_env_defaults().items():
        assert name in os.environ
    monkeypatch.setenv("UCXPY_PROGRESS_MODE", "polling")
    ucx.apply_ucx_env_defaults()
    assert os.environ["UCXPY_PROGRESS_MODE"] == "polling"
