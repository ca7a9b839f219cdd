"""UCX wire format (see ``ucx.py`` for the transport): header messages, how a KV payload
is cut into messages, the zero-copy buffers UCX reads and writes, and the handshake body
with its UCX fields. Pure functions over frames.py; no UCX import, so both ends (and
tests) share them without a UCX runtime.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch

from . import frames
from .base import MAX_REQUEST_ID_BYTES, KVFrameError

# Header messages are padded to the longest header + request id, so a receiver can post
# one fixed-size recv before it knows the request id's length.
HEADER_MSG_BYTES = frames.HEADER_SIZE + MAX_REQUEST_ID_BYTES
EOS = b"PDKV-EOS"  # first bytes of the header-sized message a sender ends a stream with


def chunk_blocks(layout: Any, slot_bytes: int) -> int:
    """Blocks per payload message: as many whole blocks of one layer's K (or V) as fit in
    the receiver's ``slot_bytes`` (at least one; the receiver sizes its slots so)."""
    per_block = layout.kv_bytes_per_block_layer // 2
    return max(1, slot_bytes // per_block)


def payload_chunks(
    num_layers: int, num_blocks: int, per_chunk: int
) -> Iterator[tuple[int, int, int, int]]:
    """A KV payload's messages in wire order, as ``(layer offset, half, first block,
    n_blocks)``, offsets relative to the frame's layer_start and block_start: for each
    layer, K (half 0) then V (half 1), each cut into runs of at most ``per_chunk``
    blocks. Sender and receiver both walk it, so they agree on every message's size and
    destination."""
    for layer in range(num_layers):
        for half in (0, 1):
            for first in range(0, num_blocks, per_chunk):
                yield layer, half, first, min(per_chunk, num_blocks - first)


def header_message(header: bytes) -> bytearray:
    """``header`` (fixed header + request id) zero-padded to HEADER_MSG_BYTES."""
    assert len(header) <= HEADER_MSG_BYTES, len(header)
    return bytearray(header) + bytes(HEADER_MSG_BYTES - len(header))


def ucx_buffer(t: torch.Tensor) -> Any:
    """Zero-copy uint8 view of contiguous ``t`` that UCX reads from / writes into: a numpy
    array for host memory, the CUDA tensor itself (``__cuda_array_interface__``; a uint8
    view, since bf16 has no typestr there) for device memory."""
    assert t.is_contiguous(), "UCX buffers must be contiguous"
    flat = t.reshape(-1).view(torch.uint8)
    return flat.numpy() if flat.device.type == "cpu" else flat


def wire_view(kv: torch.Tensor) -> Any:
    """``kv`` [n_layers, 2, n_blocks, heads, block_size, head_dim] (contiguous) as uint8
    [n_layers, 2, n_blocks, block bytes of K or V]: a numpy array for host memory, a
    torch tensor for device memory. ``wire_view(kv)[l, half, a:b].reshape(-1)`` is then
    a message for UCX at the cost of a slice (torch views cost ~10x more per message)."""
    flat = kv.view(*kv.shape[:3], -1).view(torch.uint8)
    return flat.numpy() if flat.device.type == "cpu" else flat


def handshake_payload(
    layout: Any, epoch: int, *, ack: bool, error: str | None = None, nonce: bytes = b"",
    auth: bytes | None = None, **ucx_fields: Any
) -> bytes:
    """The frames.py handshake JSON (with P's ``nonce`` and the sender's ``auth`` proof,
    auth.py) plus a ``"ucx"`` object (worker address; in D's ack also data_tag and
    slot_bytes)."""
    body = json.loads(frames.encode_handshake(layout, epoch, error, ack=ack, nonce=nonce,
                                              auth=auth))
    fields = dict(ucx_fields)
    fields["worker_address"] = base64.b64encode(fields["worker_address"]).decode("ascii")
    body["ucx"] = fields
    return json.dumps(body, sort_keys=True).encode("utf-8")


class Handshake(NamedTuple):
    """A parsed handshake (HANDSHAKE from P or HANDSHAKE_ACK from D)."""

    layout: Any  # KVLayout; None in a refusal for the cluster secret
    epoch: int
    error: str | None  # D's refusal, naming the mismatched field
    worker_address: bytes  # the peer's UCX worker address (empty in a refusal)
    data_tag: int  # D's ack only: headers under it, payload messages under data_tag + 1
    slot_bytes: int  # D's ack only: the most bytes D takes in one payload message
    nonce: bytes = b""  # P's HANDSHAKE only: its nonce (auth.py)
    auth: bytes | None = None  # the sender's proof of the cluster secret (auth.py)


def parse_handshake(payload: bytes, *, ack: bool) -> Handshake:
    """Parse a handshake body; ``ack``: D's HANDSHAKE_ACK, which must also carry the data
    tag and slot size. KVFrameError if malformed or the UCX fields are missing (a TCP
    peer, say). A refusal (error set) needs no UCX fields."""
    layout, epoch, error, nonce, proof = frames.decode_handshake(payload, ack=ack)
    if error is not None:
        return Handshake(layout, epoch, error, b"", 0, 0, nonce, proof)
    try:
        fields = json.loads(payload)["ucx"]
        address = base64.b64decode(fields["worker_address"], validate=True)
        tag = int(fields["data_tag"]) if ack else 0
        slot_bytes = int(fields["slot_bytes"]) if ack else 0
        ok = bool(address) and (
            not ack or (0 < tag < 2**64 - 1 and tag % 2 == 0 and slot_bytes > 0)
        )
    except (ValueError, KeyError, TypeError) as e:
        raise KVFrameError(f"handshake lacks valid UCX fields: {e}") from None
    if not ok:
        raise KVFrameError("handshake has an empty worker address, a bad data_tag or slot_bytes")
    return Handshake(layout, epoch, error, address, tag, slot_bytes, nonce, proof)
