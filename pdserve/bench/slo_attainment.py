"""DistServe's SLO attainment and goodput of per-request latencies, over repetitions, in
tables and plots.

A record (goodput.json) holds `reps`: per repetition, per workload, the SLO base
(`unloaded`: vLLM's unloaded TTFT and TPOT in that repetition) and per arm the
latencies of each rate point measured ({rate: [(TTFT s, TPOT s) or None]}). Every SLO
pair is a (TTFT scale, TPOT scale) of that repetition's base; each repetition is scored
against its own base, and the figures are the median over repetitions with their
spread (lowest, highest)."""

from __future__ import annotations

import statistics
from pathlib import Path

from .knee import wilson


def slo_scales(arm: str) -> tuple[float, float | None] | None:
    """(TPOT scale k, TTFT scale a or None) of an `slo<k>` / `slo<k>t<a>` arm, else None."""
    if not arm.startswith("slo"):
        return None
    k, _, a = arm[3:].partition("t")
    try:
        return float(k), (float(a) if a else None)
    except ValueError:
        return None


def scored_at(arm: str, ttft_scale: float, tpot_scale: float) -> bool:
    """Whether `arm`'s runs count at this SLO pair: an `slo` arm only at the SLOs it was
    told (any TTFT scale when it was told none)."""
    scales = slo_scales(arm)
    return scales is None or (scales[0] == tpot_scale and scales[1] in (None, ttft_scale))


def latencies(result: dict) -> list[tuple[float, float] | None]:
    """Per request (TTFT s, TPOT s), None for a failed one or one token only."""
    out = []
    for ttft, itls, n, err in zip(result["ttfts"], result["itls"], result["output_lens"],
                                  result.get("errors") or [""] * len(result["ttfts"])):
        if err or not n or n < 2 or ttft is None:
            out.append(None)
            continue
        out.append((ttft, sum(itls) / len(itls) if itls else 0.0))
    return out


def met(lat: list[tuple[float, float] | None], slo_ttft_s: float, slo_tpot_s: float) -> int:
    """Requests within both SLOs (failed ones miss)."""
    return sum(1 for x in lat if x is not None and x[0] <= slo_ttft_s and x[1] <= slo_tpot_s)


def attainment(lat: list[tuple[float, float] | None], slo_ttft_s: float,
               slo_tpot_s: float) -> float:
    """Share of requests within both SLOs (failed ones miss)."""
    return met(lat, slo_ttft_s, slo_tpot_s) / max(len(lat), 1)


def goodput(points: list[tuple[float, float]], target: float) -> float:
    """Highest rate with attainment >= target over (rate, attainment) points: the last
    rate before attainment first falls under `target`, interpolated linearly to the
    crossing; 0.0 when the lowest rate misses it (the sweep's top rate when none does)."""
    points = sorted(points)
    if not points or points[0][1] < target:
        return 0.0
    for (r0, a0), (r1, a1) in zip(points, points[1:]):
        if a1 < target:
            return r0 + (r1 - r0) * (a0 - target) / (a0 - a1)
    return points[-1][0]


def as_reps(record: dict) -> list[dict]:
    """The record's repetitions; a record of one pass (no "reps") is one repetition."""
    return record["reps"] if "reps" in record else [{"workloads": record["workloads"]}]


def pair_name(ttft_scale: float, tpot_scale: float) -> str:
    return f"ttft x{ttft_scale:g} tpot x{tpot_scale:g}"


def slos(w: dict, ttft_scale: float, tpot_scale: float) -> tuple[float, float]:
    """(TTFT SLO s, TPOT SLO s) of a pair, on a repetition's workload `w`'s base."""
    return ttft_scale * w["unloaded"]["ttft_s"], tpot_scale * w["unloaded"]["tpot_s"]


def shares(runs: dict, slo: tuple[float, float]) -> dict[float, float]:
    """{rate: attainment} of one arm's rate points `runs` at SLOs `slo`."""
    return {float(r): attainment(lat, *slo) for r, lat in runs.items()}


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "low": min(values), "high": max(values),
            "reps": values} if values else {}


