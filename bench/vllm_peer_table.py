"""The table closing bench/vllm_peer.sh: per rate and dtype, vLLM's and pdserve's output
tok/s, mean TTFT, mean TPOT (and goodput when the client computed it) from `vllm bench
serve` result files, then pdserve/vLLM ratios. Where a system ran several times
(`..._run<k>.json`, REPEATS=N), each figure of its row is that figure's median over the
runs (the lower middle one of an even count), and a line lists every run's throughput,
mean TTFT and mean TPOT.

    python bench/vllm_peer_table.py bench/results/vllm_peer_*.json
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

SYSTEMS = ("vllm", "pdserve")
COLUMNS = (("done", 7), ("req/s", 7), ("out tok/s", 10), ("goodput", 8),
           ("TTFT mean", 10), ("TPOT mean", 10))


def key(path: Path) -> tuple[str, str, str]:
    """(system, dtype, rate) from vllm_peer_<system>_<dtype>_<rate>[_run<k>].json."""
    _, _, system, dtype, rate = path.stem.split("_", 4)
    return system, dtype, rate.split("_run")[0]


def _rate_order(rate: str) -> float:
    try:
        return float(rate)
    except ValueError:
        return float("inf")


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "-"


def _medians(runs: list[dict]) -> dict:
    """One result whose every number is its median_low over `runs` (a single run as is)."""
    if len(runs) == 1:
        return runs[0]
    out = dict(runs[0])
    for k, v in runs[0].items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and all(
                isinstance(r.get(k), (int, float)) for r in runs):
            out[k] = statistics.median_low([r[k] for r in runs])
    return out


def table(paths: list[Path]) -> str:
    all_runs: dict[tuple[str, str, str], list[dict]] = {}
    for p in sorted(paths):
        all_runs.setdefault(key(p), []).append(json.loads(p.read_text()))
    runs = {k: _medians(v) for k, v in all_runs.items()}
    groups = sorted({(d, r) for _, d, r in runs},      # fp32 first, as the script runs
                    key=lambda g: (g[0] != "fp32", g[0], _rate_order(g[1])))
    head = f"{'rate':>5} {'dtype':>5} {'system':>12}" + "".join(f" {n:>{w}}" for n, w in COLUMNS)
    lines = [head]
    for dtype, rate in groups:
        got = {s: runs.get((s, dtype, rate)) for s in SYSTEMS}
        for system, r in got.items():
            if r is None:
                continue
            cells = (f"{r['completed']}/{r['num_prompts']}", f"{r['request_throughput']:.3f}",
                     f"{r['output_throughput']:.1f}",
                     "-" if r.get("request_goodput") is None else f"{r['request_goodput']:.3f}",
                     f"{r['mean_ttft_ms']:.0f}ms", f"{r['mean_tpot_ms']:.1f}ms")
            lines.append(f"{rate:>5} {dtype:>5} {system:>12}"
                         + "".join(f" {c:>{w}}" for c, (_, w) in zip(cells, COLUMNS)))
            if len(every := all_runs[(system, dtype, rate)]) > 1:
                lines.append(f"{'':>24} {len(every)} runs (tok/s, TTFT, TPOT): " + ", ".join(
                    f"{r['output_throughput']:.1f} {r['mean_ttft_ms']:.0f}ms "
                    f"{r['mean_tpot_ms']:.1f}ms" for r in every))
        v, p = got["vllm"], got["pdserve"]
        if v is not None and p is not None:
            cells = ("", _ratio(p["request_throughput"], v["request_throughput"]),
                     _ratio(p["output_throughput"], v["output_throughput"]),
                     _ratio(p.get("request_goodput"), v.get("request_goodput")),
                     _ratio(p["mean_ttft_ms"], v["mean_ttft_ms"]),
                     _ratio(p["mean_tpot_ms"], v["mean_tpot_ms"]))
            lines.append(f"{rate:>5} {dtype:>5} {'pdserve/vllm':>12}"
                         + "".join(f" {c:>{w}}" for c, (_, w) in zip(cells, COLUMNS)))
    return "\n".join(lines)


if __name__ == "__main__":
    print(table([Path(a) for a in sys.argv[1:]]))
