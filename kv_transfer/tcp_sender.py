"""TCP sender (prefill worker P side); the transport is described in ``tcp.py``.

One blocking socket per decode address, opened on first use, handshaken (D's
challenge, then layout + epoch + proofs of the cluster secret both ways; auth.py), then
reused under a per-connection lock. A KV frame's payload is
[n_layers, 2, n_blocks, heads, block_size, head_dim] (blocks in block-table order), sent
with ``sendmsg`` (writev, up to 64 buffers a call) from the header and the payload's
pieces, copying nothing on a host cache::

    host cache: each run of consecutive blocks, per layer and K/V, is one contiguous
        region of kv (one per block when only some KV heads go; host_io.HostCacheView)
        -> [header, region, region, ..., crc32c?] -> host_io.sendmsg_all
    over host_io.MAX_DIRECT_PIECES regions, or a CUDA cache:
        kv[layer_start:layer_end].index_select(2, src_idx) (its heads sliced)
        -> one contiguous tensor (CUDA: copied to a pinned host buffer) -> sendmsg_all

With checksum=True the CRC32C is computed over the pieces in place and sent after them.
"""

from __future__ import annotations

import logging
import socket
import threading
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from . import auth, control, frames, host_io
from .base import (
    KVAuthError,
    KVFrameError,
    KVLayout,
    KVLayoutMismatch,
    KVSender,
    KVTransferError,
)
from .frames import FrameType

logger = logging.getLogger(__name__)


KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 10, 5, 3


