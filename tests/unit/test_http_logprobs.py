"""OpenAI's logprobs over HTTP (router/openai_protocol.py) with the fake router of
test_http_api.py: completions' `logprobs: k` and chat's `logprobs` + `top_logprobs` reach
the GenerateRequest as sampling.logprobs, and the router's per-token TokenLogprobs come
back in OpenAI's shapes, whole and streamed."""

from __future__ import annotations

import json

import pytest
from test_http_api import FakeRouter, client, oai_client, script, sse_events

from pdserve.proto import pdserve_pb2 as pb


def with_logprobs(msgs: list) -> list:
    """script()'s messages, each token with a logprob entry and two top ones."""
    for i, m in enumerate(msgs):
        m.logprobs.add(token_id=m.token_ids[0], logprob=-0.5 - i, rank=1, token=m.text,
                       top_logprobs=[pb.TopLogprob(token_id=m.token_ids[0], logprob=-0.5 - i,
                                                   token=m.text),
                                     pb.TopLogprob(token_id=99, logprob=-2.0, token="x")])
    return msgs


@pytest.fixture
def router():
    r = FakeRouter(messages=with_logprobs(script("Hel", "lo")))
    yield r
    assert r.all_closed(), "a router generator was left open"


def test_completion_logprobs(router):
    body = client(router).post("/v1/completions", json={"prompt": "Hi", "logprobs": 2}).json()
    assert router.requests[0][0].sampling.logprobs == 2
    assert body["choices"][0]["logprobs"] == {
        "tokens": ["Hel", "lo"], "token_logprobs": [-0.5, -1.5],
        "top_logprobs": [{"Hel": -0.5, "x": -2.0}, {"lo": -1.5, "x": -2.0}],
        "text_offset": [0, 3]}


def test_chat_logprobs_through_the_openai_client(router):
    out = oai_client(router).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Hi"}], logprobs=True, top_logprobs=2)
    assert router.requests[0][0].sampling.logprobs == 2
    content = out.choices[0].logprobs.content
    assert [(c.token, c.logprob, c.bytes) for c in content] == [
        ("Hel", -0.5, list(b"Hel")), ("lo", -1.5, list(b"lo"))]
    assert [(t.token, t.logprob) for t in content[1].top_logprobs] == [("lo", -1.5), ("x", -2.0)]


def test_chat_logprobs_without_top_ask_for_the_sampled_token_only(router):
    client(router).post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "logprobs": True})
    assert router.requests[0][0].sampling.logprobs == 0


def test_no_logprobs_unless_asked(router):
    body = client(router).post("/v1/completions", json={"prompt": "Hi"}).json()
    assert not router.requests[0][0].sampling.HasField("logprobs")
    assert body["choices"][0]["logprobs"] is None


def test_streamed_completion_logprobs_continue_their_text_offset(router):
    with client(router).stream("POST", "/v1/completions", json={
            "prompt": "Hi", "logprobs": 1, "stream": True}) as r:
        events = sse_events(r.read().decode())
    chunks = [json.loads(e) for e in events[:-1]]
    lps = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    assert [(lp["tokens"], lp["text_offset"]) for lp in lps] == [(["Hel"], [0]), (["lo"], [3])]


def echoing_router() -> FakeRouter:
    """The first message carries the prompt "Hi" as two tokens' prompt_logprobs."""
    msgs = with_logprobs(script("Hel", "lo"))
    msgs[0].prompt_logprobs.add(token_id=5, token="H")              # no context: no logprob
    msgs[0].prompt_logprobs.add(token_id=6, logprob=-3.0, rank=7, token="i",
                                top_logprobs=[pb.TopLogprob(token_id=8, logprob=-0.125, token="a")])
    return FakeRouter(messages=msgs)


def test_echo_with_logprobs_puts_the_prompt_first():
    r = echoing_router()
    body = client(r).post("/v1/completions", json={
        "prompt": "Hi", "echo": True, "logprobs": 1, "max_tokens": 2}).json()
    s = r.requests[0][0].sampling
    assert (s.logprobs, s.prompt_logprobs) == (1, 1)
    choice = body["choices"][0]
    assert choice["text"] == "HiHello"
    assert choice["logprobs"]["tokens"] == ["H", "i", "Hel", "lo"]
    assert choice["logprobs"]["token_logprobs"] == [None, -3.0, -0.5, -1.5]
    # the sampled (here: echoed) token's own logprob joins its position's top ones
    assert choice["logprobs"]["top_logprobs"][:2] == [None, {"a": -0.125, "i": -3.0}]
    assert choice["logprobs"]["text_offset"] == [0, 1, 2, 5]
    assert r.all_closed()


def test_echo_without_logprobs_asks_for_none():
    r = FakeRouter()
    body = client(r).post("/v1/completions", json={"prompt": "Hi", "echo": True}).json()
    assert body["choices"][0]["text"] == "HiHello" and body["choices"][0]["logprobs"] is None
    assert not r.requests[0][0].sampling.HasField("prompt_logprobs")


def test_streamed_echo_sends_the_prompt_first():
    r = echoing_router()
    with client(r).stream("POST", "/v1/completions", json={
            "prompt": "Hi", "echo": True, "logprobs": 0, "stream": True}) as resp:
        events = sse_events(resp.read().decode())
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert [c["text"] for c in chunks] == ["Hi", "Hel", "lo", ""]
    assert chunks[0]["logprobs"]["tokens"] == ["H", "i"]
    assert chunks[2]["logprobs"]["text_offset"] == [5]
