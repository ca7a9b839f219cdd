"""UCX receiver (decode worker D side); the transport is described in ``ucx.py``.

A UCX listener; per accepted connection one task on the runtime's loop: handshake on the
control endpoint, then a frame loop on the data endpoint. The loop keeps
``max_inflight`` receives posted for headers (UCX matches the receives of one tag in
the order they were posted), so a header is usually there before Python asks for it.
Each header is validated against the layout; then the frame's payload messages (whole
blocks of one layer's K or V, see ``ucx_wire.payload_chunks``) are received asynchronously:

- blocks with consecutive ids: straight into that region of the cache (zero-copy, like
  TCP), counted as a write in flight on the reservation, so forget() frees the blocks
  only once the receive is complete or cancelled;
- otherwise into a staging slot, copied into the blocks by ReservationTable once it
  arrived;
- for a request nobody waits for: into a 1-byte buffer, which UCX truncates and drops.

The loop does not wait for a frame's payload before reading the next header (up to
``max_inflight`` payload receives in flight): waiting costs a completion round trip --
ucxx's notifier thread, then the event loop -- per frame (measured on `pdserve bench
transfer`: 0.81 GB/s that way, ~2 GB/s pipelined; docs/ucx.md). Before a DONE or ABORT
frame takes effect, every payload receive before it is complete. A connection that
sends anything malformed, or whose control endpoint breaks, is closed with a warning
and its unfinished requests fail; the other connections are unaffected.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from . import auth, frames, ucx as _ucx, ucx_wire as wire
from .base import (
    KVAuthError,
    KVCompletion,
    KVFrameError,
    KVLayout,
    KVLayoutMismatch,
    KVReceiver,
    KVTransferError,
)
from .frames import FrameHeader, FrameType
from .reservations import Reservation

logger = logging.getLogger(__name__)

# Receives per connection kept posted / in flight (headers; payload messages), staging
# slots for payloads whose blocks are not consecutive, and the largest payload message.
# Measured on `pdserve bench transfer` (2-core VM; docs/ucx.md): with 768 KiB frames,
# 8 in flight ~1.3 GB/s, 32 ~2 GB/s, 64 no better; with 6 MiB frames, 1 MiB messages
# 3.1 GB/s, 4 MiB 4.2-4.3, 16 MiB no better.
DEFAULT_MAX_INFLIGHT = 32
DEFAULT_STAGING_SLOTS = 4
DEFAULT_SLOT_BYTES = 4 << 20


class _AcceptHook:
    """The listener's callback. The listener outlives a closed receiver (see
    UcxRuntime.park_listener), and must not keep it -- and its KV cache -- alive."""

    def __init__(self, rx: UcxKVReceiver) -> None:
        self.rx: UcxKVReceiver | None = rx

    def __call__(self, ctl: Any) -> None:
        rx = self.rx
        if rx is None:
            _ucx.abort_endpoint(ctl)
        else:
            rx._accept(ctl)


class _PostedRing:
    """Receives kept posted under one tag on one endpoint, one per buffer, taken in
    posting order (UCX matches a tag's receives in the order they were posted). The
    caller gives a taken buffer back with ``repost``."""

    def __init__(self, ep: Any, tag: int, bufs: list[np.ndarray]) -> None:
        self._ep, self._tag = ep, tag
        self._posted: collections.deque = collections.deque()
        for buf in bufs:
            self.repost(buf)

    def repost(self, buf: np.ndarray) -> None:
        task = asyncio.get_running_loop().create_task(_ucx.tag_recv(self._ep, buf, self._tag))
        self._posted.append((buf, task))

    async def take(self, what: str, timeout_s: float | None) -> np.ndarray:
        """The oldest receive's buffer once its message has arrived; KVTransferError
        naming ``what`` on a UCX error or after ``timeout_s`` (None: no deadline)."""
        buf, task = self._posted[0]
        if not task.done() or task.exception() is not None:
            await _ucx.guarded(asyncio.shield(task), what, timeout_s)
        self._posted.popleft()
        return buf

    def tasks(self) -> list[asyncio.Task]:
        return [task for _, task in self._posted]


@dataclass(eq=False)
class _RecvConn:
    conn_id: int
    ctl: Any  # ucx Endpoint the listener accepted (handshake, liveness)
    data: Any = None  # ucx Endpoint to P's worker address (frames arrive under `tag`)
    tag: int = 0  # headers; payload messages come under tag + 1
    task: asyncio.Task | None = None
    headers: _PostedRing | None = None  # while the frame loop runs
    # Payload receives posted and not yet complete, oldest first.
    pending: collections.deque = field(default_factory=collections.deque)
    free_slots: list = field(default_factory=list)  # staging slots not in use
    slots_made: int = 0


@dataclass(eq=False)
class _PendingRecv:
    """A payload message being received: straight into the blocks (``slot`` None, one
    write counted by begin_direct) or into a staging slot, copied to the blocks later."""

    task: asyncio.Task
    res: Reservation
    slot: tuple[torch.Tensor, torch.Tensor, Any] | None  # (raw, blocks view, UCX buffer)
    layer: int
    half: int
    first: int  # reservation block-table position of the message's first block
    n: int


class UcxKVReceiver(KVReceiver):
    """UCX receiver; see the module docstring.

    port: 0 lets UCX pick one. ucxx listens on every interface (its listener takes a port
    only: ListenerBuilder(worker, port, ...) as of ucxx 0.52); ``host`` is the address
    start() hands out, and the cluster secret (``secret``, auth.py) is what keeps other
    peers from pairing. io_timeout_s bounds the handshake and each message of a frame
    once its header arrived (an idle connection between frames never times out).
    slot_bytes (raised to one block of one layer's K) is the largest payload message; senders cut payloads to fit. max_inflight receives
    stay posted for headers, and at most as many for payload messages; a message whose
    blocks are not consecutive goes through one of ``staging_slots`` slots
    (``staging_slots * slot_bytes`` bytes of ``kv.device`` memory per connection at
    most, made on first need).
    """

    def __init__(
        self,
        kv: torch.Tensor,
        layout: KVLayout,
        epoch: int,
        host: str = "127.0.0.1",
        *,
        on_complete: Callable[[KVCompletion], None],
        port: int = 0,
        io_timeout_s: float = 30.0,
        slot_bytes: int = DEFAULT_SLOT_BYTES,
        max_inflight: int = DEFAULT_MAX_INFLIGHT,
        staging_slots: int = DEFAULT_STAGING_SLOTS,
        secret: str | None = None,
    ) -> None:
        super().__init__(kv, layout, epoch, host, on_complete=on_complete)
        self._secret = auth.secret_bytes(secret)
        if max_inflight < 1 or staging_slots < 1:
            raise ValueError(
                f"max_inflight and staging_slots must be >= 1, got {max_inflight}, {staging_slots}"
            )
        self.port = port
        self.io_timeout_s = io_timeout_s
        self.slot_bytes = max(slot_bytes, layout.kv_bytes_per_block_layer // 2)
        self.max_inflight = max_inflight
        self.staging_slots = staging_slots
        self._per_chunk = wire.chunk_blocks(layout, self.slot_bytes)
        self._wire = wire.wire_view(kv)  # what receives go straight into
        self._max_blocks = kv.shape[2]
        self._lock = threading.Lock()  # guards the fields below
        self._rt: _ucx.UcxRuntime | None = None
        self._worker_address = b""  # the runtime's, set by start()
        self._hook = _AcceptHook(self)
        self._listener: Any = None
        self._conns: dict[int, _RecvConn] = {}  # touched on the loop thread only
        self._conn_ids = itertools.count()
        self._started = False
        self._closed = False

    def start(self) -> tuple[str, int]:
        with self._lock:
            if self._closed:
                raise KVTransferError("receiver is closed")
            if self._started:
                return self.host, self.port
            self._rt = _ucx.acquire_runtime()
            self._worker_address = self._rt.worker_address
            try:
                self.port = self._rt.call(self._listen(), self.io_timeout_s)
            except BaseException:
                _ucx.release_runtime(self._rt)
                self._rt = None
                raise
            self._started = True
        logger.info(
            "KV receiver (ucx) listening on %s:%d (epoch %d)", self.host, self.port, self.epoch
        )
        return self.host, self.port

    def close(self, join_timeout_s: float = 5.0) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            rt, self._rt = self._rt, None
        if rt is not None:
            try:
                rt.call(self._stop(rt, join_timeout_s), join_timeout_s + _ucx.CALL_SLACK_S)
            except KVTransferError as e:
                logger.warning("KV receiver (ucx) did not stop cleanly: %s", e)
            finally:
                _ucx.release_runtime(rt)
        self._table.fail_all("KV receiver closed")

    # ---- coroutines (run on the UCX loop) -----------------------------------------

    async def _listen(self) -> int:
        try:
            self._listener = _ucx.ucx.create_listener(self._hook, self.port)
        except _ucx.UCX_ERRORS as e:
            msg = f"cannot listen on port {self.port}: {type(e).__name__}: {e}"
        else:
            return self._listener.port
        raise KVTransferError(msg)

    def _accept(self, ctl: Any) -> None:
        """Listener callback, on the loop: one serving task per connection."""
        if self._closed:
            _ucx.abort_endpoint(ctl)
            return
        conn = _RecvConn(next(self._conn_ids), ctl)
        self._conns[conn.conn_id] = conn
        conn.task = asyncio.get_running_loop().create_task(self._serve(conn))

    async def _stop(self, rt: _ucx.UcxRuntime, join_timeout_s: float) -> None:
        self._hook.rx = None  # from now on connections are dropped as they arrive
        if self._listener is not None:
            rt.park_listener(self._listener)
            self._listener = None
        tasks = [c.task for c in self._conns.values() if c.task is not None]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=join_timeout_s)

    async def _serve(self, conn: _RecvConn) -> None:
        why = "peer closed the connection"
        frames_task = watch_task = None
        try:
            await _ucx.guarded(self._handshake(conn), "handshake", self.io_timeout_s)
            loop = asyncio.get_running_loop()
            frames_task = loop.create_task(self._frame_loop(conn))
            watch_task = loop.create_task(self._until_broken(conn.ctl))
            await asyncio.wait({frames_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
            if not frames_task.done():
                # Control endpoint broke: P hung up or died. Frames it sent before that may
                # still be in flight on the data endpoint (EOS ends them); read them first.
                await asyncio.wait({frames_task}, timeout=_ucx.DRAIN_S)
            if not frames_task.done():
                why = "peer went away (control endpoint closed) mid-stream"
            else:
                frames_task.result()  # raises what ended the frame loop, if anything
        except (KVLayoutMismatch, KVAuthError) as e:
            why = str(e)
            logger.warning("KV connection %d refused: %s", conn.conn_id, e)
        except KVTransferError as e:  # KVFrameError, UCX errors, timeouts
            why = f"{type(e).__name__}: {e}"
            if not self._closed:
                logger.warning("closing KV connection %d: %s", conn.conn_id, why)
        except asyncio.CancelledError:
            why = "KV receiver closed"
        except Exception as e:  # a bug here must cost one connection, not the receiver
            why = f"internal error: {type(e).__name__}: {e}"
            logger.exception("closing KV connection %d after internal error", conn.conn_id)
        finally:
            tasks = [t for t in (frames_task, watch_task) if t is not None]
            if conn.headers is not None:
                tasks += conn.headers.tasks()
            tasks += [p.task for p in conn.pending]
            for t in tasks:
                t.cancel()
            # Aborting cancels the receives in flight, so their buffers may go after it.
            _ucx.abort_endpoint(conn.data)
            _ucx.abort_endpoint(conn.ctl)
            if tasks:
                await asyncio.wait(tasks, timeout=_ucx.DRAIN_S)
            for t in tasks:  # retrieved, so asyncio does not log them as lost
                if t.done() and not t.cancelled() and t.exception() is not None:
                    logger.debug("KV connection %d task ended: %r", conn.conn_id, t.exception())
            self._settle(conn)
            conn.data = conn.ctl = conn.headers = None
            conn.free_slots.clear()
            self._conns.pop(conn.conn_id, None)
            if not self._closed:
                self._table.connection_lost(conn.conn_id, why)

    @staticmethod
    async def _until_broken(ctl: Any) -> None:
        """Returns when the control endpoint breaks (P never sends on it again)."""
        try:
            await ctl.recv(np.zeros(1, np.uint8))
        except _ucx.UCX_ERRORS as e:
            logger.debug("KV control endpoint ended: %s", e)

    async def _handshake(self, conn: _RecvConn) -> None:
        nonce_d = auth.new_nonce()
        await self._send_ctl(conn, FrameType.CHALLENGE, nonce_d, epoch=0)
        hbuf = np.zeros(wire.HEADER_MSG_BYTES, np.uint8)
        await conn.ctl.recv(hbuf)
        h = frames.unpack_header(memoryview(hbuf), self.layout, self._max_blocks)
        if h.frame_type != FrameType.HANDSHAKE:
            raise KVFrameError(f"expected HANDSHAKE, got {h.frame_type.name}")
        body = np.zeros(h.payload_len, np.uint8)
        await conn.ctl.recv(body)
        hs = wire.parse_handshake(body.tobytes(), ack=False)
        if not auth.verify(self._secret, auth.PREFILL, nonce_d, hs.nonce, hs.auth):
            await self._send_ctl(conn, FrameType.HANDSHAKE_ACK, frames.encode_auth_refusal(),
                                 epoch=0)  # nothing about D to a stranger
            await self._until_hung_up(conn)
            why = ("the peer did not prove the cluster secret" if self._secret else
                   "the peer sent a proof, this receiver has no secret")
            raise KVAuthError(f"{frames.AUTH_REFUSED}: {why}")
        error = hs.layout.mismatch(self.layout)
        if error is None:
            conn.data = await _ucx.endpoint_to_worker(hs.worker_address)
            # Even, so that data_tag + 1 (payloads) is this connection's too.
            tags = {c.tag for c in self._conns.values()}
            while conn.tag == 0 or conn.tag in tags:
                conn.tag = int.from_bytes(os.urandom(8), "little") & ~1
        ack = wire.handshake_payload(
            self.layout, self.epoch, ack=True, error=error,
            auth=auth.proof(self._secret, auth.DECODE, nonce_d, hs.nonce),
            worker_address=self._worker_address, data_tag=conn.tag, slot_bytes=self.slot_bytes,
        )
        await self._send_ctl(conn, FrameType.HANDSHAKE_ACK, ack, epoch=self.epoch)
        if error is not None:
            await self._until_hung_up(conn)
            raise KVLayoutMismatch(error)
        logger.debug("KV connection %d paired (prefill epoch %d)", conn.conn_id, hs.epoch)

    @staticmethod
    async def _send_ctl(conn: _RecvConn, ftype: FrameType, payload: bytes, epoch: int) -> None:
        """A handshake-phase frame on the control endpoint: header message, payload."""
        header = frames.pack_header(ftype, epoch=epoch, payload_len=len(payload))
        await conn.ctl.send(np.frombuffer(wire.header_message(header), np.uint8))
        await conn.ctl.send(np.frombuffer(payload, np.uint8))

    async def _until_hung_up(self, conn: _RecvConn) -> None:
        """After a refusal: let P read it before the endpoint goes (it hangs up after
        reading)."""
        try:
            await asyncio.wait_for(conn.ctl.recv(np.zeros(1, np.uint8)), self.io_timeout_s)
        except (asyncio.TimeoutError, *_ucx.UCX_ERRORS):
            pass  # hung up (or silent): either way we are done with it

    async def _frame_loop(self, conn: _RecvConn) -> None:
        headers = [np.zeros(wire.HEADER_MSG_BYTES, np.uint8) for _ in range(self.max_inflight)]
        conn.headers = _PostedRing(conn.data, conn.tag, headers)
        while True:
            # No deadline for the next header (idle connections are normal).
            hbuf = await conn.headers.take("frame header", None)
            try:
                eos = hbuf[: len(wire.EOS)].tobytes() == wire.EOS
                if not eos:
                    h = frames.unpack_header(memoryview(hbuf), self.layout, self._max_blocks)
            finally:
                conn.headers.repost(hbuf)
            if eos:
                await self._reap(conn, keep=0)
                return
            if h.frame_type == FrameType.KV:
                await self._on_kv(h, conn)
                continue
            # Every KV byte before a DONE or ABORT is in place before it counts.
            await self._reap(conn, keep=0)
            if h.frame_type == FrameType.DONE:
                self._table.on_done(h)
            elif h.frame_type == FrameType.ABORT:
                reason = np.zeros(h.payload_len, np.uint8)
                if h.payload_len:
                    await _ucx.guarded(
                        _ucx.tag_recv(conn.data, reason, conn.tag + 1),
                        "ABORT reason",
                        self.io_timeout_s,
                    )
                self._table.on_abort(h, reason.tobytes().decode("utf-8", "replace"))
            else:
                raise KVFrameError(f"unexpected {h.frame_type.name} frame after handshake")

    async def _on_kv(self, h: FrameHeader, conn: _RecvConn) -> None:
        """Post the frame's payload receives (see the module docstring) and return
        without waiting for them, while max_inflight of them are in flight."""
        if h.has_crc:  # host-side crc32c would mean a device -> host copy; not offered
            raise KVFrameError("CRC32C-flagged KV frames are not supported over ucx")
        res = self._table.admit_kv(h, conn.conn_id)
        keep = res is not None and self._table.claim_blocks(res, h)
        loop = asyncio.get_running_loop()
        payload_tag = conn.tag + 1
        for layer, half, first, n in wire.payload_chunks(
            h.num_layers, h.num_blocks, self._per_chunk
        ):
            if not keep:
                await _ucx.guarded(self._discard(conn), "discarded KV payload", self.io_timeout_s)
                continue
            layer += h.layer_start
            first += h.block_start  # from here on, a position in the reservation's table
            slot = None
            start = self._table.begin_direct(res, first, n)
            if start is not None:
                buf = self._wire[layer, half, start : start + n].reshape(-1)
            else:
                slot = await self._take_slot(conn)
                buf = slot[2]
            task = loop.create_task(_ucx.tag_recv(conn.data, buf, payload_tag))
            conn.pending.append(_PendingRecv(task, res, slot, layer, half, first, n))
            await self._reap(conn, keep=self.max_inflight)

    async def _reap(self, conn: _RecvConn, keep: int) -> None:
        """Finish the payload receives that are complete, oldest first, and wait for the
        oldest while more than ``keep`` are in flight. KVTransferError if one failed
        (the connection then closes; _serve settles the rest)."""
        while conn.pending and (conn.pending[0].task.done() or len(conn.pending) > keep):
            p = conn.pending[0]
            if not p.task.done() or p.task.exception() is not None:
                await _ucx.guarded(asyncio.shield(p.task), "KV payload", self.io_timeout_s)
            conn.pending.popleft()
            if p.slot is None:
                self._table.end_direct(p.res)
                continue
            self._table.write_blocks(p.res, p.layer, p.half, p.first, p.slot[1][: p.n])
            if self.kv.is_cuda:  # the copy must read the slot before its next receive
                torch.cuda.current_stream(self.kv.device).synchronize()
            conn.free_slots.append(p.slot)

    def _settle(self, conn: _RecvConn) -> None:
        """Once the connection is closed: write out the payload messages that arrived
        (like TCP, a frame delivered before the peer went away lands) and release the
        receives the abort cancelled."""
        for p in conn.pending:
            t = p.task
            arrived = t.done() and not t.cancelled() and t.exception() is None
            if p.slot is None:
                self._table.end_direct(p.res)
            elif arrived:
                self._table.write_blocks(p.res, p.layer, p.half, p.first, p.slot[1][: p.n])
        conn.pending.clear()

    async def _take_slot(self, conn: _RecvConn) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """A staging slot for a message whose blocks are not consecutive: a free one, a
        new one (up to staging_slots per connection), or the next one
        a receive in flight gives back."""
        while not conn.free_slots:
            if conn.slots_made < self.staging_slots:
                conn.slots_made += 1
                kv = self.kv
                raw = torch.empty(self.slot_bytes, dtype=torch.uint8, device=kv.device)
                n = self._per_chunk * self.layout.kv_bytes_per_block_layer // 2
                # [per_chunk, num_kv_heads, block_size, head_dim]
                blocks = raw[:n].view(kv.dtype).view(self._per_chunk, *kv.shape[3:])
                return raw, blocks, wire.ucx_buffer(raw)
            await self._reap(conn, keep=len(conn.pending) - 1)
        return conn.free_slots.pop()

    async def _discard(self, conn: _RecvConn) -> None:
        """Receive the next payload message into a 1-byte buffer: UCX drops the rest."""
        try:
            await _ucx.tag_recv(conn.data, np.zeros(1, np.uint8), conn.tag + 1)
        except _ucx.UCX_TRUNCATED:
            pass
