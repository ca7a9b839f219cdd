"""Wire format of the control connection every transport pairs over (and of TCP's KV);
the handshake and BEGIN_ACK payloads are encoded in control.py.

Every frame is a fixed 56-byte little-endian header, the UTF-8 request id, then the
payload (the 8-byte fields sit on 8-byte offsets)::

     0       4   5   6   7   8                              16
    +-------+---+---+---+---+-------------------------------+
    | magic |ver|typ|flg|dty|          epoch (u64)          |
    |"PDKV" |u8 |u8 |u8 |u8 |                               |
    +-------+---+---+---+---+-------------------------------+
    16             20             24             28             32
    +--------------+--------------+--------------+--------------+
    | layer_start  |  layer_end   | block_start  |  num_blocks  |
    |    (u32)     |    (u32)     |    (u32)     |    (u32)     |
    +--------------+--------------+--------------+--------------+
    32                             40                             48     50     52     54  56
    +------------------------------+------------------------------+------+------+------+---+
    |     first_token (i64, -1     |      payload_len (u64)       |rid_ln|head_ |num_  |pad|
    |       = no token)            |   (incl. trailing crc32c)    | u16  |start |heads |   |
    +------------------------------+------------------------------+------+------+------+---+
    56                 56 + rid_len                               + payload_len
    +------------------+------------------------------------------+
    | request_id UTF-8 | payload                                  |
    +------------------+------------------------------------------+

A KV frame carries KV heads [head_start, head_start + num_heads) (the model's numbering;
num_heads 0: all the receiver's heads, the case of two workers of one rank each) of
layers [layer_start, layer_end) of the blocks at positions
[block_start, block_start + num_blocks) of the receiver's reservation (its block table,
in the order D gave to expect()), so one request's KV may arrive as several frames per
layer (one per prefill chunk, say), in any order; each (layer, block) exactly once::

    reservation | b0 | b1 | b2 | b3 | b4 | b5 | b6 |
                |<------------>|                     frame A: block_start 0, num_blocks 3
                               |<----------------->| frame B: block_start 3, num_blocks 4

Payload by frame type:

    CHALLENGE      NONCE_BYTES random bytes: D's nonce_d, the first frame   (D -> P)
                   on every connection (auth.py)
    HANDSHAKE      JSON {"layout": <KVLayout>, "epoch": <P's epoch>,        (P -> D)
                         "nonce": "<nonce_p hex>", "auth": null | "<hex>",
                         "nixl": null | {...}}  (nixl.py: P's agent name)
    HANDSHAKE_ACK  JSON {"layout": <KVLayout>, "epoch": <D's epoch>,        (D -> P)
                         "error": null | "<why D refuses>", "auth": null | "<hex>",
                         "nixl": null | {...}}  (nixl.py: D's agent metadata and
                                                 its registered cache)
                   (a refusal for the cluster secret is {"error": AUTH_REFUSED} only:
                   nothing about D goes to a peer that has not proved the secret)
    KV             K/V bytes of a [layer_end - layer_start, 2, num_blocks,
                   num_heads, block_size, head_dim] tensor in the layout
                   dtype, C order; + 4-byte LE CRC32C (Castagnoli,
                   google-crc32c) of them if flag bit 0
    DONE           empty; layer_end = number of layers sent, num_blocks =
                   one-sided writes made for it (nixl.py; 0 on TCP); the
                   sender has sent every frame of its heads [head_start,
                   head_start + num_heads); first_token set by the sender
                   that sampled it (a tensor-parallel P's rank 0), -1 by
                   the other ranks
    ABORT          UTF-8 reason (<= MAX_REASON_BYTES)
    BEGIN          empty: P is about to write the request's KV (its KV   (P -> D)
                   heads, as a KV frame names them) into D's blocks
                   with one-sided writes (nixl.py); D answers
    BEGIN_ACK      JSON {"block_ids": [...]} (D's reserved blocks, in      (D -> P)
                   block-table order) or {"error": "<why not>"}; <=
                   MAX_BEGIN_ACK_BYTES. From then until P's DONE or ABORT
                   (or the connection's end) D keeps those blocks out of
                   its pool, even if the request is forgotten meanwhile

A KV frame's payload_len is fully determined by its header and the layout, so a
receiver checks it before reading a single payload byte.
"""

