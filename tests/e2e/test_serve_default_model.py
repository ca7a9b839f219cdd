"""End to end on the default model (SmolLM2-135M-Instruct): gRPC → router → prefill →
TCP KV transfer → decode, checked token for token against HF transformers `generate`."""

from __future__ import annotations

import os
import threading
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from serving import (TRANSPORTS, OpenAIPenalties, Served, hf_greedy, hf_greedy_logprobs,
                     hf_logprobs_of, start_ray)

from pdserve.client import make_request
from pdserve.proto import pdserve_pb2 as pb
from pdserve.sharegpt import sample_prompts

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=TRANSPORTS)
def served(request):
    start_ray()
    s = Served(transport=request.param)
    yield s
    s.stop()


@pytest.fixture(autouse=True)
def no_leaks(served):
    yield
    served.assert_all_free()


def test_concurrent_real_prompts_match_hf(served):
    """ShareGPT prompts of different lengths in flight at once: token-identical to HF."""
    tok = _tokenizer()
    prompts = sample_prompts(3, max_chars=400) + ["Hi", "The capital of France is",
                                                  "List three colors:\n1."]
    n = 24
    results = served.generate_many(prompts, max_tokens=n, temperature=0)
    lengths = set()
    for prompt, (ids, text, reason) in zip(prompts, results):
        prompt_ids = tok(prompt)["input_ids"]
        lengths.add(len(prompt_ids))
        ref = hf_greedy("default", prompt_ids, n)
        assert ids == ref, f"prompt {prompt[:40]!r}: got {ids}, HF {ref}"
        assert reason == ("stop" if ref[-1] == 2 and len(ref) < n else "length")
        assert text == tok.decode(ids, skip_special_tokens=True)
    assert len(lengths) == len(prompts)          # really different lengths
    status = served.decode_status()
    assert max(d.peak_batch_size for d in status) > 1  # decode batched them
    # the KV came by NIXL's one-sided writes exactly when the cluster runs that transport
    nixl = served.cluster.config.decode.transport == "nixl"
    assert [d.kv_transport for d in status] == [served.cluster.config.decode.transport]
    assert all((d.kv_one_sided_writes > 0) == nixl for d in status), status
    # the last steps ran with the prefill worker idle: its core lent (core_share.py)
    assert [d.step_threads for d in status] == [min(2, len(os.sched_getaffinity(0)))]


def test_chat_messages_use_chat_template(served):
    tok = _tokenizer()
    messages = [{"role": "user", "content": "What is 2+2?"}]
    ids, text, reason = served.generate(messages, max_tokens=16, temperature=0)
    prompt_ids = list(tok.apply_chat_template(messages, add_generation_prompt=True,
                                              tokenize=True)["input_ids"])
    assert ids == hf_greedy("default", prompt_ids, 16)
    assert text.strip()


def test_token_ids_prompt_and_stops(served):
    tok = _tokenizer()
    prompt_ids = tok("The capital of France is")["input_ids"]
    full, _, _ = served.generate(prompt_ids, max_tokens=12, temperature=0, ignore_eos=True)
    # stop_token_ids: finishes on that token, which is included in token_ids.
    ids, _, reason = served.generate(prompt_ids, max_tokens=12, temperature=0,
                                     stop_token_ids=[full[3]])
    assert ids == full[:full.index(full[3]) + 1] and reason == "stop"
    # stop string: text ends right before it.
    text_full = tok.decode(full, skip_special_tokens=True)
    stop = text_full[8:14]
    _, text, reason = served.generate(prompt_ids, max_tokens=12, temperature=0, stop=[stop])
    assert reason == "stop" and text == text_full[:text_full.index(stop)]
    # max_tokens=1: the prefill worker's token alone.
    ids, _, reason = served.generate(prompt_ids, max_tokens=1, temperature=0)
    assert ids == full[:1] and reason == "length"


