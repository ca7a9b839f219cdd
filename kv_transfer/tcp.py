"""TCP transport: the fallback and the single-box test transport.

Same frames (``frames.py``), handshake (``auth.py``: D's challenge, proofs of the
cluster secret both ways) and receiver state machine (``reservations.py``) as every
transport; blocking sockets with TCP_NODELAY, zero-copy sends from tensor memory
(``memoryview``); on receive, ``recv_into`` the reserved blocks themselves, or, for a
CRC32C-flagged frame (the default, WorkerConfig.kv_checksum), a staging tensor that is
checked before a byte reaches the cache::

    cache   kv: [num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim]  (0 = K, 1 = V)
    payload     [n_layers, 2, n_blocks, n_heads, block_size, head_dim], blocks in
                block-table order; n_heads: all the cache's, or a tensor-parallel
                rank's range of them (the header's head_start, num_heads)

    P: host cache: per layer and K/V, each run of consecutive src blocks is one
         region of kv (one per block when only some heads go), sent in place;
       over MAX_DIRECT_PIECES regions, or a CUDA cache: kv[layers, :, src_idx]
         gathered into one tensor (CUDA: then copied to pinned host memory)
       sendmsg(header + request_id + payload pieces (+ crc32c)) ---------------+
                                                                               |
    D: no crc: recv_into the reserved blocks themselves (host cache) <---------+
       crc:    recv_into staging (uint8) -> check crc
                 -> kv[layers, :, dst_idx[block_start : block_start + n_blocks]] = staged
                    (one memcpy per run of blocks on a host cache; a mismatch fails
                     only that request, the connection goes on)
       CUDA cache: through a pinned host staging buffer, then index_copy_

The checksum's cost (docs/performance.md "KV checksum"): ~0.035 ms per 768 KiB frame on
each end; over loopback 2.3 GB/s without, 1.5 GB/s with. Turn it off (kv_checksum=False)
on links that already carry end-to-end integrity.

The sender is ``tcp_sender.py``; this module is the receiver (D side): one accept thread, one thread per connection, listening on ``host`` only (the worker's
cluster address, WorkerConfig.host; never a wildcard unless that is what it is given).
Every connection starts with D's CHALLENGE and must pair (layout, epoch, and the
cluster secret when one is set; auth.py) before any KV frame is read. Each frame header
is validated against the layout, and a KV frame's payload_len against its block range
and the reservation, so a forged length never makes D allocate more than the
reservation's bytes (an unknown request's payload is read and dropped in 1 MiB chunks).
Either way the bytes go into the cache through ReservationTable.write, the one write
path (a CUDA cache: through a pinned host staging buffer).

What fails what:

- a CRC32C mismatch fails that request only (its bytes never reach the cache); the
  connection stays in sync, other requests on it go on;
- a stale epoch, an unknown or forgotten request id: the frame's payload is read and
  dropped (a stale epoch also fails that request);
- anything malformed, a truncated frame, a lost connection: the connection is closed
  with a warning and the requests that received frames over it fail; other
  connections are unaffected.
"""

from __future__ import annotations

import itertools
import logging
import selectors
import socket
import threading
import time
from typing import Callable

import torch

from . import auth, control, frames, host_io
from .base import (
    KVAuthError,
    KVFrameError,
    KVLayout,
    KVLayoutMismatch,
    KVReceiver,
    KVTransferError,
)
from .frames import FrameHeader, FrameType
from .tcp_sender import TcpKVSender, set_nodelay

logger = logging.getLogger(__name__)

THREAD_PREFIX = "kvrecv"  # threads: kvrecv-accept-<port>, kvrecv-conn-<port>-<n>
DISCARD_CHUNK_BYTES = 1 << 20