from __future__ import annotations

import enum
import socket
import struct
from dataclasses import dataclass

import torch

from .base import MAX_REQUEST_ID_BYTES, PROTOCOL_VERSION, KVFrameError, KVLayout

MAGIC = b"PDKV"
HEADER = struct.Struct("<4sBBBBQIIIIqQHHH2x")
HEADER_SIZE = HEADER.size
assert HEADER_SIZE == 56, HEADER_SIZE
_RID_LEN = 12  # index of the request id's length in HEADER's fields

FLAG_CRC32C = 1 << 0  # payload carries a trailing little-endian CRC32C (host_io.crc32c)
KNOWN_FLAGS = FLAG_CRC32C
CRC_BYTES = 4

MAX_HANDSHAKE_BYTES = 64 * 1024  # layout JSON is ~200 bytes; caps what a side buffers
NONCE_BYTES = 32  # CHALLENGE payload, and P's nonce in its HANDSHAKE
AUTH_REFUSED = "cluster secret mismatch"  # D's refusal error when auth fails (auth.py)
MAX_REASON_BYTES = 4096
MAX_BEGIN_ACK_BYTES = 1 << 20  # ~90k block ids of JSON: a 1.4M-token prompt at block_size 16

# Codes are part of the protocol: never renumber, only append.
DTYPE_CODES: dict[str, int] = {"float32": 1, "float16": 2, "bfloat16": 3, "uint8": 4,
                                "int8": 5, "float8_e4m3fn": 6, "float8_e5m2": 7}
DTYPE_NAMES: dict[int, str] = {code: name for name, code in DTYPE_CODES.items()}


class FrameType(enum.IntEnum):
    HANDSHAKE = 1
    HANDSHAKE_ACK = 2
    KV = 3
    DONE = 4
    ABORT = 5
    CHALLENGE = 6
    BEGIN = 7
    BEGIN_ACK = 8


@dataclass(frozen=True, slots=True)
class FrameHeader:
    """Decoded header plus request id. first_token is None when absent on the wire."""

    frame_type: FrameType
    request_id: str = ""
    flags: int = 0
    epoch: int = 0
    layer_start: int = 0
    layer_end: int = 0
    block_start: int = 0  # KV: first reservation block-table position this frame fills
    num_blocks: int = 0
    dtype_code: int = 0
    first_token: int | None = None
    payload_len: int = 0  # bytes following the request id, crc included
    head_start: int = 0   # KV, DONE: the model's KV heads [head_start, + num_heads)
    num_heads: int = 0    # 0: all the receiver's heads

    def heads(self, layout: KVLayout) -> range:
        """The KV heads (the model's numbering) this frame covers on a receiver of
        ``layout``."""
        if self.num_heads == 0:
            return layout.heads
        return range(self.head_start, self.head_start + self.num_heads)

    @property
    def has_crc(self) -> bool:
        return bool(self.flags & FLAG_CRC32C)

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start


def dtype_code(dtype: str) -> int:
    """Wire code of a layout dtype name; ValueError if it has none."""
    try:
        return DTYPE_CODES[dtype]
    except KeyError:
        raise ValueError(
            f"dtype {dtype!r} has no wire code; supported: {sorted(DTYPE_CODES)}"
        ) from None


