"""Each transport end to end over loopback, sender and receiver in one process: every
scenario runs over TCP (KV frames on the socket) and NIXL (one-sided writes into D's
cache, the same control connection); the few that speak raw TCP KV frames run on tcp
only."""

import logging
import random
import socket
import threading
import time

import pytest
import torch

from pdserve.kv_transfer import (
    KVLayout,
    KVLayoutMismatch,
    KVTransferError,
    TransferState,
    frames,
    host_io,
    make_receiver,
    make_sender,
)
from pdserve.kv_transfer.frames import FrameType
from pdserve.kv_transfer.control_server import THREAD_PREFIX
from kvtest import (  # noqa: E402  (shared with the other transport's tests)
    BLOCK_SIZE, DST_IDS, EPOCH, HEAD_DIM, HEADS, MODEL, NUM_LAYERS, PER_LAYER, SRC_IDS,
    TIMEOUT_S, TRANSPORTS, Completions, TransportEnv, assert_copied, make_cache, send_request,
    CHUNK_CASES, INCONSISTENT_CASES, check_chunked_round_trip, check_inconsistent_frames_fail,
)
from tcp_client import kv_frame as raw_kv_frame, raw_connect, wait_closed  # noqa: E402


TCP_ONLY = pytest.mark.parametrize("env", ["tcp"], indirect=True)  # raw TCP KV frames


@pytest.fixture(params=TRANSPORTS)
def env(request):
    e = TransportEnv(request.param)
    yield e
    e.close()


def wait_state(rx, rid, state):
    deadline = time.monotonic() + TIMEOUT_S
    while rx.state(rid) != state:
        assert time.monotonic() < deadline, f"{rid} still {rx.state(rid).name}"
        time.sleep(0.005)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ranges", [PER_LAYER, [(0, NUM_LAYERS)], [(0, 1), (1, 4)]])
def test_round_trip(env, dtype, ranges):
    src, dst = make_cache(8, dtype, seed=1), make_cache(10, dtype, seed=2)
    before = dst.clone()
    rx, addr, done = env.receiver(dst)
    tx = env.sender(src)
    rx.expect("r1", DST_IDS)
    assert rx.state("r1") == TransferState.WAITING
    sent = send_request(tx, addr, "r1", ranges)
    c = done.wait("r1")
    assert (c.ok, c.first_token, c.error) == (True, 42, None)
    assert sent == KVLayout.for_cache(src, MODEL).payload_bytes(NUM_LAYERS, 3)
    assert rx.state("r1") == TransferState.DONE
    assert_copied(src, dst, before)


@pytest.mark.parametrize("checksum", [False, True], ids=["direct", "staged-crc"])
@pytest.mark.parametrize("dst_ids, seed", CHUNK_CASES)
def test_chunked_round_trip(env, dst_ids, seed, checksum):
    """Several frames per layer (block_start), shuffled: received straight into each
    chunk's runs of blocks, or through the staging tensor when checksummed."""
    check_chunked_round_trip(env, dst_ids, seed, tx_kw={"checksum": checksum})


@TCP_ONLY
@pytest.mark.parametrize("checksum", [False, True], ids=["direct", "staged-crc"])
def test_a_fragmented_block_table_goes_through_one_buffer(env, checksum, monkeypatch):
    """Frames of more pieces than host_io.MAX_DIRECT_PIECES (here 2; DST_IDS is 3 runs)
    are gathered into one buffer on P and received into one on D, then copied."""
    monkeypatch.setattr(host_io, "MAX_DIRECT_PIECES", 2)
    staged, grow = [], frames.grow_buffer
    monkeypatch.setattr(frames, "grow_buffer",
                        lambda b, n, pinned: staged.append(n) or grow(b, n, pinned))
    src, dst = make_cache(8, seed=1), make_cache(10, seed=2)
    before = dst.clone()
    rx, addr, done = env.receiver(dst)
    rx.expect("r1", DST_IDS)
    send_request(env.sender(src, checksum=checksum), addr, "r1", [(0, 2), (2, 4)])
    assert done.wait("r1").ok
    assert_copied(src, dst, before)
    assert staged == [KVLayout.for_cache(src, MODEL).payload_bytes(2, 3)] * 2   # per frame


