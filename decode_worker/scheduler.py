"""Decode-side scheduler: reservations, KV arrival, the continuous batch, stops.

Lifecycle of a request on a decode worker (pure state; no model, no sockets):

    reserve()            blocks for prompt + max_tokens taken from the pool, under a
        │                lease (deadline); state WAITING_FOR_REMOTE_KV
        ▼
    on_kv_complete()     every layer arrived and the prefill worker's first token came
        │                with the done frame (ok=False -> FINISHED_ERROR, blocks freed)
        ▼
    schedule()           admits arrived requests into RUNNING; applies aborts and lease
        │                expiry; returns the batch for one decode step
        ▼
    update_from_output() appends each sampled token, checks EOS / stop_token_ids /
                         max_tokens / context length, frees finished requests' blocks

Blocks are reserved for the worst case (prompt + max_tokens) up front, so a running
request never needs a block the pool cannot give: no preemption is needed, at the
price of admitting fewer requests than an on-demand policy would.

Thread-safety: every public method takes the scheduler's lock. Blocks are only ever
freed inside schedule()/update_from_output(), i.e. on the step thread between model
steps, so a step never writes into a block that was freed and handed to another
request mid-step; aborts from other threads are recorded and applied there.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..engine.block_pool import BlockPool, blocks_needed
from ..engine.request import RequestState, TokenEvent
from ..engine.sampling_params import SamplingParams


@dataclass(slots=True)
class DecodeRequest:
    request_id: str
    prompt_len: int                      # tokens whose KV arrives from prefill
    params: SamplingParams
    block_table: list[int]
    lease_deadline: float                # time.monotonic() seconds
    state: RequestState = RequestState.WAITING_FOR_REMOTE_KV
    output_ids: list[int] = field(default_factory=list)
    abort_reason: str | None = None      # set by abort(); applied by schedule()
    error: str | None = None

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + len(self.output_ids)


@dataclass(frozen=True, slots=True)
class DecodeBatch:
    """One decode step: feed each request's newest token at position num_tokens - 1."""

    requests: tuple[DecodeRequest, ...]


