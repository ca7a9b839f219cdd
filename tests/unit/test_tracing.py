"""pdserve/tracing.py off (the default): no trace, no carrier, nothing read from the
headers; the config refuses a sample ratio outside [0, 1] and the workers trace where
the router does. On (pdserve/trace_export.py, over a recording exporter): a span's
attributes and events are bounded, the export queue in bytes, each export call's size,
and a client's sampled flag counts only as far as otlp_traces_client_sample_ratio says."""

import pytest

from pdserve import tracing
from pdserve.config import ClusterConfig
from pdserve.router.config import RouterConfig


def test_off_by_default_nothing_is_built():
    assert not tracing.enabled()
    assert tracing.request_trace("llm_request", {"traceparent": "x"}, {}) is None
    assert tracing.trace_headers([("traceparent", f"00-{'1' * 32}-{'2' * 16}-01")]) is None
    assert tracing.worker_span("prefill_worker", {"traceparent": "x"}) is None
    assert tracing.configure(None, "pdserve-router") is False and not tracing.enabled()


def test_config_bounds_and_the_workers_follow_the_router():
    with pytest.raises(ValueError, match="otlp_traces_sample_ratio"):
        RouterConfig(otlp_traces_sample_ratio=1.5)
    cfg = ClusterConfig(router=RouterConfig(otlp_traces_endpoint="127.0.0.1:4317"))
    assert cfg.prefill.otlp_traces_endpoint == cfg.decode.otlp_traces_endpoint == "127.0.0.1:4317"
    assert ClusterConfig().decode.otlp_traces_endpoint is None


def test_log_records_name_the_request_their_task_serves():
    """configure_logging's filter: a record logged by a request's asyncio task (and the
    tasks it starts) names the request, and its trace when traced; others nothing."""
    import asyncio
    import io
    import logging

    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter(tracing.LOG_FORMAT))
    handler.addFilter(tracing.RequestInLogs())
    log = logging.getLogger("pdserve.test-request-logs")
    log.addHandler(handler)
    log.propagate = False

    class Traced:
        def get_span_context(self):
            return type("C", (), {"trace_id": 0x4BF92F3577B34DA6A3CE929D0E0E4736})()

    async def serve(rid, span):
        tracing.set_log_request(rid, span)
        log.warning("in %s", rid)
        await asyncio.get_running_loop().create_task(asyncio.sleep(0))
        await asyncio.create_task(asyncio.to_thread(log.warning, "its thread"))

    async def main():
        await asyncio.gather(serve("a", None), serve("b", Traced()))
        log.warning("outside")

    try:
        asyncio.run(main())
    finally:
        log.removeHandler(handler)
    lines = out.getvalue().splitlines()
    assert "WARNING pdserve.test-request-logs [request a]: in a" in lines
    assert ("WARNING pdserve.test-request-logs [request b trace "
            "4bf92f3577b34da6a3ce929d0e0e4736]: in b") in lines
    assert "WARNING pdserve.test-request-logs [request a]: its thread" in lines
    assert lines[-1] == "WARNING pdserve.test-request-logs: outside"


def _provider(exporter, sample_ratio=1.0, client_sample_ratio=1.0):
    from opentelemetry.sdk.trace import TracerProvider

    from pdserve import trace_export

    processor = trace_export.BoundedSpanProcessor(exporter)
    provider = TracerProvider(sampler=trace_export.sampler(sample_ratio, client_sample_ratio),
                              span_limits=trace_export.span_limits())
    provider.add_span_processor(processor)
    return provider, processor


class _Recording:
    """A SpanExporter that keeps each export call's spans."""

    def __init__(self):
        self.calls = []

    def export(self, spans):
        from opentelemetry.sdk.trace.export import SpanExportResult
        self.calls.append(list(spans))
        return SpanExportResult.SUCCESS

    def shutdown(self):
        pass

    def force_flush(self, timeout_millis=30000):
        return True


def test_a_span_holds_bounded_attributes_and_events():
    from pdserve import trace_export

    exporter = _Recording()
    provider, _ = _provider(exporter)
    tracer = provider.get_tracer("t")
    tracer.start_span("huge", attributes={"id": "x" * (8 << 20)}).end()
    span = tracer.start_span("s")
    for i in range(500):
        span.add_event("step", {f"a{j}": "y" * 5000 for j in range(40)})
    span.set_attributes({f"k{i}": i for i in range(100)})
    span.end()
    provider.force_flush()
    huge, got = [s for call in exporter.calls for s in call]
    assert len(huge.attributes["id"]) == trace_export.MAX_ATTRIBUTE_CHARS
    assert len(got.attributes) == trace_export.MAX_SPAN_ATTRIBUTES
    assert len(got.events) == trace_export.MAX_SPAN_EVENTS
    assert all(len(e.attributes) == trace_export.MAX_EVENT_ATTRIBUTES for e in got.events)
    assert all(len(v) == trace_export.MAX_ATTRIBUTE_CHARS
               for e in got.events for v in e.attributes.values())
    provider.shutdown()


