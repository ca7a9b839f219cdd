"""OpenTelemetry traces of requests: off unless an OTLP endpoint is configured
(RouterConfig.otlp_traces_endpoint, vLLM's `--otlp-traces-endpoint`).

When on, a process builds its own TracerProvider (never the global one, so libraries
that trace themselves once a global provider exists stay quiet) with a batching OTLP
exporter: gRPC by default, HTTP with ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf``
(the variable vLLM and SGLang read). Sampling is decided once per trace at its root:
a request that arrives without a W3C ``traceparent`` is traced with probability
`sample_ratio`, one whose ``traceparent`` says sampled with probability
`client_sample_ratio` (1.0 by default: the client's flag is followed, as OpenTelemetry's
ParentBased sampler does; lowered, clients cannot force tracing), one that says not
sampled never. Spans and the export queue are bounded (pdserve/trace_export.py): what a
client sends reaches span attributes.

When off, `request_trace` returns None and every caller skips its tracing behind an
``if trace is not None``: no span, attribute or carrier is built on the request path.

Attribute names follow OpenTelemetry's GenAI semantic conventions (``gen_ai.*``, the
strings copied here: the conventions package marks them in development); pdserve's own
are under ``pdserve.``.
"""

from __future__ import annotations

import contextvars
import logging
import os
import time
from collections.abc import Iterable, Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

logger = logging.getLogger(__name__)

# OpenTelemetry GenAI semantic conventions (semantic-conventions-genai, gen-ai-spans.md)
OPERATION = "gen_ai.operation.name"
PROVIDER = "gen_ai.provider.name"
REQUEST_MODEL = "gen_ai.request.model"
REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
REQUEST_TEMPERATURE = "gen_ai.request.temperature"
REQUEST_TOP_P = "gen_ai.request.top_p"
REQUEST_CHOICES = "gen_ai.request.choice.count"
RESPONSE_ID = "gen_ai.response.id"
RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
RESPONSE_TTFT = "gen_ai.response.time_to_first_chunk"      # seconds
USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
ERROR_TYPE = "error.type"

_W3C = TraceContextTextMapPropagator()   # traceparent / tracestate only, whatever
                                         # OTEL_PROPAGATORS says
_provider = None   # this process's TracerProvider, once configure() ran with an endpoint
_tracer = None


# The request this asyncio task (or thread) serves, for its log records: (request id,
# trace id in hex or None). Set where a request starts on each process (set_log_request).
_log_request: contextvars.ContextVar[tuple[str, str | None] | None] = contextvars.ContextVar(
    "pdserve_log_request", default=None)


LOG_FORMAT = "%(levelname)s %(name)s%(request)s: %(message)s"


class RequestInLogs(logging.Filter):
    """Gives every record `request` (" [request <id> trace <hex>]" while a request's
    code logs, else ""), for the format configure_logging sets. The router refuses a
    request_id that is not printable (router/validation.py); one set otherwise (a
    worker driven directly) is written escaped, so an id never starts a log line."""

    def filter(self, record: logging.LogRecord) -> bool:
        current = _log_request.get()
        if current is None:
            record.request = ""
        else:
            rid, trace_id = current
            if not rid.isprintable():
                rid = rid.encode("unicode_escape").decode("ascii")
            record.request = f" [request {rid}" + (f" trace {trace_id}]" if trace_id else "]")
        return True


def configure_logging(level: str | int) -> None:
    """This process's logging (logging.basicConfig at `level`), each record naming the
    request and, when traced, the trace its code serves (set_log_request)."""
    logging.basicConfig(level=level, format=LOG_FORMAT)
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, RequestInLogs) for f in handler.filters):
            handler.addFilter(RequestInLogs())


def set_log_request(request_id: str, span=None) -> None:
    """Name `request_id` (and the trace of `span`, when traced) in the log records of
    this asyncio task and of the tasks it starts from now on."""
    trace_id = None
    if span is not None and span.get_span_context().trace_id:
        trace_id = format(span.get_span_context().trace_id, "032x")
    _log_request.set((request_id, trace_id))


def configure(endpoint: str | None, service_name: str, sample_ratio: float = 1.0,
              attributes: Mapping[str, Any] | None = None,
              client_sample_ratio: float = 1.0) -> bool:
    """Trace this process's requests to the OTLP collector at `endpoint` (host:port for
    gRPC, or a URL; None: tracing stays off). `attributes` join the resource's
    (``service.name`` is `service_name`). A request without a trace context is traced
    with probability `sample_ratio`, one whose context says sampled with probability
    `client_sample_ratio` (the router's: a worker's parent is the router's span, which
    a worker always follows). Returns whether tracing is on.

    Raises:
        ValueError: a ratio outside [0, 1], or an unknown
            OTEL_EXPORTER_OTLP_TRACES_PROTOCOL.
    """
    global _provider, _tracer
    if endpoint is None:
        return False
    for name, ratio in (("otlp_traces_sample_ratio", sample_ratio),
                        ("otlp_traces_client_sample_ratio", client_sample_ratio)):
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"{name}={ratio}: must be in [0, 1]")
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    from . import trace_export

    provider = TracerProvider(
        resource=Resource.create({"service.name": service_name, "process.pid": os.getpid(),
                                  **(attributes or {})}),
        sampler=trace_export.sampler(sample_ratio, client_sample_ratio),
        span_limits=trace_export.span_limits())
    provider.add_span_processor(trace_export.BoundedSpanProcessor(_exporter(endpoint)))
    _provider, _tracer = provider, provider.get_tracer("pdserve")
    logger.info("tracing requests to %s (sampled %.3g, a client's sampled flag %.3g)",
                endpoint, sample_ratio, client_sample_ratio)
    return True