def test_registry_and_checksum_round_trip(env):
    """make_receiver / make_sender by the transport's name, with a checksum asked for
    (CRC32C where the transport checksums its frames, ignored elsewhere)."""
    src, dst = make_cache(8, seed=1), make_cache(10, seed=2)
    before = dst.clone()
    done = Completions()
    rx = make_receiver(env.kind, dst, KVLayout.for_cache(dst, MODEL), EPOCH, notify=done)
    done.attach(rx)
    tx = make_sender(env.kind, src, KVLayout.for_cache(src, MODEL), checksum=True)
    assert type(rx).__module__.endswith(("tcp", "nixl_receiver")), type(rx)
    assert getattr(tx, "checksum", False) == (env.kind == "tcp")
    try:
        addr = rx.start()
        rx.expect("r1", DST_IDS)
        send_request(tx, addr, "r1", PER_LAYER)
        assert done.wait("r1").ok
        assert_copied(src, dst, before)
    finally:
        tx.close()
        rx.close()


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


@pytest.mark.parametrize("shared", [False, True], ids=["two-senders", "one-sender-two-threads"])
def test_parallel_senders(env, shared):
    srcs = [make_cache(8, seed=s) for s in (1, 3)]
    if shared:  # both threads go through one sender (one connection) over one cache
        srcs[1] = srcs[0]
    dst = make_cache(10, seed=2)
    before = dst.clone()
    rx, addr, done = env.receiver(dst)
    txs = [env.sender(srcs[0])] * 2 if shared else [env.sender(s) for s in srcs]
    rx.expect("p0", [7, 2, 9])
    rx.expect("p1", [0, 4, 3])
    errors = []

    def run(i):
        try:
            send_request(txs[i], addr, f"p{i}", PER_LAYER, src_ids=[5, 1, 6], first_token=i)
        except Exception as e:  # surfaced by the assert below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
        assert not t.is_alive()
    assert not errors
    assert done.wait("p0").ok and done.wait("p1").ok
    assert torch.equal(dst[:, :, [7, 2, 9]], srcs[0][:, :, [5, 1, 6]])
    assert torch.equal(dst[:, :, [0, 4, 3]], srcs[1][:, :, [5, 1, 6]])
    others = [1, 5, 6, 8]
    assert torch.equal(dst[:, :, others], before[:, :, others])


@TCP_ONLY
def test_checksum_corruption_fails_request_and_keeps_serving(env):
    src, dst = make_cache(8, seed=1), make_cache(10, seed=2)
    before = dst.clone()
    layout = KVLayout.for_cache(dst, MODEL)
    rx, addr, done = env.receiver(dst)
    blocks = src[:, :, SRC_IDS]  # [L, 2, 3, bs, H, D]
    rx.expect("bad", DST_IDS)
    rx.expect("good", DST_IDS[::-1])
    with raw_connect(addr, layout) as s:
        s.sendall(raw_kv_frame(layout, "bad", 0, blocks, crc_delta=1))
        c = done.wait("bad")
        assert not c.ok and "checksum" in c.error
        assert rx.state("bad") == TransferState.FAILED
        assert torch.equal(dst, before)  # corrupt payload never reached the cache
        for layer in range(NUM_LAYERS):  # same connection still in sync
            s.sendall(raw_kv_frame(layout, "good", layer, blocks))
        s.sendall(frames.pack_header(FrameType.DONE, "good", epoch=EPOCH, layer_end=NUM_LAYERS, first_token=3))
        assert done.wait("good").ok
    assert_copied(src, dst, before, SRC_IDS, DST_IDS[::-1])


def test_handshake_mismatch_names_field(env):
    dst = make_cache(10)
    rx, addr, done = env.receiver(dst)
    tx = env.sender(make_cache(8, block_size=8))
    with pytest.raises(KVLayoutMismatch, match="block_size: prefill has 8, decode has 4"):
        tx.send_layers(addr, "r", EPOCH, 0, 1, [0])
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
    rx.forget("gone")
    with pytest.raises(KeyError):
        rx.state("gone")
    for rid, ranges in [("ghost", PER_LAYER), ("gone", [(0, NUM_LAYERS)])]:  # never/no more expected
        if env.kind == "nixl":  # refused at BEGIN, before a byte is written
            with pytest.raises(KVTransferError, match=f"refused KV of request {rid}: not expected"):
                send_request(tx, addr, rid, ranges)
        else:                   # read and dropped
            send_request(tx, addr, rid, ranges)
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
    if env.kind == "nixl":  # refused at BEGIN: nothing is written
        with pytest.raises(KVTransferError, match="not expected.*stale"):
            send_request(env.sender(src), addr, "r", PER_LAYER, epoch=EPOCH - 1)
    else:
        send_request(env.sender(src), addr, "r", PER_LAYER, epoch=EPOCH - 1)
    c = done.wait("r")
    assert not c.ok and "stale epoch" in c.error
    assert torch.equal(dst, before)


