"""What pdserve/tracing.py exports, bounded: a client's input reaches span attributes (a
request id, an error's message), so every span is bounded (OpenTelemetry's SpanLimits:
MAX_ATTRIBUTE_CHARS a string value, at most MAX_SPAN_ATTRIBUTES attributes and
MAX_SPAN_EVENTS events), and so is the export queue, in spans and in bytes
(BoundedSpanProcessor: a span ended while MAX_QUEUE_BYTES wait is dropped and counted).
Each export call carries at most MAX_EXPORT_BYTES of spans: a collector's gRPC server
takes messages of 4 MiB by default and refuses a larger one whole, losing every trace in
it. Imported by tracing.configure only, so a process that does not trace never imports
the SDK (~50 ms).

The sampler is OpenTelemetry's ParentBased, with the parent of another process that
says sampled (a client's ``traceparent``) followed with probability
`client_sample_ratio`, a random draw per request (`RandomRatio`).
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, SpanProcessor
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import (ALWAYS_ON, Decision, ParentBased, Sampler,
                                              SamplingResult, TraceIdRatioBased)

logger = logging.getLogger(__name__)

MAX_ATTRIBUTE_CHARS = 1024    # a string value (an attribute's, an event's) is cut there
MAX_SPAN_ATTRIBUTES = 64      # pdserve's spans set at most ~20
MAX_SPAN_EVENTS = 64          # a prefill's chunks, a decode worker's slow steps
MAX_EVENT_ATTRIBUTES = 16
MAX_QUEUE_SPANS = 2048        # BatchSpanProcessor's default queue
MAX_QUEUE_BYTES = 16 << 20    # spans waiting for export, counted by span_bytes
MAX_EXPORT_BYTES = 1 << 20    # spans per export call (one OTLP message), by span_bytes
EXPORT_BATCH_SPANS = 512      # BatchSpanProcessor's default batch


def span_limits() -> SpanLimits:
    return SpanLimits(max_attribute_length=MAX_ATTRIBUTE_CHARS,
                      max_span_attributes=MAX_SPAN_ATTRIBUTES, max_events=MAX_SPAN_EVENTS,
                      max_event_attributes=MAX_EVENT_ATTRIBUTES, max_links=0)


def sampler(sample_ratio: float, client_sample_ratio: float = 1.0) -> Sampler:
    """ParentBased(TraceIdRatioBased(`sample_ratio`)) for roots, a remote parent that
    says sampled followed with probability `client_sample_ratio` (1.0: always, as
    ParentBased's default). That draw is random, not by trace id: a client picks its
    trace ids, and would pick ones TraceIdRatioBased always passes."""
    return ParentBased(TraceIdRatioBased(sample_ratio),
                       remote_parent_sampled=ALWAYS_ON if client_sample_ratio >= 1.0
                       else RandomRatio(client_sample_ratio))


class RandomRatio(Sampler):
    """Samples with probability `ratio`, a fresh draw per decision."""

    def __init__(self, ratio: float):
        self.ratio = ratio

    def should_sample(self, parent_context, trace_id, name, kind=None, attributes=None,
                      links=None, trace_state=None) -> SamplingResult:
        drawn = random.random() < self.ratio
        parent = trace.get_current_span(parent_context).get_span_context()
        return SamplingResult(Decision.RECORD_AND_SAMPLE if drawn else Decision.DROP,
                              attributes if drawn else None, parent.trace_state)

    def get_description(self) -> str:
        return f"RandomRatio{{{self.ratio}}}"


def span_bytes(span: ReadableSpan) -> int:
    """About how many bytes `span` holds: its name, attributes, events and status text,
    plus 160 for ids, times and framing (within a small factor of its OTLP encoding)."""
    n = 160 + len(span.name) + _attributes_bytes(span.attributes)
    for event in span.events:
        n += 16 + len(event.name) + _attributes_bytes(event.attributes)
    return n + len(span.status.description or "")


def _attributes_bytes(attributes: Mapping[str, Any] | None) -> int:
    return sum(4 + len(k) + _value_bytes(v) for k, v in (attributes or {}).items())


def _value_bytes(value) -> int:
    if isinstance(value, str):
        return len(value.encode("utf-8", "replace"))
    if isinstance(value, Sequence):
        return sum(_value_bytes(v) for v in value)
    return 8


class BoundedSpanProcessor(SpanProcessor):
    """BatchSpanProcessor over `exporter` (the OTLP one) with its queue bounded in bytes
    as well as in spans: a sampled span ended while MAX_QUEUE_SPANS spans or
    MAX_QUEUE_BYTES (span_bytes) wait is dropped, never queued; `dropped` counts those.
    Export calls carry at most MAX_EXPORT_BYTES each (SplittingExporter)."""

    def __init__(self, exporter: SpanExporter):
        self._lock = threading.Lock()
        self.queued_spans = self.queued_bytes = self.dropped = 0
        self._batch = BatchSpanProcessor(SplittingExporter(exporter, self),
                                         max_queue_size=MAX_QUEUE_SPANS,
                                         max_export_batch_size=EXPORT_BATCH_SPANS)

    def on_start(self, span, parent_context=None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        if not (span.context and span.context.trace_flags.sampled):
            return
        n = span_bytes(span)
        with self._lock:
            full = (self.queued_spans >= MAX_QUEUE_SPANS
                    or self.queued_bytes + n > MAX_QUEUE_BYTES)
            if full:
                self.dropped += 1
                dropped, spans, size = self.dropped, self.queued_spans, self.queued_bytes
            else:
                self.queued_spans += 1
                self.queued_bytes += n
        if not full:
            self._batch.on_end(span)
        elif dropped == 1 or dropped % 1000 == 0:
            logger.warning("tracing: %d spans dropped so far: the export queue is full "
                           "(%d spans, %d bytes waiting)", dropped, spans, size)

    def taken(self, spans: Sequence[ReadableSpan]) -> None:
        """`spans` left the queue for an export call."""
        n = sum(span_bytes(s) for s in spans)
        with self._lock:
            self.queued_spans -= len(spans)
            self.queued_bytes -= n

    def shutdown(self) -> None:
        self._batch.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._batch.force_flush(timeout_millis)


class SplittingExporter(SpanExporter):
    """`exporter`'s export in calls of at most MAX_EXPORT_BYTES of spans (a single larger
    span alone), telling `processor` what left its queue."""

    def __init__(self, exporter: SpanExporter, processor: BoundedSpanProcessor):
        self.exporter, self.processor = exporter, processor

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.processor.taken(spans)
        ok, part, size = True, [], 0
        for span in spans:
            n = span_bytes(span)
            if part and size + n > MAX_EXPORT_BYTES:
                ok &= self.exporter.export(part) == SpanExportResult.SUCCESS
                part, size = [], 0
            part.append(span)
            size += n
        if part:
            ok &= self.exporter.export(part) == SpanExportResult.SUCCESS
        return SpanExportResult.SUCCESS if ok else SpanExportResult.FAILURE

    def shutdown(self) -> None:
        self.exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.exporter.force_flush(timeout_millis)
