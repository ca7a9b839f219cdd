"""End to end through the OpenAI-compatible HTTP API (router/http_api.py) on the default
model, driven by the official `openai` client: greedy completions and chat completions,
streamed and not, equal what gRPC returns for the same prompt, usage included; bad input
gets 400 with an OpenAI error body naming the parameter; an SSE client that disconnects
frees its KV blocks within a second. One cluster serves gRPC and HTTP side by side; the
module ends with Served.stop's check that every KV pool is free.

Status mapping (429, 401, 503, 504), framing and disconnects at every stage are covered
without a cluster in tests/unit/test_http_api.py."""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx2
import openai
import pytest
from pydantic import BaseModel, Field
from serving import Served, start_ray

from pdserve.client import make_request

pytestmark = pytest.mark.slow

MAX_TOKENS = 16
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def served():
    start_ray()
    s = Served(router_kw={"http_port": 0})
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    assert served.http_url is not None
    with openai.OpenAI(base_url=f"{served.http_url}/v1", api_key="x", max_retries=0,
                       timeout=120) as c:
        yield c


def grpc_result(served, prompt, **kw) -> tuple[str, str, tuple[int, int]]:
    """(text, finish_reason, (prompt_tokens, completion_tokens)) of the same request
    over gRPC."""
    text, last = [], None
    for msg in served.client.stream(make_request(prompt, **kw)):
        text.append(msg.text)
        last = msg
    return "".join(text), last.finish_reason, (last.usage.prompt_tokens,
                                               last.usage.completion_tokens)


def usage(u) -> tuple[int, int]:
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    return u.prompt_tokens, u.completion_tokens


