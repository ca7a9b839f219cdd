"""The prefill worker's spans of traced requests (pdserve/tracing.py): one per prompt,
`prefill_worker`, under the router's prefill span whose context came in the
PrefillOrder, from the call to the first token:

    start(worker_id, order, req)   when the call arrives (None: not traced)
    chunks(out, step_s)            each step (step thread): an event `chunk` on each
                                   traced prompt it computed a chunk of, with the step's
                                   tokens, requests and seconds, so a slow step shows in
                                   every traced prompt it held
    end(span, req, ...)            once answered: seconds queued before it took blocks,
                                   tokens found cached and computed; its KV transfer a
                                   span `kv_transfer` under it, first frame to DONE
"""

from __future__ import annotations

import time

from .. import tracing
from ..engine.block_pool import blocks_needed
from ..engine.outputs import SchedulerOutput
from ..messages import PrefillOrder
from .requests import PrefillRequest


def start(worker_id: str, order: PrefillOrder, req: PrefillRequest):
    """The prompt's span, or None when the router does not trace it."""
    if order.trace_context is None:
        return None
    return tracing.worker_span("prefill_worker", order.trace_context,
                               {"pdserve.worker_id": worker_id,
                                "pdserve.prompt_tokens": req.prompt_len})


def chunks(out: SchedulerOutput, step_s: float) -> None:
    """The step `out`, `step_s` seconds, on each traced prompt it computed a chunk of
    (call before update_from_output: the chunk starts at num_computed_tokens)."""
    for r, n in zip(out.requests, out.num_scheduled_tokens):
        if r.span is not None:
            r.span.add_event("chunk", {
                "pdserve.chunk_start": r.num_computed_tokens, "pdserve.chunk_tokens": n,
                "pdserve.step_tokens": out.total_num_scheduled_tokens,
                "pdserve.step_requests": len(out.requests), "pdserve.step_s": step_s})


def end(span, req: PrefillRequest, order: PrefillOrder, transport: str, block_size: int,
        num_layers: int, error: BaseException | None = None) -> None:
    """End the prompt's span (failed with `error`), its KV transfer recorded under it."""
    if req.kv_send_started is not None and req.kv_send_done is not None:
        tracing.past_span(span, "kv_transfer", req.kv_send_started, req.kv_send_done, {
            "pdserve.kv.transport": transport,
            "pdserve.kv.blocks": blocks_needed(req.prompt_len, block_size)
            - order.num_cached_blocks,
            "pdserve.kv.bytes": req.kv_bytes_sent, "pdserve.kv.layers": num_layers})
    tracing.end(span, {"pdserve.queue_s": (req.scheduled or time.monotonic()) - req.arrived,
                       "pdserve.cached_tokens": req.num_cached,
                       "pdserve.computed_tokens": req.prompt_len - req.num_cached}, error)