def summarize(record: dict, pairs: list[tuple[float, float]], target: float = 0.9) -> dict:
    """{workload: {"unloaded": [per rep], "arms_unloaded": {arm: spread of its unloaded
    TTFT (s)}, "unloaded_vs_default": {arm: spread of that TTFT over the default arm's in
    the same repetition}, "pairs": {pair_name: {"binds": "TTFT" |
    "TPOT" | None, "arms": {arm: {"goodput": spread, "ratio": spread of the ratio to
    vLLM's goodput in the same repetition, "points": per rep {rate: [share, low, high,
    n]}}}}}}}, a spread being {"median", "low", "high", "reps"} over the repetitions,
    and (low, high) a point's 95% Wilson interval. `binds`: the SLO that more of vLLM's
    misses missed."""
    out: dict = {}
    for rep in as_reps(record):
        for name, w in rep["workloads"].items():
            s = out.setdefault(name, {"unloaded": [], "arms_unloaded": {},
                                      "unloaded_vs_default": {}, "pairs": {}})
            s["unloaded"].append(w["unloaded"])
            lone = w.get("arms_unloaded", {})
            for arm, x in lone.items():
                s["arms_unloaded"].setdefault(arm, []).append(x["ttft_s"])
                if "default" in lone and arm != "default":
                    s["unloaded_vs_default"].setdefault(arm, []).append(
                        x["ttft_s"] / lone["default"]["ttft_s"])
            for a, b in pairs:
                slo = slos(w, a, b)
                row = s["pairs"].setdefault(pair_name(a, b), {"binds": [0, 0], "arms": {}})
                vllm, here = None, []
                for arm, runs in w["arms"].items():
                    if not runs or not scored_at(arm, a, b):
                        continue
                    here.append(arm)
                    g = goodput(list(shares(runs, slo).items()), target)
                    cell = row["arms"].setdefault(arm, {"goodput": [], "ratio": [],
                                                        "points": []})
                    cell["goodput"].append(g)
                    cell["points"].append({r: [met(lat, *slo) / max(len(lat), 1),
                                               *wilson(met(lat, *slo), len(lat)), len(lat)]
                                           for r, lat in runs.items()})
                    if arm == "vllm":
                        vllm = g
                        for lat in runs.values():
                            for x in lat:
                                if x is not None and (x[0] > slo[0] or x[1] > slo[1]):
                                    row["binds"][0] += x[0] > slo[0]
                                    row["binds"][1] += x[1] > slo[1]
                for arm in here:      # ratios within this repetition only
                    if arm != "vllm" and vllm:
                        cell = row["arms"][arm]
                        cell["ratio"].append(cell["goodput"][-1] / vllm)
    for s in out.values():
        for key in ("arms_unloaded", "unloaded_vs_default"):
            s[key] = {a: _spread(v) for a, v in s[key].items()}
        for row in s["pairs"].values():
            ttft, tpot = row["binds"]
            row["binds"] = None if ttft == tpot == 0 else ("TPOT" if tpot >= ttft else "TTFT")
            for cell in row["arms"].values():
                cell["goodput"], cell["ratio"] = _spread(cell["goodput"]), _spread(cell["ratio"])
    return out


def _cell(c: dict, vllm: bool) -> str:
    g = c["goodput"]
    text = f"{g['median']:.2f}" + (f" [{g['low']:.2f}-{g['high']:.2f}]" if len(g["reps"]) > 1
                                   else "")
    if not vllm and (r := c["ratio"]):
        text += f" ({r['median']:.2f}x" + (f" [{r['low']:.2f}-{r['high']:.2f}]"
                                           if len(r["reps"]) > 1 else "") + ")"
    return text


