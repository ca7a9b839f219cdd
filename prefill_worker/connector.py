"""The prefill worker's side of the KV connector, polled like the decode worker's.

The step loop hands it each chunk's layers as they are computed and each prompt once it
is done (its first token sampled, or failed, or aborted); one send thread moves them to
the decode worker through the transport (kv_transfer: ``KVSender.send_layers``, then
``send_done`` or ``send_abort``). The step loop polls ``get_finished()`` for the requests
whose transfer ended, and only then releases their blocks and answers the router: the
mirror of D's step loop polling ``KVReceiver.get_finished()`` (vLLM's KV connector has
the same split: the model runner saves layers, the scheduler asks what finished)::

    step thread                               send thread
    save_layers(req, i, i+1, lo, hi)   ──▶    sender.send_layers(layer i, blocks lo..hi)
    request_finished(req, first_token) ──▶    sender.send_done(first_token), or
                                              send_abort(why) when it failed
    get_finished() -> [req]            ◀──    once DONE / ABORT went out; notify()

``notify`` wakes the step loop, which also polls between layers of a forward, so a
finished request's blocks wait at most one layer's compute (none when P is idle). The
first token itself goes out at once (``on_done``, from the send thread): answering
from the poll cost mean TTFT +4% at rate inf (4.95 s against 4.69 s, ``vllm bench
serve`` fp32, 4 and 2 runs), as requests finished at the end of one batch
waited for a layer of the next. A failed transfer fails that request only
(``req.finish`` says why).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..kv_transfer import KVSender, KVTransferError
from .requests import FinishCause, PrefillRequest, fail

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _SendLayers:
    req: PrefillRequest
    layer_start: int
    layer_end: int
    block_lo: int                    # block-table positions [block_lo, block_hi)
    block_hi: int


@dataclass(frozen=True, slots=True)
class _SendDone:
    req: PrefillRequest
    first_token: int | None          # None on a rank that did not sample it
    ok: bool                         # False: the prefill failed or was aborted (ABORT)


class PrefillKVConnector:
    """Send queue and thread of one prefill worker; see the module docstring.

    sender: the transport's KVSender over P's cache. num_layers: the model's layer count
    (DONE says all were sent). notify: wakes the step loop (quick, thread-safe).
    on_done(req, first_token): runs on the send thread once DONE went out (the answer
    to the router; the blocks still wait for get_finished()). observe_transfer_s: gets
    each completed transfer's seconds, first send to DONE. targets(d_size): what this
    rank sends a decode worker of d_size ranks, (decode rank, KV heads or None for all)
    pairs (kv_transfer/tp_plan.py rank_targets; default: one rank each side); a request's
    decode ranks are at ``(req.kv_address, *req.kv_rank_addresses)``.
    """

    def __init__(self, sender: KVSender, num_layers: int, notify: Callable[[], None],
                 on_done: Callable[[PrefillRequest, int], None] | None = None,
                 observe_transfer_s: Callable[[float], None] | None = None,
                 targets: Callable[[int], Sequence[tuple[int, range | None]]] | None = None
                 ) -> None:
        self.sender, self.num_layers = sender, num_layers
        self._targets = targets or (lambda d_size: ((0, None),))
        self._notify, self._on_done, self._observe = notify, on_done, observe_transfer_s
        self.kv_bytes_sent = 0          # K/V payload bytes sent to decode workers
        self.kv_send_failures = 0       # requests whose KV could not be sent
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()   # guards _finished
        self._finished: list[PrefillRequest] = []
        self._thread = threading.Thread(target=self._send_loop, name="prefill-send",
                                        daemon=True)
        self._thread.start()

    def save_layers(self, req: PrefillRequest, layer_start: int, layer_end: int,
                    block_lo: int, block_hi: int) -> None:
        """Queue layers [layer_start, layer_end) of the request's blocks at block-table
        positions [block_lo, block_hi) (P's; D's reservation starts after its
        num_cached_blocks). Skipped once the request failed or was aborted."""
        self._tasks.put(_SendLayers(req, layer_start, layer_end, block_lo, block_hi))

    def request_finished(self, req: PrefillRequest, first_token: int | None,
                         ok: bool | None = None) -> None:
        """The request's prompt is done (first_token), or failed / was aborted (None:
        ABORT instead of DONE; ``ok=True`` with None: DONE without a token, from a
        tensor-parallel rank that did not sample it). Its blocks must stay until
        get_finished() lists it."""
        self._tasks.put(_SendDone(req, first_token,
                                  first_token is not None if ok is None else ok))

    def get_finished(self) -> list[PrefillRequest]:
        """Requests whose transfer ended since the last call, each once (``req.finish``
        set when it failed; a sent one was answered at DONE through ``on_done``)."""
        with self._lock:
            finished, self._finished = self._finished, []
        return finished

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the send thread after what is queued; then close the sender."""
        self._tasks.put(None)
        self._thread.join(timeout_s)
        self.sender.close()

    def _send_loop(self) -> None:
        while (task := self._tasks.get()) is not None:
            req = task.req
            try:
                if isinstance(task, _SendLayers):
                    if req.finish is None:
                        self._send_layers(task)
                    continue
                if req.finish is not None or not task.ok:
                    fail(req, FinishCause.ABORTED, f"request {req.request_id} aborted")
                    self._try_send_abort(req)
                else:
                    for address, heads in self._destinations(req):
                        self.sender.send_done(address, req.request_id, req.epoch,
                                              task.first_token, self.num_layers, heads=heads)
                    req.kv_send_done = time.perf_counter()
                    if self._on_done is not None:
                        self._on_done(req, task.first_token)
                    if req.kv_send_started is not None and self._observe is not None:
                        self._observe(req.kv_send_done - req.kv_send_started)
            except Exception as e:  # KVTransferError, or a bug: it fails this request only
                if not isinstance(e, KVTransferError):
                    logger.exception("KV send of %s failed unexpectedly", req.request_id)
                if req.finish is None:
                    self.kv_send_failures += 1
                fail(req, FinishCause.TRANSFER, str(e) if isinstance(e, KVTransferError)
                     else f"KV send failed: {type(e).__name__}: {e}")   # names the address
                # a failed pairing is logged by the sender, once per decode worker
                pairing = isinstance(e, KVTransferError) and e.pairing
                logger.log(logging.DEBUG if pairing else logging.WARNING,
                           "%s: %s", req.request_id, req.finish.message)
                if isinstance(task, _SendLayers):
                    continue      # the request's _SendDone, still queued, finishes it
            with self._lock:
                self._finished.append(req)
            self._notify()

    def _send_layers(self, task: _SendLayers) -> None:
        req = task.req
        if req.kv_send_started is None:
            req.kv_send_started = time.perf_counter()
        lo, hi = task.block_lo, task.block_hi
        for address, heads in self._destinations(req):
            sent = self.sender.send_layers(
                address, req.request_id, req.epoch, task.layer_start, task.layer_end,
                req.block_table[lo:hi], block_start=lo - req.num_cached_blocks, heads=heads)
            self.kv_bytes_sent += sent
            req.kv_bytes_sent += sent

    def _destinations(self, req: PrefillRequest) -> list[tuple[tuple[str, int], range | None]]:
        """(decode rank's KV address, KV heads) for each decode rank this rank sends."""
        ranks = (req.kv_address, *req.kv_rank_addresses)
        return [(ranks[d], heads) for d, heads in self._targets(len(ranks))]

    def _try_send_abort(self, req: PrefillRequest) -> None:
        for address, _ in self._destinations(req):
            try:
                self.sender.send_abort(address, req.request_id, req.epoch, req.finish.message)
            except KVTransferError as e:
                logger.debug("abort frame for %s not sent: %s", req.request_id, e)
