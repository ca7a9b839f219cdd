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

A KV frame fills a rectangle of the reservation: layers [layer_start, layer_end) x
block-table positions [block_start, block_start + num_blocks) (frames.py). Arrival is
one byte per (layer, position); a frame whose rectangle overlaps one that arrived fails
the request, and DONE counts only when every byte is set::

                  position 0  1  2  3  4
    arrived  layer 0      [1  1  1  0  0]     frame (layers [0, 2), blocks [0, 3))
             layer 1      [1  1  1  0  0]     is in; blocks [3, 5) of both layers
             ...                              are still to come
"""

from __future__ import annotations

import logging
import contextlib
import functools
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from .base import MAX_REQUEST_ID_BYTES, KVCompletion, KVFinished, KVLayout, TransferState
from . import frames, host_io
from .frames import FrameHeader

logger = logging.getLogger(__name__)

MAX_FINISHED_RECORDS = 8192  # kept for state(): a D that never forgets stays bounded


@dataclass(eq=False)
class Reservation:
    """One expected request. Mutable; guarded by ``lock`` (internal, never crosses a
    module boundary except as an opaque handle to the transport)."""

    request_id: str
    block_ids: list[int]  # [num_blocks] D's blocks, in block-table order (expect())
    dst_idx: torch.Tensor  # [num_blocks] int64, on kv.device: block_ids as a tensor
    # [num_layers * num_blocks] 1 once (layer, block-table position) arrived, by layer
    arrived: bytearray
    state: TransferState = TransferState.WAITING
    conn_ids: set[int] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Two-phase forget: set by forget(); whoever releases `lock` next with no write in
    # flight reports the request released (guarded by `meta`), so the blocks go back to
    # D's pool only once nothing writes into them, and forget() itself never blocks.
    forgotten: bool = False
    meta: threading.Lock = field(default_factory=threading.Lock)
    # Writers that may put bytes into the blocks unseen (begin_writer: a one-sided
    # write's lease); the release waits for them too. Guarded by `lock`.
    writes_in_flight: int = 0
    writer_conn: int | None = None  # the connection whose BEGIN leased the blocks (nixl.py)
    num_writes: int = 0  # notifications of one-sided writes seen (nixl.py's poll thread)

    @functools.cached_property
    def runs(self) -> list[tuple[int, int]]:
        """dst blocks as runs of consecutive ids (host_io.block_runs)."""
        return host_io.block_runs(self.block_ids)

    def runs_in(self, first: int, n: int) -> list[tuple[int, int]]:
        """Runs of the blocks at table positions ``first .. first + n - 1``: equal to
        ``host_io.block_runs(block_ids[first:first + n])``, cut from the cached runs."""
        if first == 0 and n == self.num_blocks:
            return self.runs
        out, pos, end = [], 0, first + n
        for start, count in self.runs:
            lo, hi = max(pos, first), min(pos + count, end)
            if lo < hi:
                out.append((start + lo - pos, hi - lo))
            pos += count
            if pos >= end:
                break
        return out

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    def claim(self, h: FrameHeader) -> str | None:
        """Mark the frame's (layer, position) rectangle arrived; if part of it arrived
        before, mark nothing and say which pair. Caller holds ``lock``; admit_kv checked
        that the rectangle lies inside the reservation."""
        nb, a, b = self.num_blocks, h.block_start, h.block_start + h.num_blocks
        rows = range(h.layer_start * nb, h.layer_end * nb, nb)  # where each layer starts
        for row in rows:
            i = self.arrived.find(1, row + a, row + b)
            if i >= 0:
                return f"layer {i // nb} block {i % nb} received twice"
        ones = b"\x01" * h.num_blocks
        for row in rows:
            self.arrived[row + a : row + b] = ones
        return None

    def missing(self) -> str | None:
        """None once every (layer, position) arrived, else how many did and the first
        that did not. Caller holds ``lock``."""
        first = self.arrived.find(0)
        if first < 0:
            return None
        total, nb = len(self.arrived), self.num_blocks
        return (f"{total - self.arrived.count(0)} of {total} (layer, block) pairs received; "
                f"first missing: layer {first // nb} block {first % nb}")


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
                bytearray(self.layout.num_layers * len(ids)))

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
        """The one way a KV frame's bytes reach the cache: claim the frame's (layer,
        block) pairs and, under the reservation's lock, put its payload [n_layers, 2,
        h.num_blocks, heads, block_size, head_dim] (layout dtype) into the blocks at
        table positions ``h.block_start ..``, from one of:

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
        regions = None
        if fill is not None or payload is not None:
            regions = self._host_view.regions(h.layer_start, h.layer_end,
                                              res.runs_in(h.block_start, h.num_blocks))

        def write_blocks() -> None:
            if regions is not None and fill is not None:
                fill(regions)
            elif regions is not None:
                host_io.copy_into(regions, frames.tensor_bytes(payload))
            elif fill is not None or payload is not None:
                self._write_device(res, h, fill, payload)

        with self._hold(res):
            if res.state >= TransferState.DONE or res.forgotten:
                logger.debug("request %s finished; dropping KV frame", res.request_id)
                return False
            dup = res.claim(h)
            if dup is None:
                write_blocks()
                res.state = TransferState.TRANSFERRING
                return True
        self.fail(res, dup)
        return False

    def _write_device(self, res: Reservation, h: FrameHeader,
                      fill: Callable[[list[memoryview]], None] | None,
                      payload: torch.Tensor | None) -> None:
        """A device cache: the payload (or a host staging buffer that ``fill`` fills:
        pinned, one per thread) copied into the blocks."""
        nbytes = self.layout.payload_bytes(h.num_layers, h.num_blocks)  # <= the reservation's
        if payload is None:
            payload = self._staging.buf = frames.grow_buffer(
                getattr(self._staging, "buf", None), nbytes, pinned=self.kv.is_cuda)
            fill([memoryview(payload.numpy())[:nbytes]])
        staged = payload[:nbytes].view(self.kv.dtype).view(
            h.num_layers, 2, h.num_blocks, *self.kv.shape[3:])
        dst = res.dst_idx[h.block_start:h.block_start + h.num_blocks]  # [h.num_blocks]
        self.kv[h.layer_start:h.layer_end].index_copy_(2, dst, staged.to(self.kv.device))

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
        res = self.lookup(h.request_id, h.epoch, "DONE")
        if res is None:
            return
        with self._hold(res):
            missing = res.missing()
        num_layers = self.layout.num_layers
        if missing is not None:
            self.fail(res, f"DONE with {missing} (sender claims {h.layer_end} of "
                           f"{num_layers} layers sent)")
            return
        if h.layer_end != num_layers:
            self.fail(res, f"DONE claims {h.layer_end} layers sent, layout has {num_layers}")
            return
        self._finish(res, KVCompletion(h.request_id, True, h.first_token, None))

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