def table(summary: dict) -> str:
    """summarize()'s goodput as Markdown: per workload a row per SLO pair, per arm the
    median goodput (req/s) [lowest-highest over the repetitions] (median ratio to vLLM's
    [its spread])."""
    lines = []
    for name, s in summary.items():
        u = s["unloaded"]
        arms = list(dict.fromkeys(a for row in s["pairs"].values() for a in row["arms"]))
        pairs = s["pairs"] if arms else {}          # no rate point: unloaded latency only
        base = ", ".join(f"{x['ttft_s'] * 1e3:.0f} ms / {x['tpot_s'] * 1e3:.1f} ms" for x in u)
        lines += [f"\n{name}: goodput (req/s) at 90% attainment, median [spread] of "
                  f"{len(u)} repetition(s), ratio to vLLM; vLLM's unloaded TTFT / TPOT per "
                  f"repetition: {base}",
                  "| SLOs (x unloaded) | binds | " + " | ".join(arms) + " |",
                  "|---|---|" + "---|" * len(arms)]
        if lone := s.get("arms_unloaded"):
            vs = s.get("unloaded_vs_default", {})
            lines.insert(-2, "unloaded TTFT per arm, median [spread]: " + ", ".join(
                f"{a} {v['median'] * 1e3:.0f} ms [{v['low'] * 1e3:.0f}-{v['high'] * 1e3:.0f}]"
                + (f" ({vs[a]['median']:.2f}x default's [{vs[a]['low']:.2f}-"
                   f"{vs[a]['high']:.2f}])" if a in vs else "") for a, v in lone.items()))
        if not arms:
            del lines[-2:]
        for pair, row in pairs.items():
            lines.append(f"| {pair} | {row['binds'] or '-'} | " + " | ".join(
                "-" if a not in row["arms"] else _cell(row["arms"][a], a == "vllm")
                for a in arms) + " |")
    return "\n".join(lines)


def plot(summary: dict, out_dir: Path, pair: str) -> list[Path]:
    """attainment_vs_rate_<workload>.png at SLO pair `pair` (each repetition's points
    with their 95% Wilson intervals), and goodput_by_pair_<workload>.png (median goodput
    per pair and arm, the bars spanning the repetitions)."""
    from .plots import _pyplot

    plt = _pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, s in summary.items():
        if not any(row["arms"] for row in s["pairs"].values()):
            continue                            # no rate point: nothing to draw
        if pair in s["pairs"]:
            fig, ax = plt.subplots(figsize=(5.5, 3.8))
            for i, (arm, c) in enumerate(s["pairs"][pair]["arms"].items()):
                colour = f"C{i}"
                for k, pts in enumerate(c["points"]):
                    rates = sorted(pts, key=float)
                    y = [100 * pts[r][0] for r in rates]
                    err = [[100 * (pts[r][0] - pts[r][1]) for r in rates],
                           [100 * (pts[r][2] - pts[r][0]) for r in rates]]
                    ax.errorbar([float(r) for r in rates], y, yerr=err, color=colour,
                                marker="o", ms=3, capsize=2, lw=1, alpha=0.8,
                                label=arm if k == 0 else None)
            ax.axhline(90, ls="--", c="gray")
            ax.set(title=f"{name}, {pair}", xlabel="request rate (req/s)",
                   ylabel="SLO attainment (%), 95% CI", ylim=(0, 102))
            ax.legend(fontsize=7)
            fig.tight_layout()
            paths.append(out_dir / f"attainment_vs_rate_{name}.png")
            fig.savefig(paths[-1], dpi=110)
            plt.close(fig)
        arms = list(dict.fromkeys(a for row in s["pairs"].values() for a in row["arms"]))
        names = list(s["pairs"])
        fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(names)), 3.8))
        width = 0.8 / max(len(arms), 1)
        for i, arm in enumerate(arms):
            xs, med, err = [], [], [[], []]
            for j, p in enumerate(names):
                if (c := s["pairs"][p]["arms"].get(arm)) is not None:
                    g = c["goodput"]
                    xs.append(j + i * width)
                    med.append(g["median"])
                    err[0].append(g["median"] - g["low"])
                    err[1].append(g["high"] - g["median"])
            ax.bar(xs, med, width, yerr=err, capsize=2, label=arm)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))], names, rotation=30,
                      ha="right", fontsize=7)
        ax.set(title=name, ylabel="goodput (req/s), median and range")
        ax.legend(fontsize=7)
        fig.tight_layout()
        paths.append(out_dir / f"goodput_by_pair_{name}.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths
