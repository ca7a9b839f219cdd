"""Receiver-side state machine, shared by every transport: which requests D expects,
into which blocks, which (layer, block) pairs have arrived, and what D's step loop
learns when it polls ``get_finished()``.

Per expected request::

    expect() -> WAITING --first KV frame--> TRANSFERRING --DONE, all arrived--> DONE
                   |                             |
                   +-----------------------------+--abort / stale epoch / lost
                                                     connection / bad frame--> FAILED

Every transition into DONE or FAILED is reported exactly once by ``get_finished()``;
``forget`` reports only the release, once no write into the blocks is in flight (a
write, or a one-sided writer's lease). The public contract is KVReceiver's (base.py).

How a frame's arrival is tracked, and when DONE counts: arrival.py.
"""

from __future__ import annotations

import logging
import contextlib
import threading
from collections import OrderedDict
from typing import Callable, Sequence

import torch

from .base import MAX_REQUEST_ID_BYTES, KVCompletion, KVFinished, KVLayout, TransferState
from . import frames, host_io
from .arrival import Reservation
from .frames import FrameHeader

logger = logging.getLogger(__name__)

MAX_FINISHED_RECORDS = 8192  # kept for state(): a D that never forgets stays bounded


class ReservationTable:
    """Thread-safe table of expected requests for one receiver (one epoch)."""

    def __init__(self, kv: torch.Tensor, layout: KVLayout, epoch: int,
                 notify: Callable[[], None] | None = None) -> None:
        self.kv = kv  # [num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim]
        self.layout = layout
        self.epoch = epoch
        self._notify = notify
        self._completions: list[KVCompletion] = []   # not yet polled; guarded by _lock
        self._released: list[str] = []               # forgotten, quiescent, not yet polled
        self._host_view = host_io.HostCacheView(kv)
        self._staging = threading.local()            # .buf: a CUDA cache's staging, per thread
        self._lock = threading.Lock()
        self._active: dict[str, Reservation] = {}
        # finished while a one-sided writer still held its lease: forget() must wait for
        # that writer too (end_writer removes them)
        self._leased: dict[str, Reservation] = {}
        self._finished: OrderedDict[str, TransferState] = OrderedDict()

    # ---- decode-worker side -------------------------------------------------------

    def expect(self, request_id: str, dst_block_ids: Sequence[int]) -> None:
        """KVReceiver.expect; idempotent for the same blocks."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
        if len(request_id.encode("utf-8")) > MAX_REQUEST_ID_BYTES:
            raise ValueError(f"request_id longer than {MAX_REQUEST_ID_BYTES} bytes UTF-8")
        ids = [int(b) for b in dst_block_ids]
        total = self.kv.shape[2]
        if not ids:
            raise ValueError(f"request {request_id}: dst_block_ids is empty")
        bad = [b for b in ids if not 0 <= b < total]
        if bad:
            raise ValueError(f"request {request_id}: block ids {bad} outside [0, {total})")
        if len(set(ids)) != len(ids):
            raise ValueError(f"request {request_id}: dst_block_ids has duplicates")
        with self._lock:
            old = self._active.get(request_id)
            if old is not None:
                if old.block_ids != ids:
                    raise ValueError(f"request {request_id} already expected with other blocks")
                return
            self._finished.pop(request_id, None)
            self._active[request_id] = Reservation(
                request_id, ids, torch.tensor(ids, dtype=torch.long, device=self.kv.device),
                self.layout.heads, self.layout.num_layers)

    def forget(self, request_id: str) -> None:
        """KVReceiver.forget: released at once when no write is in flight (or the
        request was never expected), else when the write (or the writer's lease) ends."""
        with self._lock:
            res = self._active.pop(request_id, None) or self._leased.get(request_id)
            self._finished.pop(request_id, None)
        if res is None:
            self._report(released=request_id)
            return
        with res.meta:
            res.forgotten = True
        if res.lock.acquire(blocking=False):   # no write in flight (or it just ended)
            res.state = TransferState.FAILED
            self._release(res)
        # else: the writer's _release reports it

    @contextlib.contextmanager
    def _hold(self, res: Reservation):
        """Hold `res.lock` (writes, state changes); on exit report a pending release."""
        res.lock.acquire()
        try:
            yield
        finally:
            self._release(res)

    def _release(self, res: Reservation) -> None:
        busy = res.writes_in_flight > 0  # then the last end_writer reports the release
        res.lock.release()
        if busy:
            return
        with res.meta:
            forgotten, res.forgotten = res.forgotten, False
        if forgotten:
            res.state = TransferState.FAILED
            self._report(released=res.request_id)

    def get_finished(self) -> KVFinished:
        """KVReceiver.get_finished."""
        with self._lock:
            done, self._completions = self._completions, []
            released, self._released = self._released, []
        return KVFinished(done, released)

    def _report(self, completion: KVCompletion | None = None, released: str | None = None) -> None:
        with self._lock:
            if completion is not None:
                self._completions.append(completion)
            if released is not None:
                self._released.append(released)
        if self._notify is not None:
            try:
                self._notify()
            except Exception:  # a buggy wake-up must not kill the receiver thread
                logger.exception("KV receiver notify raised")

    def state(self, request_id: str) -> TransferState:
        with self._lock:
            res = self._active.get(request_id)
            state = res.state if res is not None else self._finished.get(request_id)
        if state is None:
            raise KeyError(f"request {request_id!r} is not expected")
        return state

    def num_active(self) -> int:
        """Requests expected and not finished, or forgotten with a writer's lease held."""
        with self._lock:
            return len(self._active) + len(self._leased)

    def fail_all(self, reason: str) -> None:
        """Fail every active request (the receiver shuts down)."""
        with self._lock:
            pending = list(self._active.values())
        for res in pending:
            self.fail(res, reason)

    # ---- transport side ------------------------------------------------------------

    def admit_kv(self, h: FrameHeader, conn_id: int) -> Reservation | None:
        """Reservation a KV frame's payload should be written into, or None if the
        payload must be read and discarded (unknown request, stale epoch, blocks beyond
        the reservation; the latter two fail the request)."""
        res = self.lookup(h.request_id, h.epoch, "KV")
        if res is None:
            return None
        if h.block_start + h.num_blocks > res.num_blocks:
            self.fail(res, f"KV frame for layers [{h.layer_start}, {h.layer_end}) carries "
                           f"blocks [{h.block_start}, {h.block_start + h.num_blocks}), "
                           f"reservation has {res.num_blocks}")
            return None
        with self._hold(res):
            res.conn_ids.add(conn_id)
        return res

    def write(self, res: Reservation, h: FrameHeader,
              fill: Callable[[list[memoryview]], None] | None = None, *,
              payload: torch.Tensor | None = None) -> bool:
        """The one way a KV frame's bytes reach the cache: claim the frame's (head,
        layer, block) triples and, under the reservation's lock, put its payload
        [n_layers, 2, h.num_blocks, n_heads, block_size, head_dim] (layout dtype) into
        the blocks at table positions ``h.block_start ..``, from one of:

        - ``fill(regions)`` (e.g. a socket's recv_into): ``regions`` are writable host
          views in payload order, the blocks themselves on a host cache
          (host_io.HostCacheView), on a CUDA cache one host staging buffer (pinned, one
          per thread) then copied into the blocks;
        - ``payload``: the bytes already in host memory, uint8 [nbytes] (staged and
          checked; pinned for a CUDA cache), copied in;
        - neither: the bytes are there already (a one-sided write, nixl.py); a claim.

        Returns True once claimed (and written); False, writing nothing, when the
        payload must be discarded: the request finished or was forgotten meanwhile, or
        a pair arrives twice (that fails it). Exceptions from ``fill`` propagate; the
        connection's requests then fail through connection_lost()."""
        regions, heads = None, h.heads(self.layout)
        if fill is not None or payload is not None:
            regions = self._host_view.regions(h.layer_start, h.layer_end,
                                              res.runs_in(h.block_start, h.num_blocks),
                                              heads=self._local(heads))

        def write_blocks() -> None:
            if regions is not None and fill is not None:
                fill(regions)
            elif regions is not None:
                host_io.copy_into(regions, frames.tensor_bytes(payload))
            elif fill is not None or payload is not None:
                self._write_device(res, h, heads, fill, payload)

        with self._hold(res):
            if res.state >= TransferState.DONE or res.forgotten:
                logger.debug("request %s finished; dropping KV frame", res.request_id)
                return False
            dup = res.claim(h, heads)
            if dup is None:
                write_blocks()
                res.state = TransferState.TRANSFERRING
                return True
        self.fail(res, dup)
        return False

    def _local(self, heads: range) -> range | None:
        """The cache's own head indices of the model's ``heads``; None for all."""
        if heads == self.layout.heads:
            return None
        first = self.layout.kv_head_start
        return range(heads.start - first, heads.stop - first)

    def _write_device(self, res: Reservation, h: FrameHeader, heads: range,
                      fill: Callable[[list[memoryview]], None] | None,
                      payload: torch.Tensor | None) -> None:
        """A device cache: the payload (or a host staging buffer that ``fill`` fills:
        pinned, one per thread) copied into the blocks (their ``heads``)."""
        nbytes = self.layout.payload_bytes(h.num_layers, h.num_blocks, len(heads))
        if payload is None:
            payload = self._staging.buf = frames.grow_buffer(
                getattr(self._staging, "buf", None), nbytes, pinned=self.kv.is_cuda)
            fill([memoryview(payload.numpy())[:nbytes]])
        staged = payload[:nbytes].view(self.kv.dtype).view(
            h.num_layers, 2, h.num_blocks, len(heads), *self.kv.shape[4:])
        dst = res.dst_idx[h.block_start:h.block_start + h.num_blocks]  # [h.num_blocks]
        local = self._local(heads) or range(self.kv.shape[3])
        self.kv[h.layer_start:h.layer_end, :, :, local.start:local.stop].index_copy_(
            2, dst, staged.to(self.kv.device))

    def begin_writer(self, res: Reservation) -> bool:
        """A peer may write into the reservation's blocks from now on, unseen by D (a
        one-sided write). Counted in flight, so forget()'s release waits for the
        matching end_writer; False (nothing counted) once the request finished."""
        with self._hold(res):
            if res.state >= TransferState.DONE or res.forgotten:
                return False
            res.writes_in_flight += 1
        return True

    def end_writer(self, res: Reservation) -> None:
        """The writer counted by begin_writer is done (DONE, ABORT, or known gone)."""
        with self._hold(res):
            res.writes_in_flight -= 1
            if res.writes_in_flight == 0:
                with self._lock:
                    self._leased.pop(res.request_id, None)

    def on_done(self, h: FrameHeader) -> None:
        """A sender's DONE for its heads: fails the request if a frame of those heads is
        missing; completes it once DONEs covered every head (arrival.py)."""
        res = self.lookup(h.request_id, h.epoch, "DONE")
        if res is None:
            return
        num_layers, heads, complete = self.layout.num_layers, h.heads(self.layout), False
        with self._hold(res):
            error = res.missing(heads)
            if error is not None:
                error = f"DONE with {error} (sender claims {h.layer_end} of {num_layers} layers sent)"
            elif h.layer_end != num_layers:
                error = f"DONE claims {h.layer_end} layers sent, layout has {num_layers}"
            else:
                complete, error = res.done(heads, h.first_token)
        if error is not None:
            self.fail(res, error)
        elif complete:
            self._finish(res, KVCompletion(h.request_id, True, res.first_token, None))

    def on_abort(self, h: FrameHeader, reason: str) -> None:
        res = self.lookup(h.request_id, h.epoch, "ABORT")
        if res is not None:
            self.fail(res, f"aborted by prefill worker: {reason}")

    def connection_lost(self, conn_id: int, why: str) -> None:
        """Fail every unfinished request that received frames over ``conn_id``."""
        with self._lock:
            touched = [r for r in self._active.values() if conn_id in r.conn_ids]
        for res in touched:
            self.fail(res, f"connection lost mid-request: {why}")

    def fail(self, res: Reservation, error: str) -> None:
        self._finish(res, KVCompletion(res.request_id, False, None, error))

    # ---- internals -----------------------------------------------------------------

    def lookup(self, request_id: str, epoch: int, what: str) -> Reservation | None:
        """The active reservation a ``what`` frame names, or None (unknown or forgotten;
        a stale epoch also fails the request)."""
        with self._lock:
            res = self._active.get(request_id)
        if res is None:
            logger.debug("discarding %s frame for unexpected request %s", what, request_id)
            return None
        if epoch != self.epoch:
            self.fail(res, f"stale epoch {epoch} on {what} frame, receiver epoch {self.epoch}")
            return None
        return res

    def _finish(self, res: Reservation, completion: KVCompletion) -> None:
        new = TransferState.DONE if completion.ok else TransferState.FAILED
        with self._lock:
            # Exactly once: only the caller that still finds the reservation active
            # (and not replaced by a fresh expect() of the same id) reports it.
            if self._active.get(res.request_id) is not res:
                return
            del self._active[res.request_id]
            self._finished[res.request_id] = new
            while len(self._finished) > MAX_FINISHED_RECORDS:
                self._finished.popitem(last=False)
        with self._hold(res):  # also waits out a write in flight before reporting
            res.state = new
            if res.writes_in_flight:    # a one-sided writer still holds its lease
                with self._lock:
                    self._leased[res.request_id] = res
        if not completion.ok:
            logger.warning("KV transfer of request %s failed: %s", res.request_id, completion.error)
        self._report(completion)
