"""D's KV port, the part every receiver shares: the listening socket, the pairing of
each connection, and a thread per paired connection running its frame loop
(``tcp_conn.py``). A receiver holds one ControlServer and is its ControlHandler: what a
connection's control frames (BEGIN, DONE, ABORT) and its loss do is the receiver's.
TcpKVReceiver (tcp.py) takes the KV bytes over these connections; NixlKVReceiver
(nixl_receiver.py) leases blocks to one-sided writers over them, and takes plain KV
frames too. KV frames go into the cache through the receiver's ReservationTable either way.

The server listens on ``host`` only (the worker's cluster address, WorkerConfig.host;
never a wildcard unless that is what it is given). Every connection starts with D's
CHALLENGE and must pair (layout, epoch, and the cluster secret when one is set; auth.py)
before any KV frame is read. Until a peer has sent its whole HANDSHAKE frame it costs no
thread: the one accept thread sends the challenges and gathers the handshakes of every
connection not yet paired without blocking, each within io_timeout_s in all (not per
read), at most MAX_PENDING_PER_HOST of them from one peer address and MAX_PENDING in all
(a new one evicts the oldest of its own address's, or, all being full, the oldest of the
address holding most: a flood without the secret evicts its own handshakes, never a real
peer's from another address); a complete handshake
gets its own thread, which checks it and serves the connection, at most MAX_CONNECTIONS
at once. So a flood of connections that never finish a handshake holds neither threads
nor, for long, sockets, and a peer that pairs (a round trip after connecting) is not
kept out. A refused peer is logged once per host (a misconfigured peer retries).

Anything malformed, a truncated frame, a lost connection: the connection is closed with
a warning, and the receiver told (ControlHandler.connection_lost); other connections are
unaffected.
"""

from __future__ import annotations

import itertools
import logging
import selectors
import socket
import threading
import time
from typing import Protocol

from . import auth, control, frames
from .base import KVAuthError, KVFrameError, KVLayout, KVLayoutMismatch, KVTransferError
from .frames import FrameHeader, FrameType
from .reservations import ReservationTable
from .tcp_conn import PairedConnection
from .tcp_sender import tune_socket

logger = logging.getLogger(__name__)

THREAD_PREFIX = "kvrecv"  # threads: kvrecv-accept-<port>, kvrecv-conn-<port>-<n>
MAX_PENDING = 256         # connections gathering their handshake (no thread each)
MAX_PENDING_PER_HOST = 32  # ... of them from one peer address (a real peer pairs in one
                           # round trip: it has one or two at a time)
MAX_CONNECTIONS = 512     # connection threads: paired peers, and handshakes being checked


class ControlHandler(Protocol):
    """What a receiver does with its paired connections' control frames. Called on the
    connection threads, several at once; a KVFrameError raised closes that connection."""

    def pair_extra(self, conn_id: int, hs: control.Handshake) -> dict | None:
        """The peer proved the secret and its layout matched: the ack's "nixl" field
        (None: this receiver takes KV frames only)."""

    def on_begin(self, conn: PairedConnection, h: FrameHeader) -> None:
        """A BEGIN frame: answer it with a BEGIN_ACK on ``conn.sock``."""

    def on_done(self, conn_id: int, h: FrameHeader) -> None:
        """A DONE frame."""

    def on_abort(self, conn_id: int, h: FrameHeader, reason: str) -> None:
        """An ABORT frame and the sender's reason."""

    def connection_lost(self, conn_id: int, why: str) -> None:
        """The connection ended (not called once the server is closing)."""


class _Pending:
    """A connection the accept thread gathers a HANDSHAKE frame from: its bytes so far,
    and how many it needs (the fixed header, then the request id, then the payload)."""

    __slots__ = ("sock", "peer", "conn_id", "nonce", "deadline", "buf", "need", "header")

    def __init__(self, sock: socket.socket, peer: tuple, conn_id: int, nonce: bytes,
                 deadline: float):
        self.sock, self.peer, self.conn_id, self.nonce = sock, peer, conn_id, nonce
        self.deadline, self.buf, self.need = deadline, bytearray(), frames.HEADER_SIZE
        self.header: FrameHeader | None = None

    def take(self, data: bytes, layout: KVLayout) -> bool:
        """Add received bytes; True once the HANDSHAKE frame is whole (KVFrameError if
        the bytes are not one)."""
        self.buf += data
        if len(self.buf) < self.need:
            return False
        if self.need == frames.HEADER_SIZE:
            self.need += frames.request_id_len(self.buf)
            if len(self.buf) < self.need:
                return False
        if self.header is None:
            self.header = frames.unpack_header(self.buf, layout)
            if self.header.frame_type != FrameType.HANDSHAKE:
                raise KVFrameError(f"expected HANDSHAKE, got {self.header.frame_type.name}")
            self.need += self.header.payload_len        # validated: <= MAX_HANDSHAKE_BYTES
        return len(self.buf) >= self.need