def test_garbage_connection_is_closed_and_others_unaffected(env, caplog):
    caplog.set_level(logging.WARNING, logger="pdserve.kv_transfer")
    src, dst = make_cache(8, seed=1), make_cache(10, seed=2)
    before = dst.clone()
    rx, addr, done = env.receiver(dst)
    tx = env.sender(src)
    rx.expect("r", DST_IDS)
    tx.send_layers(addr, "r", EPOCH, 0, 1, SRC_IDS)  # connection open and mid-request
    rng = random.Random(0)
    for junk in (bytes(rng.getrandbits(8) for _ in range(1000)), frames.MAGIC + b"\xff" * 60):
        with socket.create_connection(addr, timeout=TIMEOUT_S) as g:
            g.sendall(junk)
            assert wait_closed(g)  # receiver hung up on us (after its challenge)
    send_request(tx, addr, "r", [(1, NUM_LAYERS)])
    assert done.wait("r").ok
    assert_copied(src, dst, before)
    # garbage before pairing: refused by the accept thread (once per peer host)
    assert any("refused: bad magic" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("ranges, src_ids, match", INCONSISTENT_CASES)
def test_inconsistent_frames_fail(env, ranges, src_ids, match):
    if env.kind == "nixl" and "reservation has" in match:  # P has D's block ids: refused on P
        with pytest.raises(KVTransferError, match=r"blocks \[2, 4\) beyond D's reservation of 3"):
            check_inconsistent_frames_fail(env, ranges, src_ids, match)
        return
    check_inconsistent_frames_fail(env, ranges, src_ids, match)


def test_abort_and_connection_loss_fail(env):
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
    if env.kind == "tcp":   # a NIXL write is seen at D once P's later progress sends it
        wait_state(rx, "lost", TransferState.TRANSFERRING)
    assert done.ids() == ["ab"]
    tx.close()
    c = done.wait("lost")
    assert not c.ok and "connection lost" in c.error
    with pytest.raises(KVTransferError, match="closed"):
        tx.send_layers(addr, "lost", EPOCH, 0, 1, SRC_IDS)


def test_close_is_idempotent_and_stops_threads(env):
    src, dst = make_cache(8, seed=1), make_cache(10, seed=2)
    rx, addr, done = env.receiver(dst)
    tx = env.sender(src)
    rx.expect("pending", DST_IDS)
    tx.send_layers(addr, "pending", EPOCH, 0, 1, SRC_IDS)
    ours = lambda: [t.name for t in threading.enumerate() if t.name.startswith(f"{THREAD_PREFIX}-") and t.name.split("-")[2] == str(addr[1])]
    assert ours()
    rx.close()
    rx.close()
    assert ours() == []
    c = done.wait("pending")
    assert not c.ok and "closed" in c.error
    tx.close()
    tx.close()
    with pytest.raises(KVTransferError):  # nothing listens there any more
        env.sender(src).send_layers(addr, "x", EPOCH, 0, 1, [0])


@TCP_ONLY
def test_forget_during_a_direct_write_defers_release_until_the_write_ends(env):
    """A frame half-received straight into the reserved blocks when D forgets the
    request: forget() returns at once, but the blocks are released (get_finished) only
    after the write ends, so D never hands them to another request mid-write."""
    dst = torch.zeros(NUM_LAYERS, 2, 12, HEADS, BLOCK_SIZE, HEAD_DIM)
    layout = KVLayout.for_cache(dst, MODEL)
    rx, addr, done = env.receiver(dst)
    rx.expect("r", [3, 4, 5])                        # one run: the zero-copy path
    s = raw_connect(addr, layout)
    payload = make_cache(3)[0:1].contiguous().view(torch.uint8).numpy().tobytes()
    header = frames.pack_header(
        FrameType.KV, "r", epoch=EPOCH, layer_start=0, layer_end=1, num_blocks=3,
        dtype_code=frames.dtype_code(layout.dtype), payload_len=len(payload))
    s.sendall(header + payload[:100])                # the receiver is now mid-write
    threading.Event().wait(0.3)                      # let it block inside recv_into
    rx.forget("r")
    assert not done.released_within("r", 0.2)        # write in flight: not yet
    s.sendall(payload[100:])
    assert done.released_within("r", TIMEOUT_S)      # the write ended: blocks released
    s.close()
    assert done.ids() == []                          # forget() never reports a completion
