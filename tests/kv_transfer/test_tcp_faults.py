"""Transfer faults over TCP: what a corrupted byte, a cut-off frame, a stale epoch, an
unknown request id or a forged length does to D. The rule every test checks: a fault
fails the request it hits (or the connection's requests, when the framing is lost),
never another, and never leaves wrong bytes in a cache that a request reports as good."""

import logging

import pytest
import torch

from pdserve.config import WorkerConfig
from pdserve.kv_transfer import KVLayout, TransferState, frames, make_sender, tcp_sender
from pdserve.kv_transfer.frames import FrameType
from kvtest import (  # noqa: E402  (shared with the other transport's tests)
    DST_IDS, EPOCH, MODEL, NUM_LAYERS, SRC_IDS, TransportEnv, assert_copied, make_cache,
    send_request,
)
from tcp_client import done_frame, kv_frame, raw_connect, wait_closed  # noqa: E402

u8 = lambda t: t.contiguous().view(torch.uint8)  # bit equality, any dtype


@pytest.fixture
def env():
    e = TransportEnv("tcp")
    yield e
    e.close()


def test_checksum_is_on_by_default_for_tcp():
    src = make_cache(8)
    layout = KVLayout.for_cache(src, MODEL)
    tx = make_sender("tcp", src, layout, checksum=WorkerConfig().kv_checksum)
    try:
        assert tx.checksum is True
    finally:
        tx.close()


def corrupting(monkeypatch, rid, layer, offset=1000):
    """Flip one payload byte of ``rid``'s KV frame for ``layer`` on its way to the
    socket (after P computed its CRC32C), as a bad NIC or cable would."""
    real = tcp_sender.host_io.sendmsg_all
    hits = []

    def send(sock, bufs):
        h = frames.unpack_header(bytes(bufs[0]))
        if (h.frame_type, h.request_id, h.layer_start) == (FrameType.KV, rid, layer):
            payload = bytearray(b"".join(bytes(b) for b in bufs[1:-1]))
            payload[offset] ^= 0x40
            bufs = [bufs[0], payload, bufs[-1]]
            hits.append(h)
        real(sock, bufs)

    monkeypatch.setattr(tcp_sender.host_io, "sendmsg_all", send)
    return hits


def test_corrupted_byte_fails_only_that_request(env, monkeypatch, caplog):
    """Three requests interleaved layer by layer on one connection; one byte of "bad"'s
    layer 2 is flipped on the wire. "bad" fails naming the checksum; its layer 2 never
    reaches the cache; "a" and "b" complete with exact bytes over the same connection."""
    caplog.set_level(logging.WARNING, logger="pdserve.kv_transfer")
    src, dst = make_cache(8, seed=1), make_cache(12, seed=2)
    before = dst.clone()
    rx, addr, done = env.receiver(dst)
    tx = env.sender(src, checksum=True)
    hits = corrupting(monkeypatch, "bad", 2)
    reqs = {"a": ([5, 1, 6], [7, 2, 9]), "bad": ([0, 2, 3], [0, 4, 3]), "b": ([4, 7], [1, 5])}
    for rid, (_, dst_ids) in reqs.items():
        rx.expect(rid, dst_ids)
    for layer in range(NUM_LAYERS):
        for rid, (src_ids, _) in reqs.items():
            tx.send_layers(addr, rid, EPOCH, layer, layer + 1, src_ids)
    for i, rid in enumerate(reqs):
        tx.send_done(addr, rid, EPOCH, i, NUM_LAYERS)
    assert len(hits) == 1
    c = done.wait("bad")
    assert not c.ok and "checksum mismatch on layers [2, 3)" in c.error, c.error
    assert rx.state("bad") == TransferState.FAILED
    for rid in ("a", "b"):
        assert done.wait(rid).ok
        assert rx.state(rid) == TransferState.DONE
    assert sorted(done.ids()) == ["a", "b", "bad"]
    src_ids, dst_ids = reqs["bad"]
    assert torch.equal(u8(dst[:2, :, dst_ids]), u8(src[:2, :, src_ids]))  # before the flip
    assert torch.equal(u8(dst[2:, :, dst_ids]), u8(before[2:, :, dst_ids]))  # never written
    for rid in ("a", "b"):
        src_ids, dst_ids = reqs[rid]
        assert torch.equal(u8(dst[:, :, dst_ids]), u8(src[:, :, src_ids]))
    untouched = [b for b in range(12) if not any(b in d for _, d in reqs.values())]
    assert torch.equal(u8(dst[:, :, untouched]), u8(before[:, :, untouched]))
    # one connection throughout, never dropped
    assert not any("closing KV connection" in r.getMessage() for r in caplog.records)
    assert len(rx._control._conns) == 1


