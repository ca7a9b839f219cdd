"""`pdserve bench serve`'s config checks and its table's ratios (the vllm mode itself runs
against a real OpenAI-compatible server in tests/e2e/test_serve_openai.py)."""

import math

import pytest

from pdserve.bench.serve import ServeBenchConfig, table
from pdserve.bench.workload import RequestResult, summarize


def test_vllm_mode_needs_the_servers_url():
    with pytest.raises(ValueError, match="vllm_url.*--vllm-url"):
        ServeBenchConfig(modes=("disagg", "vllm"))
    assert ServeBenchConfig(modes=("disagg", "vllm"), vllm_url="http://127.0.0.1:8000")
    assert "vllm" not in ServeBenchConfig().modes          # the default needs no server


def _summary(mode: str, tokens_per_s: float) -> dict:
    """A run of 2 requests of 10 tokens each, `tokens_per_s` output tokens a second."""
    duration = 20 / tokens_per_s
    results = [RequestResult(5, True, [0.1 * (i + 1) for i in range(10)], 1.0)
               for _ in range(2)]
    return {"mode": mode, "request_rate": math.inf, "kv_blocks_leaked": 0,
            **summarize(results, duration, slo_ttft_ms=1e4, slo_tpot_ms=1e4)}


def test_the_headline_is_each_mode_over_vllm():
    out = table([_summary("disagg", 150.0), _summary("hf", 50.0), _summary("vllm", 100.0)])
    head, disagg, hf, vllm = out.splitlines()
    assert head.index("tok/s vs vllm") < head.index("goodput vs vllm") < head.index("vs hf")
    assert disagg.split()[11:14] == ["1.50x", "1.50x", "3.00x"]   # vs vllm (tok/s, goodput), vs hf
    assert hf.split()[11:14] == ["0.50x", "0.50x", "1.00x"]
    assert vllm.split()[11:14] == ["1.00x", "1.00x", "2.00x"]
