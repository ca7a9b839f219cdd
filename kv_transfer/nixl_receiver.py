"""NIXL receiver (decode worker D side); the transport is described in ``nixl.py``.

D registers its whole cache with its agent once; its ControlServer
(control_server.py, the TCP receiver's too) pairs peers and reads BEGIN / DONE / ABORT
(and plain TCP KV frames, from a tcp sender), handing them to this receiver, its
ControlHandler; one poll thread takes the notifications of P's WRITEs and marks the
(layer, block) pairs they name as arrived in the ReservationTable::

    BEGIN(rid)   -> lease D's blocks to this connection, answer with their ids
    notification -> ReservationTable.write(res, h) (a KV frame whose bytes landed)
    DONE(rid, n) -> end the lease; finish once n notifications are in (DONE_GRACE_S)
    ABORT / connection lost -> end the lease (lost: LOST_WRITER_GRACE_S later); fail

A BEGIN names the KV heads its sender writes. Tensor-parallel prefill ranks each write
their own heads of one request (kv_transfer/tp_plan.py): every one holds a lease of its
own, counted apart (the blocks are released once the last ends), and its DONE waits for
its own notifications; a BEGIN for heads another connection is writing is refused.
"""

from __future__ import annotations

import base64
import logging
import threading
import time
from typing import Any, Callable

import torch

from . import control, frames
from .base import KVFrameError, KVLayout, KVReceiver
from .control_server import THREAD_PREFIX, ControlServer
from .frames import FrameHeader, FrameType
from .nixl import (BUSY_POLL_S, BUSY_WINDOW_S, DONE_GRACE_S, IDLE_POLL_S, LOST_WRITER_GRACE_S,
                   MAX_AGENT_NAME_BYTES, MAX_LANES, make_agent, memory_of)
from .reservations import Reservation
from .tcp_conn import PairedConnection

logger = logging.getLogger(__name__)


