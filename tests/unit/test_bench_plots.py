"""pdserve/bench/plots.py: the --plot PNGs of `pdserve bench serve`."""

import math

import pytest

from pdserve.bench.plots import plot_cdfs, plot_vs_rate
from pdserve.bench.workload import RequestResult, summarize

pytest.importorskip("matplotlib")

PNG = b"\x89PNG"


def results(ttft_s: float, gap_s: float, n: int = 20) -> list[RequestResult]:
    out = []
    for i in range(n):
        first = ttft_s * (1 + i / n)
        toks = [first + k * gap_s for k in range(1 + i % 5)]   # some with 1 token (no TPOT)
        out.append(RequestResult(prompt_tokens=8, ok=True, token_times=toks, e2e=toks[-1]))
    out.append(RequestResult(prompt_tokens=8, ok=False, error="boom"))
    return out


def mode(name: str, rate: float, ttft_s: float) -> dict:
    return {**summarize(results(ttft_s, 0.02), 10.0, slo_ttft_ms=200, slo_tpot_ms=50),
            "mode": name, "request_rate": rate}


def is_png(path) -> bool:
    return path.is_file() and path.stat().st_size > 100 and path.read_bytes()[:4] == PNG


def test_cdfs_write_two_pngs(tmp_path):
    runs = [("disagg @ 1 req/s", results(0.05, 0.02)), ("hf @ 1 req/s", results(3.0, 0.1))]
    paths = plot_cdfs(runs, tmp_path / "plots", tag="_1")     # out_dir created; spread > 20x
    assert [p.name for p in paths] == ["ttft_cdf_1.png", "tpot_cdf_1.png"]
    assert all(is_png(p) for p in paths)


def test_cdfs_with_no_ok_results_still_write(tmp_path):
    paths = plot_cdfs([("dead", [RequestResult(prompt_tokens=3, error="x")])], tmp_path)
    assert all(is_png(p) for p in paths)


def test_vs_rate_writes_one_png_with_inf_at_the_edge(tmp_path):
    modes = [mode(m, r, t * r) for m, t in (("disagg", 0.05), ("hf", 0.5))
             for r in (0.5, 1.0, 2.0, 4.0)]
    modes += [mode("disagg", math.inf, 1.0), mode("hf", math.inf, 9.0)]
    paths = plot_vs_rate(modes, tmp_path, slo_ttft_ms=200, slo_tpot_ms=50)
    assert [p.name for p in paths] == ["latency_vs_rate.png"] and is_png(paths[0])


def test_vs_rate_needs_two_finite_rates(tmp_path):
    one = [mode("disagg", 1.0, 0.05), mode("hf", 1.0, 0.5), mode("disagg", math.inf, 1.0)]
    assert plot_vs_rate(one, tmp_path / "none") == []
    assert not (tmp_path / "none").exists()


def test_vs_rate_mode_only_at_inf_and_nan_figures(tmp_path):
    nan = {**mode("local", 2.0, 0.1), "ttft_ms": {"p90": math.nan}, "tpot_ms": {"p90": math.nan}}
    modes = [mode("disagg", 1.0, 0.05), mode("disagg", 2.0, 0.1), nan,
             mode("hf", math.inf, 5.0)]
    assert is_png(plot_vs_rate(modes, tmp_path)[0])