@pytest.mark.parametrize("crc", [False, True], ids=["direct", "staged-crc"])
def test_truncated_frame_then_close_fails_the_connections_requests(env, crc):
    """A frame cut off mid-payload, then the connection closes: every request that got
    frames over that connection fails with the cause; a reservation that got none and a
    transfer on another connection are untouched; nothing stays counted as written, so
    the failed requests' blocks are released at once."""
    src, dst = make_cache(8, seed=1), make_cache(16, seed=2)
    before = dst.clone()
    layout = KVLayout.for_cache(dst, MODEL)
    rx, addr, done = env.receiver(dst)
    tx = env.sender(src)
    rx.expect("r1", [0, 1])
    rx.expect("r2", [3, 4, 5])  # one run: received straight into the blocks unless crc
    rx.expect("idle", [6])
    rx.expect("other", DST_IDS)
    tx.send_layers(addr, "other", EPOCH, 0, 1, SRC_IDS)  # in flight on another connection
    s = raw_connect(addr, layout)
    s.sendall(kv_frame(layout, "r1", 0, src[:, :, [2, 3]], crc=crc))
    cut = kv_frame(layout, "r2", 0, src[:, :, [4, 5, 6]], crc=crc)
    s.sendall(cut[: len(cut) // 2])
    s.close()
    for rid in ("r1", "r2"):
        c = done.wait(rid)
        assert not c.ok and "connection lost" in c.error and "mid-frame" in c.error, c.error
        rx.forget(rid)
        assert rx.get_finished().released == [rid]  # no write in flight: released at once
    assert rx.state("idle") == TransferState.WAITING
    send_request(tx, addr, "other", [(1, NUM_LAYERS)])
    assert done.wait("other").ok
    assert torch.equal(u8(dst[:, :, DST_IDS]), u8(src[:, :, SRC_IDS]))
    assert torch.equal(u8(dst[0, :, [0, 1]]), u8(src[0, :, [2, 3]]))  # r1's whole frame landed
    if crc:  # staged: the cut frame never reached r2's blocks
        assert torch.equal(u8(dst[:, :, [3, 4, 5]]), u8(before[:, :, [3, 4, 5]]))
    untouched = [b for b in range(16) if b not in DST_IDS + [0, 1, 3, 4, 5]]
    assert torch.equal(u8(dst[:, :, untouched]), u8(before[:, :, untouched]))
    assert set(rx._table._active) == {"idle"}


@pytest.mark.parametrize("frame", ["kv", "kv-crc", "done", "abort"])
def test_stale_epoch_frame_fails_its_request_and_is_dropped(env, frame):
    """A frame from an earlier incarnation of D's epoch fails that request; its payload
    is read and dropped, so the connection stays in sync for the next request."""
    src, dst = make_cache(8, seed=1), make_cache(10, seed=2)
    before = dst.clone()
    layout = KVLayout.for_cache(dst, MODEL)
    rx, addr, done = env.receiver(dst)
    rx.expect("stale", [0, 1, 3])
    rx.expect("ok", DST_IDS)
    old = EPOCH - 1
    with raw_connect(addr, layout) as s:
        s.sendall({
            "kv": lambda: kv_frame(layout, "stale", 0, src[:, :, SRC_IDS], crc=False, epoch=old),
            "kv-crc": lambda: kv_frame(layout, "stale", 1, src[:, :, SRC_IDS], epoch=old),
            "done": lambda: done_frame("stale", 1, NUM_LAYERS, epoch=old),
            "abort": lambda: b"".join(frames.abort_frame("stale", old, "late")),
        }[frame]())
        c = done.wait("stale")
        assert not c.ok and f"stale epoch {old}" in c.error, c.error
        for layer in range(NUM_LAYERS):
            s.sendall(kv_frame(layout, "ok", layer, src[:, :, SRC_IDS]))
        s.sendall(done_frame("ok", 7, NUM_LAYERS))
        assert done.wait("ok").first_token == 7
    assert_copied(src, dst, before)  # only "ok"'s blocks changed


def test_unknown_request_frames_are_rejected(env):
    """Frames for a request D never expected, or forgot, write nothing, report nothing,
    and leave the connection in sync."""
    src, dst = make_cache(8, seed=1), make_cache(10, seed=2)
    before = dst.clone()
    layout = KVLayout.for_cache(dst, MODEL)
    rx, addr, done = env.receiver(dst)
    rx.expect("forgotten", [0, 1, 3])
    rx.forget("forgotten")
    rx.expect("ok", DST_IDS)
    with raw_connect(addr, layout) as s:
        for rid in ("ghost", "forgotten"):
            s.sendall(kv_frame(layout, rid, 0, src[:, :, SRC_IDS], crc=False)
                      + kv_frame(layout, rid, 1, src[:, :, SRC_IDS], crc_delta=1)
                      + done_frame(rid, 1, NUM_LAYERS)
                      + b"".join(frames.abort_frame(rid, EPOCH, "x")))
        for layer in range(NUM_LAYERS):
            s.sendall(kv_frame(layout, "ok", layer, src[:, :, SRC_IDS]))
        s.sendall(done_frame("ok", 7, NUM_LAYERS))
        assert done.wait("ok").ok
    assert done.ids() == ["ok"]
    for rid in ("ghost", "forgotten"):
        with pytest.raises(KeyError):
            rx.state(rid)
    assert_copied(src, dst, before)


def test_forged_lengths_are_capped_by_the_reservation(env, monkeypatch):
    """A KV frame claiming more blocks than the reservation fails that request and its
    payload is dropped without a buffer for it; a length beyond the layout closes the
    connection before a byte of payload is read. Staging never exceeds the reservation."""
    staged = []
    real_grow = frames.grow_buffer
    monkeypatch.setattr(frames, "grow_buffer",
                        lambda buf, n, pinned: staged.append(n) or real_grow(buf, n, pinned))
    src, dst = make_cache(8, seed=1), make_cache(10, seed=2)
    before = dst.clone()
    layout = KVLayout.for_cache(dst, MODEL)
    rx, addr, done = env.receiver(dst)
    rx.expect("small", [4, 5])
    rx.expect("ok", DST_IDS)
    with raw_connect(addr, layout) as s:
        s.sendall(kv_frame(layout, "small", 0, src[:, :, :8]))  # 8 blocks into 2
        c = done.wait("small")
        assert not c.ok and "reservation has 2" in c.error, c.error
        for layer in range(NUM_LAYERS):  # still in sync: the 8 blocks were read and dropped
            s.sendall(kv_frame(layout, "ok", layer, src[:, :, SRC_IDS]))
        s.sendall(done_frame("ok", 7, NUM_LAYERS))
        assert done.wait("ok").ok
    assert max(staged) == layout.payload_bytes(1, len(DST_IDS))
    rx.expect("huge", [0])
    with raw_connect(addr, layout) as s:
        s.sendall(frames.pack_header(  # payload_len far beyond what the header implies
            FrameType.KV, "huge", epoch=EPOCH, layer_start=1, layer_end=2, num_blocks=1,
            dtype_code=frames.dtype_code(layout.dtype), payload_len=2**62))
        assert wait_closed(s)
    assert rx.state("huge") == TransferState.WAITING  # nothing of it was admitted
    assert max(staged) == layout.payload_bytes(1, len(DST_IDS))
    assert_copied(src, dst, before)


@pytest.mark.parametrize("dst_ids", [
    pytest.param(list(range(3, 40)), id="one-run"),
    pytest.param(list(range(0, 74, 2)), id="37-runs"),  # 4 layers x K/V x 37 runs > 256 pieces
])
def test_checksummed_frames_scatter_exactly(env, dst_ids):
    """A checksummed frame is staged, checked, then scattered: by one memcpy per run of
    blocks, or (too many pieces) by index_copy_; both land exact bytes."""
    src, dst = make_cache(40, seed=1), make_cache(80, seed=2)
    before = dst.clone()
    rx, addr, done = env.receiver(dst)
    tx = env.sender(src, checksum=True)
    src_ids = list(range(len(dst_ids)))[::-1]
    rx.expect("r", dst_ids)
    send_request(tx, addr, "r", [(0, NUM_LAYERS)], src_ids=src_ids)
    assert done.wait("r").ok
    assert_copied(src, dst, before, src_ids, dst_ids)