class TcpKVReceiver(KVReceiver):
    """Threaded TCP receiver; see the module docstring.

    port: 0 picks a free one. io_timeout_s bounds the handshake, and the wait for the
    rest of a frame once its first byte arrived (an idle connection between frames
    never times out). secret: the cluster's shared secret every sender must prove
    (auth.py); None: pair only with senders that have none.
    """

    def __init__(self, kv: torch.Tensor, layout: KVLayout, epoch: int,
                 host: str = "127.0.0.1", *, notify: Callable[[], None] | None = None,
                 port: int = 0, io_timeout_s: float = 30.0, secret: str | None = None) -> None:
        super().__init__(kv, layout, epoch, host, notify=notify)
        self._secret = auth.secret_bytes(secret)
        self.port = port
        self.io_timeout_s = io_timeout_s
        self._lock = threading.Lock()  # guards the fields below
        self._listen: socket.socket | None = None
        self._wake_r, self._wake_w = None, None
        self._threads: list[threading.Thread] = []
        self._conns: dict[int, socket.socket] = {}
        self._conn_ids = itertools.count()
        self._started = False
        self._closed = False

    def start(self) -> tuple[str, int]:
        with self._lock:
            if self._closed:
                raise KVTransferError("receiver is closed")
            if self._started:
                return self.host, self.port
            lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            lsock.bind((self.host, self.port))
            lsock.listen(64)
            self.port = lsock.getsockname()[1]
            self._listen = lsock
            # select() on this pair lets close() wake the accept thread at once.
            self._wake_r, self._wake_w = socket.socketpair()
            t = threading.Thread(
                target=self._accept_loop, name=f"{THREAD_PREFIX}-accept-{self.port}", daemon=True
            )
            self._threads.append(t)
            self._started = True
        t.start()
        logger.info("KV receiver listening on %s:%d (epoch %d)", self.host, self.port, self.epoch)
        return self.host, self.port

    def close(self, join_timeout_s: float = 5.0) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            threads = list(self._threads)
            conns = list(self._conns.values())
        if self._wake_w is not None:
            self._wake_w.send(b"x")
        for sock in conns:
            try:  # wakes the connection thread blocked in recv_into
                sock.shutdown(socket.SHUT_RDWR)
            except OSError as e:
                logger.debug("shutdown of KV connection: %s", e)
        for t in threads:
            if t is not threading.current_thread():
                t.join(join_timeout_s)
                if t.is_alive():
                    logger.warning("KV receiver thread %s did not stop in %.1fs", t.name, join_timeout_s)
        for s in (self._listen, self._wake_r, self._wake_w):
            if s is not None:
                s.close()
        self._table.fail_all("KV receiver closed")

    # ---- threads -------------------------------------------------------------------

    def _accept_loop(self) -> None:
        assert self._listen is not None and self._wake_r is not None
        # selectors (epoll), not select(): a busy server may hold fds above 1024.
        with selectors.DefaultSelector() as sel:
            sel.register(self._listen, selectors.EVENT_READ)
            sel.register(self._wake_r, selectors.EVENT_READ)
            while True:
                ready = {key.fileobj for key, _ in sel.select()}
                if self._wake_r in ready:
                    return
                self._accept_one()

    def _accept_one(self) -> None:
        assert self._listen is not None
        try:
            sock, peer = self._listen.accept()
        except OSError as e:
            logger.warning("KV receiver accept failed: %s", e)
            time.sleep(0.05)  # e.g. out of fds: back off instead of spinning on select
            return
        conn_id = next(self._conn_ids)
        t = threading.Thread(
            target=self._serve_conn,
            args=(sock, peer, conn_id),
            name=f"{THREAD_PREFIX}-conn-{self.port}-{conn_id}",
            daemon=True,
        )
        with self._lock:
            if self._closed:
                sock.close()
                return
            self._conns[conn_id] = sock
            self._threads = [x for x in self._threads if x.is_alive()] + [t]
        t.start()

    def _serve_conn(self, sock: socket.socket, peer: tuple, conn_id: int) -> None:
        why = "peer closed the connection"
        try:
            set_nodelay(sock)
            _Connection(self, sock, conn_id).serve()
        except (KVLayoutMismatch, KVAuthError) as e:
            why = str(e)
            logger.warning("KV connection from %s refused: %s", peer, e)
        except (KVFrameError, OSError) as e:
            why = f"{type(e).__name__}: {e}"
            if not self._closed:
                logger.warning("closing KV connection from %s: %s", peer, why)
        except Exception as e:  # a bug here must cost one connection, not the receiver
            why = f"internal error: {type(e).__name__}: {e}"
            logger.exception("closing KV connection from %s after internal error", peer)
        finally:
            with self._lock:
                self._conns.pop(conn_id, None)
            sock.close()
            if not self._closed:
                self._connection_lost(conn_id, why)

    # ---- hooks of a transport that pairs over this control connection (nixl.py) ----

    def _pair_extra(self, conn_id: int, hs: control.Handshake) -> dict | None:
        """Called once the peer proved the secret and its layout matched: the ack's
        "nixl" field (None: this receiver takes KV frames only)."""
        return None

    def _on_begin(self, conn: "_Connection", h: FrameHeader) -> None:
        raise KVFrameError("BEGIN frame, but this receiver takes KV frames only (tcp)")

    def _on_done(self, conn_id: int, h: FrameHeader) -> None:
        self._table.on_done(h)

    def _on_abort(self, conn_id: int, h: FrameHeader, reason: str) -> None:
        self._table.on_abort(h, reason)

    def _connection_lost(self, conn_id: int, why: str) -> None:
        self._table.connection_lost(conn_id, why)