def test_seeded_sampling_is_reproducible(served):
    kw = dict(max_tokens=12, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    a = served.generate("Once upon a time", **kw)
    b = served.generate("Once upon a time", **kw)
    assert a[0] == b[0]


def test_logits_processors_match_hf(served):
    """Greedy with each penalty, a logit bias and min_tokens, first token sampled on P
    and the rest on D: token-identical to HF `generate` with the same processor. Over
    TCP only: the processors run in the engines, and the KV they read crossed the same
    transfer as every other test's here."""
    if served.cluster.config.prefill.transport != "tcp":
        pytest.skip("logits processors run in the engines; their KV transfer is tcp's here")
    tok = _tokenizer()
    prompt = "List the planets of the solar system, one per line, and say a word on each:"
    ids = tok(prompt)["input_ids"]
    n = 24
    plain = hf_greedy("default", ids, n)
    bias_token = plain[2]
    cases = [
        (dict(repetition_penalty=1.3), dict(repetition_penalty=1.3)),
        (dict(repetition_penalty=0.8), dict(repetition_penalty=0.8)),
        (dict(presence_penalty=1.5), dict(logits_processor=[OpenAIPenalties(len(ids), 1.5, 0)])),
        (dict(frequency_penalty=2.0, presence_penalty=-0.5),
         dict(logits_processor=[OpenAIPenalties(len(ids), -0.5, 2.0)])),
        (dict(logit_bias={bias_token: 4.0}), dict(sequence_bias={(bias_token,): 4.0})),
    ]
    for ours, theirs in cases:
        got, _, _ = served.generate(ids, max_tokens=n, temperature=0, **ours)
        want = hf_greedy("default", ids, n, **theirs)
        assert got == want, f"{ours}: got {got}, HF {want}"
        assert want != plain, ours                   # the processor changed the output
    # min_tokens: a prompt that ends at once (EOS) without it
    short = tok.apply_chat_template([{"role": "user", "content": "Say only: yes"}],
                                    add_generation_prompt=True, tokenize=True)["input_ids"]
    early = hf_greedy("default", short, 32)
    assert len(early) < 16 and early[-1] == 2
    got, _, reason = served.generate(short, max_tokens=32, temperature=0, min_tokens=16)
    assert got == hf_greedy("default", short, 32, min_new_tokens=16) and len(got) >= 16


def test_logprobs_match_hf(served):
    """Each token's logprob and its top 5 (the first token's from P, the rest from D)
    equal HF's log-softmax of the same logits within 1e-4 (fp32): the model's raw
    distribution, before the repetition penalty that chose the tokens, at every one of
    the 12 positions (HF given the same tokens)."""
    ids = _tokenizer()("The three primary colors are")["input_ids"]
    n = 12
    greedy_ids, _ = hf_greedy_logprobs("default", ids, n)
    msgs = list(served.client.stream(make_request(ids, max_tokens=n, temperature=0,
                                                  logprobs=5, repetition_penalty=1.2)))
    got = [lp for m in msgs for lp in m.logprobs]
    tokens = [t for m in msgs for t in m.token_ids]
    assert len(got) == len(tokens) == n
    assert tokens != greedy_ids           # the penalty changed the tokens, not the logprobs
    want = hf_logprobs_of("default", ids, tokens)
    for i in range(n):
        top = want[i].topk(5)
        assert got[i].token_id == tokens[i]
        assert got[i].logprob == pytest.approx(want[i, tokens[i]].item(), abs=1e-4)
        assert got[i].rank == int((want[i] > want[i, tokens[i]]).sum()) + 1
        assert [t.token_id for t in got[i].top_logprobs] == top.indices.tolist()
        assert [t.logprob for t in got[i].top_logprobs] == pytest.approx(
            top.values.tolist(), abs=1e-4)
    assert got[0].token == _tokenizer().decode([tokens[0]])


def test_prompt_logprobs_match_hf(served):
    """Every prompt token's logprob and top 3 given the tokens before it, computed by P
    over the whole prompt, equal HF's log-softmax of a forward over it (twice: the second
    time P's prefix cache holds the prompt, and must not be used)."""
    from serving import _hf_model
    from pdserve.engine.loader import resolve_model
    tok = _tokenizer()
    ids = tok("Paris is the capital of France, and Berlin is the capital of Germany. " * 3
              )["input_ids"]
    hf = _hf_model(str(resolve_model("default")))
    with torch.inference_mode():
        want = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    for _ in range(2):
        msgs = list(served.client.stream(make_request(ids, max_tokens=2, temperature=0,
                                                      prompt_logprobs=3)))
        got = msgs[0].prompt_logprobs
        assert [e.token_id for e in got] == ids and not got[0].HasField("logprob")
        assert all(not m.prompt_logprobs for m in msgs[1:])
        for pos, e in enumerate(got[1:]):           # position pos predicts token pos + 1
            assert e.logprob == pytest.approx(want[pos, ids[pos + 1]].item(), abs=1e-4)
            assert [t.token_id for t in e.top_logprobs] == want[pos].topk(3).indices.tolist()


def test_n_samples_of_one_prefill(served):
    """sampling.n: D forks one prefill's KV. Greedy, every sample equals HF (samples 1..
    compute their first token on D from the last prompt token, over their own copy of its
    block: a partial block, and a full one); seeded n=4 is reproducible, its samples
    differ, and sample 0 is what n=1 gives with the seed."""
    ids = _tokenizer()("Name three rivers of Europe, the countries they cross, and the seas "
                       "they flow into, with one line on each.")["input_ids"]
    assert len(ids) > 16
    for prompt in (ids, ids[:16]):                  # block_size 16: last block partial, full
        want = hf_greedy("default", prompt, 8, ignore_eos=True)
        got = served.samples(prompt, max_tokens=8, temperature=0, ignore_eos=True, n=3)
        assert got == {0: want, 1: want, 2: want}
    kw = dict(max_tokens=12, temperature=1.0, top_p=0.95, seed=77, ignore_eos=True)
    a = served.samples(ids, n=4, **kw)
    assert served.samples(ids, n=4, **kw) == a
    assert len({tuple(t) for t in a.values()}) == 4
    assert served.generate(ids, **kw)[0] == a[0]


def test_streaming_and_usage(served):
    msgs = list(served.client.stream(make_request("Tell me a story.", max_tokens=10,
                                                  temperature=0, ignore_eos=True)))
    assert len(msgs) >= 2                        # first token streamed on its own (TTFT)
    assert len(msgs[0].token_ids) == 1
    assert all(not m.finish_reason for m in msgs[:-1]) and msgs[-1].finish_reason == "length"
    assert msgs[-1].usage.completion_tokens == 10 == sum(len(m.token_ids) for m in msgs)
    assert msgs[-1].usage.prompt_tokens == len(_tokenizer()("Tell me a story.")["input_ids"])


def test_client_cancel_frees_blocks(served):
    """A cancelled stream's blocks are freed by the cancel: 3,800 tokens (the decode pool
    holds 4,096) take a single stream about a minute on a CPU box (a decode step of the
    default model is >15 ms), and every block is free within 20 s of the cancel."""
    call = served.client.generator.Generate(
        make_request("Write a long essay about the sea.", max_tokens=3800, temperature=0,
                     ignore_eos=True), timeout=300)
    got = [next(call) for _ in range(3)]
    assert all(m.token_ids for m in got)
    call.cancel()
    served.assert_all_free(timeout_s=20.0)


@pytest.mark.parametrize("request_, field", [
    (pb.GenerateRequest(), "prompt"),
    (make_request(""), "text"),
    (pb.GenerateRequest(token_ids=pb.TokenIds()), "token_ids"),
    (make_request([1, 2, 10**6]), "token_ids"),
    (make_request("hi " * 9000), "text"),
    (make_request("hi", max_tokens=9000), "sampling.max_tokens"),
    (make_request("hi", temperature=-1.0), "sampling.temperature"),
    (make_request("hi", temperature=float("nan")), "sampling.temperature"),
    (make_request("hi", top_p=0.0), "sampling.top_p"),
    (make_request("hi", top_k=-5), "sampling.top_k"),
    (make_request("hi", max_tokens=0), "sampling.max_tokens"),
    (make_request("hi", stop=["x"] * 100), "sampling.stop"),
    (make_request("hi", presence_penalty=2.5), "sampling.presence_penalty"),
    (make_request("hi", repetition_penalty=0.0), "sampling.repetition_penalty"),
    (make_request("hi", min_p=1.5), "sampling.min_p"),
    (make_request("hi", max_tokens=4, min_tokens=5), "sampling.min_tokens"),
    (make_request("hi", logit_bias={10**6: 1.0}), "sampling.logit_bias"),
    (make_request("hi", logit_bias={5: 101.0}), "sampling.logit_bias"),
    (pb.GenerateRequest(messages=pb.ChatMessages()), "messages"),
])
def test_bad_requests_get_invalid_argument(served, request_, field):
    with pytest.raises(grpc.RpcError) as e:
        served.client.generate(request_)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith(field), e.value.details()


def test_health_reflection_and_status(served):
    channel = served.client.channel
    health = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service="pdserve.v1.Generator"), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    resp = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
        list_services="")]), timeout=10))
    names = {s.name for s in resp.list_services_response.service}
    assert {"pdserve.v1.Generator", "pdserve.v1.Admin", "grpc.health.v1.Health"} <= names
    st = served.client.status()
    assert {w.role for w in st.workers} == {"prefill", "decode"}
    assert all(w.state == "ready" and w.pid > 0 for w in st.workers)


def test_many_concurrent_clients_with_cancels(served):
    """Requests joining and leaving the batch, some cancelled mid-stream: no leak, and the
    survivors still match HF."""
    tok = _tokenizer()
    prompts = ["Say something nice.", "Count to ten:", "Why is the sky blue?", "Hello there"]
    results, errors = {}, []

    def run(i, p):
        try:
            call = served.client.generator.Generate(
                make_request(p, max_tokens=16, temperature=0), timeout=120)
            ids = []
            for m in call:
                ids += m.token_ids
                if i % 2 and len(ids) >= 4:
                    call.cancel()
                    return
            results[p] = ids
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                errors.append(e)

    threads = [threading.Thread(target=run, args=(i, p)) for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    for p, ids in results.items():
        assert ids == hf_greedy("default", tok(p)["input_ids"], 16)


def _tokenizer():
    from transformers import AutoTokenizer

    from pdserve.engine.loader import resolve_model
    return AutoTokenizer.from_pretrained(resolve_model("default"))
