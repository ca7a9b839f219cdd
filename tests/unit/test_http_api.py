"""router/http_api.py + openai_protocol.py with a fake router: no model, no Ray.

The fake's generate() plays a script of GenerateResponses (or raises a RequestError)
and records the requests it got and whether its generator was closed, which is what
the real router's `finally` needs to abort a request on its workers. Driven three
ways: Starlette's TestClient, the official `openai` client over that TestClient, and
raw ASGI calls where a test must choose when the client disconnects. One test serves
the app with uvicorn on a real socket (http_server.serve_http), over TLS with a client
certificate. Every test ends with the fake's generators all closed.
"""

from __future__ import annotations

import asyncio
import json
import threading
from types import SimpleNamespace

import grpc
import openai
import pytest
from starlette.testclient import TestClient

from pdserve.config import ClusterConfig, RouterConfig
from pdserve.engine.sampling_params import InvalidRequestError
from pdserve.metrics import RouterMetrics
from pdserve.proto import pdserve_pb2 as pb
from pdserve.router.errors import RequestError
from pdserve.router.heap import HeapTrim
from pdserve.router.http_api import build_app, http_status

KEY = "test-key-0123456789"
MODEL = "default"


def script(*texts: str, reason: str = "length", prompt_tokens: int = 3) -> list:
    """One GenerateResponse per text, one token each; the last one finishes."""
    msgs = [pb.GenerateResponse(token_ids=[10 + i], text=t) for i, t in enumerate(texts)]
    msgs[-1].finish_reason = reason
    msgs[-1].usage.prompt_tokens, msgs[-1].usage.completion_tokens = prompt_tokens, len(texts)
    return msgs


class FakeRouter:
    """What build_app reads of a Router: config, model_name, metrics, prefill/decode
    (w.available) and generate()."""

    def __init__(self, messages=None, error: Exception | None = None,
                 error_after: Exception | None = None, hang_after: int | None = None,
                 **router_kw):
        self.config = ClusterConfig(router=RouterConfig(port=0, metrics_port=0, **router_kw))
        self.model_name = MODEL
        self.metrics = RouterMetrics(lambda: 0)
        self.heap_trim = HeapTrim(trim=lambda pad: 0)
        self.prefill = [SimpleNamespace(available=True)]
        self.decode = [SimpleNamespace(available=True)]
        self.messages = script("Hel", "lo") if messages is None else messages
        self.error, self.error_after, self.hang_after = error, error_after, hang_after
        self.requests: list[tuple[pb.GenerateRequest, float | None]] = []
        self.opened = 0
        self.closed = 0
        self.closed_event = threading.Event()
        self.hanging = threading.Event()

    async def generate(self, req, deadline_s):
        self.requests.append((req, deadline_s))
        self.opened += 1
        try:
            if self.error is not None:
                raise self.error
            for i, msg in enumerate(self.messages):
                if i == self.hang_after:
                    self.hanging.set()
                    await asyncio.sleep(3600)
                yield msg
            if self.error_after is not None:
                raise self.error_after
        finally:
            self.closed += 1
            self.closed_event.set()

    def all_closed(self) -> bool:
        return self.closed == self.opened

    def statuses(self) -> dict[str, float]:
        return {s.labels["status"]: s.value for m in self.metrics.requests.collect()
                for s in m.samples if s.name.endswith("_total")}


@pytest.fixture
def router():
    r = FakeRouter()
    yield r
    assert r.all_closed(), "a router generator was left open"


def client(router: FakeRouter, **kw) -> TestClient:
    return TestClient(build_app(router), **kw)


def oai_client(router: FakeRouter, api_key: str = "x") -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key=api_key, max_retries=0,
                         http_client=client(router))


def assert_openai_error(r, status: int, param: str | None, type_: str = "invalid_request_error"):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == type_ and err["param"] == param, err
    if param is not None:
        assert err["message"].startswith(f"{param}: "), err
    return err


# --- requests -> GenerateRequest ----------------------------------------------------

