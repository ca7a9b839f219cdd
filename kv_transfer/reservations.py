"""Receiver-side state machine, shared by every transport: which requests D expects,
into which blocks, which layers have arrived, and when to call ``on_complete``.

Per expected request::

    expect() -> WAITING --first KV frame--> TRANSFERRING --DONE, all layers--> DONE
                   |                             |
                   +-----------------------------+--abort / stale epoch / lost
                                                     connection / bad frame--> FAILED

Every transition into DONE or FAILED calls ``on_complete`` exactly once, outside the
table's locks. ``forget`` removes a request without a callback; once it returns, no
frame writes into that request's blocks any more (it waits out a scatter in flight),
so D may hand those blocks to someone else.
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

from .base import MAX_REQUEST_ID_BYTES, KVCompletion, KVLayout, TransferState
from . import host_io
from .frames import FrameHeader

logger = logging.getLogger(__name__)

# Finished records kept for state(); older ones are dropped so a long-running D
# that never calls forget() does not grow without bound.
MAX_FINISHED_RECORDS = 8192


@dataclass(eq=False)
class Reservation:
    """One expected request. Mutable; guarded by ``lock`` (internal, never crosses a
    module boundary except as an opaque handle to the transport)."""

    request_id: str
    dst_idx: torch.Tensor  # [num_blocks] int64, on kv.device
    layers_seen: list[bool]  # [num_layers]
    state: TransferState = TransferState.WAITING
    conn_ids: set[int] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Two-phase forget: set when forget() found a write in flight; whoever releases
    # `lock` next runs it (guarded by `meta`), so the blocks go back to D's pool only
    # once nothing writes into them, and forget() itself never blocks.
    on_quiescent: Callable[[], None] | None = None
    meta: threading.Lock = field(default_factory=threading.Lock)
    # Receives posted straight into the blocks and not yet complete (see begin_direct);
    # on_quiescent waits for them too. Guarded by `lock`.
    writes_in_flight: int = 0

    @functools.cached_property
    def runs(self) -> list[tuple[int, int]]:
        """dst blocks as runs of consecutive ids (host_io.block_runs)."""
        return host_io.block_runs(self.dst_idx.tolist())

    @functools.cached_property
    def _run_ends(self) -> list[tuple[int, int]]:
        """For each block-table position: (first block id of the rest of its run, table
        position where that run ends)."""
        out, pos = [], 0
        for first, n in self.runs:
            out += [(first + i, pos + n) for i in range(n)]
            pos += n
        return out

    def consecutive(self, first: int, n: int) -> int | None:
        """The block id at table position ``first`` if the ``n`` blocks from there are
        consecutive ids (one region of the cache), else None."""
        start, end = self._run_ends[first]
        return start if first + n <= end else None

    @property
    def num_blocks(self) -> int:
        return self.dst_idx.numel()


class ReservationTable:
    """Thread-safe table of expected requests for one receiver (one epoch)."""

    def __init__(
        self,
        kv: torch.Tensor,
        layout: KVLayout,
        epoch: int,
        on_complete: Callable[[KVCompletion], None],
    ) -> None:
        self.kv = kv  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        self.layout = layout
        self.epoch = epoch
        self._on_complete = on_complete
        self._host_view = host_io.HostCacheView(kv)
        self._lock = threading.Lock()
        self._active: dict[str, Reservation] = {}
        self._finished: OrderedDict[str, TransferState] = OrderedDict()

    # ---- decode-worker side -------------------------------------------------------

    def expect(self, request_id: str, dst_block_ids: Sequence[int]) -> None:
        """Register a reservation. Idempotent for the same blocks; ValueError for bad ids
        or for re-expecting an active request with different blocks."""
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
                if old.dst_idx.tolist() != ids:
                    raise ValueError(
                        f"request {request_id} already expected with other blocks"
                    )
                return
            self._finished.pop(request_id, None)
            self._active[request_id] = Reservation(
                request_id=request_id,
                dst_idx=torch.tensor(ids, dtype=torch.long, device=self.kv.device),
                layers_seen=[False] * self.layout.num_layers,
            )

    def forget(self, request_id: str, on_quiescent: Callable[[], None] | None = None) -> None:
        """Stop expecting a request; no later frame writes into its blocks.

        Never blocks. `on_quiescent()` runs once no write into the blocks is in flight:
        at once when none is, else from the receiving thread when its write ends. D
        frees the blocks there, so a block is never handed out while still written.
        """
        with self._lock:
            res = self._active.pop(request_id, None)
            self._finished.pop(request_id, None)
        if res is None:
            if on_quiescent is not None:
                on_quiescent()
            return
        with res.meta:
            res.on_quiescent = on_quiescent
        if res.lock.acquire(blocking=False):   # no write in flight (or it just ended)
            res.state = TransferState.FAILED
            self._release(res)
        # else: the writer's _release runs on_quiescent

    @contextlib.contextmanager
    def _hold(self, res: Reservation):
        """Hold `res.lock` (writes, state changes); on exit run a pending on_quiescent."""
        res.lock.acquire()
        try:
            yield
        finally:
            self._release(res)

    @staticmethod
    def _release(res: Reservation) -> None:
        forgotten = res.request_id  # for the log line only
        busy = res.writes_in_flight > 0  # then the last end_direct runs on_quiescent
        res.lock.release()
        if busy:
            return
        with res.meta:
            cb, res.on_quiescent = res.on_quiescent, None
        if cb is not None:
            res.state = TransferState.FAILED
            try:
                cb()
            except Exception:  # a buggy callback must not kill the receiver thread
                logger.exception("on_quiescent raised for request %s", forgotten)

    def state(self, request_id: str) -> TransferState:
        with self._lock:
            res = self._active.get(request_id)
            if res is not None:
                return res.state
            try:
                return self._finished[request_id]
            except KeyError:
                raise KeyError(f"request {request_id!r} is not expected") from None

    def fail_all(self, reason: str) -> None:
        """Fail every active request (receiver shutting down)."""
        with self._lock:
            pending = list(self._active.values())
        for res in pending:
            self.fail(res, reason)

    # ---- transport side ------------------------------------------------------------

    def admit_kv(self, h: FrameHeader, conn_id: int) -> Reservation | None:
        """Reservation a KV frame's payload should be written into, or None if the
        payload must be read and discarded (unknown request, stale epoch, block-count
        mismatch; the latter two fail the request)."""
        res = self._lookup(h.request_id, h.epoch, "KV")
        if res is None:
            return None
        if h.num_blocks != res.num_blocks:
            self.fail(
                res,
                f"KV frame for layers [{h.layer_start}, {h.layer_end}) carries "
                f"{h.num_blocks} blocks, reservation has {res.num_blocks}",
            )
            return None
        with self._hold(res):
            res.conn_ids.add(conn_id)
        return res

    def write_layers(self, res: Reservation, h: FrameHeader, staged: torch.Tensor) -> None:
        """Scatter ``staged`` [n_layers, 2, num_blocks, block_size, heads, head_dim]
        (layout dtype, on kv.device) into the reservation's blocks, unless the request
        finished or was forgotten meanwhile, or a layer arrives twice (fails it)."""
        dup = None
        with self._hold(res):
            if res.state >= TransferState.DONE:
                logger.debug("request %s finished; dropping KV frame", res.request_id)
                return
            seen = res.layers_seen[h.layer_start : h.layer_end]
            if any(seen):
                dup = h.layer_start + seen.index(True)
            else:
                self.kv[h.layer_start : h.layer_end].index_copy_(2, res.dst_idx, staged)
                res.layers_seen[h.layer_start : h.layer_end] = [True] * h.num_layers
                res.state = TransferState.TRANSFERRING
        if dup is not None:
            self.fail(res, f"layer {dup} received twice")

    def claim_layers(self, res: Reservation, h: FrameHeader) -> bool:
        """Start a KV frame whose payload arrives in pieces (see write_blocks): marks its
        layers as arrived now, so a second frame for them fails the request even while
        this one is still arriving. False when the payload must be discarded: the request
        finished or was forgotten meanwhile, or a layer arrives twice (fails it)."""
        with self._hold(res):
            if res.state >= TransferState.DONE:
                logger.debug("request %s finished; dropping KV frame", res.request_id)
                return False
            seen = res.layers_seen[h.layer_start : h.layer_end]
            if not any(seen):
                res.layers_seen[h.layer_start : h.layer_end] = [True] * h.num_layers
                res.state = TransferState.TRANSFERRING
                return True
            dup = h.layer_start + seen.index(True)
        self.fail(res, f"layer {dup} received twice")
        return False

    def write_blocks(
        self, res: Reservation, layer: int, half: int, first: int, data: torch.Tensor
    ) -> None:
        """Copy ``data`` [n, block_size, heads, head_dim] (layout dtype, on kv.device) into
        K (half 0) or V (half 1) of ``layer`` for the reservation's blocks
        ``first .. first + n - 1`` (indices into its block table), after claim_layers
        admitted the frame; a no-op once the request finished or was forgotten."""
        with self._hold(res):
            if res.state >= TransferState.DONE:
                return
            n = data.shape[0]
            if len(res.runs) == 1:  # one run of blocks: a plain slice of the cache
                start = res.runs[0][0] + first
                self.kv[layer, half, start : start + n].copy_(data)
            else:
                self.kv[layer, half].index_copy_(0, res.dst_idx[first : first + n], data)

    def begin_direct(self, res: Reservation, first: int, n: int) -> int | None:
        """For a transport that receives asynchronously straight into the blocks: the
        first block id when the reservation's blocks ``first .. first + n - 1`` are
        consecutive and the request is still expected, with one write counted in flight;
        every such call must be paired with end_direct once the receive is complete or
        cancelled (forget's on_quiescent waits for it). None otherwise: receive into a
        staging buffer and write_blocks."""
        start = res.consecutive(first, n)
        if start is None:
            return None
        with self._hold(res):
            if res.state >= TransferState.DONE:
                return None
            res.writes_in_flight += 1
        return start

    def end_direct(self, res: Reservation) -> None:
        """A receive counted by begin_direct is complete (or cancelled)."""
        with self._hold(res):
            res.writes_in_flight -= 1

    def write_layers_direct(self, res: Reservation, h: FrameHeader,
                            fill: Callable[[list[memoryview]], None]) -> bool | None:
        """Zero-copy variant of write_layers for a host cache: `fill(regions)` receives
        the payload straight into the reservation's blocks (regions in wire order, see
        host_io.HostCacheView). Returns True once written; False, without calling
        `fill`, when the payload must be discarded (request finished or forgotten,
        duplicate layer); None when the direct path does not apply (CUDA cache, too
        many block runs): use write_layers with a staged copy. Exceptions from `fill` propagate;
        the connection's requests then fail through connection_lost()."""
        regions = self._host_view.regions(h.layer_start, h.layer_end, res.runs)
        if regions is None:
            return None
        dup = None
        with self._hold(res):
            if res.state >= TransferState.DONE:
                logger.debug("request %s finished; dropping KV frame", res.request_id)
                return False
            seen = res.layers_seen[h.layer_start : h.layer_end]
            if any(seen):
                dup = h.layer_start + seen.index(True)
            else:
                fill(regions)
                res.layers_seen[h.layer_start : h.layer_end] = [True] * h.num_layers
                res.state = TransferState.TRANSFERRING
                return True
        self.fail(res, f"layer {dup} received twice")
        return False

    def on_done(self, h: FrameHeader) -> None:
        res = self._lookup(h.request_id, h.epoch, "DONE")
        if res is None:
            return
        with self._hold(res):
            missing = [i for i, s in enumerate(res.layers_seen) if not s]
        if missing or h.layer_end != self.layout.num_layers:
            self.fail(
                res,
                f"DONE after {self.layout.num_layers - len(missing)} of "
                f"{self.layout.num_layers} layers (sender claims {h.layer_end}); "
                f"missing {missing[:8]}{'...' if len(missing) > 8 else ''}",
            )
            return
        self._finish(res, KVCompletion(h.request_id, True, h.first_token, None))

    def on_abort(self, h: FrameHeader, reason: str) -> None:
        res = self._lookup(h.request_id, h.epoch, "ABORT")
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

    def _lookup(self, request_id: str, epoch: int, what: str) -> Reservation | None:
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
        if not completion.ok:
            logger.warning("KV transfer of request %s failed: %s", res.request_id, completion.error)
        try:
            self._on_complete(completion)
        except Exception:  # a buggy callback must not kill the receiver thread
            logger.exception("on_complete raised for request %s", res.request_id)
