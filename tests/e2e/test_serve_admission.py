"""Admission control through the real server: with max_queued_requests=2, a burst of 8
long prompts gets 2 admitted (token-identical to HF transformers) and the other 6
refused at once with RESOURCE_EXHAUSTED naming the bound, while the 2 still prefill.
The decode worker's lease is 1 s, under the admitted pair's ~4 s of prefill: the router
renews it while the prefill worker has each prompt, so none is reclaimed (and none is
prefilled twice)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import ray
from serving import Served, hf_greedy, start_ray

pytestmark = pytest.mark.slow

MAX_QUEUED_REQUESTS = 2
MAX_QUEUED_TOKENS = 2000
MAX_TOKENS = 8
FAST_S = 5.0      # loose bound on a refusal's latency; prefill of the admitted pair takes ~4 s
LEASE_S = 1.0     # decode.lease_s: renewed every half lease while P has the prompt


@pytest.fixture(scope="module")
def served():
    start_ray()
    s = Served(router_kw={"max_queued_requests": MAX_QUEUED_REQUESTS,
                          "max_queued_tokens": MAX_QUEUED_TOKENS,
                          "max_prefill_queue_tokens": 0},     # every prompt on P
               decode_kw={"lease_s": LEASE_S})
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
    # the second admitted prompt waited on P behind the first, past D's lease
    assert max(done[i][2] for i in admitted) > 2 * LEASE_S, done
    [d] = ray.get([w.status.remote() for w in served.cluster.decode])
    assert d.kv_reservations_reclaimed == 0, d
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


def test_ten_times_the_sustainable_rate_is_shed_and_recovers(served):
    """Open-loop arrivals at 10x the rate the cluster sustains: the excess is refused at
    once with RESOURCE_EXHAUSTED, the router's queue never exceeds its bound (memory
    stays bounded), every admitted request finishes token-identical to HF, and the
    cluster serves normally afterwards."""
    tok = _tokenizer()
    n = 4

    def prompt(i: int) -> str:
        return f"Question {i}: what is {i} plus {2 * i}?"

    # Sustainable rate: closed loop, as many clients as the queue admits at once.
    t0 = time.monotonic()
    with ThreadPoolExecutor(MAX_QUEUED_REQUESTS) as ex:
        list(ex.map(lambda i: served.generate(prompt(i), max_tokens=n, temperature=0),
                    range(3 * MAX_QUEUED_REQUESTS)))
    rate = 3 * MAX_QUEUED_REQUESTS / (time.monotonic() - t0)

    offered = 10 * rate
    count = max(20, round(offered * 3))          # ~3 s of arrivals
    results: dict[int, tuple] = {}
    peak_queue = [0]
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak_queue[0] = max(peak_queue[0], served.client.status().queued_requests)
            time.sleep(0.02)

    def call(i: int) -> None:
        t = time.monotonic()
        try:
            ids, _, _ = served.generate(prompt(100 + i), max_tokens=n, temperature=0)
            results[i] = ("ok", ids, time.monotonic() - t)
        except grpc.RpcError as e:
            results[i] = (e.code(), e.details(), time.monotonic() - t)

    watcher = threading.Thread(target=watch)
    watcher.start()
    with ThreadPoolExecutor(count) as ex:
        for i in range(count):
            ex.submit(call, i)
            time.sleep(1 / offered)
    stop.set()
    watcher.join()

    ok = [i for i, r in results.items() if r[0] == "ok"]
    shed = [r for r in results.values() if r[0] != "ok"]
    assert len(results) == count
    assert len(shed) >= count // 2, f"{len(shed)} of {count} shed at {offered:.1f} req/s"
    for code, details, latency_s in shed:
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details)
        assert "max_queued_requests" in details and latency_s < FAST_S, (details, latency_s)
    assert peak_queue[0] <= MAX_QUEUED_REQUESTS
    assert ok, "nothing admitted"
    for i in ok:
        assert results[i][1] == hf_greedy("default", tok(prompt(100 + i))["input_ids"], n)
    served.assert_all_free()
    ids, _, _ = served.generate(prompt(7), max_tokens=n, temperature=0)   # recovered
    assert ids == hf_greedy("default", tok(prompt(7))["input_ids"], n)
    served.assert_all_free()


def _tokenizer():
    from transformers import AutoTokenizer

    from pdserve.engine.loader import resolve_model
    return AutoTokenizer.from_pretrained(resolve_model("default"))
