"""decode_worker/spans.py: a traced request's span on the decode worker, under the
router's span whose context it was given; its KV's arrival a span under it; its first step and a step slower than twice
the running mean recorded as events; ended once its last sample finished. An SDK tracer
with an in-memory exporter stands in for the OTLP one."""

from dataclasses import dataclass

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pdserve import tracing
from pdserve.decode_worker.spans import DecodeSpans
from pdserve.engine.outputs import SchedulerOutput
from pdserve.engine.request import TokenEvent
from pdserve.kv_transfer.base import KVCompletion


@dataclass
class Row:
    request_id: str


def test_a_traced_request_s_span_has_its_first_and_slow_steps_and_ends_with_its_samples(
        monkeypatch):
    exporter, provider = InMemorySpanExporter(), TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_tracer", provider.get_tracer("test"))
    attempt = provider.get_tracer("test").start_span("attempt")
    spans = DecodeSpans()
    assert not spans
    spans.start("r", 2, tracing.RequestTrace.carrier(attempt))      # n=2: r and r/1
    out = SchedulerOutput((Row("r"), Row("r/1"), Row("other")), (1, 1, 1))
    spans.kv_arrived([KVCompletion("other", True, 1, None), KVCompletion("r", True, 5, None)])
    for step_s in (0.010, 0.011, 0.010, 0.009, 0.030, 0.012):
        spans.step(out, step_s)
    spans.finished([TokenEvent("r", (5,), "length"), TokenEvent("other", (5,), "stop")])
    assert spans and [s.name for s in exporter.get_finished_spans()] == ["kv_arrival"]
    spans.finished([TokenEvent("r/1", (7,), None), TokenEvent("r/1", (8,), "stop")])
    assert not spans
    [arrival, span] = exporter.get_finished_spans()
    assert arrival.name == "kv_arrival" and arrival.attributes["pdserve.kv.ok"] is True
    assert arrival.parent.span_id == span.context.span_id
    assert span.name == "decode_worker" and span.parent.span_id == attempt.context.span_id
    assert span.context.trace_id == attempt.context.trace_id
    assert span.attributes["pdserve.steps"] == 6                   # once per step, not per row
    assert span.attributes["gen_ai.response.finish_reasons"] == ("length", "stop")
    assert [e.attributes["pdserve.step_s"] for e in span.events] == [0.010, 0.030]
    assert span.events[0].attributes["pdserve.first"] and span.events[1].attributes[
        "pdserve.step_requests"] == 3


def test_untraced_does_nothing():
    spans = DecodeSpans()
    spans.start("r", 1, {"traceparent": f"00-{'1' * 32}-{'2' * 16}-01"})   # tracing off
    assert not spans


def test_a_request_cancelled_before_its_samples_were_forked_ends_its_span(monkeypatch):
    """n=3, cancelled while its KV was on the way (never forked): sample 0's event ends
    the span, with nothing left behind; a refused reservation's span ends too."""
    exporter, provider = InMemorySpanExporter(), TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_tracer", provider.get_tracer("test"))
    carrier = tracing.RequestTrace.carrier(provider.get_tracer("test").start_span("attempt"))
    spans = DecodeSpans()
    spans.start("r", 3, carrier)
    spans.start("r", 3, carrier)                      # a repeated reserve: one span
    spans.finished([TokenEvent("r", (), "cancelled")])
    assert not spans
    spans.start("q", 1, carrier)
    spans.cancel("q")
    assert not spans
    assert [(s.name, s.attributes.get("pdserve.reserved")) for s in
            exporter.get_finished_spans()] == [("decode_worker", None), ("decode_worker", False)]