def tune_socket(sock: socket.socket) -> None:
    """A paired KV connection's options, both sides: TCP_NODELAY (frames are written
    header then payload; Nagle would hold the small header back) and TCP keepalive, so
    a peer whose host vanished (no FIN, no RST) is seen gone within ~25 s of silence
    (KEEPALIVE_IDLE_S + KEEPALIVE_PROBES x KEEPALIVE_INTERVAL_S) and the leases and
    reservations it held are released (a frozen peer's kernel still answers probes: a
    pull's lease also ends with its own expiry, NixlKVReceiver.forget)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                       ("TCP_KEEPCNT", KEEPALIVE_PROBES)):
        if hasattr(socket, opt):          # Linux; elsewhere the system's defaults
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)


@dataclass(eq=False)
class _SendConn:
    lock: threading.Lock = field(default_factory=threading.Lock)
    sock: socket.socket | None = None
    peer_epoch: int | None = None
    host_buf: torch.Tensor | None = None  # pinned uint8 staging, CUDA caches only
    peer: object = None  # what a one-sided transport learned at pairing (nixl.py)


class TcpKVSender(KVSender):
    """Blocking TCP sender; see the module docstring.

    checksum: append a CRC32C (Castagnoli, google-crc32c) to every KV payload, which D
        checks before a byte of it reaches the cache (a mismatch fails that request
        only). Costs a crc pass on each end and D's zero-copy receive (tcp.py gives
        the measured cost); on by default through WorkerConfig.kv_checksum.
    secret: the cluster's shared secret; D must prove it and P proves it to D (auth.py).
        None: pair only with a D that has none.
    epoch: P's own epoch, sent in the handshake for D's logs.
    connect_timeout_s / io_timeout_s: bound every connect and every send/recv.
    """

    def __init__(
        self,
        kv: torch.Tensor,
        layout: KVLayout,
        *,
        checksum: bool = False,
        secret: str | None = None,
        epoch: int = 0,
        connect_timeout_s: float = 5.0,
        io_timeout_s: float = 30.0,
    ) -> None:
        super().__init__(kv, layout)
        self.checksum = checksum
        self._secret = auth.secret_bytes(secret)
        self.epoch = epoch
        self.connect_timeout_s = connect_timeout_s
        self.io_timeout_s = io_timeout_s
        self._dtype_code = frames.dtype_code(layout.dtype)
        self._lock = threading.Lock()  # guards _conns
        self._conns: dict[tuple[str, int], _SendConn] = {}
        self._unpaired: set[tuple[str, int]] = set()   # peers whose pairing failure is logged
        self._closed = False
        self._host_view = host_io.HostCacheView(kv)

    def connect(self, addr: tuple[str, int]) -> int:
        epoch = []
        self._with_conn(addr, lambda conn: epoch.append(conn.peer_epoch))
        return epoch[0]

    def send_layers(
        self,
        addr: tuple[str, int],
        request_id: str,
        epoch: int,
        layer_start: int,
        layer_end: int,
        src_block_ids: Sequence[int],
        block_start: int = 0,
        heads: range | None = None,
    ) -> int:
        ids, nbytes = self._check_send(layer_start, layer_end, src_block_ids, block_start,
                                       heads)
        local = self._local(heads)
        # Zero-copy when the cache is in host memory: each run of consecutive blocks is
        # one contiguous region per layer and K/V, sent straight from the cache (writev).
        # Otherwise gather into one fresh contiguous tensor (index_select), which is
        # exactly the wire payload [n_layers, 2, n_blocks, heads, block_size, head_dim].
        regions = self._host_view.regions(layer_start, layer_end, host_io.block_runs(ids),
                                          host_io.MAX_DIRECT_PIECES, heads=local)
        packed = None
        if regions is None:
            src_idx = torch.tensor(ids, dtype=torch.long, device=self.kv.device)
            packed = self.kv[layer_start:layer_end].index_select(2, src_idx)
            if local is not None:
                packed = packed[:, :, :, local.start:local.stop].contiguous()
        header = frames.pack_header(
            FrameType.KV,
            request_id,
            flags=frames.FLAG_CRC32C if self.checksum else 0,
            epoch=epoch,
            layer_start=layer_start,
            layer_end=layer_end,
            block_start=block_start,
            num_blocks=len(ids),
            dtype_code=self._dtype_code,
            payload_len=nbytes + (frames.CRC_BYTES if self.checksum else 0),
            **self._head_fields(heads),
        )

        def send(conn: _SendConn) -> None:
            if regions is not None:
                pieces = regions
            elif packed.device.type == "cpu":
                pieces = [frames.tensor_bytes(packed)]
            else:
                conn.host_buf = frames.grow_buffer(conn.host_buf, nbytes, pinned=True)
                conn.host_buf[:nbytes].copy_(packed.reshape(-1).view(torch.uint8))
                pieces = [frames.tensor_bytes(conn.host_buf[:nbytes])]
            assert sum(len(p) for p in pieces) == nbytes, (sum(len(p) for p in pieces), nbytes)
            tail = []
            if self.checksum:  # extended piece by piece: no gather for the checksum
                crc = host_io.crc32c(pieces)
                tail = [crc.to_bytes(frames.CRC_BYTES, "little")]
            host_io.sendmsg_all(conn.sock, [header, *pieces, *tail])

        self._with_conn(addr, send)
        return nbytes

    def send_done(self, addr: tuple[str, int], request_id: str, epoch: int,
                  first_token: int | None, num_layers_sent: int,
                  heads: range | None = None) -> None:
        fields = self._head_fields(heads)
        named = range(fields["head_start"], fields["head_start"] + fields["num_heads"])
        if first_token is None and not named:   # a tokenless DONE names its heads (a
            named = heads or self.layout.heads   # rank of a one-KV-head model: all of them)

        def done(conn: _SendConn) -> None:
            writes = self._settle(conn, request_id, epoch)
            conn.sock.sendall(frames.done_header(request_id, epoch, first_token,
                                                 num_layers_sent, writes, named or None))

        self._with_conn(addr, done)

    def send_abort(self, addr: tuple[str, int], request_id: str, epoch: int, reason: str) -> None:
        header, payload = frames.abort_frame(request_id, epoch, reason)

        def abort(conn: _SendConn) -> None:
            self._settle(conn, request_id, epoch)   # D frees the blocks at ABORT
            conn.sock.sendall(header + payload)

        self._with_conn(addr, abort)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns = list(self._conns.values())
            self._conns.clear()
        for conn in conns:
            with conn.lock:
                self._drop(conn)

    # ---- internals -----------------------------------------------------------------

    def _local(self, heads: range | None) -> range | None:
        """This cache's own indices of the model's KV ``heads``; None for all of them."""
        if heads is None or heads == self.layout.heads:
            return None
        first = self.layout.kv_head_start
        return range(heads.start - first, heads.stop - first)

    def _head_fields(self, heads: range | None) -> dict[str, int]:
        """A frame's head_start / num_heads for ``heads`` (None: this cache's): zero,
        meaning all the receiver's heads, only when they are all the model's."""
        heads = self.layout.heads if heads is None else heads
        if heads == range(self.layout.total_kv_heads):
            return {"head_start": 0, "num_heads": 0}
        return {"head_start": heads.start, "num_heads": len(heads)}

    def _with_conn(self, addr: tuple[str, int], fn: Callable[[_SendConn], None]) -> None:
        addr = (addr[0], int(addr[1]))
        with self._lock:
            if self._closed:
                raise KVTransferError("sender is closed")
            conn = self._conns.setdefault(addr, _SendConn())
        with conn.lock:
            paired = conn.sock is not None
            try:
                if not paired:
                    self._connect(conn, addr)
                    paired = True
                    self._unpaired.discard(addr)
                fn(conn)
            except (KVLayoutMismatch, KVAuthError) as e:
                self._drop(conn)
                self._pairing_failed(addr, e)
                raise
            except (OSError, KVFrameError) as e:
                self._drop(conn)
                err = KVTransferError(f"KV transfer to {addr[0]}:{addr[1]} failed: {e}")
                if not paired:
                    self._pairing_failed(addr, err)
                raise err from e

    def _pairing_failed(self, addr: tuple[str, int], e: KVTransferError) -> None:
        """Log a failed pairing with `addr`: a warning the first time since it last
        paired, debug after (a sender retries on every request); marks `e.pairing`, so
        the caller need not log it again."""
        e.pairing = True
        if addr in self._unpaired:
            logger.debug("pairing with decode worker %s:%d failed again: %s", *addr, e)
            return
        self._unpaired.add(addr)
        logger.warning("pairing with decode worker %s:%d failed: %s (logged once until "
                       "a pairing with it succeeds)", *addr, e)

    def _connect(self, conn: _SendConn, addr: tuple[str, int]) -> None:
        sock = socket.create_connection(addr, timeout=self.connect_timeout_s)
        conn.sock = sock  # set first so _drop closes it if the handshake fails
        tune_socket(sock)
        sock.settimeout(self.io_timeout_s)
        nonce_d = self._read_frame(sock, FrameType.CHALLENGE)[1]
        nonce_p = auth.new_nonce()
        payload = control.encode_handshake(
            self.layout, self.epoch, ack=False, nonce=nonce_p,
            auth=auth.proof(self._secret, auth.PREFILL, nonce_d, nonce_p),
            nixl=self._handshake_extra())
        sock.sendall(
            frames.pack_header(FrameType.HANDSHAKE, epoch=self.epoch, payload_len=len(payload))
            + payload
        )
        ack = control.decode_handshake(
            self._read_frame(sock, FrameType.HANDSHAKE_ACK)[1], ack=True)
        auth.check_ack(self._secret, addr, nonce_d, nonce_p, ack.error, ack.auth)
        if ack.error is not None:
            raise KVLayoutMismatch(f"decode worker at {addr[0]}:{addr[1]} refused: {ack.error}")
        msg = self.layout.mismatch(ack.layout)
        if msg is not None:
            raise KVLayoutMismatch(f"decode worker at {addr[0]}:{addr[1]}: {msg}")
        self._paired(conn, addr, ack)
        conn.peer_epoch = ack.epoch
        host_io.set_kernel_timeouts(sock, self.io_timeout_s)
        logger.debug("connected to decode worker %s:%d epoch %d", addr[0], addr[1], ack.epoch)

    # ---- hooks of a transport that pairs over this connection (nixl.py) -------------

    def _handshake_extra(self) -> dict | None:
        """The handshake's "nixl" field (None: this sender sends KV frames)."""
        return None

    def _paired(self, conn: _SendConn, addr: tuple[str, int], ack: control.Handshake) -> None:
        """Called once D's ack proved the secret and its layout matched."""

    def _settle(self, conn: _SendConn, request_id: str, epoch: int) -> int:
        """Before DONE / ABORT (conn.lock held): wait for the request's one-sided
        writes; how many notifications DONE tells D to expect (0: KV frames only)."""
        return 0

    @staticmethod
    def _read_frame(sock: socket.socket, want: FrameType) -> tuple[frames.FrameHeader, bytes]:
        """The next frame, which must be a ``want``, and its payload (bounded by frames
        validation: a control frame's)."""
        h = frames.read_header(sock)
        if h.frame_type != want:
            raise KVFrameError(f"expected {want.name}, got {h.frame_type.name}")
        body = bytearray(h.payload_len)
        frames.recv_exact(sock, memoryview(body))
        return h, bytes(body)

    def _drop(self, conn: _SendConn) -> None:
        if conn.sock is not None:
            try:
                conn.sock.close()
            except OSError as e:  # already broken; nothing left to release
                logger.debug("closing KV sender socket: %s", e)
        conn.sock = None
        conn.peer_epoch = None
        conn.peer = None

