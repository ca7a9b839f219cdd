"""pdserve/bench/slo_attainment.py's measure: SLO attainment per request, goodput read off a
rate sweep (DistServe's definition), the summary's SLO scales; and pdserve/bench/goodput.py's
workloads and arms.
No server: the client's per-request detail is made up."""

from __future__ import annotations

import pytest

from pdserve.bench.goodput import GoodputConfig, workload
from pdserve.bench.slo_attainment import (attainment, goodput, grid, grid_table, latencies,
                                          summarize, table)


def test_attainment_needs_both_slos_and_counts_failures_as_misses():
    lat = [(0.1, 0.01), (0.3, 0.01), (0.1, 0.05), None]
    assert attainment(lat, 0.2, 0.02) == 0.25
    assert attainment(lat, 0.5, 0.1) == 0.75


@pytest.mark.parametrize("points, want", [
    ([(1, 1.0), (2, 0.95), (3, 0.5)], 2 + (0.95 - 0.9) / (0.95 - 0.5)),   # interpolated
    ([(1, 1.0), (2, 0.8), (3, 0.95)], 1 + 0.1 / 0.2),   # the first fall counts, not a recovery
    ([(1, 0.5), (2, 0.4)], 0.0),                         # the lowest rate misses
    ([(2, 0.99), (1, 1.0)], 2.0),                        # none misses: the top rate
    ([(1, 0.9), (2, 0.9)], 2.0),                         # at the bar is within it
])
def test_goodput_is_the_highest_rate_at_the_attainment(points, want):
    assert goodput(points, 0.9) == pytest.approx(want)


def test_latencies_from_the_clients_detail():
    res = {"ttfts": [0.2, 0.0, 0.3], "itls": [[0.01, 0.03], [], [0.02]],
           "output_lens": [3, 0, 2], "errors": ["", "boom", ""]}
    assert latencies(res) == [(0.2, pytest.approx(0.02)), None, (0.3, 0.02)]


def test_summary_per_scale_and_which_slo_binds():
    cfg = GoodputConfig(scales=(1, 10))
    fast, slow_decode = (0.1, 0.01), (0.1, 0.05)
    record = {"workloads": {"chat": {
        "unloaded": {"ttft_s": 0.1, "tpot_s": 0.01, "prompt_tokens": 100},
        "arms": {"vllm": {"1": [fast] * 10, "2": [slow_decode] * 10},
                 "strict": {"1": [fast] * 10, "2": [fast] * 10}}}}}
    s = summarize(record, cfg)["chat"]["scales"]
    assert s["1"]["vllm"]["goodput"] == pytest.approx(1.1)     # 100% at 1, 0% at 2
    assert s["1"]["strict"]["goodput"] == 2.0
    assert s["1"]["tpot_binds"] is True
    assert s["10"]["vllm"]["goodput"] == 2.0 and s["10"]["tpot_binds"] is None
    assert "| 1 | TPOT | 1.10 | 2.00 (1.82x) |" in table(summarize(record, cfg))


@pytest.mark.parametrize("name, lo, hi, out_lo, out_hi", [
    ("summarize", 1000, 1900, 64, 128), ("longanswer", 4, 64, 256, 512)])
def test_workload_shapes(name, lo, hi, out_lo, out_hi):
    from transformers import AutoTokenizer

    from pdserve.engine.loader import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model("default"))
    reqs = workload(name, tok, 8, seed=3)
    assert len(reqs) == 8 and len({r["prompt"] for r in reqs}) == 8
    # decode(encode) may merge a token or two at the cut
    assert all(lo - 4 <= r["prompt_tokens"] <= hi + 4 for r in reqs), [r["prompt_tokens"] for r in reqs]
    assert all(out_lo <= r["output_tokens"] <= out_hi for r in reqs)
    assert reqs == workload(name, tok, 8, seed=3)          # seeded


