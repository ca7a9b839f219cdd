"""n and best_of over HTTP (router/openai_protocol.py, openai_responses.py) with the fake
router of test_http_api.py: they reach the GenerateRequest as sampling.n / best_of, and
the router's messages of several samples (GenerateResponse.index, interleaved) come
back as OpenAI's choices, whole and streamed, with the usage of them all."""

from __future__ import annotations

import pytest
from test_http_api import FakeRouter, assert_openai_error, client, oai_client, script

from pdserve.proto import pdserve_pb2 as pb

MODEL = "default"


def two_samples() -> list[pb.GenerateResponse]:
    """Sample 0 says "Hello" (2 tokens), sample 1 "Hey!" (3), interleaved."""
    a, b = script("Hel", "lo"), script("He", "y", "!", reason="stop")
    for m in b:
        m.index = 1
    for m in (a[0], b[0]):                   # each sample's first message: the prompt's
        m.prompt_logprobs.add(token_id=5, token="Hi")
    return [a[0], b[0], b[1], a[1], b[2]]


@pytest.fixture
def router():
    r = FakeRouter(messages=two_samples())
    yield r
    assert r.all_closed(), "a router generator was left open"


def test_completions_n_gives_a_choice_per_sample_and_the_usage_of_all(router):
    out = oai_client(router).completions.create(model=MODEL, prompt="Hi", n=2, seed=3)
    assert router.requests[0][0].sampling.n == 2
    assert [(c.index, c.text, c.finish_reason) for c in out.choices] == [
        (0, "Hello", "length"), (1, "Hey!", "stop")]
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (3, 5)


def test_chat_n_streamed_gives_each_choice_its_role_text_and_finish(router):
    chunks = list(oai_client(router).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=2, stream=True,
        stream_options={"include_usage": True}))
    text = {0: "", 1: ""}
    roles, finish = [], {}
    for ch in chunks[:-1]:
        (c,) = ch.choices
        roles += [c.index] if c.delta.role else []
        text[c.index] += c.delta.content or ""
        if c.finish_reason:
            finish[c.index] = c.finish_reason
    assert text == {0: "Hello", 1: "Hey!"} and roles == [0, 1]
    assert finish == {0: "length", 1: "stop"}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5


def test_echo_with_n_puts_the_prompt_before_every_choice(router):
    out = client(router).post("/v1/completions", json={
        "prompt": "Hi", "n": 2, "echo": True, "logprobs": 0, "max_tokens": 3}).json()
    assert [c["text"] for c in out["choices"]] == ["HiHello", "HiHey!"]
    assert [c["logprobs"]["tokens"][0] for c in out["choices"]] == ["Hi", "Hi"]


def test_best_of_reaches_the_router_and_is_not_streamed(router):
    client(router).post("/v1/completions", json={"prompt": "Hi", "n": 2, "best_of": 4})
    s = router.requests[0][0].sampling
    assert (s.n, s.best_of) == (2, 4)
    r = client(router).post("/v1/completions", json={"prompt": "Hi", "best_of": 2,
                                                     "stream": True})
    assert_openai_error(r, 400, "best_of")
    r = client(router).post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "best_of": 2})
    assert_openai_error(r, 400, "best_of")          # not a chat parameter, as at OpenAI