def test_the_export_queue_is_bounded_in_bytes_and_export_calls_stay_small():
    """Spans of ~64 KiB each (as many attributes of MAX_ATTRIBUTE_CHARS as a span keeps)
    ended faster than the 5 s batching exports them: those beyond MAX_QUEUE_BYTES are
    dropped, not queued; a flush exports the rest in calls of at most MAX_EXPORT_BYTES;
    afterwards the queue takes spans again."""
    from pdserve import trace_export

    exporter = _Recording()
    provider, processor = _provider(exporter)
    tracer = provider.get_tracer("t")
    fat = {f"k{i}": "z" * 2000 for i in range(trace_export.MAX_SPAN_ATTRIBUTES)}
    for _ in range(400):
        tracer.start_span("fat", attributes=fat).end()
    per_span = trace_export.MAX_SPAN_ATTRIBUTES * (trace_export.MAX_ATTRIBUTE_CHARS + 6)
    assert processor.queued_bytes <= trace_export.MAX_QUEUE_BYTES
    assert processor.dropped >= 400 - trace_export.MAX_QUEUE_BYTES // per_span > 0
    provider.force_flush()
    assert processor.queued_bytes == processor.queued_spans == 0
    exported = [s for call in exporter.calls for s in call]
    assert len(exported) == 400 - processor.dropped
    assert len(exporter.calls) > 1 and all(
        sum(trace_export.span_bytes(s) for s in call) <= trace_export.MAX_EXPORT_BYTES
        for call in exporter.calls)
    tracer.start_span("after").end()
    provider.force_flush()
    assert exporter.calls[-1][-1].name == "after"
    provider.shutdown()


def test_a_clients_sampled_flag_is_followed_only_as_far_as_the_operator_allows():
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    sampled = TraceContextTextMapPropagator().extract(
        {"traceparent": f"00-{'4' * 32}-{'5' * 16}-01"})
    unsampled = TraceContextTextMapPropagator().extract(
        {"traceparent": f"00-{'6' * 32}-{'5' * 16}-00"})

    def traced(provider, context, n=50):
        tracer = provider.get_tracer("t")
        return sum(tracer.start_span("r", context=context).is_recording() for _ in range(n))

    follow, _ = _provider(_Recording(), sample_ratio=0.0)
    assert traced(follow, sampled) == 50           # OpenTelemetry's default: followed
    assert traced(follow, unsampled) == traced(follow, None) == 0
    capped, _ = _provider(_Recording(), sample_ratio=1.0, client_sample_ratio=0.0)
    assert traced(capped, sampled) == 0            # a client cannot force it
    assert traced(capped, None) == 50
    half, _ = _provider(_Recording(), sample_ratio=0.0, client_sample_ratio=0.5)
    assert 5 < traced(half, sampled, 200) < 195    # a draw per request, not by trace id
    # a worker's span under the router's (a remote sampled parent) is always recorded
    router_span = follow.get_tracer("t").start_span("root", context=sampled)
    carrier = {}
    TraceContextTextMapPropagator().inject(carrier, trace.set_span_in_context(router_span))
    worker, _ = _provider(_Recording())
    assert traced(worker, TraceContextTextMapPropagator().extract(carrier)) == 50
    for p in (follow, capped, half, worker):
        p.shutdown()
    with pytest.raises(ValueError, match="otlp_traces_client_sample_ratio"):
        RouterConfig(otlp_traces_client_sample_ratio=-0.1)


def test_a_request_id_that_is_not_printable_is_escaped_in_log_lines():
    import io
    import logging

    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter(tracing.LOG_FORMAT))
    handler.addFilter(tracing.RequestInLogs())
    log = logging.getLogger("pdserve.test-escaped-ids")
    log.addHandler(handler)
    log.propagate = False
    try:
        tracing.set_log_request("r\nERROR pdserve.router: forged\x1b[2J")
        log.warning("real")
    finally:
        tracing._log_request.set(None)
        log.removeHandler(handler)
    assert out.getvalue().splitlines() == [
        "WARNING pdserve.test-escaped-ids [request r\\nERROR pdserve.router: "
        "forged\\x1b[2J]: real"]
