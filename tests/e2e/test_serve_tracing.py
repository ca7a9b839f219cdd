"""OpenTelemetry traces of requests (pdserve/tracing.py), exported by the router to a
real OTLP gRPC collector this test runs (opentelemetry-proto's TraceService over grpc,
no mock exporter): a request sent with a client's W3C traceparent yields spans in the
client's trace, under its span: the request's root span with the GenAI attributes, and
under it tokenization and the attempt with its reservation, prefill and decode, the
workers' spans under the router's that called them (D's reservation; P's prefill with its
KV transfer), whose parents are right and whose durations add up (the TTFT the spans give is within 10% of
the client's). The OpenAI API reads the header alike, and an unsampled traceparent is
not traced. A request whose decode worker is killed mid-stream shows both attempts
in its trace, the first failed, the second with its own reservation, prefill and decode.
A flood of sampled requests with 8 MiB request ids costs the router no memory and no
one's trace. Every answer is HF's greedy one and every pool is free at the end."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent import futures

import grpc
import pytest
from serving import Served, hf_greedy, start_ray, wait_until

from pdserve.client import make_request

pytestmark = pytest.mark.slow

PROMPT = [100 + (i * 7919) % 40000 for i in range(200)]
MAX_TOKENS = 8
TRACE_ID, CLIENT_SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
BLOCKS = 13                           # KV blocks of PROMPT and MAX_TOKENS (16 tokens each)
BLOCK_BYTES = 30 * 2 * 3 * 16 * 64 * 4   # the model's K/V per block: fp32
ROOT = "text_completion default"      # the root span: "{gen_ai.operation.name} {model}"
SPANS = (ROOT, "tokenize", "attempt", "reserve", "decode_worker.reserve", "prefill",
         "prefill_worker", "kv_transfer", "decode", "decode_worker", "kv_arrival")
ERROR = 2                             # opentelemetry.proto Status.STATUS_CODE_ERROR
FLOOD_ID_BYTES = (8 << 20) - 4096     # a request_id of nearly the 8 MiB a request may be
FLOOD_CONCURRENCY = 4
FLOODS = 3
LEFT_BYTES = 100 << 20                # what a flood leaves on the router's RSS, at most
# the router's peak RSS over a flood, at most: each request in flight held at most 3 times
# (HTTP/2's frames, gRPC's reassembled message, Python's bytes), and one more; a parsed
# copy and a str of each id would add 2
IN_FLIGHT_BYTES = FLOOD_CONCURRENCY * 4 * (8 << 20)
# the last flood's leftover over the first's, at most: 6 of a flood's 24 ids (a span that
# kept each id would add 192 MiB a flood)
RETAINED_BYTES = 48 << 20


class Collector:
    """An OTLP trace receiver on a free port of 127.0.0.1: every span exported to it,
    as dicts (name, ids in hex, start and end in ns, attributes, status code)."""

    def __init__(self):
        from opentelemetry.proto.collector.trace.v1 import (trace_service_pb2,
                                                            trace_service_pb2_grpc)

        collector = self

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):
                with collector.lock:
                    for rs in request.resource_spans:
                        for ss in rs.scope_spans:
                            collector.spans += [_span(s) for s in ss.spans]
                return trace_service_pb2.ExportTraceServiceResponse()

        self.lock, self.spans = threading.Lock(), []
        self.server = grpc.server(futures.ThreadPoolExecutor(2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def wait_for(self, trace_id: str, *names: str, timeout_s: float = 60.0,
                 until=lambda spans: True) -> list[dict]:
        """The spans of `trace_id` once as many of each of `names` (a name listed twice:
        two) arrived and `until(spans)` holds: every process exports its own, batched
        every 5 s."""
        want = {n: names.count(n) for n in names}
        deadline = time.monotonic() + timeout_s
        while True:
            with self.lock:
                spans = [s for s in self.spans if s["trace_id"] == trace_id]
            got = [s["name"] for s in spans]
            if all(got.count(n) >= k for n, k in want.items()) and until(spans):
                return spans
            assert time.monotonic() < deadline, got
            time.sleep(0.2)


def _span(s) -> dict:
    return {"name": s.name, "trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(),
            "parent": s.parent_span_id.hex(), "start": s.start_time_unix_nano,
            "end": s.end_time_unix_nano, "status": s.status.code,
            "attributes": {kv.key: _value(kv.value) for kv in s.attributes},
            "events": [{"name": e.name, "attributes": {kv.key: _value(kv.value)
                                                       for kv in e.attributes}}
                       for e in s.events]}


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind)


@pytest.fixture(scope="module")
def traced():
    """(served, collector): a cluster whose router exports to the collector."""
    collector = Collector()
    start_ray()
    served = Served(router_kw={"otlp_traces_endpoint": f"127.0.0.1:{collector.port}",
                               "http_port": 0})
    try:
        served.generate([7] * 20, max_tokens=2)   # warm (no block shared with PROMPT)
        yield served, collector
        served.assert_all_free()
    finally:
        served.stop()
        collector.server.stop(0)


def stream(served: Served, prompt: list[int], trace_id: str, max_tokens: int,
           on_token=lambda tokens: None) -> tuple[list[int], float]:
    """(tokens, TTFT in s) of a greedy Generate sent with a traceparent of `trace_id`
    under CLIENT_SPAN; `on_token(tokens so far)` after each message."""
    from pdserve.proto import pdserve_pb2_grpc as pb_grpc

    channel = grpc.insecure_channel(served.address)
    grpc.channel_ready_future(channel).result(timeout=60)   # TTFT without the connect
    stub = pb_grpc.GeneratorStub(channel)
    sent, ttft, tokens = time.monotonic(), None, []
    for msg in stub.Generate(make_request(prompt, max_tokens=max_tokens, temperature=0),
                             metadata=[("traceparent", f"00-{trace_id}-{CLIENT_SPAN}-01")]):
        if ttft is None and msg.token_ids:
            ttft = time.monotonic() - sent
        tokens += msg.token_ids
        on_token(tokens)
    return tokens, ttft


def spans_of(spans: list[dict], name: str) -> list[dict]:
    """Those of `spans` named `name`, by start time."""
    return sorted((s for s in spans if s["name"] == name), key=lambda s: s["start"])


def by_name(spans: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for s in sorted(spans, key=lambda s: s["start"]):
        out.setdefault(s["name"], []).append(s)
    return out


def test_a_request_is_one_trace_under_the_clients_span(traced):
    served, collector = traced
    tokens, ttft = stream(served, PROMPT, TRACE_ID, MAX_TOKENS)
    assert tokens == hf_greedy("default", PROMPT, MAX_TOKENS)
    named = by_name(collector.wait_for(TRACE_ID, *SPANS))
    assert {n: len(s) for n, s in named.items()} == {n: 1 for n in SPANS}, named
    spans = {n: s for n, [s] in named.items()}
    root = spans[ROOT]
    assert root["parent"] == CLIENT_SPAN, root            # the client's trace goes on
    parents = {name: s["parent"] for name, s in spans.items()}
    attempt = spans["attempt"]["span_id"]
    assert parents == {"text_completion default": CLIENT_SPAN,
                       "tokenize": root["span_id"], "attempt": root["span_id"],
                       "reserve": attempt, "prefill": attempt, "decode": attempt,
                       # the workers' spans, under the router's that called them
                       "decode_worker.reserve": spans["reserve"]["span_id"],
                       "prefill_worker": spans["prefill"]["span_id"],
                       "kv_transfer": spans["prefill_worker"]["span_id"],
                       "decode_worker": attempt,
                       "kv_arrival": spans["decode_worker"]["span_id"]}, parents
    a = root["attributes"]
    assert a["gen_ai.operation.name"] == "text_completion"
    assert a["gen_ai.request.model"] == "default" and a["gen_ai.request.max_tokens"] == 8
    assert a["gen_ai.usage.input_tokens"] == len(PROMPT)
    assert a["gen_ai.usage.output_tokens"] == MAX_TOKENS
    assert a["gen_ai.response.finish_reasons"] == ["length"]
    r = spans["reserve"]["attributes"]
    assert r["pdserve.local_prefill"] is False and r["pdserve.prefill_worker"], r
    assert r["pdserve.placement.routing_policy"] == "kv_aware", r     # and why
    assert r["pdserve.placement.prefill_on_decode"] is False, r
    assert r["pdserve.placement.prefill_queued_tokens"] >= len(PROMPT), r
    assert r["pdserve.placement.prefix_hit_tokens"] % 16 == 0, r
    d = spans["decode_worker.reserve"]["attributes"]
    assert d["pdserve.reserved"] and d["pdserve.blocks"] == BLOCKS, d
    p = spans["prefill_worker"]["attributes"]
    assert p["pdserve.computed_tokens"] + p["pdserve.cached_tokens"] == len(PROMPT), p
    assert 0 <= p["pdserve.queue_s"] < 1e-9 * (spans["prefill_worker"]["end"]
                                               - spans["prefill_worker"]["start"]), p
    dw = spans["decode_worker"]                     # D's: reservation to the last token
    assert dw["attributes"]["pdserve.steps"] == MAX_TOKENS - 1, dw   # a step a token
    assert dw["attributes"]["gen_ai.response.finish_reasons"] == ["length"], dw
    assert dw["events"][0]["name"] == "step" and dw["events"][0]["attributes"]["pdserve.first"]
    dec = spans["decode"]["attributes"]             # P's token, then D's
    assert dec["pdserve.output_tokens"] == MAX_TOKENS - 1 and dec["pdserve.tpot_s"] > 0, dec
    chunks = spans["prefill_worker"]["events"]      # each chunk, with the step it ran in
    assert [e["name"] for e in chunks] == ["chunk"] * len(chunks) and chunks, chunks
    assert sum(e["attributes"]["pdserve.chunk_tokens"] for e in chunks) == \
        p["pdserve.computed_tokens"], chunks
    assert all(e["attributes"]["pdserve.step_s"] > 0 for e in chunks), chunks
    # the transfer's two sides in one trace: D saw the last frame after P sent it
    assert spans["kv_arrival"]["attributes"]["pdserve.kv.ok"] is True
    assert spans["kv_arrival"]["end"] >= spans["kv_transfer"]["end"]
    kv = spans["kv_transfer"]["attributes"]
    assert kv["pdserve.kv.transport"] == "tcp" and kv["pdserve.kv.layers"] == 30, kv
    assert kv["pdserve.kv.blocks"] == BLOCKS - d["pdserve.cached_blocks"], (kv, d)
    assert kv["pdserve.kv.bytes"] == kv["pdserve.kv.blocks"] * BLOCK_BYTES, kv
    # durations add up: each child within its parent, the steps in order
    for name, s in spans.items():
        up = next((p for p in spans.values() if p["span_id"] == s["parent"]), None)
        assert up is None or up["start"] <= s["start"] <= s["end"] <= up["end"], name
    order = [spans[n] for n in ("tokenize", "reserve", "prefill", "decode")]
    assert all(x["end"] <= y["start"] for x, y in zip(order, order[1:])), order
    # TTFT from the spans (the root's start to the prefill's end, P's first token)
    # within 10% of the client's
    span_ttft = (spans["prefill"]["end"] - root["start"]) / 1e9
    assert abs(span_ttft - ttft) <= 0.1 * ttft, (span_ttft, ttft)
    assert abs(a["gen_ai.response.time_to_first_chunk"] - ttft) <= 0.1 * ttft


def test_an_http_request_continues_the_clients_trace(traced):
    """The OpenAI API reads the traceparent header: a chat completion's root span is
    `chat default`, under the client's span; one sent with an unsampled traceparent
    (flags 00) is not traced."""
    import json
    import urllib.request

    served, collector = traced
    trace_id, unsampled = "5af7651916cd43dd8448eb211c80319c", "6af7651916cd43dd8448eb211c80319c"
    for tid, flags in ((unsampled, "00"), (trace_id, "01")):
        body = json.dumps({"model": "default", "max_tokens": 4, "temperature": 0,
                           "messages": [{"role": "user", "content": "Hello there"}]}).encode()
        req = urllib.request.Request(f"{served.http_url}/v1/chat/completions", body, {
            "Content-Type": "application/json",
            "traceparent": f"00-{tid}-{CLIENT_SPAN}-{flags}"})
        with urllib.request.urlopen(req, timeout=120) as r:
            assert json.loads(r.read())["choices"][0]["finish_reason"] == "length"
    spans = by_name(collector.wait_for(trace_id, "chat default"))
    [root] = spans["chat default"]
    assert root["parent"] == CLIENT_SPAN and root["attributes"]["gen_ai.operation.name"] == "chat"
    assert root["attributes"]["gen_ai.usage.output_tokens"] == 4
    with collector.lock:
        assert not [s for s in collector.spans if s["trace_id"] == unsampled]


def test_a_traced_stream_the_client_cancels_frees_its_kv_and_ends_its_spans(traced):
    """A client that cancels a traced stream mid-way: every KV block is back at once (the
    attempt's inner generators are closed with it), and the request's spans all end,
    the root's status `cancelled`."""
    from pdserve.proto import pdserve_pb2_grpc as pb_grpc

    served, collector = traced
    trace_id = "7af7651916cd43dd8448eb211c80319c"
    stub = pb_grpc.GeneratorStub(grpc.insecure_channel(served.address))
    call = stub.Generate(make_request(PROMPT, max_tokens=200, temperature=0, ignore_eos=True),
                         metadata=[("traceparent", f"00-{trace_id}-{CLIENT_SPAN}-01")])
    got = 0
    for msg in call:
        got += len(msg.token_ids)
        if got >= 3:
            call.cancel()
            break
    served.assert_all_free(timeout_s=5)
    spans = by_name(collector.wait_for(trace_id, ROOT, "attempt", "decode", "decode_worker"))
    assert spans[ROOT][0]["attributes"]["pdserve.status"] == "cancelled"
    assert spans["decode_worker"][0]["attributes"]["gen_ai.response.finish_reasons"] == [
        "cancelled"]


def test_a_decode_worker_killed_mid_stream_shows_the_retry_in_the_same_trace(traced):
    served, collector = traced
    trace_id, n = "0af7651916cd43dd8448eb211c80319c", 48
    pid = served.decode_status()[0].pid
    killed = []

    def kill_at_the_fourth(tokens):
        if len(tokens) >= 4 and not killed:
            os.kill(pid, signal.SIGKILL)             # this test's decode worker, by its pid
            killed.append(len(tokens))

    tokens, _ = stream(served, PROMPT, trace_id, n, kill_at_the_fourth)
    assert killed and killed[0] < n
    assert tokens == hf_greedy("default", PROMPT, n)
    spans = by_name(collector.wait_for(trace_id, ROOT, "attempt", "attempt", "prefill_worker",
                                       "prefill_worker"))
    [root] = spans[ROOT]
    first, second = spans["attempt"]
    assert first["parent"] == second["parent"] == root["span_id"]
    assert first["status"] == ERROR and first["attributes"]["error.type"] == "AttemptFailed"
    assert second["status"] != ERROR and first["end"] <= second["start"]
    # the second attempt's own steps: a new reservation, the retried prompt (the first
    # attempt's tokens its tail) prefilled again, decoded to the end
    for name in ("reserve", "prefill", "decode"):
        assert [s["parent"] for s in spans[name]][-1] == second["span_id"], name
    # P's span of the retry; the restarted decode worker's of the new reservation and of
    # the request (the killed one's died with it, unexported) come, under the second's
    assert spans["prefill_worker"][-1]["parent"] == spans["prefill"][-1]["span_id"]
    collector.wait_for(trace_id, until=lambda spans: {
        ("decode_worker.reserve", spans_of(spans, "reserve")[-1]["span_id"]),
        ("decode_worker", second["span_id"])} <= {(s["name"], s["parent"]) for s in spans})
    assert second["attributes"]["pdserve.prompt_tokens"] > len(PROMPT)
    assert root["attributes"]["gen_ai.usage.output_tokens"] == n
    assert root["attributes"]["gen_ai.response.finish_reasons"] == ["length"]


def test_a_flood_of_huge_sampled_request_ids_costs_no_memory_and_no_ones_trace(traced):
    """FLOODS floods of 24 requests, 4 at a time, each with a request_id of nearly the
    8 MiB a request may be and a traceparent that says sampled: each is refused
    (INVALID_ARGUMENT naming request_id) from the id's length prefix, before the request
    is parsed or a span copies the id. Over a flood the router's RSS peaks within
    IN_FLIGHT_BYTES of where it was; each flood leaves it within LEFT_BYTES (100 MB)
    once its buffers are trimmed (router/heap.py), the last within RETAINED_BYTES of
    the first (nothing kept). A traced request sent right after arrives at the collector
    (the export batch it shares with the flood's spans stays under what a collector
    takes)."""
    import psutil
    import ray
    from concurrent.futures import ThreadPoolExecutor

    from pdserve.proto import pdserve_pb2_grpc as pb_grpc

    served, collector = traced
    pid = ray.get(served.cluster.router.__ray_call__.remote(lambda _self: os.getpid()),
                  timeout=60)
    router = psutil.Process(pid)
    channel = grpc.insecure_channel(served.address)
    stub = pb_grpc.GeneratorStub(channel)
    flood_trace = "1" * 32

    def huge(i: int) -> grpc.StatusCode:
        req = make_request([7] * 20, max_tokens=2)
        req.request_id = f"{i}-" + "x" * FLOOD_ID_BYTES
        try:
            list(stub.Generate(req, timeout=60, metadata=[
                ("traceparent", f"00-{flood_trace}-{CLIENT_SPAN}-01")]))
        except grpc.RpcError as e:
            assert "request_id" in e.details(), e.details()
            return e.code()
        return grpc.StatusCode.OK

    def flood() -> int:
        """The router's peak RSS (bytes) over one flood."""
        peak, done = [0], threading.Event()

        def watch():
            while not done.is_set():
                peak[0] = max(peak[0], router.memory_info().rss)
                time.sleep(0.05)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            with ThreadPoolExecutor(FLOOD_CONCURRENCY) as ex:
                codes = list(ex.map(huge, range(24)))
        finally:
            done.set()
            watcher.join()
        assert codes == [grpc.StatusCode.INVALID_ARGUMENT] * 24, codes
        return peak[0]

    def trims() -> int:
        return ray.get(served.cluster.router.__ray_call__.remote(
            lambda self: self.heap_trim.trims), timeout=60)

    rss0 = router.memory_info().rss
    peaks, left = [], []
    for _ in range(FLOODS):
        trimmed = trims()
        peaks.append(flood())
        wait_until(lambda: trims() > trimmed, "no heap trim after a flood", peaks, 30)
        left.append(router.memory_info().rss)
    assert max(peaks) - rss0 < IN_FLIGHT_BYTES, (rss0, peaks, left)
    assert max(left) - rss0 < LEFT_BYTES, (rss0, peaks, left)
    assert left[-1] - left[0] < RETAINED_BYTES, (rss0, peaks, left)
    trace_id = "8af7651916cd43dd8448eb211c80319c"
    tokens, _ = stream(served, [9] * 40, trace_id, 3)
    assert tokens == hf_greedy("default", [9] * 40, 3)
    spans = collector.wait_for(trace_id, ROOT, "attempt")
    assert all(len(str(v)) <= 1024 for s in spans for v in s["attributes"].values())
    with collector.lock:      # nothing of the flood: refused before its span was built
        assert not [s for s in collector.spans if s["trace_id"] == flood_trace]