def pack_header(frame_type: FrameType, request_id: str = "", *, flags: int = 0,
                epoch: int = 0, layer_start: int = 0, layer_end: int = 0,
                block_start: int = 0, num_blocks: int = 0, dtype_code: int = 0,
                first_token: int | None = None, payload_len: int = 0,
                head_start: int = 0, num_heads: int = 0) -> bytes:
    """Fixed header followed by the UTF-8 request id (fields: the module docstring).
    Raises ValueError on values that do not fit their fields."""
    rid = request_id.encode("utf-8")
    if len(rid) > MAX_REQUEST_ID_BYTES:
        raise ValueError(f"request_id is {len(rid)} bytes UTF-8, limit {MAX_REQUEST_ID_BYTES}")
    if first_token is not None and first_token < 0:
        raise ValueError(f"first_token must be >= 0, got {first_token}")
    try:
        fixed = HEADER.pack(MAGIC, PROTOCOL_VERSION, int(frame_type), flags, dtype_code, epoch,
                            layer_start, layer_end, block_start, num_blocks,
                            -1 if first_token is None else first_token, payload_len, len(rid),
                            head_start, num_heads)
    except struct.error as e:
        raise ValueError(f"frame header field out of range: {e}") from e
    return fixed + rid


def _unpack_fixed(buf: bytes | memoryview) -> tuple:
    """Parse and check the fixed part; returns the raw struct tuple."""
    if len(buf) < HEADER_SIZE:
        raise KVFrameError(f"truncated header: {len(buf)} of {HEADER_SIZE} bytes")
    raw = HEADER.unpack_from(buf, 0)
    magic, version, ftype, flags = raw[0], raw[1], raw[2], raw[3]
    if magic != MAGIC:
        raise KVFrameError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != PROTOCOL_VERSION:
        raise KVFrameError(f"protocol version {version}, this side speaks {PROTOCOL_VERSION}")
    if ftype not in FrameType._value2member_map_:
        raise KVFrameError(f"unknown frame type {ftype}")
    if flags & ~KNOWN_FLAGS:
        raise KVFrameError(f"unknown flag bits {flags & ~KNOWN_FLAGS:#x}")
    if raw[_RID_LEN] > MAX_REQUEST_ID_BYTES:
        raise KVFrameError(
            f"request_id length {raw[_RID_LEN]} exceeds {MAX_REQUEST_ID_BYTES} bytes"
        )
    return raw


def request_id_len(buf: bytes | memoryview) -> int:
    """Bytes of request id that follow the fixed header in ``buf`` (HEADER_SIZE bytes);
    KVFrameError if the fixed part is malformed. For readers that gather a frame
    without blocking (control_server.py's pairing)."""
    return _unpack_fixed(buf)[_RID_LEN]


def unpack_header(
    buf: bytes | memoryview, layout: KVLayout | None = None, max_blocks: int | None = None
) -> FrameHeader:
    """Decode ``HEADER_SIZE + request_id_len`` bytes of ``buf`` and validate them.

    With ``layout``, a KV frame's dtype, layer range and payload_len are checked against
    it; with ``max_blocks``, its block range [block_start, block_start + num_blocks) too.
    Raises KVFrameError on any violation.
    """
    raw = _unpack_fixed(buf)
    (_, _, ftype, flags, dcode, epoch, lstart, lend, bstart, nblocks, tok, plen, rid_len,
     hstart, nheads) = raw
    if len(buf) < HEADER_SIZE + rid_len:
        raise KVFrameError(
            f"truncated request_id: {len(buf) - HEADER_SIZE} of {rid_len} bytes"
        )
    try:
        rid = bytes(buf[HEADER_SIZE : HEADER_SIZE + rid_len]).decode("utf-8")
    except UnicodeDecodeError as e:
        raise KVFrameError(f"request_id is not UTF-8: {e}") from e
    if tok < -1:
        raise KVFrameError(f"first_token {tok} is negative")
    h = FrameHeader(FrameType(ftype), rid, flags, epoch, lstart, lend, bstart, nblocks, dcode,
                    None if tok == -1 else tok, plen, hstart, nheads)
    _validate(h, layout, max_blocks)
    return h


