"""The benchmark commands run and report what they promise (figures are not asserted:
speed is judged from the benchmark's own output, never by a timed test)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_bench_transfer_tcp_writes_json(tmp_path):
    out = tmp_path / "t.json"
    r = subprocess.run([sys.executable, "-m", "pdserve.cli", "bench", "transfer", "--transports",
                        "tcp", "--num-requests", "2", "--prompt-tokens", "64", "--repeats", "1",
                        "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "ratio" in r.stdout
    (res,) = json.loads(out.read_text())["results"]
    assert res["transport"] == "tcp"
    # 2 requests x 64 tokens x 30 layers x K,V x 3 heads x 64 dims x 4 bytes
    assert res["bytes"] == 2 * 64 * 30 * 2 * 3 * 64 * 4
    assert res["gbps"] > 0 and res["baseline_gbps"] > 0
    assert res["ratio"] == pytest.approx(res["gbps"] / res["baseline_gbps"], rel=1e-6)


def test_bench_ttft_reports_ratio(tmp_path):
    out = tmp_path / "t.json"
    r = subprocess.run([sys.executable, "-m", "pdserve.cli", "bench", "ttft", "--prompt-tokens",
                        "64", "--repeats", "1", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert res["prompt_tokens"] == 64 and res["transport"] == "tcp"
    assert res["ratio"] == pytest.approx(res["ttft_s"] / res["prefill_s"], rel=1e-6)


def test_bench_local_prefill_sweeps_both_policies(tmp_path):
    out = tmp_path / "l.json"
    r = subprocess.run([sys.executable, "-m", "pdserve.cli", "bench", "local-prefill",
                        "--lengths", "16,48", "--repeats", "1", "--background", "1",
                        "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "picked local_prefill_max_tokens" in r.stdout
    res = json.loads(out.read_text())
    assert [p["prompt_tokens"] for p in res["points"]] == [16, 48]
    for p in res["points"]:
        assert p["remote_ttft_s"] > 0 and p["local_ttft_s"] > 0
        assert p["ttft_ratio"] == pytest.approx(p["local_ttft_s"] / p["remote_ttft_s"])
    assert res["local_prefill_max_tokens"] in (0, 16, 48)


def test_bench_serve_runs_every_mode_on_the_same_prompts(tmp_path):
    out, plots = tmp_path / "s.json", tmp_path / "plots"
    r = subprocess.run([sys.executable, "-m", "pdserve.cli", "bench", "serve", "--dataset",
                        "random", "--num-prompts", "4", "--random-prompt-len", "20,80",
                        "--random-output-len", "3,6", "--request-rate", "inf",
                        "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000", "--hf-batch-size",
                        "2", "--prefill-chunk-size", "32", "--json", str(out),
                        "--plot", str(plots)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "vs coloc" in r.stdout
    res = json.loads(out.read_text())
    assert res["config"]["workload"]["num_prompts"] == 4
    assert [m["mode"] for m in res["modes"]] == ["disagg", "colocated", "hf"]
    outputs = res["config"]["workload"]["output_tokens"]
    for m in res["modes"]:
        assert m["request_rate"] == "inf" and m["failed"] == 0 and m["completed"] == 4
        assert m["kv_blocks_leaked"] == 0                    # every pool free after the run
        assert m["total_output_tokens"] == outputs           # ignore_eos: exactly max_tokens
        assert m["goodput_req_s"] == m["request_throughput_req_s"]   # a loose SLO: all meet it
        for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            assert set(m[k]) == {"mean", "p50", "p90", "p99"}
    assert {p.name for p in plots.iterdir()} == {"ttft_cdf.png", "tpot_cdf.png"}