class NixlKVReceiver(KVReceiver):
    """D side: registers the whole cache with NIXL at construction; pairs and takes
    BEGIN / DONE / ABORT over the TCP connections of its ControlServer, whose
    ControlHandler it is (a peer may also send plain TCP KV frames); one thread polls
    NIXL notifications and marks what landed.

    host: the worker's address (the ControlServer binds it; UCX_NET_DEVICES its
    interface). ``kw``: the ControlServer's port, io_timeout_s and secret (see
    control_server.ControlServer). start() raises KVTransferError once closed,
    OSError if host:port can't be bound.
    """

    def __init__(self, kv: torch.Tensor, layout: KVLayout, epoch: int,
                 host: str = "127.0.0.1", *, notify: Callable[[], None] | None = None,
                 **kw: Any) -> None:
        super().__init__(kv, layout, epoch, host, notify=notify)
        self._control = ControlServer(self._table, self, host, **kw)
        self._agent = make_agent("decode", host)
        self._mem, self._device_id = memory_of(kv)
        self._registered = self._agent.register_memory([kv])
        self._metadata = base64.b64encode(self._agent.get_agent_metadata()).decode("ascii")
        self._nlock = threading.Lock()     # guards the four fields below
        self._agents: dict[str, int] = {}  # P's agent name -> its control connection id
        self._writers: dict[int, dict[str, Reservation]] = {}  # conn id -> rid -> leased
        self._leased_heads: dict[tuple[int, str], range] = {}  # (conn id, rid) -> its heads
        # (rid, conn id) -> (DONE, deadline): waiting for that writer's notifications
        self._pending_done: dict[tuple[str, int], tuple[FrameHeader, float]] = {}
        self._lost: list[tuple[float, Reservation]] = []  # (release time, lease to end)
        self._expiring: list[tuple[float, str]] = []  # (when, rid): forget's lease_timeout_s
        self.num_writes = 0   # notifications of one-sided writes taken (poll thread)
        self._poller = threading.Thread(target=self._poll_loop, daemon=True)

    @property
    def port(self) -> int:
        """The port listened on (the one start() bound, once started)."""
        return self._control.port

    def start(self) -> tuple[str, int]:
        addr = self._control.start()
        if not self._poller.is_alive() and not self._control.closed:
            self._poller.name = f"{THREAD_PREFIX}-poll-{self.port}"
            self._poller.start()
        return addr

    def close(self, join_timeout_s: float = 5.0) -> None:
        self._control.close(join_timeout_s)
        if self._poller.is_alive():
            self._poller.join(join_timeout_s)
        with self._nlock:
            lost, self._lost = self._lost, []
            for leases in self._writers.values():
                lost += [(0.0, res) for res in leases.values()]
            self._writers.clear()
        for _, res in lost:
            self._table.end_writer(res)
        if self._registered is not None:
            self._agent.deregister_memory(self._registered)
            self._registered = None

    # ---- ControlHandler: the control frames (connection threads) -------------------

    def pair_extra(self, conn_id: int, hs: control.Handshake) -> dict | None:
        if hs.nixl is None:
            return None   # a tcp sender: KV frames over the connection, as tcp.py
        names = hs.nixl.get("agents")
        if not isinstance(names, list) or not 0 < len(names) <= MAX_LANES or not all(
                isinstance(n, str) and 0 < len(n.encode()) <= MAX_AGENT_NAME_BYTES
                for n in names):
            raise KVFrameError(f"malformed nixl agent names in handshake: {str(names)[:80]}")
        with self._nlock:
            self._agents.update((name, conn_id) for name in names)
            self._writers.setdefault(conn_id, {})
        return {"metadata": self._metadata, "kv_ptr": self.kv.data_ptr(),
                "num_blocks": self.kv.shape[2], "mem_type": self._mem,
                "device_id": self._device_id}

    def on_begin(self, conn: PairedConnection, h: FrameHeader) -> None:
        rid, error = h.request_id, None
        heads = h.heads(self.layout)
        res = self._table.lookup(rid, h.epoch, "BEGIN")
        with self._nlock:   # check and take in one step: one writer per head
            leases = self._writers.get(conn.conn_id)
            taken = any(c != conn.conn_id and r == rid and _overlap(hs, heads)
                        for (c, r), hs in self._leased_heads.items())
            again = leases is not None and rid in leases
            if leases is not None and res is not None and not taken and not again:
                leases[rid] = res
                self._leased_heads[(conn.conn_id, rid)] = heads
        if leases is None:
            error = "this connection did not pair for NIXL writes"
        elif res is None:
            error = ("not expected: never reserved, forgotten, or its epoch is stale "
                     f"(receiver epoch {self.epoch})")
        elif taken:
            error = "another prefill worker is writing it"
        elif again:
            error = "BEGIN twice on one connection"
        elif not self._table.begin_writer(res):
            with self._nlock:
                leases.pop(rid, None)
                self._leased_heads.pop((conn.conn_id, rid), None)
            error = "already finished"
        else:
            res.conn_ids.add(conn.conn_id)
            res.writer_conns.add(conn.conn_id)
        ack = control.begin_ack_frame(rid, h.epoch, None if error else res.block_ids, error)
        conn.sock.sendall(ack)

    def on_done(self, conn_id: int, h: FrameHeader) -> None:
        self._end_lease(conn_id, h.request_id)
        res = self._table.lookup(h.request_id, h.epoch, "DONE")
        if res is None or res.writes_by_conn.get(conn_id, 0) >= h.num_blocks:
            self._table.on_done(h)
            return
        with self._nlock:   # the poll thread finishes it once its notifications are in
            self._pending_done[(h.request_id, conn_id)] = (h, time.monotonic() + DONE_GRACE_S)

    def on_abort(self, conn_id: int, h: FrameHeader, reason: str) -> None:
        self._end_lease(conn_id, h.request_id)
        with self._nlock:
            self._pending_done.pop((h.request_id, conn_id), None)
        self._table.on_abort(h, reason)

    def connection_lost(self, conn_id: int, why: str) -> None:
        release_at = time.monotonic() + LOST_WRITER_GRACE_S
        with self._nlock:
            leases = self._writers.pop(conn_id, {})
            for rid in leases:
                self._leased_heads.pop((conn_id, rid), None)
            self._agents = {a: c for a, c in self._agents.items() if c != conn_id}
            self._lost += [(release_at, res) for res in leases.values()]
        self._table.connection_lost(conn_id, why)

    def forget(self, request_id: str, lease_timeout_s: float | None = None) -> None:
        super().forget(request_id)
        if lease_timeout_s is not None:
            with self._nlock:
                if any(request_id in leases for leases in self._writers.values()):
                    self._expiring.append((time.monotonic() + lease_timeout_s, request_id))

    def _end_lease(self, conn_id: int, request_id: str) -> None:
        with self._nlock:
            res = self._writers.get(conn_id, {}).pop(request_id, None)
            self._leased_heads.pop((conn_id, request_id), None)
        if res is not None:
            self._table.end_writer(res)

    # ---- poll thread -------------------------------------------------------------

    def _poll_loop(self) -> None:
        last_busy = 0.0
        while not self._control.closed:
            try:
                busy = self._poll_once()
            except Exception:  # a bug here must not stop every later transfer silently
                logger.exception("NIXL notification poll failed")
                busy = False
            now = time.monotonic()
            last_busy = now if busy else last_busy
            time.sleep(BUSY_POLL_S if now - last_busy < BUSY_WINDOW_S else IDLE_POLL_S)

    def _poll_once(self) -> bool:
        notifs = self._agent.get_new_notifs()
        for agent, messages in notifs.items():
            agent = agent.decode() if isinstance(agent, bytes) else agent
            for msg in messages:
                self._on_notif(agent, msg)
        now = time.monotonic()
        with self._nlock:
            pending = list(self._pending_done.items())
            due = [res for t, res in self._lost if t <= now]
            self._lost = [(t, res) for t, res in self._lost if t > now]
            expired = [(conn_id, rid) for t, rid in self._expiring if t <= now
                       for conn_id, leases in self._writers.items() if rid in leases]
            self._expiring = [(t, rid) for t, rid in self._expiring if t > now]
        for res in due:
            self._table.end_writer(res)
        for conn_id, rid in expired:     # a writer past its own expiry: frozen or gone
            logger.warning("NIXL lease of %s expired with its writer silent: released, "
                           "the writer's connection closed", rid)
            self._end_lease(conn_id, rid)
            self._control.drop_connection(conn_id)
        for (rid, conn_id), (h, deadline) in pending:
            res = self._table.lookup(rid, h.epoch, "DONE")
            if res is None or res.writes_by_conn.get(conn_id, 0) >= h.num_blocks or now > deadline:
                with self._nlock:
                    self._pending_done.pop((rid, conn_id), None)
                if res is not None:
                    self._table.on_done(h)   # fails it, naming what is missing, if late
        return bool(notifs) or bool(pending)

    def _on_notif(self, agent: str, msg: bytes) -> None:
        """One notification: the KV frame headers (no payload) of every share its
        WRITE carried, back to back (a lane merges the shares queued behind it)."""
        with self._nlock:
            conn_id = self._agents.get(agent)
        if conn_id is None:
            logger.warning("dropping NIXL notification from unpaired agent %s", agent[:64])
            return
        view, off = memoryview(msg), 0
        while off < len(view):
            try:
                h = frames.unpack_header(view[off:], self.layout, self.kv.shape[2])
            except KVFrameError as e:
                logger.warning("dropping malformed NIXL notification from %s: %s",
                               agent[:64], e)
                return
            off += frames.HEADER_SIZE + len(h.request_id.encode())
            if h.frame_type != FrameType.KV:
                logger.warning("dropping NIXL notification of type %s", h.frame_type.name)
                return
            self._on_kv_written(conn_id, h)

    def _on_kv_written(self, conn_id: int, h: FrameHeader) -> None:
        self.num_writes += 1
        res = self._table.admit_kv(h, conn_id)
        if res is None:
            return
        # only this thread writes it; DONE handling reads it
        res.writes_by_conn[conn_id] = res.writes_by_conn.get(conn_id, 0) + 1
        if conn_id not in res.writer_conns:
            self._table.fail(res, "KV written without a BEGIN on its connection")
            return
        self._table.write(res, h)


def _overlap(a: range, b: range) -> bool:
    return a.start < b.stop and b.start < a.stop