def test_completion_request_fields(router):
    r = client(router).post("/v1/completions", json={
        "model": "whatever", "prompt": "Hi", "max_tokens": 7, "temperature": 0, "top_p": 0.5,
        "top_k": 4, "seed": 9, "stop": "\n", "ignore_eos": True, "n": 1, "user": "u"})
    assert r.status_code == 200, r.text
    req, deadline_s = router.requests[0]
    assert deadline_s is None         # the router applies request_timeout_s
    assert req.text == "Hi" and req.request_id.startswith("cmpl-")
    s = req.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed, list(s.stop), s.ignore_eos) \
        == (7, 0.0, 0.5, 4, 9, ["\n"], True)


def test_cache_salt_and_the_user_field_mapped_to_it_on_request(router):
    """vLLM's cache_salt reaches the request; OpenAI's `user` salts it only with
    cache_salt_from_user, and an explicit cache_salt wins."""
    bodies = ({"prompt": "Hi", "user": "u1"}, {"prompt": "Hi", "cache_salt": "s"},
              {"prompt": "Hi", "cache_salt": "s", "user": "u1"})
    for body in bodies:
        assert client(router).post("/v1/completions", json=body).status_code == 200
    assert [r.cache_salt for r, _ in router.requests] == ["", "s", "s"]
    mapped = FakeRouter(cache_salt_from_user=True)
    for body in bodies + ({"messages": [{"role": "user", "content": "x"}], "user": "u2"},):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        assert client(mapped).post(path, json=body).status_code == 200
    assert [r.cache_salt for r, _ in mapped.requests] == ["u1", "s", "s", "u2"]
    assert mapped.all_closed()


@pytest.mark.parametrize("prompt, field, value", [
    ([1, 2, 3], "token_ids", [1, 2, 3]),
    (["one prompt"], "text", "one prompt"),
    ([[5, 6]], "token_ids", [5, 6]),
])
def test_completion_prompt_forms(router, prompt, field, value):
    assert client(router).post("/v1/completions", json={"prompt": prompt}).status_code == 200
    req = router.requests[0][0]
    assert req.WhichOneof("prompt") == field
    assert (list(req.token_ids.ids) if field == "token_ids" else req.text) == value


def test_chat_request_fields(router):
    r = client(router).post("/v1/chat/completions", json={
        "messages": [{"role": "developer", "content": "Be brief."},
                     {"role": "user", "content": [{"type": "text", "text": "a"},
                                                  {"type": "text", "text": "b"}]}],
        "max_tokens": 5, "max_completion_tokens": 3, "stop": ["x", "y"], "top_k": -1,
        "stream_options": None, "response_format": {"type": "text"}, "tool_choice": "none"})
    assert r.status_code == 200, r.text
    req = router.requests[0][0]
    assert [(m.role, m.content) for m in req.messages.messages] == [
        ("system", "Be brief."), ("user", "a\nb")]
    assert req.sampling.max_tokens == 3          # max_completion_tokens wins
    assert list(req.sampling.stop) == ["x", "y"] and req.sampling.top_k == 0


NEUTRAL = {"presence_penalty": 0.0, "frequency_penalty": 0, "repetition_penalty": 1.0,
           "min_p": 0.0, "top_k": -1}


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "Hi"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
])
def test_neutral_sampling_params_are_accepted(router, path, body):
    # vLLM's own clients send these explicitly: each one changes nothing
    r = client(router).post(path, json=body | NEUTRAL)
    assert r.status_code == 200, r.text
    assert router.requests[0][0].sampling.top_k == 0     # -1: disabled, as in vLLM


