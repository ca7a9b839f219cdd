"""Wire format and layout descriptor: no sockets except one socketpair."""

import socket
import struct

import google_crc32c
import pytest
import torch

from pdserve.kv_transfer import KVFrameError, KVLayout, control, make_receiver, make_sender
from pdserve.kv_transfer import frames, host_io
from pdserve.kv_transfer.frames import FrameType

LAYOUT = KVLayout("cfg-abc", num_layers=4, num_kv_heads=3, head_dim=8, block_size=4, dtype="float32")


def _kv_header(**kw):
    args = dict(
        epoch=7,
        layer_start=1,
        layer_end=3,
        num_blocks=5,
        dtype_code=frames.DTYPE_CODES["float32"],
        payload_len=LAYOUT.payload_bytes(2, 5),
    )
    args.update(kw)
    return frames.pack_header(FrameType.KV, "req-1", **args)


@pytest.mark.parametrize(
    "ftype, kw",
    [
        (FrameType.HANDSHAKE, dict(epoch=3, payload_len=100)),
        (FrameType.HANDSHAKE_ACK, dict(epoch=2**64 - 1, payload_len=1)),
        (FrameType.KV, dict(epoch=7, layer_start=1, layer_end=3, num_blocks=5,
                            dtype_code=frames.DTYPE_CODES["float32"],
                            payload_len=LAYOUT.payload_bytes(2, 5) + 4, flags=frames.FLAG_CRC32C)),
        (FrameType.KV, dict(epoch=7, layer_start=0, layer_end=4, block_start=11, num_blocks=5,
                            dtype_code=frames.DTYPE_CODES["float32"],
                            payload_len=LAYOUT.payload_bytes(4, 5))),
        (FrameType.DONE, dict(epoch=1, layer_end=4, first_token=12345)),
        (FrameType.ABORT, dict(epoch=1, payload_len=10)),
        (FrameType.CHALLENGE, dict(payload_len=frames.NONCE_BYTES)),
    ],
)
def test_header_round_trip(ftype, kw):
    rid = "" if ftype in (FrameType.HANDSHAKE, FrameType.HANDSHAKE_ACK, FrameType.CHALLENGE) \
        else "réq-ü"
    buf = frames.pack_header(ftype, rid, **kw)
    assert len(buf) == frames.HEADER_SIZE + len(rid.encode())
    h = frames.unpack_header(buf, LAYOUT, max_blocks=16)
    assert h.frame_type == ftype and h.request_id == rid
    for k, v in kw.items():
        assert getattr(h, k) == v, k
    if "first_token" not in kw:
        assert h.first_token is None
    if "block_start" not in kw:
        assert h.block_start == 0


def test_header_layout_is_56_bytes_little_endian():
    assert frames.HEADER_SIZE == 56
    buf = frames.pack_header(
        FrameType.KV, "r", epoch=2**40 + 1, layer_start=1, layer_end=2, block_start=0x01020304,
        num_blocks=6, dtype_code=1, first_token=9, payload_len=123, flags=frames.FLAG_CRC32C,
        head_start=3, num_heads=2,
    )
    assert len(buf) == 56 + 1 and buf[:4] == b"PDKV" and buf[4] == 6  # protocol version
    assert struct.unpack_from("<QIIIIqQHHH", buf, 8) == (
        2**40 + 1, 1, 2, 0x01020304, 6, 9, 123, 1, 3, 2)
    assert buf[54:56] == bytes(2) and buf[56:] == b"r"
    with pytest.raises(ValueError, match="out of range"):
        frames.pack_header(FrameType.KV, "r", block_start=2**32, num_blocks=1)


def _corrupt(buf, offset, value):
    b = bytearray(buf)
    b[offset] = value
    return bytes(b)