class _Connection:
    """Frame loop of one accepted connection (runs on its own thread)."""

    def __init__(self, rx: TcpKVReceiver, sock: socket.socket, conn_id: int) -> None:
        self.rx = rx
        self.sock = sock
        self.conn_id = conn_id
        self.table = rx._table
        self.layout = rx.layout
        self.max_blocks = rx.kv.shape[2]
        self.staging: torch.Tensor | None = None  # uint8, reused and grown per frame

    def serve(self) -> None:
        if not self._handshake():
            return
        while True:
            h = self._next_header()
            if h is None:
                return
            if h.frame_type == FrameType.KV:
                self._on_kv(h)
            elif h.frame_type == FrameType.DONE:
                self.rx._on_done(self.conn_id, h)
            elif h.frame_type == FrameType.ABORT:
                reason = self._read_small(h.payload_len).decode("utf-8", "replace")
                self.rx._on_abort(self.conn_id, h, reason)
            elif h.frame_type == FrameType.BEGIN:
                self.rx._on_begin(self, h)
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
            frame_timeout_s=self.rx.io_timeout_s,
        )

    def _handshake(self) -> bool:
        """Pair with the peer (challenge, handshake, ack; auth.py); False if it hung up
        before saying anything (a probe)."""
        self.sock.settimeout(self.rx.io_timeout_s)  # a silent peer must not pin a thread
        nonce_d = auth.new_nonce()
        self.sock.sendall(frames.pack_header(FrameType.CHALLENGE, payload_len=len(nonce_d))
                          + nonce_d)
        h = frames.read_header(self.sock, self.layout, self.max_blocks, eof_ok=True)
        if h is None:
            return False
        if h.frame_type != FrameType.HANDSHAKE:
            raise KVFrameError(f"expected HANDSHAKE, got {h.frame_type.name}")
        hs = control.decode_handshake(self._read_small(h.payload_len), ack=False)
        key = self.rx._secret
        if not auth.verify(key, auth.PREFILL, nonce_d, hs.nonce, hs.auth):
            self._send_ack(control.encode_auth_refusal(), epoch=0)  # nothing about D
            raise KVAuthError(
                f"{frames.AUTH_REFUSED}: the peer "
                + ("proved no cluster secret" if hs.auth is None else
                   "sent a proof, this receiver has no secret" if key is None else
                   "sent a wrong proof"))
        error = hs.layout.mismatch(self.layout)
        extra = None if error is not None else self.rx._pair_extra(self.conn_id, hs)
        self._send_ack(control.encode_handshake(
            self.layout, self.rx.epoch, error, ack=True,
            auth=auth.proof(key, auth.DECODE, nonce_d, hs.nonce), nixl=extra),
            epoch=self.rx.epoch)
        if error is not None:
            raise KVLayoutMismatch(error)
        host_io.set_kernel_timeouts(self.sock, self.rx.io_timeout_s)
        logger.debug("KV connection %d paired (prefill epoch %d%s)", self.conn_id, hs.epoch,
                     ", nixl" if extra is not None else "")
        return True

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
        self.staging = frames.grow_buffer(self.staging, nbytes, pinned=self.rx.kv.is_cuda)
        body = memoryview(self.staging.numpy())[:nbytes]
        frames.recv_exact(self.sock, body)
        return body

    def _discard(self, n: int) -> None:
        scratch = memoryview(bytearray(min(n, DISCARD_CHUNK_BYTES)))
        while n > 0:
            k = min(n, len(scratch))
            frames.recv_exact(self.sock, scratch[:k])
            n -= k


__all__ = ["THREAD_PREFIX", "TcpKVReceiver", "TcpKVSender"]
