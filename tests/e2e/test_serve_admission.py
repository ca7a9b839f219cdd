"""Admission control through the real server: with max_queued_requests=2, a burst of 8
long prompts gets 2 admitted (token-identical to HF transformers) and the other 6
refused at once with RESOURCE_EXHAUSTED naming the bound, while the 2 still prefill."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from serving import Served, hf_greedy, start_ray

pytestmark = pytest.mark.slow

MAX_QUEUED_REQUESTS = 2
MAX_QUEUED_TOKENS = 2000
MAX_TOKENS = 8
FAST_S = 5.0      # loose bound on a refusal's latency; prefill of the admitted pair takes ~4 s


@pytest.fixture(scope="module")
def served():
    start_ray()
    s = Served(router_kw={"max_queued_requests": MAX_QUEUED_REQUESTS,
                          "max_queued_tokens": MAX_QUEUED_TOKENS})
    yield s
    s.stop()           # every KV pool free and the router's queue empty


def _prompt(i: int, days: int = 24) -> str:
    """~470 tokens for 24 days; distinct from the first word, so no prefix is shared."""
    return f"Traveller {i} keeps a diary. " + " ".join(
        f"Day {j}: traveller {i} walked {j * (i + 3) % 17 + 1} miles and saw {j % 5 + i} birds."
        for j in range(days))


def test_burst_beyond_max_queued_requests_fails_fast(served):
    tok = _tokenizer()
    prompts = [_prompt(i) for i in range(8)]
    start = threading.Barrier(len(prompts))
    done: dict[int, tuple] = {}     # i -> (outcome, payload, seconds from send, end time)

    def call(i: int) -> None:
        start.wait()
        t0 = time.monotonic()
        try:
            ids, _, _ = served.generate(prompts[i], max_tokens=MAX_TOKENS, temperature=0)
            done[i] = ("ok", ids, time.monotonic() - t0, time.monotonic())
        except grpc.RpcError as e:
            done[i] = (e.code(), e.details(), time.monotonic() - t0, time.monotonic())

    with ThreadPoolExecutor(len(prompts)) as ex:
        futures = [ex.submit(call, i) for i in range(len(prompts))]
        deadline = time.monotonic() + 2 * FAST_S
        while sum(1 for r in done.values() if r[0] != "ok") < len(prompts) - MAX_QUEUED_REQUESTS \
                and time.monotonic() < deadline:
            time.sleep(0.01)
        # The refusals are back; the admitted pair is still waiting for its first token.
        st = served.client.status()
        for f in futures:
            f.result()

    admitted = sorted(i for i, r in done.items() if r[0] == "ok")
    refused = [done[i] for i in sorted(set(done) - set(admitted))]
    assert len(admitted) == MAX_QUEUED_REQUESTS, done
    assert (st.queued_requests, st.queued_tokens) == (
        MAX_QUEUED_REQUESTS, sum(len(tok(prompts[i])["input_ids"]) for i in admitted))
    for code, details, latency_s, _ in refused:
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details)
        assert f"max_queued_requests={MAX_QUEUED_REQUESTS}" in details, details
        assert latency_s < FAST_S, latency_s
    assert max(r[3] for r in refused) < min(done[i][3] for i in admitted)
    for i in admitted:
        ref = hf_greedy("default", tok(prompts[i])["input_ids"], MAX_TOKENS)
        assert done[i][1] == ref, f"prompt {i}: got {done[i][1]}, HF {ref}"
    served.assert_all_free()


def test_prompt_over_max_queued_tokens_is_refused_at_once(served):
    prompt = _prompt(0, days=110)      # ~2,100 tokens: fits the KV pools, not the queue bound
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        served.generate(prompt, max_tokens=MAX_TOKENS, temperature=0)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"exceeds max_queued_tokens={MAX_QUEUED_TOKENS}" in e.value.details()
    assert time.monotonic() - t0 < FAST_S
    served.assert_all_free()


def _tokenizer():
    from transformers import AutoTokenizer

    from pdserve.engine.loader import resolve_model
    return AutoTokenizer.from_pretrained(resolve_model("default"))