@pytest.mark.parametrize(
    "buf, match",
    [
        (_corrupt(_kv_header(), 0, ord("X")), "magic"),
        (_corrupt(_kv_header(), 4, 99), "version"),
        (_corrupt(_kv_header(), 5, 42), "frame type"),
        (_corrupt(_kv_header(), 6, 0x80), "flag"),
        (_kv_header()[:20], "truncated header"),
        (_kv_header()[:-2], "truncated request_id"),
        (_kv_header(payload_len=LAYOUT.payload_bytes(2, 5) + 1), "payload_len"),
        (_kv_header(flags=frames.FLAG_CRC32C), "payload_len"),  # crc flag but no crc bytes
        (_kv_header(layer_end=5, payload_len=LAYOUT.payload_bytes(4, 5)), "num_layers"),
        (_kv_header(layer_end=1), "empty"),
        (_kv_header(num_blocks=0), "num_blocks"),
        (_kv_header(num_blocks=17, payload_len=LAYOUT.payload_bytes(2, 17)), "exceeds"),
        (_kv_header(block_start=12), r"block range \[12, 17\) exceeds 16 blocks"),
        (_kv_header(dtype_code=frames.DTYPE_CODES["bfloat16"]), "dtype"),
        (frames.pack_header(FrameType.DONE, "r", layer_end=4), "first_token"),
        (frames.pack_header(FrameType.DONE, "r", layer_end=4, first_token=1, payload_len=3), "payload_len"),
        (frames.pack_header(FrameType.KV, "", num_blocks=1, layer_end=1), "request_id"),
        (frames.pack_header(FrameType.HANDSHAKE, payload_len=10**9), "HANDSHAKE"),
        (frames.pack_header(FrameType.ABORT, "r", payload_len=10**6), "ABORT"),
        (frames.pack_header(FrameType.CHALLENGE, payload_len=10**6), "CHALLENGE"),
    ],
)
def test_bad_headers_raise(buf, match):
    with pytest.raises(KVFrameError, match=match):
        frames.unpack_header(buf, LAYOUT, max_blocks=16)


def test_oversize_request_id():
    with pytest.raises(ValueError, match="256"):
        frames.pack_header(FrameType.DONE, "x" * 257, first_token=1)
    # Forge the length field directly: receiver must refuse before reading 60k bytes.
    raw = bytearray(frames.pack_header(FrameType.DONE, "x", first_token=1))
    struct.pack_into("<H", raw, 48, 60000)
    with pytest.raises(KVFrameError, match="request_id length"):
        frames.unpack_header(bytes(raw))


def test_recv_exact_eof_mid_frame():
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"abc")
        a.close()
        buf = bytearray(10)
        with pytest.raises(KVFrameError, match="3 of 10"):
            frames.recv_exact(b, memoryview(buf))
    a, b = socket.socketpair()
    with a, b:
        a.close()
        assert frames.recv_exact(b, memoryview(bytearray(4)), eof_ok=True) is False


def test_read_header_from_socket():
    a, b = socket.socketpair()
    with a, b:
        a.sendall(_kv_header())
        h = frames.read_header(b, LAYOUT)
        assert (h.request_id, h.layer_start, h.layer_end, h.block_start, h.num_blocks) == (
            "req-1", 1, 3, 0, 5)


def test_handshake_payload_round_trip():
    p = control.encode_handshake(LAYOUT, 9, "nope", ack=True, auth=b"\x01" * 32)
    assert control.decode_handshake(p, ack=True) == (LAYOUT, 9, "nope", b"", b"\x01" * 32, None)
    nonce = bytes(range(frames.NONCE_BYTES))
    p = control.encode_handshake(LAYOUT, 3, ack=False, nonce=nonce)
    assert control.decode_handshake(p, ack=False) == (LAYOUT, 3, None, nonce, None, None)
    refusal = control.decode_handshake(control.encode_auth_refusal(), ack=True)
    assert (refusal.layout, refusal.error) == (None, frames.AUTH_REFUSED)
    for bad, ack in [(b"{not json", True), (b"[1, 2]", True), (b'"x"', False),
                     (control.encode_auth_refusal(), False),  # P's handshake needs a layout
                     (control.encode_handshake(LAYOUT, 3, ack=False), False),  # and a nonce
                     (control.encode_handshake(LAYOUT, 3, ack=False, nonce=b"ab"), False),
                     (p.replace(b'"auth": null', b'"auth": "zz"'), False)]:
        with pytest.raises(KVFrameError, match="malformed"):
            control.decode_handshake(bad, ack=ack)


def test_layout_mismatch_names_fields():
    other = KVLayout("cfg-abc", 4, 3, 8, block_size=32, dtype="bfloat16")
    msg = LAYOUT.mismatch(other)
    assert "block_size: prefill has 4, decode has 32" in msg
    assert "dtype: prefill has 'float32', decode has 'bfloat16'" in msg
    assert "num_layers" not in msg
    assert LAYOUT.mismatch(KVLayout.from_json(LAYOUT.to_json())) is None


