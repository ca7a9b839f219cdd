"""PNG figures for `pdserve bench serve --plot DIR`.

- `plot_cdfs`: the empirical CDFs of TTFT and TPOT (ms), one line per labelled run.
- `plot_vs_rate`: p90 TTFT, p90 TPOT and goodput against the request rate, one line per
  serving mode, with the SLOs as dashed lines.

matplotlib (the `bench` extra) is imported inside the functions, with the Agg backend,
so importing this module never needs it nor a display.
"""

from __future__ import annotations

import math
from pathlib import Path

from .workload import RequestResult

LOG_SPREAD = 20.0   # a log axis once the largest value is > 20x the smallest


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _log_if_spread(ax, values: list[float], axis: str) -> None:
    pos = [v for v in values if v > 0 and math.isfinite(v)]
    if pos and max(pos) > LOG_SPREAD * min(pos):
        (ax.set_xscale if axis == "x" else ax.set_yscale)("log")


def plot_cdfs(runs: list[tuple[str, list[RequestResult]]], out_dir: Path,
              tag: str = "") -> list[Path]:
    """Write `ttft_cdf{tag}.png` and `tpot_cdf{tag}.png` into `out_dir` (created if
    missing): the empirical CDF of TTFT and of TPOT, in ms, one line per (label, results)
    run, e.g. ("disagg @ 0.5 req/s", results). Only ok results count; TPOT leaves out
    requests with one output token. A run with no values has no line. The x axis is log
    when the largest value is over 20x the smallest.

    Returns:
        the two paths written.

    Raises:
        ImportError: matplotlib is not installed (`pip install 'pdserve[bench]'`).
        OSError: `out_dir` cannot be created or written.
    """
    plt = _pyplot()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    metrics = (("ttft", "TTFT", lambda r: r.ttft), ("tpot", "TPOT", lambda r: r.tpot))
    for name, title, value in metrics:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        every: list[float] = []
        for label, results in runs:
            xs = sorted(v * 1e3 for r in results
                        if r.ok and r.token_times and (v := value(r)) is not None)
            if not xs:
                continue
            every += xs
            ys = [0.0] + [(k + 1) / len(xs) for k in range(len(xs))]   # rises from 0
            ax.step(xs[:1] + xs, ys, where="post", label=f"{label} (n={len(xs)})")
        _log_if_spread(ax, every, "x")
        ax.set_xlabel(f"{title} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.set_title(f"{title} CDF")
        ax.grid(True, which="both", alpha=0.3)
        if every:
            ax.legend(fontsize="small")
        path = out_dir / f"{name}_cdf{tag}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


def plot_vs_rate(modes: list[dict], out_dir: Path, slo_ttft_ms: float | None = None,
                 slo_tpot_ms: float | None = None) -> list[Path]:
    """Write `latency_vs_rate.png` into `out_dir` (created if missing): three panels
    against the request rate (req/s): p90 TTFT (ms), p90 TPOT (ms), goodput (req/s);
    one line per mode, dashed horizontal lines at the SLOs given (ms), and a dotted
    goodput = rate line (the most goodput a rate allows).

    `modes` are `summarize()` dicts with "mode" (str) and "request_rate" (req/s, may be
    inf) added. A rate of inf (every request sent at t=0) is placed at the right edge,
    one step past the largest finite rate, ticked "inf", and joined to the mode's finite
    points by a dotted segment (its x position is not a rate). NaN figures (no request
    completed) leave a gap.

    Returns:
        [the path written], or [] (nothing written) with fewer than 2 distinct finite
        rates.

    Raises:
        ImportError: matplotlib is not installed (`pip install 'pdserve[bench]'`).
        KeyError: a dict lacks "mode", "request_rate", "ttft_ms", "tpot_ms" or
            "goodput_req_s".
        OSError: `out_dir` cannot be created or written.
    """
    finite = sorted({float(m["request_rate"]) for m in modes
                     if math.isfinite(float(m["request_rate"]))})
    if len(finite) < 2:
        return []
    plt = _pyplot()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    inf_x = finite[-1] + (finite[-1] - finite[0]) / (len(finite) - 1)
    has_inf = any(math.isinf(float(m["request_rate"])) for m in modes)

    by_mode: dict[str, list[dict]] = {}
    for m in modes:
        by_mode.setdefault(m["mode"], []).append(m)
    panels = (("p90 TTFT (ms)", lambda m: m["ttft_ms"]["p90"], slo_ttft_ms),
              ("p90 TPOT (ms)", lambda m: m["tpot_ms"]["p90"], slo_tpot_ms),
              ("goodput (req/s)", lambda m: m["goodput_req_s"], None))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, (ylabel, value, slo) in zip(axes, panels):
        every: list[float] = []
        for k, (mode, points) in enumerate(by_mode.items()):
            color = f"C{k % 10}"
            pts = sorted((float(m["request_rate"]), float(value(m))) for m in points)
            fin = [(x, y) for x, y in pts if math.isfinite(x)]
            inf = [(inf_x, y) for x, y in pts if math.isinf(x)]
            every += [y for _, y in pts]
            if fin:
                ax.plot(*zip(*fin), "o-", color=color, label=mode)
            if inf:
                ax.plot(*zip(*(fin[-1:] + inf)), ":", color=color)
                ax.plot(*zip(*inf), "o", color=color, label=None if fin else mode)
        if slo is not None:
            ax.axhline(slo, linestyle="--", color="gray", label=f"SLO {slo:g} ms")
        if ylabel.startswith("goodput"):
            ax.plot(finite, finite, ":", color="gray", label="= rate")
        else:
            _log_if_spread(ax, every + ([slo] if slo is not None else []), "y")
        ticks = finite + ([inf_x] if has_inf else [])
        ax.set_xticks(ticks, [f"{x:g}" for x in finite] + (["inf"] if has_inf else []))
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle("latency and goodput vs request rate")
    fig.tight_layout()
    path = out_dir / "latency_vs_rate.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]