def test_vllm_bench_serve_request_is_served(router):
    # the body `vllm bench serve --backend openai` streams (vllm 0.32, --ignore-eos)
    with client(router).stream("POST", "/v1/completions", json={
            "model": "/models/SmolLM2-135M-Instruct", "prompt": "Hi", "repetition_penalty": 1.0,
            "max_tokens": 2, "logprobs": None, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}) as r:
        assert r.status_code == 200, r.read()
        events = sse_events(r.read().decode())
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["usage"]["completion_tokens"] == 2
    s = router.requests[0][0].sampling
    assert (s.max_tokens, s.ignore_eos) == (2, True)


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "Hi"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
])
def test_logits_processor_params_reach_the_request(router, path, body):
    r = client(router).post(path, json=body | {
        "repetition_penalty": 1.25, "presence_penalty": 0.5, "frequency_penalty": -0.5,
        "min_p": 0.125, "min_tokens": 3, "stop_token_ids": [7, 9],
        "logit_bias": {"42": -100, "7": 2.5}})
    assert r.status_code == 200, r.text
    s = router.requests[0][0].sampling
    assert (s.repetition_penalty, s.presence_penalty, s.frequency_penalty, s.min_p) == \
        (1.25, 0.5, -0.5, 0.125)
    assert s.min_tokens == 3 and list(s.stop_token_ids) == [7, 9]
    assert dict(s.logit_bias) == {42: -100.0, 7: 2.5}


@pytest.mark.parametrize("param, value, says", [
    ("logit_bias", {"abc": 1.0}, "is not a token id"),
    ("logit_bias", {"-3": 1.0}, "out of range"),
    ("min_tokens", -1, "must be >= 0"),
    ("stop_token_ids", [-2], "out of range"),
])
def test_malformed_logits_processor_params_are_400_naming_them(router, param, value, says):
    err = assert_openai_error(client(router).post(
        "/v1/completions", json={"prompt": "Hi", param: value}), 400, param)
    assert says in err["message"]
    assert not router.requests


# --- responses ----------------------------------------------------------------------

def test_completion_response_shape(router):
    body = client(router).post("/v1/completions", json={"prompt": "Hi"}).json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["model"] == MODEL and isinstance(body["created"], int)
    assert body["choices"] == [{"index": 0, "text": "Hello", "logprobs": None,
                                "finish_reason": "length"}]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert router.statuses() == {"length": 1.0}    # the same metrics as gRPC


def test_openai_client_completion_and_chat(router):
    c = oai_client(router)
    out = c.completions.create(model="anything", prompt="Hi", max_tokens=2, temperature=0)
    assert out.choices[0].text == "Hello" and out.model == MODEL
    assert out.usage.total_tokens == 5
    chat = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
    assert chat.id.startswith("chatcmpl-") and chat.object == "chat.completion"
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == "Hello"
    assert chat.choices[0].finish_reason == "length"
    assert [m.id for m in c.models.list()] == [MODEL]


def sse_events(text: str) -> list:
    """The data of each SSE event; every event is `data: ...` then a blank line."""
    assert text.endswith("\n\n")
    events = text[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events), events
    return [e[len("data: "):] for e in events]


def test_sse_framing_chat_with_usage(router):
    with client(router).stream("POST", "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Hi"}], "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.read().decode())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1]) == "Hello"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 5


def test_openai_client_streams(router):
    c = oai_client(router)
    parts = list(c.completions.create(model=MODEL, prompt="Hi", stream=True))
    assert "".join(p.choices[0].text for p in parts) == "Hello"
    assert parts[-1].choices[0].finish_reason == "length"
    chunks = list(c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], stream=True,
        stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == "Hello"
    assert chunks[-1].usage.completion_tokens == 2


# --- errors -------------------------------------------------------------------------

