"""UCX sender (prefill worker P side); the transport is described in ``ucx.py``.

One connection per decode address, opened on first use (control endpoint, handshake,
data endpoint), then reused under a per-connection lock so a frame's messages stay
adjacent. A KV payload goes as messages of whole blocks of one layer's K or V, each at
most D's slot size (``ucx_wire.payload_chunks``), handed to UCX from host or device memory as
it lies (never copied to host here)::

    one run of blocks:  kv[l, half, first:first + n]                    (zero-copy)
    otherwise:          index_select(kv[layers], 2, src_idx, out=conn.packed)[l, half]

send_layers returns once its frame is handed to UCX (up to MAX_FRAMES_IN_FLIGHT per
connection), so the transfer of one layer overlaps the next call; send_done, send_abort
and connect wait for every frame before them. UCX may therefore still read a request's
blocks after send_layers returns: they must stay as they are until that request's
send_done or send_abort returns (the prefill worker frees them only then). A watcher on
the control endpoint aborts the data endpoint as soon as D goes away, so frames in
flight fail at once instead of at ``io_timeout_s``.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Coroutine, Sequence

import numpy as np
import torch

from . import auth, frames, host_io, ucx as _ucx, ucx_wire as wire
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

# Frames per connection handed to UCX and not yet complete. Like TCP's sendall returning
# once the kernel holds the bytes, a failure then surfaces on a later call to the same
# decode worker. Frames in flight reference the cache (zero-copy), so the window costs no
# memory. Measured on `pdserve bench transfer` (768 KiB frames, 2-core VM; docs/ucx.md):
# 0.60 GB/s waiting for every frame, ~1.3 GB/s with 8, ~2 GB/s with 32 (no gain beyond).
MAX_FRAMES_IN_FLIGHT = 32


@dataclass(eq=False)
class _SendConn:
    lock: threading.Lock = field(default_factory=threading.Lock)
    ctl: Any = None  # ucx Endpoint through D's listener (handshake, liveness)
    data: Any = None  # ucx Endpoint to D's worker address (every frame)
    tag: int = 0  # data_tag D chose: headers under it, payload messages under tag + 1
    per_chunk: int = 0  # blocks per payload message, from D's slot size
    peer_epoch: int | None = None
    watcher: asyncio.Task | None = None
    broken: str | None = None  # why, once the watcher saw D go away
    packed: torch.Tensor | None = None  # uint8 on kv.device, reused by gathered KV frames
    # Frames handed to UCX, oldest first, and the connection they went out on (a frame
    # of an earlier connection must never go out on a later one).
    inflight: collections.deque = field(default_factory=collections.deque)
    generation: int = 0

    @property
    def open(self) -> bool:
        return self.data is not None and self.broken is None


class UcxKVSender(KVSender):
    """Blocking UCX sender; see the module docstring (blocks must stay untouched until
    their request's send_done / send_abort returns).

    epoch: P's own epoch, sent in the handshake for D's logs.
    secret: the cluster's shared secret; D must prove it and P proves it to D (auth.py).
        None: pair only with a D that has none.
    connect_timeout_s bounds reaching D; io_timeout_s bounds the handshake and every
    frame.
    """

    def __init__(
        self,
        kv: torch.Tensor,
        layout: KVLayout,
        *,
        epoch: int = 0,
        secret: str | None = None,
        connect_timeout_s: float = 5.0,
        io_timeout_s: float = 30.0,
    ) -> None:
        super().__init__(kv, layout)
        self._secret = auth.secret_bytes(secret)
        self.epoch = epoch
        self.connect_timeout_s = connect_timeout_s
        self.io_timeout_s = io_timeout_s
        self._dtype_code = frames.dtype_code(layout.dtype)
        self._lock = threading.Lock()  # guards _conns and _closed
        self._conns: dict[tuple[str, int], _SendConn] = {}
        self._closed = False
        self._wire = wire.wire_view(kv)
        self._rt = _ucx.acquire_runtime()

    def connect(self, addr: tuple[str, int]) -> int:
        epoch = []
        self._with_conn(addr, lambda conn: self._noop(conn, epoch), flush=True)
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
    ) -> int:
        ids, nbytes = self._check_send(layer_start, layer_end, src_block_ids, block_start)
        runs = host_io.block_runs(ids)
        header = frames.pack_header(
            FrameType.KV,
            request_id,
            epoch=epoch,
            layer_start=layer_start,
            layer_end=layer_end,
            block_start=block_start,
            num_blocks=len(ids),
            dtype_code=self._dtype_code,
            payload_len=nbytes,
        )

        def step(conn: _SendConn) -> Coroutine[Any, Any, None]:
            if len(runs) == 1:  # one run of blocks: every piece is a region of the cache
                first, n = runs[0]
                src = self._wire[layer_start:layer_end, :, first : first + n]
            else:
                self._reap(conn, keep=0)  # conn.packed may still be on its way out
                src = wire.wire_view(self._pack(conn, layer_start, layer_end, ids, nbytes))
            # [n_layers, 2, n_blocks, block bytes]: each [l, half, a:a + n] is contiguous
            chunks = wire.payload_chunks(src.shape[0], src.shape[2], conn.per_chunk)
            pieces = [src[l, half, a : a + n].reshape(-1) for l, half, a, n in chunks]
            if self.kv.is_cuda:  # UCX reads device memory on its own streams
                torch.cuda.current_stream(self.kv.device).synchronize()
            return self._send_frame(conn, conn.generation, header, pieces)

        self._with_conn(addr, step, flush=False)
        return nbytes

    def _pack(
        self, conn: _SendConn, layer_start: int, layer_end: int, ids: list[int], nbytes: int
    ) -> torch.Tensor:
        """Gather the frame's blocks into the connection's reused buffer: exactly the wire
        payload [n_layers, 2, n_blocks, num_kv_heads, block_size, head_dim]. (A fresh
        tensor per frame would cost more than the copy: page faults on every first touch,
        measured 23 ms against 4 ms for 64 MiB.) Safe to reuse: a send is complete, the
        peer holding the bytes, before the next frame of this connection is packed."""
        if conn.packed is None or conn.packed.numel() < nbytes:
            size = max(nbytes, 2 * conn.packed.numel() if conn.packed is not None else 0)
            conn.packed = torch.empty(size, dtype=torch.uint8, device=self.kv.device)
        out = conn.packed[:nbytes].view(self.kv.dtype).view(
            layer_end - layer_start, 2, len(ids), *self.kv.shape[3:]
        )
        src_idx = torch.tensor(ids, dtype=torch.long, device=self.kv.device)
        torch.index_select(self.kv[layer_start:layer_end], 2, src_idx, out=out)
        return out

    def send_done(
        self,
        addr: tuple[str, int],
        request_id: str,
        epoch: int,
        first_token: int,
        num_layers_sent: int,
    ) -> None:
        header = frames.done_header(request_id, epoch, first_token, num_layers_sent)
        self._with_conn(
            addr, lambda conn: self._send_frame(conn, conn.generation, header, []), flush=True
        )

    def send_abort(self, addr: tuple[str, int], request_id: str, epoch: int, reason: str) -> None:
        header, payload = frames.abort_frame(request_id, epoch, reason)
        bufs = [np.frombuffer(payload, np.uint8)] if payload else []
        self._with_conn(
            addr, lambda conn: self._send_frame(conn, conn.generation, header, bufs), flush=True
        )

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns = list(self._conns.values())
            self._conns.clear()
        try:
            for conn in conns:
                with conn.lock:
                    try:
                        self._reap(conn, keep=0)  # let frames handed over reach D
                    except KVTransferError as e:
                        logger.debug("KV frames lost at close: %s", e)
                    try:
                        self._rt.call(self._hang_up(conn), self.io_timeout_s + _ucx.CALL_SLACK_S)
                    except KVTransferError as e:
                        logger.debug("closing KV connection: %s", e)
        finally:
            rt, self._rt = self._rt, None
            _ucx.release_runtime(rt)

    # ---- blocking side -------------------------------------------------------------

    def _with_conn(
        self,
        addr: tuple[str, int],
        step: Callable[[_SendConn], Coroutine[Any, Any, None]],
        *,
        flush: bool,
    ) -> None:
        """Hand ``step(conn)`` to the loop on the (re)opened connection to ``addr``; with
        ``flush``, wait for it and every frame before it."""
        addr = (addr[0], int(addr[1]))
        with self._lock:
            if self._closed:
                raise KVTransferError("sender is closed")
            conn = self._conns.setdefault(addr, _SendConn())
        where = f"KV transfer to {addr[0]}:{addr[1]}"
        slack = _ucx.CALL_SLACK_S
        with conn.lock:
            try:
                self._reap(conn, keep=None)  # an earlier frame's failure surfaces here
                if conn.broken is not None:
                    why = conn.broken
                    self._reap(conn, keep=0)
                    self._rt.call(self._hang_up(conn), self.io_timeout_s + slack)
                    raise KVTransferError(f"decode worker went away ({why})")
                if conn.data is None:
                    budget = self.connect_timeout_s + self.io_timeout_s + slack
                    self._rt.call(self._open(conn, addr), budget)
                conn.inflight.append(self._rt.submit(step(conn)))
                self._reap(conn, keep=0 if flush else MAX_FRAMES_IN_FLIGHT)
            except (KVLayoutMismatch, KVAuthError, KVFrameError):
                raise
            except KVTransferError as e:
                raise KVTransferError(f"{where} failed: {e}") from None

    def _reap(self, conn: _SendConn, keep: int | None) -> None:
        """Collect the frames in flight that are done, and wait for the oldest while more
        than ``keep`` remain (None: never wait). After a failure every frame in flight is
        waited for (the connection is gone, they fail fast), then the first is raised."""
        error = None
        while conn.inflight and (
            conn.inflight[0].done()
            or (keep is not None and len(conn.inflight) > keep)
            or error is not None
        ):
            fut = conn.inflight.popleft()
            try:
                self._rt.result(fut, self.io_timeout_s + _ucx.CALL_SLACK_S)
            except KVTransferError as e:
                error = error or e
        if error is not None:
            raise error

    # ---- coroutines (run on the UCX loop) -----------------------------------------

    async def _open(self, conn: _SendConn, addr: tuple[str, int]) -> None:
        ctl = await _ucx.guarded(
            _ucx.ucx.create_endpoint(addr[0], addr[1]), "connect", self.connect_timeout_s
        )
        conn.ctl = ctl
        try:
            await _ucx.guarded(self._handshake(conn, addr), "handshake", self.io_timeout_s)
        except BaseException:
            await self._hang_up(conn)
            raise
        conn.generation += 1
        conn.watcher = asyncio.get_running_loop().create_task(self._watch(conn))
        logger.debug("connected to decode worker %s:%d epoch %d", *addr, conn.peer_epoch)

    async def _handshake(self, conn: _SendConn, addr: tuple[str, int]) -> None:
        nonce_d = await self._recv_ctl(conn, FrameType.CHALLENGE)
        nonce_p = auth.new_nonce()
        body = wire.handshake_payload(
            self.layout, self.epoch, ack=False, nonce=nonce_p,
            auth=auth.proof(self._secret, auth.PREFILL, nonce_d, nonce_p),
            worker_address=self._rt.worker_address,
        )
        hs = frames.pack_header(FrameType.HANDSHAKE, epoch=self.epoch, payload_len=len(body))
        await conn.ctl.send(np.frombuffer(wire.header_message(hs), np.uint8))
        await conn.ctl.send(np.frombuffer(body, np.uint8))
        ack = await self._recv_ctl(conn, FrameType.HANDSHAKE_ACK)
        hs = wire.parse_handshake(ack, ack=True)
        auth.check_ack(self._secret, addr, nonce_d, nonce_p, hs.error, hs.auth)
        if hs.error is not None:
            raise KVLayoutMismatch(f"decode worker at {addr[0]}:{addr[1]} refused: {hs.error}")
        msg = self.layout.mismatch(hs.layout)
        if msg is not None:
            raise KVLayoutMismatch(f"decode worker at {addr[0]}:{addr[1]}: {msg}")
        conn.data = await _ucx.endpoint_to_worker(hs.worker_address)
        conn.tag, conn.peer_epoch = hs.data_tag, hs.epoch
        conn.per_chunk = wire.chunk_blocks(self.layout, hs.slot_bytes)

    @staticmethod
    async def _recv_ctl(conn: _SendConn, want: FrameType) -> bytes:
        """Payload of the next control-endpoint frame, which must be a ``want`` (header
        message, then the payload as one message; bounded by frames validation)."""
        hbuf = np.zeros(wire.HEADER_MSG_BYTES, np.uint8)
        await conn.ctl.recv(hbuf)
        h = frames.unpack_header(memoryview(hbuf))
        if h.frame_type != want:
            raise KVFrameError(f"expected {want.name}, got {h.frame_type.name}")
        body = np.zeros(h.payload_len, np.uint8)
        await conn.ctl.recv(body)
        return body.tobytes()

    async def _send_frame(
        self, conn: _SendConn, generation: int, header: bytes, payload: list[Any]
    ) -> None:
        if generation != conn.generation or conn.data is None:
            raise KVTransferError("connection was reset before this frame went out")

        async def send() -> None:
            # All posted at once (UCX keeps their order: one endpoint, one tag), awaited
            # together: the receiver's copy-out of one piece overlaps the next transfer.
            hdr = np.frombuffer(wire.header_message(header), np.uint8)
            await asyncio.gather(
                _ucx.tag_send(conn.data, hdr, conn.tag),
                *(_ucx.tag_send(conn.data, b, conn.tag + 1) for b in payload),
            )

        try:
            await _ucx.guarded(send(), "send", self.io_timeout_s)
        except BaseException:
            # A frame cut short leaves the stream out of sync: drop the connection (this
            # also cancels the send in flight before the caller frees its buffer).
            await self._hang_up(conn, eos=False)
            raise

    @staticmethod
    async def _noop(conn: _SendConn, epoch_out: list) -> None:
        epoch_out.append(conn.peer_epoch)

    async def _watch(self, conn: _SendConn) -> None:
        """Returns when the control endpoint breaks (D closed or died); then fails the
        connection, cancelling a send in flight."""
        try:
            await conn.ctl.recv(np.zeros(1, np.uint8))  # D never sends on it again
            why = "unexpected message on the control endpoint"
        except _ucx.UCX_ERRORS as e:
            why = f"{type(e).__name__}: {e}"
        conn.broken = why
        _ucx.abort_endpoint(conn.data)

    async def _hang_up(self, conn: _SendConn, eos: bool = True) -> None:
        """End the connection: EOS on the data endpoint (so D reads every frame before
        it sees the hang-up), then close both endpoints. Idempotent."""
        if eos and conn.open:
            eos_msg = np.frombuffer(wire.header_message(wire.EOS), np.uint8)
            try:
                await _ucx.guarded(_ucx.tag_send(conn.data, eos_msg, conn.tag), "EOS", 1.0)
            except KVTransferError as e:
                logger.debug("KV connection EOS not sent: %s", e)
        if conn.watcher is not None and conn.watcher is not asyncio.current_task():
            conn.watcher.cancel()
        _ucx.abort_endpoint(conn.data)
        _ucx.abort_endpoint(conn.ctl)
        conn.ctl = conn.data = conn.watcher = None
        conn.peer_epoch = None
        conn.broken = None
