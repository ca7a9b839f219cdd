"""Control messages of the pairing connection beside the KV frames (py): the
handshake payloads (JSON: layouts, epochs, proofs of the cluster secret, auth.py; the
NIXL pairing fields, nixl.py) and the BEGIN_ACK that leases D's blocks to a one-sided
writer. Every decoder raises KVFrameError on anything malformed."""

from __future__ import annotations

import json
from typing import NamedTuple

from .base import KVFrameError, KVLayout
from .frames import AUTH_REFUSED, MAX_REASON_BYTES, NONCE_BYTES, FrameType, pack_header


class Handshake(NamedTuple):
    """A decoded HANDSHAKE or HANDSHAKE_ACK payload."""

    layout: KVLayout | None  # None only in an AUTH_REFUSED refusal
    epoch: int
    error: str | None  # D's refusal (acks only)
    nonce: bytes = b""  # P's nonce_p (HANDSHAKE); b"" in an ack
    auth: bytes | None = None  # the sender's HMAC proof (auth.py); None: it has no secret
    nixl: dict | None = None  # one-sided-write pairing fields (nixl.py); None: TCP frames only


def encode_handshake(layout: KVLayout, epoch: int, error: str | None = None, *, ack: bool,
                     nonce: bytes = b"", auth: bytes | None = None,
                     nixl: dict | None = None) -> bytes:
    """Handshake (``ack=False``, with P's ``nonce``) or ack payload JSON, UTF-8;
    ``auth`` is the sender's proof of the cluster secret (None without one); ``nixl``
    the NIXL transport's pairing fields (JSON-serializable; nixl.py checks them)."""
    body: dict = {"layout": json.loads(layout.to_json()), "epoch": epoch,
                  "auth": None if auth is None else auth.hex(), "nixl": nixl}
    if ack:
        body["error"] = error
    else:
        body["nonce"] = nonce.hex()
    return json.dumps(body, sort_keys=True).encode("utf-8")


def encode_auth_refusal() -> bytes:
    """D's ack to a peer that did not prove the cluster secret: the error only."""
    return json.dumps({"error": AUTH_REFUSED}).encode("utf-8")


def decode_handshake(payload: bytes, *, ack: bool) -> Handshake:
    """Inverse of :func:`encode_handshake` (and, ``ack`` only, of
    :func:`encode_auth_refusal`). KVFrameError if malformed: a HANDSHAKE (``ack=False``)
    needs a layout and P's nonce, and carries no error."""
    try:
        body = json.loads(payload)
        error = body.get("error")
        refusal = ack and error == AUTH_REFUSED and "layout" not in body
        layout = None if refusal else KVLayout.from_json(json.dumps(body["layout"]))
        epoch = body.get("epoch", 0) if refusal else body["epoch"]
        nonce = bytes.fromhex(body.get("nonce") or "")
        auth = None if body.get("auth") is None else bytes.fromhex(body["auth"])
        nixl = None if refusal else body.get("nixl")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise KVFrameError(f"malformed handshake payload: {e}") from e
    if not (nixl is None or isinstance(nixl, dict)):
        raise KVFrameError(f"malformed handshake payload: nixl={nixl!r}")
    if not isinstance(epoch, int) or not (error is None or isinstance(error, str)):
        raise KVFrameError(f"malformed handshake payload: epoch={epoch!r} error={error!r}")
    if len(nonce) != (0 if ack else NONCE_BYTES) or (error is not None and not ack):
        raise KVFrameError(f"malformed handshake payload: nonce of {len(nonce)} bytes "
                           f"(expected {0 if ack else NONCE_BYTES}), error={error!r}")
    return Handshake(layout, epoch, error, nonce, auth, nixl)


def begin_ack_frame(request_id: str, epoch: int, block_ids: list[int] | None = None,
                    error: str | None = None) -> bytes:
    """BEGIN_ACK frame (header + JSON payload): D's reserved ``block_ids`` for a BEGIN,
    or the ``error`` that refuses it (cut to MAX_REASON_BYTES)."""
    body = {"block_ids": block_ids} if error is None else {"error": error[:MAX_REASON_BYTES]}
    payload = json.dumps(body).encode("utf-8")
    return pack_header(FrameType.BEGIN_ACK, request_id, epoch=epoch,
                       payload_len=len(payload)) + payload


def decode_begin_ack(payload: bytes) -> tuple[list[int] | None, str | None]:
    """(block_ids, None) or (None, error) from a BEGIN_ACK payload; KVFrameError if
    malformed (block ids must be non-negative ints)."""
    try:
        body = json.loads(payload)
        ids, error = body.get("block_ids"), body.get("error")
    except (ValueError, AttributeError) as e:
        raise KVFrameError(f"malformed BEGIN_ACK payload: {e}") from e
    if error is not None:
        return None, str(error)
    if not isinstance(ids, list) or not ids or not all(
            isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in ids):
        raise KVFrameError(f"malformed BEGIN_ACK payload: block_ids={str(ids)[:80]}")
    return ids, None
