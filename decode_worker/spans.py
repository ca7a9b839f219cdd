"""The decode worker's spans of traced requests (pdserve/tracing.py): one per request,
from its reservation to the end of its last sample, under the router's attempt span.

    start(request, samples, context)   at reserve, before the step thread may run it,
                                       when the router traces the request
    cancel(request)                    the reservation was refused or failed
    kv_arrived(completions)            its KV transfer ended: a span `kv_arrival` under
                                       the request's, from the reservation to the step
                                       loop's poll that saw the last frame (ok or not):
                                       D's side of the transfer, in
                                       the trace P's `kv_transfer` is in (the context
                                       came with the reservation, before any frame)
    step(out, step_s)                  each step (step thread): the request's steps
                                       counted; its first step, and any step slower
                                       than twice the worker's running mean, recorded
                                       as an event `step` with the batch it ran in, so
                                       a slow step shows in every traced request it held
    finished(events)                   its samples' last events: the span ends once all
                                       of them ended (finish reason, steps, mean step),
                                       or once sample 0 is cancelled or fails before any
                                       other sample was seen (they were never forked)

Empty (falsy) unless a traced request is in flight, so the step loop skips it with one
check. Thread-safe: start() runs on the actor's event loop, the rest on the step thread.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from .. import tracing
from ..engine.outputs import SchedulerOutput
from ..engine.request import TokenEvent
from .fork import sample_id

SLOW = 2.0           # a step this many times the running mean is recorded as an event
ALPHA = 0.1          # the running mean's weight per step


@dataclass(slots=True)
class _Traced:
    span: Any
    base: str                        # the request's id (sample 0's)
    num_samples: int
    samples: int                     # not finished yet
    reserved: float = field(default_factory=time.perf_counter)
    steps: int = 0
    step_s: float = 0.0              # summed over its steps
    reasons: list[str] = field(default_factory=list)
    forked: bool = False             # a sample other than 0 was seen


_FAILED = ("cancelled", "error")


class DecodeSpans:
    """The spans of the traced requests in flight on one decode worker; see the module
    docstring."""

    def __init__(self) -> None:
        self._by_id: dict[str, _Traced] = {}     # every sample's id -> its request's
        self._lock = threading.Lock()
        self._mean_step_s: float | None = None   # over steps that held a traced request

    def __bool__(self) -> bool:
        return bool(self._by_id)

    def start(self, request_id: str, num_samples: int, context: dict) -> None:
        """Trace `request_id` (with its samples) under the router's span in `context`."""
        with self._lock:
            if request_id in self._by_id:          # a repeated reserve: already traced
                return
        span = tracing.worker_span("decode_worker", context, {"pdserve.request_id": request_id})
        if span is None:
            return
        t = _Traced(span, request_id, num_samples, num_samples)
        with self._lock:
            for k in range(num_samples):
                self._by_id[sample_id(request_id, k)] = t

    def cancel(self, request_id: str) -> None:
        """End `request_id`'s span: its reservation was refused or failed."""
        with self._lock:
            t = self._by_id.get(request_id)
            if t is None:
                return
            for k in range(t.num_samples):
                self._by_id.pop(sample_id(request_id, k), None)
        tracing.end(t.span, {"pdserve.reserved": False})

    def kv_arrived(self, completions: list) -> None:
        """Transfers ended (kv_transfer KVCompletion each), on the step thread."""
        now = time.perf_counter()
        with self._lock:
            traced = [(c, t) for c in completions if (t := self._by_id.get(c.request_id))]
        for c, t in traced:
            tracing.past_span(t.span, "kv_arrival", t.reserved, now,
                              {"pdserve.kv.ok": c.ok, **({"error.type": "KVTransferError"}
                                                         if not c.ok else {})})

    def step(self, out: SchedulerOutput, step_s: float) -> None:
        """One step of `out` that took `step_s` seconds."""
        with self._lock:
            mean = self._mean_step_s
            self._mean_step_s = step_s if mean is None else mean + ALPHA * (step_s - mean)
            seen = set()
            for req, n in zip(out.requests, out.num_scheduled_tokens):
                t = self._by_id.get(req.request_id)
                if t is None:
                    continue
                t.forked = t.forked or req.request_id != t.base
                if id(t) in seen:
                    continue
                seen.add(id(t))
                t.steps += 1
                t.step_s += step_s
                if t.steps == 1 or (mean is not None and step_s > SLOW * mean):
                    t.span.add_event("step", {
                        "pdserve.step_s": step_s, "pdserve.step_requests": len(out.requests),
                        "pdserve.step_tokens": out.total_num_scheduled_tokens,
                        "pdserve.tokens": n, "pdserve.first": t.steps == 1})

    def finished(self, events: list[TokenEvent]) -> None:
        """End the spans whose requests' last samples these events finish."""
        done = []
        with self._lock:
            for e in events:
                t = self._by_id.get(e.request_id)
                if t is None:
                    continue
                t.forked = t.forked or e.request_id != t.base
                if e.finish_reason is None:
                    continue
                del self._by_id[e.request_id]
                t.samples -= 1
                t.reasons.append(e.finish_reason)
                if t.samples > 0 and not t.forked and e.finish_reason in _FAILED:
                    for k in range(t.num_samples):      # the others were never forked
                        self._by_id.pop(sample_id(t.base, k), None)
                    t.samples = 0
                if t.samples == 0:
                    done.append(t)
        for t in done:
            tracing.end(t.span, {"pdserve.steps": t.steps,
                                 "pdserve.mean_step_s": t.step_s / max(t.steps, 1),
                                 tracing.RESPONSE_FINISH_REASONS: t.reasons})