def test_layout_for_cache_and_validation():
    kv = torch.zeros(4, 2, 10, 3, 4, 8, dtype=torch.bfloat16)   # [L, 2, blocks, heads, bs, d]
    lay = KVLayout.for_cache(kv, "m")
    assert (lay.num_layers, lay.block_size, lay.num_kv_heads, lay.head_dim, lay.dtype) == (
        4, 4, 3, 8, "bfloat16")
    assert lay.payload_bytes(2, 3) == 2 * 2 * 3 * 4 * 3 * 8 * 2
    with pytest.raises(ValueError, match="block_size"):
        KVLayout("m", 4, 3, 8, block_size=0, dtype="float32")
    with pytest.raises(ValueError, match="dtype"):
        KVLayout("m", 4, 3, 8, 4, dtype="float99")
    with pytest.raises(ValueError, match="unknown fields"):
        KVLayout.from_json('{"bogus": 1}')
    with pytest.raises(ValueError):
        KVLayout.for_cache(torch.zeros(4, 3, 2), "m")


def test_registry_unknown_kind():
    kv = torch.zeros(4, 2, 10, 3, 4, 8)
    with pytest.raises(ValueError, match="'tcp'"):
        make_sender("carrier-pigeon", kv, LAYOUT)
    with pytest.raises(ValueError, match="valid kinds"):
        make_receiver("nope", kv, LAYOUT, 0, lambda c: None)


def test_crc32c_is_castagnoli_over_pieces_without_copies():
    """The KV frame checksum: CRC32C (not zlib's crc32), extended across the pieces of a
    payload in order, over writable views of tensor memory as the transport has them."""
    check = memoryview(bytearray(b"123456789"))
    assert host_io.crc32c([check]) == 0xE3069283  # CRC32C's check value (zlib: 0xCBF43926)
    payload = torch.randn(2, 2, 5, 3, 4, 8)  # [L, 2, n, H, bs, D]
    wire = frames.tensor_bytes(payload)
    want = google_crc32c.value(bytes(wire))
    assert host_io.crc32c([wire]) == want
    assert host_io.crc32c([wire[:100], wire[100:100], wire[100:333], wire[333:]]) == want
    assert host_io.crc32c([wire[1:]], crc=host_io.crc32c([wire[:1]])) == want


def test_handshake_carries_the_nixl_fields():
    extra = {"agent": "pdserve-prefill-1", "num_blocks": 8}
    p = control.encode_handshake(LAYOUT, 3, ack=False, nonce=bytes(frames.NONCE_BYTES),
                                nixl=extra)
    assert control.decode_handshake(p, ack=False).nixl == extra
    with pytest.raises(KVFrameError, match="nixl"):
        control.decode_handshake(p.replace(b'"nixl": {', b'"nixl": [{').replace(b"8}", b"8}]"),
                                ack=False)


def test_begin_and_its_ack():
    h = frames.unpack_header(frames.pack_header(FrameType.BEGIN, "r", epoch=4), LAYOUT, 10)
    assert (h.frame_type, h.request_id, h.epoch) == (FrameType.BEGIN, "r", 4)
    with pytest.raises(KVFrameError, match="BEGIN frame has payload_len 3"):
        frames.unpack_header(frames.pack_header(FrameType.BEGIN, "r", payload_len=3))
    with pytest.raises(KVFrameError, match="BEGIN frame without request_id"):
        frames.unpack_header(frames.pack_header(FrameType.BEGIN))
    ack = control.begin_ack_frame("r", 4, [7, 2, 9])
    h = frames.unpack_header(ack)
    assert h.frame_type == FrameType.BEGIN_ACK
    payload = ack[frames.HEADER_SIZE + 1:]
    assert len(payload) == h.payload_len
    assert control.decode_begin_ack(payload) == ([7, 2, 9], None)
    refused = control.begin_ack_frame("r", 4, error="x" * 10_000)
    body = control.decode_begin_ack(refused[frames.HEADER_SIZE + 1:])
    assert body == (None, "x" * frames.MAX_REASON_BYTES)
    for bad in [b"{", b'{"block_ids": []}', b'{"block_ids": [1, -2]}',
                b'{"block_ids": [true]}', b'{"block_ids": "1"}', b"[]"]:
        with pytest.raises(KVFrameError, match="malformed BEGIN_ACK"):
            control.decode_begin_ack(bad)
    too_big = frames.pack_header(FrameType.BEGIN_ACK, "r",
                                 payload_len=frames.MAX_BEGIN_ACK_BYTES + 1)
    with pytest.raises(KVFrameError, match="BEGIN_ACK payload_len"):
        frames.unpack_header(too_big)