def _validate(h: FrameHeader, layout: KVLayout | None, max_blocks: int | None) -> None:
    t = h.frame_type
    if t in (FrameType.KV, FrameType.DONE, FrameType.ABORT, FrameType.BEGIN,
             FrameType.BEGIN_ACK) and not h.request_id:
        raise KVFrameError(f"{t.name} frame without request_id")
    if t in (FrameType.HANDSHAKE, FrameType.HANDSHAKE_ACK):
        if not 0 < h.payload_len <= MAX_HANDSHAKE_BYTES:
            raise KVFrameError(
                f"{t.name} payload_len {h.payload_len} not in [1, {MAX_HANDSHAKE_BYTES}]"
            )
    elif t == FrameType.CHALLENGE:
        if h.payload_len != NONCE_BYTES:
            raise KVFrameError(f"CHALLENGE payload_len {h.payload_len}, expected {NONCE_BYTES}")
    elif t == FrameType.BEGIN:
        if h.payload_len != 0:
            raise KVFrameError(f"BEGIN frame has payload_len {h.payload_len}, expected 0")
        _validate_heads(h, layout)
    elif t == FrameType.BEGIN_ACK:
        if not 0 < h.payload_len <= MAX_BEGIN_ACK_BYTES:
            raise KVFrameError(
                f"BEGIN_ACK payload_len {h.payload_len} not in [1, {MAX_BEGIN_ACK_BYTES}]")
    elif t == FrameType.ABORT:
        if h.payload_len > MAX_REASON_BYTES:
            raise KVFrameError(f"ABORT reason {h.payload_len} bytes, limit {MAX_REASON_BYTES}")
    elif t == FrameType.DONE:
        if h.payload_len != 0:
            raise KVFrameError(f"DONE frame has payload_len {h.payload_len}, expected 0")
        if h.first_token is None and h.num_heads == 0:
            raise KVFrameError("DONE frame for every head without first_token")
        if layout is not None and h.layer_end > layout.num_layers:
            raise KVFrameError(
                f"DONE frame claims {h.layer_end} layers, layout has {layout.num_layers}"
            )
        _validate_heads(h, layout)
    elif t == FrameType.KV:
        _validate_kv(h, layout, max_blocks)


def _validate_kv(h: FrameHeader, layout: KVLayout | None, max_blocks: int | None) -> None:
    if h.num_blocks == 0:
        raise KVFrameError("KV frame with num_blocks 0")
    if max_blocks is not None and h.block_start + h.num_blocks > max_blocks:
        raise KVFrameError(
            f"KV frame block range [{h.block_start}, {h.block_start + h.num_blocks}) "
            f"exceeds {max_blocks} blocks"
        )
    if h.layer_start >= h.layer_end:
        raise KVFrameError(f"KV frame layer range [{h.layer_start}, {h.layer_end}) is empty")
    if layout is None:
        return
    if h.layer_end > layout.num_layers:
        raise KVFrameError(
            f"KV frame layer range [{h.layer_start}, {h.layer_end}) beyond "
            f"num_layers {layout.num_layers}"
        )
    _validate_heads(h, layout)
    if h.dtype_code != DTYPE_CODES.get(layout.dtype):
        got = DTYPE_NAMES.get(h.dtype_code, f"code {h.dtype_code}")
        raise KVFrameError(f"KV frame dtype {got}, layout dtype {layout.dtype}")
    heads = len(h.heads(layout))
    expected = layout.payload_bytes(h.num_layers, h.num_blocks, heads) + (
        CRC_BYTES if h.has_crc else 0)
    if h.payload_len != expected:
        raise KVFrameError(
            f"KV frame payload_len {h.payload_len}, expected {expected} for "
            f"{h.num_layers} layers x {h.num_blocks} blocks x {heads} heads of {layout.dtype}"
            + (" + crc32c" if h.has_crc else "")
        )


def _validate_heads(h: FrameHeader, layout: KVLayout | None) -> None:
    """A frame's head range must lie within the receiver's heads."""
    if layout is None or h.num_heads == 0:
        return
    mine = layout.heads
    if h.head_start < mine.start or h.head_start + h.num_heads > mine.stop:
        raise KVFrameError(
            f"{h.frame_type.name} frame for KV heads [{h.head_start}, "
            f"{h.head_start + h.num_heads}), this receiver holds [{mine.start}, {mine.stop})")


