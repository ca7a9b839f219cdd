"""The frame loop of one paired KV connection on the receiver (D side): the peer's
handshake checked, then its KV, DONE, ABORT and BEGIN frames; KV bytes into the reserved
blocks through ReservationTable.write (straight, or staged and CRC32C-checked first),
the control frames to the receiver's ControlHandler. control_server.py's ControlServer
accepts the connections and runs each on its own thread."""

from __future__ import annotations

import logging
import socket
from typing import TYPE_CHECKING

import torch

from . import auth, control, frames, host_io
from .base import KVAuthError, KVFrameError, KVLayoutMismatch
from .frames import FrameHeader, FrameType

if TYPE_CHECKING:
    from .control_server import ControlServer

logger = logging.getLogger(__name__)

DISCARD_CHUNK_BYTES = 1 << 20


class PairedConnection:
    """Frame loop of one accepted connection (runs on its own thread): ``server``'s
    table takes its KV frames, ``server``'s handler its control frames."""

    def __init__(self, server: "ControlServer", sock: socket.socket, conn_id: int) -> None:
        self.server = server
        self.sock = sock
        self.conn_id = conn_id
        self.table = server.table
        self.handler = server.handler
        self.layout = server.table.layout
        self.max_blocks = server.table.kv.shape[2]
        self.staging: torch.Tensor | None = None  # uint8, reused and grown per frame

    def serve(self, nonce_d: bytes, handshake: bytes) -> None:
        """Check the peer's handshake (D sent `nonce_d` in its challenge), then serve
        its frames until it hangs up."""
        self._handshake(nonce_d, handshake)
        while True:
            h = self._next_header()
            if h is None:
                return
            if h.frame_type == FrameType.KV:
                self._on_kv(h)
            elif h.frame_type == FrameType.DONE:
                self.handler.on_done(self.conn_id, h)
            elif h.frame_type == FrameType.ABORT:
                reason = self._read_small(h.payload_len).decode("utf-8", "replace")
                self.handler.on_abort(self.conn_id, h, reason)
            elif h.frame_type == FrameType.BEGIN:
                self.handler.on_begin(self, h)
            else:
                raise KVFrameError(f"unexpected {h.frame_type.name} frame after handshake")

    def _next_header(self) -> FrameHeader | None:
        # Wait without a deadline for the first byte (idle connections are normal);
        # the kernel timeout bounds the rest of the frame, so a stalled peer cannot pin
        # this thread.
        return frames.read_header(
            self.sock,
            self.layout,
            self.max_blocks,
            eof_ok=True,
            frame_timeout_s=self.server.io_timeout_s,
        )

    def _handshake(self, nonce_d: bytes, payload: bytes) -> None:
        """Pair with the peer from its HANDSHAKE `payload` (auth.py): the ack, or a
        refusal raised (KVAuthError, KVLayoutMismatch)."""
        self.sock.settimeout(self.server.io_timeout_s)  # a silent peer must not pin a thread
        hs = control.decode_handshake(payload, ack=False)
        key, epoch = self.server.secret, self.table.epoch
        if not auth.verify(key, auth.PREFILL, nonce_d, hs.nonce, hs.auth):
            self._send_ack(control.encode_auth_refusal(), epoch=0)  # nothing about D
            raise KVAuthError(
                f"{frames.AUTH_REFUSED}: the peer "
                + ("proved no cluster secret" if hs.auth is None else
                   "sent a proof, this receiver has no secret" if key is None else
                   "sent a wrong proof"))
        error = hs.layout.mismatch(self.layout)
        extra = None if error is not None else self.handler.pair_extra(self.conn_id, hs)
        self._send_ack(control.encode_handshake(
            self.layout, epoch, error, ack=True,
            auth=auth.proof(key, auth.DECODE, nonce_d, hs.nonce), nixl=extra),
            epoch=epoch)
        if error is not None:
            raise KVLayoutMismatch(error)
        host_io.set_kernel_timeouts(self.sock, self.server.io_timeout_s)
        logger.debug("KV connection %d paired (prefill epoch %d%s)", self.conn_id, hs.epoch,
                     ", nixl" if extra is not None else "")

    def _send_ack(self, payload: bytes, epoch: int) -> None:
        self.sock.sendall(
            frames.pack_header(FrameType.HANDSHAKE_ACK, epoch=epoch, payload_len=len(payload))
            + payload
        )

    def _read_small(self, n: int) -> bytes:
        buf = bytearray(n)  # n is bounded by frame validation (handshake / abort limits)
        frames.recv_exact(self.sock, memoryview(buf))
        return bytes(buf)

    def _on_kv(self, h: FrameHeader) -> None:
        res = self.table.admit_kv(h, self.conn_id)
        if res is None:
            self._discard(h.payload_len)
            return
        if not h.has_crc:   # zero-copy: recv_into the reserved blocks themselves
            if not self.table.write(res, h, self._recv_into):
                self._discard(h.payload_len)
            return
        # Checksummed: staged and checked first, so corrupt bytes never reach the cache.
        body = self._recv_staged(h.payload_len - frames.CRC_BYTES)   # validated: frames.py
        crc = bytearray(frames.CRC_BYTES)
        frames.recv_exact(self.sock, memoryview(crc))
        want, got = int.from_bytes(crc, "little"), host_io.crc32c([body])
        if want != got:
            self.table.fail(res, f"checksum mismatch on layers [{h.layer_start}, "
                                 f"{h.layer_end}) blocks [{h.block_start}, "
                                 f"{h.block_start + h.num_blocks}): crc32c in frame "
                                 f"{want:#010x}, payload has {got:#010x}")
            return
        self.table.write(res, h, payload=self.staging[:len(body)])

    def _recv_into(self, regions: list[memoryview]) -> None:
        """The payload straight into ``regions``; many small ones (a fragmented block
        table) through one staged read and a memcpy each (syscalls cost more)."""
        if len(regions) <= host_io.MAX_DIRECT_PIECES:
            for r in regions:
                frames.recv_exact(self.sock, r)
        else:
            host_io.copy_into(regions, self._recv_staged(sum(len(r) for r in regions)))

    def _recv_staged(self, nbytes: int) -> memoryview:
        """The next ``nbytes`` of payload (bounded by the reservation's bytes) into the
        connection's reused staging buffer."""
        self.staging = frames.grow_buffer(self.staging, nbytes, pinned=self.table.kv.is_cuda)
        body = memoryview(self.staging.numpy())[:nbytes]
        frames.recv_exact(self.sock, body)
        return body

    def _discard(self, n: int) -> None:
        scratch = memoryview(bytearray(min(n, DISCARD_CHUNK_BYTES)))
        while n > 0:
            k = min(n, len(scratch))
            frames.recv_exact(self.sock, scratch[:k])
            n -= k