def test_completions_equal_grpc(served, client):
    want = grpc_result(served, PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    out = client.completions.create(model="default", prompt=PROMPT, max_tokens=MAX_TOKENS,
                                    temperature=0)
    assert out.object == "text_completion" and out.model == "default"
    got = out.choices[0]
    assert (got.text, got.finish_reason, usage(out.usage)) == want

    chunks = list(client.completions.create(model="default", prompt=PROMPT,
                                            max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want[0]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want[1]
    assert usage(chunks[-1].usage) == want[2]


def test_completions_stop_string_equals_grpc(served, client):
    full = grpc_result(served, PROMPT, max_tokens=MAX_TOKENS, temperature=0)[0]
    stop = full[6:10]
    want = grpc_result(served, PROMPT, max_tokens=MAX_TOKENS, temperature=0, stop=[stop])
    out = client.completions.create(model="default", prompt=PROMPT, max_tokens=MAX_TOKENS,
                                    temperature=0, stop=stop)
    assert (out.choices[0].text, out.choices[0].finish_reason) == want[:2]
    assert want[1] == "stop"


def test_chat_equals_grpc(served, client):
    want = grpc_result(served, MESSAGES, max_tokens=MAX_TOKENS, temperature=0)
    out = client.chat.completions.create(model="default", messages=MESSAGES,
                                         max_completion_tokens=MAX_TOKENS, temperature=0)
    assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"
    got = out.choices[0]
    assert (got.message.content, got.finish_reason, usage(out.usage)) == want

    chunks = list(client.chat.completions.create(
        model="default", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want[0]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want[1]
    assert chunks[-1].choices == [] and usage(chunks[-1].usage) == want[2]


def test_n_and_best_of_equal_grpc(served, client):
    """n choices, whole and streamed, are gRPC's samples (seeded: sample i draws with
    seed + i); best_of returns the n of highest cumulative logprob among gRPC's."""
    kw = dict(max_tokens=MAX_TOKENS, temperature=1.0, seed=11)
    want = {}
    for m in served.client.stream(make_request(PROMPT, n=3, **kw)):
        want[m.index] = want.get(m.index, "") + m.text
    assert len(set(want.values())) == 3
    out = client.completions.create(model="default", prompt=PROMPT, n=3, **kw)
    assert {c.index: c.text for c in out.choices} == want
    assert out.usage.completion_tokens == 3 * MAX_TOKENS
    got = {}
    for ch in client.chat.completions.create(model="default", messages=MESSAGES, n=2,
                                             stream=True, **kw):
        for c in ch.choices:
            got[c.index] = got.get(c.index, "") + (c.delta.content or "")
    chat = {}
    for m in served.client.stream(make_request(MESSAGES, n=2, **kw)):
        chat[m.index] = chat.get(m.index, "") + m.text
    assert got == chat
    score = {}
    for m in served.client.stream(make_request(PROMPT, n=4, logprobs=0, **kw)):
        score[m.index] = score.get(m.index, 0.0) + sum(e.logprob for e in m.logprobs)
    best = sorted(score, key=score.get, reverse=True)[:2]
    want4 = {}
    for m in served.client.stream(make_request(PROMPT, n=4, **kw)):
        want4[m.index] = want4.get(m.index, "") + m.text
    out = client.completions.create(model="default", prompt=PROMPT, n=2, best_of=4, **kw)
    assert [c.text for c in out.choices] == [want4[i] for i in best]
    assert all(c.logprobs is None for c in out.choices)


def test_echo_logprobs_as_lm_eval_asks_for_them(served, client):
    """lm-evaluation-harness's loglikelihood request (token ids, echo, logprobs 1,
    max_tokens 1): one logprob per prompt token after the first and one for the
    generated token, equal to what gRPC's prompt_logprobs and logprobs give."""
    ids = [504, 3575, 282, 4649, 314]
    out = client.completions.create(model="m", prompt=ids, max_tokens=1, logprobs=1,
                                    echo=True, temperature=0)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None
    msgs = list(served.client.stream(make_request(ids, max_tokens=1, temperature=0,
                                                  logprobs=1, prompt_logprobs=1)))
    want = [e.logprob for e in msgs[0].prompt_logprobs[1:]] + [msgs[0].logprobs[0].logprob]
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-6)
    from transformers import AutoTokenizer

    from pdserve.engine.loader import resolve_model
    prompt = AutoTokenizer.from_pretrained(resolve_model("default")).decode(ids)
    assert out.choices[0].text.startswith(prompt) and len(out.choices[0].text) > len(prompt)
    assert [max(t, key=t.get) for t in lp.top_logprobs[1:]] == [
        msgs[0].prompt_logprobs[1 + i].top_logprobs[0].token for i in range(len(ids) - 1)
    ] + [msgs[0].logprobs[0].top_logprobs[0].token]


class Answer(BaseModel):
    answer: bool
    confidence: int = Field(ge=0, le=100)


class City(BaseModel):
    name: str = Field(max_length=20)
    country: Literal["France", "Germany", "Italy"]
    population_millions: int = Field(ge=0, le=50)


class Basket(BaseModel):
    items: list[Literal["apple", "pear", "plum"]] = Field(min_length=1, max_length=3)


@pytest.mark.parametrize("model, question", [
    (Answer, "Is Paris in France? Answer in JSON."),
    (City, "Describe the capital of Italy in JSON."),
    (Basket, "Which fruits should I buy? Answer in JSON."),
])
def test_json_schema_through_the_openai_clients_parse(client, model, question):
    """response_format json_schema (strict) as the openai client's parse() sends it: the
    object validates against the schema (the client parses it with pydantic)."""
    out = client.chat.completions.parse(
        model="m", messages=[{"role": "user", "content": question}], response_format=model,
        max_completion_tokens=120, temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, model), choice.message.content


def test_regex_and_choice_over_grpc(served):
    """vLLM's structured_outputs through gRPC → P (first token) → D: the whole text
    matches, from the first token on."""
    from pdserve.proto import pdserve_pb2 as pb
    ids, text, reason = served.generate("My phone number is", max_tokens=30, temperature=0.8,
                                        seed=3, structured_outputs=pb.StructuredOutputs(
                                            regex=r"\(0[1-9]\) [0-9]{4}-[0-9]{4}"))
    assert re.fullmatch(r"\(0[1-9]\) [0-9]{4}-[0-9]{4}", text) and reason == "stop", text
    _, text, _ = served.generate("Is the sky green?", max_tokens=10, temperature=0,
                                 structured_outputs=pb.StructuredOutputs(
                                     choice=pb.Choices(choices=["yes", "no", "maybe"])))
    assert text in ("yes", "no", "maybe")
    # ignore_eos past the end of the object: it goes on, unconstrained, to max_tokens
    ids, text, reason = served.generate("Give me a JSON object.", max_tokens=40, temperature=0,
                                        ignore_eos=True, structured_outputs=pb.StructuredOutputs(
                                            json_object=True))
    assert reason == "length" and len(ids) == 40
    obj, _ = json.JSONDecoder().raw_decode(text)
    assert isinstance(obj, dict)


def test_a_schema_that_does_not_compile_is_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=MESSAGES, extra_body={
            "structured_outputs": {"json": {"type": 5}}})
    assert e.value.body["param"] == "structured_outputs"
    assert "json does not compile: Type should be a string" in e.value.body["message"]


def test_lm_eval_scores_equal_hf(served, tmp_path, monkeypatch):
    """lm-evaluation-harness, unmodified: its `local-completions` model against pdserve
    and its `hf` model on the same weights score a multiple-choice task (loglikelihood:
    echo + logprobs) and answer it (generate_until) the same, sample by sample."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    from lm_eval_task import GEN_TASK, MC_TASK, write_tasks

    from pdserve.engine.loader import resolve_model
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tasks, manager = [MC_TASK, GEN_TASK], TaskManager(include_path=str(write_tasks(tmp_path)))
    model_dir = str(resolve_model("default"))
    ours = simple_evaluate(
        model="local-completions", tasks=tasks, task_manager=manager, log_samples=True,
        model_args=f"model=default,base_url={served.http_url}/v1/completions,"
                   f"tokenizer={model_dir},tokenizer_backend=huggingface,num_concurrent=1,"
                   "max_retries=1")
    theirs = simple_evaluate(model="hf", tasks=tasks, task_manager=manager, log_samples=True,
                             model_args=f"pretrained={model_dir},dtype=float32,device=cpu")
    mc = zip(ours["samples"][MC_TASK], theirs["samples"][MC_TASK], strict=True)
    for a, b in mc:                          # per choice: (loglikelihood, is_greedy)
        assert [g for _, g in a["filtered_resps"]] == [g for _, g in b["filtered_resps"]]
        assert [ll for ll, _ in a["filtered_resps"]] == pytest.approx(
            [ll for ll, _ in b["filtered_resps"]], abs=1e-3)
    gen = [(a["filtered_resps"], b["filtered_resps"]) for a, b in
           zip(ours["samples"][GEN_TASK], theirs["samples"][GEN_TASK], strict=True)]
    assert [a for a, _ in gen] == [b for _, b in gen] and any(a[0].strip() for a, _ in gen)
    assert ours["results"][MC_TASK]["acc,none"] == theirs["results"][MC_TASK]["acc,none"]


def test_models_and_health(served, client):
    assert [m.id for m in client.models.list()] == ["default"]
    r = httpx2.get(f"{served.http_url}/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    assert served.client.status().http_address == served.http_url.removeprefix("http://")


@pytest.mark.parametrize("kw, param", [
    ({"temperature": -1}, "temperature"),              # the router's own validation
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 100_000}, "max_tokens"),           # beyond the model's context
    ({"n": 200}, "n"),                                 # more than 128 samples
    ({"n": 3, "best_of": 2}, "best_of"),               # fewer drawn than returned
    ({"extra_body": {"top_k": "many"}}, "top_k"),      # wrong type
    ({"extra_body": {"frobnicate": 1}}, "frobnicate"),  # not a parameter
])
def test_bad_completion_input_is_400(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="default", prompt=PROMPT, **kw)
    err = e.value.body
    assert e.value.status_code == 400 and err["type"] == "invalid_request_error"
    assert err["param"] == param and err["message"].startswith(f"{param}: "), err


def test_bad_chat_input_is_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="default", messages=[])
    assert e.value.body["param"] == "messages"
    assert "at least one message" in e.value.body["message"]


def test_disconnecting_sse_client_frees_its_blocks(served):
    body = {"model": "default", "messages": MESSAGES, "max_tokens": 400, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx2.Client(timeout=120) as c:
        with c.stream("POST", f"{served.http_url}/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            events = 0
            for line in r.iter_lines():
                events += line.startswith("data: ")
                if events == 3:     # role, then two tokens' text: the request is decoding
                    break
            # 400 tokens take seconds here: it still holds its blocks on D
            assert sum(d.running_requests for d in served.decode_status()) == 1
    # the connection is closed here; uvicorn sees it, the router aborts P and D
    served.assert_all_free(timeout_s=1.0)


def test_bench_serve_vllm_mode_times_every_token_of_an_openai_server(served):
    """`pdserve bench serve`'s vllm mode drives any OpenAI-compatible server; here pdserve's
    own: token-id prompts, ignore_eos, every token timed from the stream."""
    import math

    from pdserve.bench.serve import run_openai
    from pdserve.bench.workload import BenchRequest, summarize

    reqs = [BenchRequest(list(range(200 + 7 * i, 230 + 11 * i)), 6 + i) for i in range(3)]
    run = run_openai(served.http_url, math.inf, reqs, [0.0] * 3)
    assert run.mode == "vllm" and run.duration_s > 0
    for req, res in zip(reqs, run.results):
        assert res.ok, res.error
        assert res.prompt_tokens == len(req.prompt_token_ids)
        assert len(res.token_times) == req.max_tokens                 # ignore_eos honoured
        assert 0 < res.token_times[0] <= res.e2e
        assert res.token_times == sorted(res.token_times)
    s = summarize(run.results, run.duration_s, None, None)
    assert s["completed"] == 3 and s["total_output_tokens"] == 6 + 7 + 8