def recv_exact(sock: socket.socket, buf: memoryview, *, eof_ok: bool = False) -> bool:
    """Fill ``buf`` from ``sock`` with ``recv_into``. Returns False only if ``eof_ok``
    and the peer closed before the first byte; EOF after that raises KVFrameError.
    Socket errors (including timeouts) propagate as OSError."""
    got, want = 0, len(buf)
    while got < want:
        n = sock.recv_into(buf[got:])
        if n == 0:
            if got == 0 and eof_ok:
                return False
            raise KVFrameError(f"connection closed mid-frame after {got} of {want} bytes")
        got += n
    return True


def read_header(sock: socket.socket, layout: KVLayout | None = None,
                max_blocks: int | None = None, *, eof_ok: bool = False,
                frame_timeout_s: float | None = None) -> FrameHeader | None:
    """Read and validate one header + request id from ``sock``. None on a clean EOF
    before the frame (only if ``eof_ok``); KVFrameError on anything malformed.
    frame_timeout_s, if given, says the socket has kernel timeouts of that length
    (host_io.set_kernel_timeouts): a timeout before the frame's first byte is then an
    idle connection and the wait goes on; the rest of the frame must arrive in time."""
    mv = memoryview(bytearray(HEADER_SIZE + MAX_REQUEST_ID_BYTES))
    while True:
        try:
            got = sock.recv_into(mv[:HEADER_SIZE])
            break
        except (BlockingIOError, TimeoutError):
            if frame_timeout_s is None:
                raise
    if got == 0:
        if eof_ok:
            return None
        raise KVFrameError("connection closed before a frame header")
    recv_exact(sock, mv[got:HEADER_SIZE])
    rid_len = _unpack_fixed(mv[:HEADER_SIZE])[_RID_LEN]  # validated before the read gets that far
    recv_exact(sock, mv[HEADER_SIZE : HEADER_SIZE + rid_len])
    return unpack_header(mv[: HEADER_SIZE + rid_len], layout, max_blocks)


def grow_buffer(buf: torch.Tensor | None, nbytes: int, pinned: bool) -> torch.Tensor:
    """A uint8 host staging buffer of at least ``nbytes``, reusing ``buf`` when big
    enough (and doubling otherwise, so a growing stream of frames reallocates rarely)."""
    if buf is not None and buf.numel() >= nbytes:
        return buf
    size = max(nbytes, 2 * buf.numel() if buf is not None else 0)
    return torch.empty(size, dtype=torch.uint8, pin_memory=pinned)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """Zero-copy byte view of a contiguous CPU tensor, for any dtype (bf16 included:
    numpy has no bf16, but a uint8 view of it does)."""
    assert t.device.type == "cpu" and t.is_contiguous(), (t.device, t.is_contiguous())
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def done_header(request_id: str, epoch: int, first_token: int | None, num_layers_sent: int,
                num_writes: int = 0, heads: range | None = None) -> bytes:
    """DONE frame (header only): the request's KV (of ``heads``; None: all of them) is
    complete; carries P's first token (None from a rank that did not sample it) and, in
    num_blocks, how many one-sided writes P made for it (nixl.py; 0 over TCP), so D
    knows when their notifications are all in."""
    return pack_header(FrameType.DONE, request_id, epoch=epoch, layer_end=num_layers_sent,
                       num_blocks=num_writes, first_token=first_token,
                       head_start=heads.start if heads else 0,
                       num_heads=len(heads) if heads else 0)


def abort_frame(request_id: str, epoch: int, reason: str) -> tuple[bytes, bytes]:
    """ABORT frame as (header, UTF-8 reason payload), the reason cut to MAX_REASON_BYTES
    on a character boundary so the receiver can always decode it."""
    payload = reason.encode("utf-8")[:MAX_REASON_BYTES].decode("utf-8", "ignore").encode("utf-8")
    return pack_header(FrameType.ABORT, request_id, epoch=epoch, payload_len=len(payload)), payload