def _exporter(endpoint: str):
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        return OTLPSpanExporter(endpoint, insecure=not endpoint.startswith("https://"))
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        return OTLPSpanExporter(endpoint)
    raise ValueError(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL={protocol!r}: choose grpc or "
                     "http/protobuf")


def enabled() -> bool:
    return _tracer is not None


def flush(timeout_s: float = 5.0) -> None:
    """Export the spans ended so far (before a process exits)."""
    if _provider is not None:
        _provider.force_flush(int(timeout_s * 1000))


class RequestTrace:
    """The spans of one request in this process: a root span, parented on the W3C
    context in `carrier` (a client's ``traceparent``/``tracestate`` headers or gRPC
    metadata), and the spans opened under it. Spans are started and ended explicitly,
    not made current: a request's code runs in async generators, across yields."""

    def __init__(self, name: str, carrier: Mapping[str, str] | None,
                 attributes: Mapping[str, Any]):
        parent = _W3C.extract(dict(carrier)) if carrier else None
        self.root = _tracer.start_span(name, context=parent, kind=trace.SpanKind.SERVER,
                                       attributes=dict(attributes))

    def start(self, name: str, parent=None, attributes: Mapping[str, Any] | None = None):
        """A span named `name` under `parent` (a span; the root when None), started now;
        end it with tracing.end."""
        ctx = trace.set_span_in_context(parent if parent is not None else self.root)
        return _tracer.start_span(name, context=ctx, attributes=dict(attributes or {}))

    @staticmethod
    def carrier(span) -> dict[str, str]:
        """`span`'s W3C context (``traceparent``), for a worker's spans under it
        (PrefillOrder.trace_context, DecodeWorker.reserve's trace_context)."""
        out: dict[str, str] = {}
        _W3C.inject(out, trace.set_span_in_context(span))
        return out


def end(span, attributes: Mapping[str, Any] | None = None,
        error: BaseException | None = None) -> None:
    """Set `attributes` on `span`, mark it failed with `error` (its type, the exception
    recorded), and end it."""
    if attributes:
        span.set_attributes(dict(attributes))
    if error is not None:
        span.set_attribute(ERROR_TYPE, type(error).__name__)
        span.record_exception(error)
        span.set_status(Status(StatusCode.ERROR, str(error)[:200]))
    span.end()


def worker_span(name: str, carrier: Mapping[str, str] | None,
                attributes: Mapping[str, Any] | None = None):
    """A span named `name`, started now under the router's span whose W3C context is
    `carrier` (from a typed message); None when the request is not traced (no carrier,
    or one its sampling left out) or this process does not trace. End it with `end`."""
    if _tracer is None or not carrier:
        return None
    span = _tracer.start_span(name, context=_W3C.extract(dict(carrier)),
                              attributes=dict(attributes or {}))
    return span if span.is_recording() else None


def past_span(parent, name: str, start: float, end_: float,
              attributes: Mapping[str, Any] | None = None) -> None:
    """A span named `name` under `parent` (a span) that ran from `start` to `end_`
    (time.perf_counter() seconds), recorded now that it is over."""
    offset = time.time_ns() - time.perf_counter_ns()
    span = _tracer.start_span(name, context=trace.set_span_in_context(parent),
                              attributes=dict(attributes or {}),
                              start_time=offset + int(start * 1e9))
    span.end(end_time=offset + int(end_ * 1e9))


def request_trace(name: str, carrier: Mapping[str, str] | None,
                  attributes: Mapping[str, Any]) -> RequestTrace | None:
    """A RequestTrace, or None when tracing is off or the sampling leaves this request
    out (the caller then skips every span: no carrier goes to the workers)."""
    if _tracer is None:
        return None
    trace_ = RequestTrace(name, carrier, attributes)
    return trace_ if trace_.root.is_recording() else None


def trace_headers(headers: Iterable[tuple[str, str]]) -> dict[str, str] | None:
    """The W3C trace context among a request's (key, value) headers or gRPC metadata
    (keys matched case-insensitively), or None when it has none or tracing is off."""
    if _tracer is None:
        return None
    found = {k.lower(): v for k, v in headers if k.lower() in ("traceparent", "tracestate")}
    return found or None
