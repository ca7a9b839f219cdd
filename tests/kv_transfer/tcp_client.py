"""A hand-driven prefill side for the TCP receiver's tests: the handshake (with or
without the cluster secret) and raw frames, each a plain byte string, so a test can cut,
corrupt or forge any of them."""

import socket

import google_crc32c
import torch

from pdserve.kv_transfer import auth, control, frames
from pdserve.kv_transfer.frames import FrameType

from kvtest import EPOCH, TIMEOUT_S


def read_frame(s):
    """(header, payload) of the next frame on ``s``."""
    h = frames.read_header(s)
    body = bytearray(h.payload_len)
    frames.recv_exact(s, memoryview(body))
    return h, bytes(body)


def handshake_bytes(layout, nonce_d, secret=None, nonce_p=None, nixl=None):
    """P's HANDSHAKE frame answering D's challenge ``nonce_d`` (``nixl``: the NIXL
    pairing fields, e.g. {"agents": [...]})."""
    nonce_p = nonce_p or auth.new_nonce()
    key = auth.secret_bytes(secret)
    p = control.encode_handshake(layout, 0, ack=False, nonce=nonce_p,
                                 auth=auth.proof(key, auth.PREFILL, nonce_d, nonce_p), nixl=nixl)
    return frames.pack_header(FrameType.HANDSHAKE, payload_len=len(p)) + p


def raw_connect(addr, layout, secret=None):
    """A socket that has done the handshake (D's challenge, P's answer, D's ack)."""
    s = socket.create_connection(addr, timeout=TIMEOUT_S)
    h, nonce_d = read_frame(s)
    assert h.frame_type == FrameType.CHALLENGE, h
    s.sendall(handshake_bytes(layout, nonce_d, secret))
    h, body = read_frame(s)
    assert h.frame_type == FrameType.HANDSHAKE_ACK, h
    assert control.decode_handshake(body, ack=True).error is None
    return s


def kv_frame(layout, rid, layer, blocks, *, crc=True, crc_delta=0, epoch=EPOCH, block_start=0):
    """KV frame for one layer of ``blocks`` [L, 2, n, bs, H, D]; with ``crc``, a CRC32C
    that is off by ``crc_delta`` (computed here by google_crc32c on bytes, not by the
    transport's zero-copy host_io.crc32c, so the two check each other)."""
    payload = blocks[layer : layer + 1].contiguous().view(torch.uint8).numpy().tobytes()
    tail = b""
    if crc:
        tail = ((google_crc32c.value(payload) + crc_delta) & 0xFFFFFFFF).to_bytes(4, "little")
    header = frames.pack_header(
        FrameType.KV, rid, flags=frames.FLAG_CRC32C if crc else 0, epoch=epoch,
        layer_start=layer, layer_end=layer + 1, block_start=block_start,
        num_blocks=blocks.shape[2], dtype_code=frames.dtype_code(layout.dtype),
        payload_len=len(payload) + len(tail),
    )
    return header + payload + tail


def done_frame(rid, first_token, num_layers, epoch=EPOCH):
    return frames.done_header(rid, epoch, first_token, num_layers)


def wait_closed(s):
    """Read ``s`` until the receiver closes it (EOF or reset); True if it did in time."""
    s.settimeout(TIMEOUT_S)
    try:
        while s.recv(1 << 16):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        return False
    return True