@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": 129}, "n"),
    ({"prompt": "x", "best_of": 3, "stream": True}, "best_of"),   # ranked once ended
    ({"prompt": "x", "echo": "loud"}, "echo"),                  # pydantic: wrong type
    ({"prompt": "x", "logprobs": -1}, "logprobs"),
    ({"prompt": "x", "presence_penalty": "high"}, "presence_penalty"),   # pydantic
    ({"prompt": "x", "max_tokens": -3}, "max_tokens"),
    ({"prompt": "x", "seed": -1}, "seed"),
    ({"prompt": "x", "top_k": -2}, "top_k"),
    ({"prompt": "x", "stop": [1]}, "stop"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": "\ud800"}, "prompt"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),     # pydantic: wrong type
    ({"prompt": "x", "frobnicate": 1}, "frobnicate"),           # not an OpenAI parameter
    ({"max_tokens": 3}, "prompt"),                              # missing
])
def test_bad_completion_input_is_400_naming_the_param(router, body, param):
    # json.dumps escapes the lone surrogate as JSON allows ("\\ud800")
    r = client(router).post("/v1/completions", content=json.dumps(body),
                            headers={"content-type": "application/json"})
    assert_openai_error(r, 400, param)
    assert not router.requests            # refused before the router


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
     "messages[0].tool_calls"),
    ({"messages": [{"content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": -1},
     "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
     "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "x"}],
      "response_format": {"type": "xml"}}, "response_format"),
    ({"messages": [{"role": "user", "content": "x"}],
      "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ({"messages": [{"role": "user", "content": "x"}], "guided_regex": "a+",
      "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [{"role": "user", "content": "x"}],
      "structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"messages": [{"role": "user", "content": "x"}], "guided_choice": "a"}, "guided_choice"),
])
def test_bad_chat_input_is_400_naming_the_param(router, body, param):
    assert_openai_error(client(router).post("/v1/chat/completions", json=body), 400, param)
    assert not router.requests


def test_router_validation_errors_name_the_openai_param():
    for field, param, body in (
            ("sampling.temperature", "temperature", {"prompt": "x"}),
            ("sampling.max_tokens", "max_tokens", {"prompt": "x"}),
            ("text", "prompt", {"prompt": "x"}),
            ("messages", "messages", {"messages": []}),
            ("sampling.max_tokens", "max_completion_tokens",
             {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 9})):
        r = FakeRouter(error=InvalidRequestError(field, "must be >= 0, got -1"))
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        err = assert_openai_error(client(r).post(path, json=body), 400, param)
        assert err["message"] == f"{param}: must be >= 0, got -1"
        assert r.statuses() == {"invalid_argument": 1.0} and r.all_closed()


def test_invalid_json_and_unknown_path():
    r = FakeRouter()
    c = client(r)
    resp = c.post("/v1/completions", content=b"{not json",
                  headers={"content-type": "application/json"})
    assert_openai_error(resp, 400, None)
    assert_openai_error(c.get("/v1/nothing"), 404, None)
    assert_openai_error(c.get("/v1/completions"), 405, None)


@pytest.mark.parametrize("code, status", [
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 429), (grpc.StatusCode.UNAVAILABLE, 503),
    (grpc.StatusCode.DEADLINE_EXCEEDED, 504), (grpc.StatusCode.INTERNAL, 500),
])
@pytest.mark.parametrize("stream", [False, True])
def test_router_errors_map_to_status(code, status, stream):
    r = FakeRouter(error=RequestError(code, "server overloaded: 256 requests already queued"))
    resp = client(r).post("/v1/completions", json={"prompt": "x", "stream": stream})
    type_ = "rate_limit_error" if status == 429 else "server_error"
    err = assert_openai_error(resp, status, None, type_)
    assert err["message"] == "server overloaded: 256 requests already queued"
    assert err["code"] == ("rate_limit_exceeded" if status == 429 else code.name.lower())
    assert http_status(code) == status
    assert r.statuses() == {code.name.lower(): 1.0} and r.all_closed()


def test_openai_client_raises_its_typed_errors():
    with pytest.raises(openai.RateLimitError):
        oai_client(FakeRouter(error=RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, "full"))) \
            .completions.create(model=MODEL, prompt="x")
    with pytest.raises(openai.BadRequestError) as e:
        oai_client(FakeRouter()).completions.create(model=MODEL, prompt="x", n=0)
    assert e.value.body["param"] == "n" and e.value.status_code == 400


def test_error_after_the_stream_began_is_an_sse_error_event():
    r = FakeRouter(error_after=RequestError(grpc.StatusCode.UNAVAILABLE, "decode worker died"))
    with client(r).stream("POST", "/v1/completions", json={"prompt": "x", "stream": True}) as s:
        assert s.status_code == 200
        events = sse_events(s.read().decode())
    assert "[DONE]" not in events
    assert json.loads(events[-1])["error"]["message"] == "decode worker died"
    assert r.all_closed()