class DecodeScheduler:
    def __init__(self, pool: BlockPool, block_size: int, max_model_len: int,
                 eos_token_ids: tuple[int, ...], max_batch_size: int = 256,
                 on_release: Callable[[str, Callable[[], None]], None] | None = None):
        """`on_release(request_id, free_blocks)` runs (under the lock) when a request
        finishes, instead of freeing its blocks here: the KV receiver stops writing into
        them and calls `free_blocks()` once no write is in flight (KVReceiver.forget),
        so a block is never reused while prefill's KV still lands in it."""
        self.pool, self.block_size, self.max_model_len = pool, block_size, max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_batch_size = max_batch_size
        self._on_release = on_release
        self._lock = threading.Lock()
        self._requests: dict[str, DecodeRequest] = {}
        self._arrived: list[str] = []
        self._events: list[TokenEvent] = []      # finishes outside a step (errors, aborts)
        self.num_reclaimed = 0

    # --- called from RPC / transport threads --------------------------------------

    def reserve(self, request_id: str, prompt_len: int, params: SamplingParams,
                lease_s: float) -> list[int]:
        """Reserve blocks for prompt + max_tokens. Idempotent per request_id.

        Returns the prompt's block ids (where prefill's KV goes), in order.
        Raises:
            NoFreeBlocksError: the pool cannot hold the request now (nothing taken).
        """
        assert prompt_len < self.max_model_len, (prompt_len, self.max_model_len)  # router checks
        with self._lock:
            req = self._requests.get(request_id)
            if req is None:
                total = min(prompt_len + params.max_tokens, self.max_model_len)
                blocks = self.pool.allocate(blocks_needed(total, self.block_size))
                req = DecodeRequest(request_id, prompt_len, params, blocks,
                                    time.monotonic() + lease_s)
                self._requests[request_id] = req
            return req.block_table[:blocks_needed(prompt_len, self.block_size)]

    def on_kv_complete(self, request_id: str, ok: bool, first_token: int | None,
                       error: str | None = None) -> None:
        """Prefill's KV for the request has all arrived (ok) or failed."""
        with self._lock:
            req = self._requests.get(request_id)
            if req is None or req.state != RequestState.WAITING_FOR_REMOTE_KV:
                return
            if ok:
                req.output_ids.append(first_token)
                self._arrived.append(request_id)
            else:
                req.abort_reason = error or "KV transfer failed"
                req.error = req.abort_reason

    def abort(self, request_id: str, reason: str = "cancelled") -> None:
        with self._lock:
            req = self._requests.get(request_id)
            if req is not None and not req.state.finished and req.abort_reason is None:
                req.abort_reason = reason

    # --- called from the step thread ----------------------------------------------

    def schedule(self, now: float | None = None) -> DecodeBatch:
        """Admit arrived requests, apply aborts and expired leases; the next batch."""
        now = time.monotonic() if now is None else now
        with self._lock:
            for rid in self._arrived:
                req = self._requests.get(rid)
                if req is not None and req.abort_reason is None:
                    req.state = RequestState.RUNNING
                    self._check_stop(req)       # the first token may already finish it
            self._arrived.clear()
            for req in list(self._requests.values()):
                if req.abort_reason is not None:
                    state = RequestState.FINISHED_ERROR if req.error else RequestState.FINISHED_ABORTED
                    self._finish(req, state)
                elif req.state == RequestState.WAITING_FOR_REMOTE_KV and now > req.lease_deadline:
                    self.num_reclaimed += 1
                    req.error = "KV reservation lease expired before prefill's KV arrived"
                    self._finish(req, RequestState.FINISHED_ERROR)
            running = [r for r in self._requests.values() if r.state == RequestState.RUNNING]
            return DecodeBatch(tuple(running[:self.max_batch_size]))

    def update_from_output(self, batch: DecodeBatch, token_ids: list[int]) -> list[TokenEvent]:
        """Append one sampled token per batch row; returns the step's events (and any
        finishes recorded since the last call)."""
        with self._lock:
            events = self._events
            self._events = []
            for req, tok in zip(batch.requests, token_ids, strict=True):
                if req.state != RequestState.RUNNING or req.abort_reason is not None:
                    continue  # aborted mid-step: schedule() finishes it
                req.output_ids.append(tok)
                if self._check_stop(req, emit=False):
                    events.append(TokenEvent(req.request_id, (tok,), req.state.finish_reason))
                else:
                    events.append(TokenEvent(req.request_id, (tok,)))
            return events

    def drain_events(self) -> list[TokenEvent]:
        with self._lock:
            events, self._events = self._events, []
            return events

    # --- helpers (lock held) ------------------------------------------------------

    def _check_stop(self, req: DecodeRequest, emit: bool = True) -> bool:
        tok, p = req.output_ids[-1], req.params
        if (not p.ignore_eos and tok in self.eos_token_ids) or tok in p.stop_token_ids:
            state = RequestState.FINISHED_STOPPED
        elif len(req.output_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            state = RequestState.FINISHED_LENGTH
        else:
            return False
        self._finish(req, state, emit=emit)
        return True

    def _finish(self, req: DecodeRequest, state: RequestState, emit: bool = True) -> None:
        req.state = state
        del self._requests[req.request_id]
        blocks = req.block_table
        if self._on_release is not None:
            self._on_release(req.request_id, lambda: self.pool.free(blocks))
        else:
            self.pool.free(blocks)
        if emit:
            self._events.append(TokenEvent(req.request_id, (), state.finish_reason, req.error))

    # --- introspection --------------------------------------------------------------

    def counts(self) -> tuple[int, int]:
        """(running, waiting_for_remote_kv) request counts."""
        with self._lock:
            running = sum(r.state == RequestState.RUNNING for r in self._requests.values())
            return running, len(self._requests) - running

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._arrived or self._events or any(
                r.state == RequestState.RUNNING or r.abort_reason for r in self._requests.values()))

    def next_lease_deadline(self) -> float | None:
        with self._lock:
            return min((r.lease_deadline for r in self._requests.values()
                        if r.state == RequestState.WAITING_FOR_REMOTE_KV), default=None)
