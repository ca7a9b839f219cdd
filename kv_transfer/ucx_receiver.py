"""UCX receiver (decode worker D side); the transport is described in ``ucx.py``.

A UCX listener; per accepted connection one task on the runtime's loop: handshake on the
control endpoint, then a frame loop on the data endpoint. Each header is validated
against the layout, then a KV payload's messages (one per layer and K/V) are received
into a reused per-connection uint8 staging tensor on ``kv.device`` (device memory for
CUDA caches), viewed as the layout dtype and scattered into the reserved blocks by
ReservationTable. (Not straight into the blocks as TCP does: that would hold the
reservation's lock across an await, and a second connection writing the same request
would then block the one event loop every connection shares.) Payloads nobody waits
for are received into a 1-byte scratch buffer (UCX truncates and drops them), so a
stray frame costs no allocation. A connection that sends anything malformed, or whose
control endpoint breaks, is closed with a warning and its unfinished requests fail; the
other connections are unaffected.
"""

from __future__ import annotations

import asyncio
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


@dataclass(eq=False)
class _RecvConn:
    conn_id: int
    ctl: Any  # ucx Endpoint the listener accepted (handshake, liveness)
    data: Any = None  # ucx Endpoint to P's worker address (frames arrive under `tag`)
    tag: int = 0  # headers; payload messages come under tag + 1
    staging: torch.Tensor | None = None  # uint8 on kv.device, reused and grown
    task: asyncio.Task | None = None
    next_header: asyncio.Task | None = None  # the header recv posted ahead


class UcxKVReceiver(KVReceiver):
    """UCX receiver; see the module docstring.

    port: 0 lets UCX pick one. ucxx listens on every interface; ``host`` is the address
    start() hands out. io_timeout_s bounds the handshake and the rest of a frame once its
    header arrived (an idle connection between frames never times out).
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
    ) -> None:
        super().__init__(kv, layout, epoch, host, on_complete=on_complete)
        self.port = port
        self.io_timeout_s = io_timeout_s
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
            tasks = [t for t in (frames_task, watch_task, conn.next_header) if t is not None]
            for t in tasks:
                t.cancel()
            # Aborting cancels a recv in flight, so the staging buffer may go after it.
            _ucx.abort_endpoint(conn.data)
            _ucx.abort_endpoint(conn.ctl)
            if tasks:
                await asyncio.wait(tasks, timeout=_ucx.DRAIN_S)
            for t in tasks:  # retrieved, so asyncio does not log them as lost
                if t.done() and not t.cancelled() and t.exception() is not None:
                    logger.debug("KV connection %d task ended: %r", conn.conn_id, t.exception())
            conn.data = conn.ctl = conn.staging = None
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
        peer_layout, peer_epoch, _, address, _ = _ucx.parse_handshake(
            body.tobytes(), want_tag=False
        )
        error = peer_layout.mismatch(self.layout)
        if error is None:
            conn.data = await _ucx.endpoint_to_worker(address)
            # Even, so that data_tag + 1 (payloads) is this connection's too.
            tags = {c.tag for c in self._conns.values()}
            while conn.tag == 0 or conn.tag in tags:
                conn.tag = int.from_bytes(os.urandom(8), "little") & ~1
        ack = _ucx.handshake_payload(
            self.layout, self.epoch, ack=True, error=error,
            worker_address=self._worker_address, data_tag=conn.tag,
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
        logger.debug("KV connection %d paired (prefill epoch %d)", conn.conn_id, peer_epoch)

    async def _frame_loop(self, conn: _RecvConn) -> None:
        # The next header's recv is always posted before this frame's payload is read
        # (headers and payloads have their own tags), so it has usually arrived by the
        # time this frame is done: one completion round trip per frame, not two.
        bufs = [np.zeros(_ucx.HEADER_MSG_BYTES, np.uint8) for _ in range(2)]
        loop = asyncio.get_running_loop()
        conn.next_header = loop.create_task(self._recv(conn, bufs[0]))
        for i in itertools.count():
            # No deadline for the next header (idle connections are normal).
            await _ucx.guarded(conn.next_header, "frame header", None)
            hbuf = bufs[i % 2]
            if hbuf[: len(_ucx.EOS)].tobytes() == _ucx.EOS:
                return
            h = frames.unpack_header(memoryview(hbuf), self.layout, self._max_blocks)
            conn.next_header = loop.create_task(self._recv(conn, bufs[(i + 1) % 2]))
            if h.frame_type == FrameType.KV:
                await self._on_kv(conn, h)
            elif h.frame_type == FrameType.DONE:
                self._table.on_done(h)
            elif h.frame_type == FrameType.ABORT:
                reason = np.zeros(h.payload_len, np.uint8)
                if h.payload_len:
                    await _ucx.guarded(
                        self._recv(conn, reason, payload=True), "ABORT reason", self.io_timeout_s
                    )
                self._table.on_abort(h, reason.tobytes().decode("utf-8", "replace"))
            else:
                raise KVFrameError(f"unexpected {h.frame_type.name} frame after handshake")

    async def _recv(self, conn: _RecvConn, buf: Any, payload: bool = False) -> None:
        await _ucx.tag_recv(conn.data, buf, conn.tag + 1 if payload else conn.tag)

    async def _on_kv(self, conn: _RecvConn, h: FrameHeader) -> None:
        if h.has_crc:  # host-side crc32 would mean a device -> host copy; not offered
            raise KVFrameError("crc32-flagged KV frames are not supported over ucx")
        res = self._table.admit_kv(h, conn.conn_id)
        pieces = 2 * h.num_layers  # one message per layer and K/V (see ucx.py)
        if res is None:
            await _ucx.guarded(
                self._discard(conn, pieces), "discarded KV payload", self.io_timeout_s
            )
            return
        kv = self.kv
        nbytes = self.layout.payload_bytes(h.num_layers, h.num_blocks)
        if conn.staging is None or conn.staging.numel() < nbytes:
            size = max(nbytes, 2 * conn.staging.numel() if conn.staging is not None else 0)
            conn.staging = torch.empty(size, dtype=torch.uint8, device=kv.device)
        piece = nbytes // pieces
        views = [_ucx.ucx_buffer(conn.staging[i * piece : (i + 1) * piece]) for i in range(pieces)]
        await _ucx.guarded(
            asyncio.gather(*(self._recv(conn, v, payload=True) for v in views)),
            "KV payload",
            self.io_timeout_s,
        )
        staged = conn.staging[:nbytes].view(kv.dtype)
        staged = staged.view(h.num_layers, 2, h.num_blocks, *kv.shape[3:])
        # [n_layers, 2, n_blocks, block_size, num_kv_heads, head_dim]
        self._table.write_layers(res, h, staged)
        if kv.is_cuda:  # the scatter must read staging before the next recv overwrites it
            torch.cuda.current_stream(kv.device).synchronize()

    async def _discard(self, conn: _RecvConn, messages: int) -> None:
        scratch = np.zeros(1, np.uint8)
        for _ in range(messages):
            try:
                await self._recv(conn, scratch, payload=True)
            except _ucx.UCX_TRUNCATED:
                pass  # expected: UCX consumed and dropped the message