class ControlServer:
    """The listening side of D's KV connections; see the module docstring.

    table: the receiver's ReservationTable (its kv, layout and epoch are what peers pair
    with; KV frames land through it). handler: the receiver's ControlHandler. port: 0
    picks a free one. io_timeout_s bounds the whole handshake (from the connection's
    accept), and the wait for the rest of a frame once its first byte arrived (an idle
    connection between frames never times out). secret: the cluster's shared secret
    every sender must prove (auth.py); None: pair only with senders that have none
    (ValueError for an empty one).
    """

    def __init__(self, table: ReservationTable, handler: ControlHandler, host: str, *,
                 port: int = 0, io_timeout_s: float = 30.0, secret: str | None = None) -> None:
        self.table, self.handler = table, handler
        self.secret = auth.secret_bytes(secret)
        self.host, self.port, self.io_timeout_s = host, port, io_timeout_s
        self._lock = threading.Lock()  # guards the fields below
        self._listen: socket.socket | None = None
        self._wake_r, self._wake_w = None, None
        self._threads: list[threading.Thread] = []
        self._conns: dict[int, socket.socket] = {}
        self._conn_ids = itertools.count()
        self._refused_peers: set[str] = set()   # hosts whose refusal was logged
        self._started = False
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def start(self) -> tuple[str, int]:
        """Listen on (host, port) and start the accept thread; returns the address
        (idempotent). KVTransferError once closed; OSError if the address can't be bound."""
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
        logger.info("KV receiver listening on %s:%d (epoch %d)", self.host, self.port,
                    self.table.epoch)
        return self.host, self.port

    def close(self, join_timeout_s: float = 5.0) -> None:
        """Stop accepting, end every connection (each thread joined within
        join_timeout_s) and fail every request still expected. Idempotent."""
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
        self.table.fail_all("KV receiver closed")

    def drop_connection(self, conn_id: int) -> None:
        """End paired connection `conn_id` (its thread sees it closed and the handler
        is told, connection_lost); nothing if it is gone already."""
        with self._lock:
            sock = self._conns.get(conn_id)
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError as e:
                logger.debug("shutdown of KV connection %d: %s", conn_id, e)

    # ---- threads -------------------------------------------------------------------

    def _accept_loop(self) -> None:
        assert self._listen is not None and self._wake_r is not None
        pending: dict[socket.socket, _Pending] = {}    # oldest first
        # selectors (epoll), not select(): a busy server may hold fds above 1024.
        with selectors.DefaultSelector() as sel:
            sel.register(self._listen, selectors.EVENT_READ)
            sel.register(self._wake_r, selectors.EVENT_READ)
            try:
                while True:
                    soonest = min((p.deadline for p in pending.values()), default=None)
                    timeout = None if soonest is None else max(soonest - time.monotonic(), 0)
                    for key, _ in sel.select(timeout):
                        if key.fileobj is self._wake_r:
                            return
                        if key.fileobj is self._listen:
                            self._accept_one(sel, pending)
                        elif key.fileobj in pending:
                            self._gather(sel, pending, key.data)
                    now = time.monotonic()
                    for p in [p for p in pending.values() if p.deadline <= now]:
                        self._drop(sel, pending, p, "no handshake within "
                                                    f"{self.io_timeout_s:g} s")
            finally:
                for p in list(pending.values()):
                    self._drop(sel, pending, p, None)

    def _accept_one(self, sel: selectors.BaseSelector,
                    pending: dict[socket.socket, _Pending]) -> None:
        """Accept a connection and send it D's challenge; its handshake is gathered
        here (_gather) until whole."""
        assert self._listen is not None
        try:
            sock, peer = self._listen.accept()
        except OSError as e:
            logger.warning("KV receiver accept failed: %s", e)
            time.sleep(0.05)  # e.g. out of fds: back off instead of spinning on select
            return
        evict = _to_evict(pending, peer[0])
        if evict is not None:
            self._drop(sel, pending, evict, f"evicted: {len(pending)} connections were "
                                            f"pairing, from {evict.peer[0]} the most")
        nonce = auth.new_nonce()
        challenge = frames.pack_header(FrameType.CHALLENGE, payload_len=len(nonce)) + nonce
        try:
            sock.setblocking(False)
            sent = sock.send(challenge)      # ~90 bytes into an empty send buffer
        except OSError as e:
            logger.debug("KV connection from %s lost before its challenge: %s", peer, e)
            sock.close()
            return
        if sent != len(challenge):
            sock.close()
            return
        p = _Pending(sock, peer, next(self._conn_ids), nonce,
                     time.monotonic() + self.io_timeout_s)
        pending[sock] = p
        sel.register(sock, selectors.EVENT_READ, p)

    def _gather(self, sel: selectors.BaseSelector, pending: dict[socket.socket, _Pending],
                p: _Pending) -> None:
        """Read what `p`'s peer sent; once its HANDSHAKE frame is whole, give the
        connection a thread (_serve_conn) that checks it and serves on."""
        try:
            data = p.sock.recv(p.need - len(p.buf))
        except BlockingIOError:
            return
        except OSError as e:
            return self._drop(sel, pending, p, f"{type(e).__name__}: {e}")
        if not data:                           # hung up before saying anything: a probe
            return self._drop(sel, pending, p, None)
        try:
            whole = p.take(data, self.table.layout)
        except KVFrameError as e:
            return self._drop(sel, pending, p, str(e))
        if not whole:
            return
        sel.unregister(p.sock)
        del pending[p.sock]
        with self._lock:
            if self._closed or len(self._conns) >= MAX_CONNECTIONS:
                full = not self._closed
                p.sock.close()
            else:
                full = None
                self._conns[p.conn_id] = p.sock
        if full is not None:
            if full:
                self._refused(p.peer, f"{MAX_CONNECTIONS} KV connections are open")
            return
        payload = bytes(p.buf[len(p.buf) - p.header.payload_len:])
        t = threading.Thread(target=self._serve_conn,
                             args=(p.sock, p.peer, p.conn_id, (p.nonce, payload)),
                             name=f"{THREAD_PREFIX}-conn-{self.port}-{p.conn_id}", daemon=True)
        try:
            t.start()
        except RuntimeError as e:   # can't start new thread: this connection only
            logger.warning("KV connection from %s closed: no thread for it (%s)", p.peer, e)
            with self._lock:
                self._conns.pop(p.conn_id, None)
            p.sock.close()
            return
        with self._lock:
            self._threads = [x for x in self._threads if x.is_alive()] + [t]

    def _drop(self, sel: selectors.BaseSelector, pending: dict[socket.socket, _Pending],
              p: _Pending, why: str | None) -> None:
        """Close a connection that did not pair (`why`: logged once per peer; None: a
        probe or shutdown, not logged)."""
        sel.unregister(p.sock)
        del pending[p.sock]
        p.sock.close()
        if why is not None:
            self._refused(p.peer, why)

    def _refused(self, peer: tuple, why: str) -> None:
        """Log a connection refused or closed before pairing: a warning the first time
        for its host, then at debug (a misconfigured peer retries)."""
        if peer[0] in self._refused_peers:
            logger.debug("KV connection from %s refused: %s", peer, why)
            return
        self._refused_peers.add(peer[0])
        logger.warning("KV connection from %s refused: %s (further refusals of %s are "
                       "logged at debug)", peer, why, peer[0])

    def _serve_conn(self, sock: socket.socket, peer: tuple, conn_id: int,
                    opening: tuple[bytes, bytes]) -> None:
        """A connection's thread: check its handshake (`opening`: D's nonce, the
        HANDSHAKE payload the accept thread gathered), then serve its frames."""
        why = "peer closed the connection"
        try:
            sock.setblocking(True)
            tune_socket(sock)
            PairedConnection(self, sock, conn_id).serve(*opening)
        except (KVLayoutMismatch, KVAuthError) as e:
            why = str(e)
            self._refused(peer, why)
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
                self.handler.connection_lost(conn_id, why)


def _to_evict(pending: dict[socket.socket, _Pending], host: str) -> _Pending | None:
    """The pending handshake a new connection from `host` evicts (`pending` oldest
    first), or None: the oldest of `host`'s own once it has MAX_PENDING_PER_HOST, else,
    with MAX_PENDING in all, the oldest of the address holding most."""
    per_host: dict[str, list[_Pending]] = {}
    for p in pending.values():
        per_host.setdefault(p.peer[0], []).append(p)
    own = per_host.get(host, [])
    if len(own) >= MAX_PENDING_PER_HOST:
        return own[0]
    if len(pending) >= MAX_PENDING:
        return max(per_host.values(), key=len)[0]
    return None