def test_config_refuses_unknown_arms():
    with pytest.raises(ValueError, match="arms"):
        GoodputConfig(arms=("vllm", "magic"))


def test_an_slo_arm_is_told_its_scale_and_scored_at_it_only():
    from pdserve.bench.goodput import arm_args
    from pdserve.bench.slo_attainment import scored_at, slo_scales

    assert slo_scales("slo3") == (3.0, None) and slo_scales("slo1.5t8") == (1.5, 8.0)
    assert slo_scales("strict") is None and slo_scales("slowest") is None
    unloaded = {"ttft_s": 0.925, "tpot_s": 0.0272}
    assert arm_args("slo3", unloaded) == ("--slo-tpot-ms", "81.6")
    assert arm_args("slo1.5t8", unloaded) == ("--slo-tpot-ms", "40.8", "--slo-ttft-ms", "7400")
    assert "--max-prefill-queue-tokens" in arm_args("strict", None)
    assert scored_at("slo3", 16, 3) and not scored_at("slo3", 16, 2)
    assert scored_at("slo1.5t8", 8, 1.5) and not scored_at("slo1.5t8", 16, 1.5)
    assert scored_at("strict", 16, 2)
    GoodputConfig(arms=("vllm", "slo1.5t8"))
    with pytest.raises(ValueError, match="arms"):
        GoodputConfig(arms=("vllm", "slo1.5tx"))
    with pytest.raises(ValueError, match="vllm first"):
        GoodputConfig(arms=("default", "slo3"))
    cfg = GoodputConfig(scales=(1, 10), arms=("vllm", "slo10"))
    ok = [(0.1, 0.01)] * 10
    record = {"workloads": {"chat": {
        "unloaded": {"ttft_s": 0.1, "tpot_s": 0.01, "prompt_tokens": 100},
        "arms": {"vllm": {"1": ok}, "slo10": {"1": ok}}}}}
    s = summarize(record, cfg)["chat"]["scales"]
    assert "slo10" not in s["1"] and s["10"]["slo10"]["goodput"] == 1.0
    assert "| 1 | - | 1.00 | - |" in table(summarize(record, cfg))


def test_the_grid_scales_ttft_and_tpot_apart():
    """A colocated arm with slow first tokens at its top rate but steady decode, and one
    whose decode slows there: a loose TTFT SLO with a tight TPOT one tells them apart.
    An slo<k> arm is scored at TPOT scale k only, an slo<k>t<a> one at its pair only."""
    late_first, slow_decode, fast = (0.5, 0.01), (0.1, 0.05), (0.1, 0.01)
    record = {"workloads": {"chat": {
        "unloaded": {"ttft_s": 0.1, "tpot_s": 0.01, "prompt_tokens": 100},
        "arms": {"vllm": {"1": [fast] * 10, "2": [slow_decode] * 10},
                 "strict": {"1": [fast] * 10, "2": [late_first] * 10},
                 "slo2": {"1": [fast] * 10, "2": [fast] * 10},
                 "slo2t10": {"1": [fast] * 10, "2": [fast] * 10}}}}}
    g = grid(record, (1, 10), (2,))["chat"]
    assert g["ttft x10 tpot x2"].pop("slo2t10") == 2.0 and "slo2t10" not in g["ttft x1 tpot x2"]
    assert g["ttft x1 tpot x2"] == {"vllm": pytest.approx(1.1), "strict": pytest.approx(1.1),
                                    "slo2": 2.0}
    assert g["ttft x10 tpot x2"]["strict"] == 2.0 and g["ttft x10 tpot x2"]["vllm"] == \
        pytest.approx(1.1)
    assert "slo2" not in grid(record, (10,), (3,))["chat"]["ttft x10 tpot x3"]
    assert "| ttft x10 tpot x2 | 1.10 | 2.00 (1.82x) | 2.00 (1.82x) |" in grid_table(
        grid(record, (10,), (2,)))
