"""UCX receiver (decode worker D side); the transport is described in ``ucx.py``.

A UCX listener; per accepted connection one task on the runtime's loop: handshake on the
control endpoint, then a frame loop on the data endpoint. The loop keeps ``ring_depth``
receives posted for headers and as many for payload messages, each payload receive into
its own ``slot_bytes`` slot (uint8 on ``kv.device``), so messages land while Python
handles earlier ones: no completion round trip per message (measured on `pdserve bench
transfer`: 0.81 GB/s receiving each frame's messages only after its header, ~2 GB/s
with the ring; see docs/ucx.md). UCX matches the receives of one tag in the order they
were posted, so the n-th posted slot holds the n-th payload message. Each header is
validated against the layout; each payload message (whole blocks of one layer's K or
V, see ``ucx.payload_chunks``) is copied from its slot into the reserved blocks by
ReservationTable, or dropped when nobody waits for the request; then the slot is posted
again. (Not received straight into the blocks as TCP does: that needs the header first,
one round trip per frame.) A connection that sends anything malformed, or whose control
endpoint breaks, is closed with a warning and its unfinished requests fail; the other
connections are unaffected.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from . import frames, ucx as _ucx
from .base import (
    KVCompletion,
    KVFrameError,
    KVLayout,
    KVLayoutMismatch,
    KVReceiver,
    KVTransferError,
)
from .frames import FrameHeader, FrameType

logger = logging.getLogger(__name__)

# Payload slots per connection and their size. Measured on `pdserve bench transfer`
# (768 KiB frames, 2-core VM; docs/ucx.md): depth 8 and 16 alike, 1 MiB slots keep a
# frame's K and V whole at the default model's geometry.
DEFAULT_SLOT_BYTES = 1 << 20
DEFAULT_RING_DEPTH = 8


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
    """Receives kept posted under one tag on one endpoint, taken in posting order (UCX
    matches a tag's receives in the order they were posted). ``slots`` are pairs (what
    ``take`` hands out, the buffer UCX receives into), made once: views cost more per
    message than the rest of the bookkeeping on a small frame. The caller gives a slot
    back with ``repost``."""

    def __init__(self, ep: Any, tag: int, slots: list[tuple[Any, Any]]) -> None:
        self._ep, self._tag = ep, tag
        self._posted: collections.deque = collections.deque()
        for slot in slots:
            self.repost(slot)

    def repost(self, slot: tuple[Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(_ucx.tag_recv(self._ep, slot[1], self._tag))
        self._posted.append((slot, task))

    async def take(self, what: str, timeout_s: float | None) -> tuple[Any, Any]:
        """The oldest receive's slot once its message has arrived; KVTransferError
        naming ``what`` on a UCX error (a message longer than the buffer, say) or after
        ``timeout_s`` (None: no deadline)."""
        slot, task = self._posted[0]
        if not task.done() or task.exception() is not None:
            await _ucx.guarded(asyncio.shield(task), what, timeout_s)
        self._posted.popleft()
        return slot

    def tasks(self) -> list[asyncio.Task]:
        return [task for _, task in self._posted]


@dataclass(eq=False)
class _RecvConn:
    conn_id: int
    ctl: Any  # ucx Endpoint the listener accepted (handshake, liveness)
    data: Any = None  # ucx Endpoint to P's worker address (frames arrive under `tag`)
    tag: int = 0  # headers; payload messages come under tag + 1
    task: asyncio.Task | None = None
    rings: tuple[_PostedRing, ...] = ()  # headers, payload slots (while the loop runs)


class UcxKVReceiver(KVReceiver):
    """UCX receiver; see the module docstring.

    port: 0 lets UCX pick one. ucxx listens on every interface; ``host`` is the address
    start() hands out. io_timeout_s bounds the handshake and each message of a frame
    once its header arrived (an idle connection between frames never times out).
    slot_bytes (raised to one block of one layer's K, and to an ABORT reason's limit)
    and ring_depth size the posted receives: ``ring_depth * slot_bytes`` bytes of
    ``kv.device`` memory per connection; senders cut payloads to fit a slot.
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
        ring_depth: int = DEFAULT_RING_DEPTH,
    ) -> None:
        super().__init__(kv, layout, epoch, host, on_complete=on_complete)
        if ring_depth < 1:
            raise ValueError(f"ring_depth must be >= 1, got {ring_depth}")
        self.port = port
        self.io_timeout_s = io_timeout_s
        self.slot_bytes = max(
            slot_bytes, layout.kv_bytes_per_block_layer // 2, frames.MAX_REASON_BYTES
        )
        self.ring_depth = ring_depth
        self._per_chunk = _ucx.chunk_blocks(layout, self.slot_bytes)
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
        except KVLayoutMismatch as e:
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
            tasks += [t for ring in conn.rings for t in ring.tasks()]
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
            conn.data = conn.ctl = None
            conn.rings = ()
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
        hbuf = np.zeros(_ucx.HEADER_MSG_BYTES, np.uint8)
        await conn.ctl.recv(hbuf)
        h = frames.unpack_header(memoryview(hbuf), self.layout, self._max_blocks)
        if h.frame_type != FrameType.HANDSHAKE:
            raise KVFrameError(f"expected HANDSHAKE, got {h.frame_type.name}")
        body = np.zeros(h.payload_len, np.uint8)
        await conn.ctl.recv(body)
        hs = _ucx.parse_handshake(body.tobytes(), ack=False)
        error = hs.layout.mismatch(self.layout)
        if error is None:
            conn.data = await _ucx.endpoint_to_worker(hs.worker_address)
            # Even, so that data_tag + 1 (payloads) is this connection's too.
            tags = {c.tag for c in self._conns.values()}
            while conn.tag == 0 or conn.tag in tags:
                conn.tag = int.from_bytes(os.urandom(8), "little") & ~1
        ack = _ucx.handshake_payload(
            self.layout, self.epoch, ack=True, error=error,
            worker_address=self._worker_address, data_tag=conn.tag, slot_bytes=self.slot_bytes,
        )
        header = frames.pack_header(FrameType.HANDSHAKE_ACK, epoch=self.epoch, payload_len=len(ack))
        await conn.ctl.send(np.frombuffer(_ucx.header_message(header), np.uint8))
        await conn.ctl.send(np.frombuffer(ack, np.uint8))
        if error is not None:
            # Let P read the refusal before the endpoint goes: it hangs up after reading.
            try:
                await asyncio.wait_for(conn.ctl.recv(np.zeros(1, np.uint8)), self.io_timeout_s)
            except (asyncio.TimeoutError, *_ucx.UCX_ERRORS):
                pass  # hung up (or silent): either way we are done with it
            raise KVLayoutMismatch(error)
        logger.debug("KV connection %d paired (prefill epoch %d)", conn.conn_id, hs.epoch)

    async def _frame_loop(self, conn: _RecvConn) -> None:
        kv = self.kv
        headers = _PostedRing(
            conn.data,
            conn.tag,
            [(b, b) for b in (np.zeros(_ucx.HEADER_MSG_BYTES, np.uint8) for _ in range(self.ring_depth))],
        )
        payload = []
        for _ in range(self.ring_depth):
            raw = torch.empty(self.slot_bytes, dtype=torch.uint8, device=kv.device)
            n = self._per_chunk * self.layout.kv_bytes_per_block_layer // 2
            # [per_chunk, block_size, num_kv_heads, head_dim]: a message's whole blocks
            blocks = raw[:n].view(kv.dtype).view(self._per_chunk, *kv.shape[3:])
            payload.append(((raw, blocks), _ucx.ucx_buffer(raw)))
        slots = _PostedRing(conn.data, conn.tag + 1, payload)
        conn.rings = (headers, slots)
        while True:
            # No deadline for the next header (idle connections are normal).
            header = await headers.take("frame header", None)
            hbuf = header[0]
            try:
                if hbuf[: len(_ucx.EOS)].tobytes() == _ucx.EOS:
                    return
                h = frames.unpack_header(memoryview(hbuf), self.layout, self._max_blocks)
            finally:
                headers.repost(header)
            if h.frame_type == FrameType.KV:
                await self._on_kv(h, conn.conn_id, slots)
            elif h.frame_type == FrameType.DONE:
                self._table.on_done(h)
            elif h.frame_type == FrameType.ABORT:
                reason = b""
                if h.payload_len:
                    slot = await slots.take("ABORT reason", self.io_timeout_s)
                    reason = slot[0][0][: h.payload_len].cpu().numpy().tobytes()
                    slots.repost(slot)
                self._table.on_abort(h, reason.decode("utf-8", "replace"))
            else:
                raise KVFrameError(f"unexpected {h.frame_type.name} frame after handshake")

    async def _on_kv(self, h: FrameHeader, conn_id: int, slots: _PostedRing) -> None:
        if h.has_crc:  # host-side crc32 would mean a device -> host copy; not offered
            raise KVFrameError("crc32-flagged KV frames are not supported over ucx")
        res = self._table.admit_kv(h, conn_id)
        keep = res is not None and self._table.claim_layers(res, h)
        chunks = _ucx.payload_chunks(h.num_layers, h.num_blocks, self._per_chunk)
        for layer, half, first, n in chunks:
            slot = await slots.take("KV payload", self.io_timeout_s)
            if keep:
                blocks = slot[0][1]
                self._table.write_blocks(res, h.layer_start + layer, half, first, blocks[:n])
                if self.kv.is_cuda:  # the copy must read the slot before its next receive
                    torch.cuda.current_stream(self.kv.device).synchronize()
            slots.repost(slot)
