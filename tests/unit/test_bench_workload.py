"""pdserve/bench/workload.py: workload sampling, Poisson arrivals, run statistics."""

import math

import numpy as np
import pytest

from pdserve.bench.workload import (
    MAX_PROMPT_TOKENS, MAX_TOTAL_TOKENS, MIN_TOKENS, RequestResult, arrival_times,
    random_workload, sharegpt_workload, summarize)


def test_poisson_arrivals_have_the_requested_rate_and_repeat_with_the_seed():
    t = arrival_times(4000, 8.0, seed=1)
    assert t == sorted(t) and t[0] > 0
    assert 4000 / t[-1] == pytest.approx(8.0, rel=0.05)
    assert t == arrival_times(4000, 8.0, seed=1) != arrival_times(4000, 8.0, seed=2)
    assert arrival_times(3, math.inf) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="request_rate"):
        arrival_times(3, 0)


def test_random_workload_lengths_lie_in_their_ranges():
    reqs = random_workload(50, 1000, (10, 20), (3, 5), seed=0)
    assert all(10 <= len(r.prompt_token_ids) <= 20 and 3 <= r.max_tokens <= 5 for r in reqs)
    assert all(0 <= t < 1000 for r in reqs for t in r.prompt_token_ids)
    assert reqs == random_workload(50, 1000, (10, 20), (3, 5), seed=0)


def test_sharegpt_workload_filters_like_vllm():
    from transformers import AutoTokenizer

    from pdserve.engine.loader import resolve_model
    tok = AutoTokenizer.from_pretrained(resolve_model("default"))
    reqs = sharegpt_workload(tok, 16, seed=0)
    assert len(reqs) == 16
    for r in reqs:
        n = len(r.prompt_token_ids)
        assert MIN_TOKENS <= n <= MAX_PROMPT_TOKENS and r.max_tokens >= MIN_TOKENS
        assert n + r.max_tokens <= MAX_TOTAL_TOKENS
    assert sharegpt_workload(tok, 16, seed=0) == reqs


def test_summarize_computes_latencies_throughput_and_goodput():
    fast = RequestResult(10, True, [0.1, 0.2, 0.3], e2e=0.3)      # TTFT 100 ms, TPOT 100 ms
    slow = RequestResult(20, True, [1.0, 1.5], e2e=1.5)           # TTFT 1 s, TPOT 500 ms
    failed = RequestResult(5, False, error="UNAVAILABLE")
    s = summarize([fast, slow, failed], duration_s=2.0, slo_ttft_ms=500, slo_tpot_ms=200)
    assert (s["completed"], s["failed"]) == (2, 1)
    assert s["total_input_tokens"] == 30 and s["total_output_tokens"] == 5
    assert s["request_throughput_req_s"] == 1.0 and s["output_throughput_tok_s"] == 2.5
    assert s["goodput_req_s"] == 0.5                               # only `fast` meets both
    assert s["ttft_ms"]["mean"] == pytest.approx(550)
    assert s["tpot_ms"]["p50"] == pytest.approx(300)
    assert s["itl_ms"]["mean"] == pytest.approx(np.mean([100, 100, 500]))
    assert s["e2e_ms"]["p99"] == pytest.approx(np.percentile([300, 1500], 99))
    # no SLO: every completed request is good
    assert summarize([fast, slow], 2.0)["goodput_req_s"] == 1.0
