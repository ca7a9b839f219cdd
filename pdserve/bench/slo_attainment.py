"""DistServe's SLO attainment and goodput of per-request latencies, in tables and plots."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .goodput import GoodputConfig


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


def attainment(lat: list[tuple[float, float] | None], slo_ttft_s: float,
               slo_tpot_s: float) -> float:
    """Share of requests within both SLOs (failed ones miss)."""
    return sum(1 for x in lat if x is not None and x[0] <= slo_ttft_s and x[1] <= slo_tpot_s
               ) / max(len(lat), 1)


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


def summarize(record: dict, cfg: GoodputConfig) -> dict:
    """Per workload, arm and SLO scale: attainment at each rate and the goodput; and
    per workload and scale which SLO binds more often among vLLM's misses."""
    out = {}
    for name, w in record["workloads"].items():
        base = w["unloaded"]
        s = out[name] = {"unloaded": base, "scales": {}}
        for scale in cfg.scales:
            ttft, tpot = scale * base["ttft_s"], scale * base["tpot_s"]
            row = {}
            for arm, runs in w["arms"].items():
                if not scored_at(arm, scale, scale):       # scored at its own SLOs only
                    continue
                points = [(float(r), attainment(lat, ttft, tpot)) for r, lat in runs.items()]
                row[arm] = {"goodput": goodput(points, cfg.attainment),
                            "attainment": dict(points)}
            misses = [x for lat in w["arms"].get("vllm", {}).values() for x in lat
                      if x is not None and (x[0] > ttft or x[1] > tpot)]
            row["tpot_binds"] = (sum(x[1] > tpot for x in misses) >= sum(x[0] > ttft for x in misses)
                                 if misses else None)
            s["scales"][str(scale)] = row
    return out


def grid(record: dict, ttft_scales: tuple[float, ...], tpot_scales: tuple[float, ...],
         target: float = 0.9) -> dict:
    """Goodput per workload and arm with the TTFT and TPOT SLOs scaled apart: {workload:
    {"ttft x<a> tpot x<b>": {arm: req/s}}}. DistServe sets each application its own pair
    (its summarization: a loose TTFT, a tight TPOT), where one scale for both makes
    whichever SLO is tighter for a workload bind. An `slo` arm is scored at the SLOs it
    was told only (scored_at)."""
    out = {}
    for name, w in record["workloads"].items():
        base = w["unloaded"]
        rows = out[name] = {}
        for a in ttft_scales:
            for b in tpot_scales:
                rows[f"ttft x{a:g} tpot x{b:g}"] = {
                    arm: goodput([(float(r), attainment(lat, a * base["ttft_s"],
                                                        b * base["tpot_s"]))
                                  for r, lat in runs.items()], target)
                    for arm, runs in w["arms"].items() if scored_at(arm, a, b)}
    return out


def grid_table(g: dict) -> str:
    """grid()'s goodput as Markdown, each arm's ratio to vLLM's."""
    lines = []
    for name, rows in g.items():
        arms = list(dict.fromkeys(a for row in rows.values() for a in row))
        lines += [f"\n{name}: goodput (req/s) at 90% attainment, ratio to vLLM",
                  "| SLOs (x unloaded) | " + " | ".join(arms) + " |",
                  "|---|" + "---|" * len(arms)]
        for slos, row in rows.items():
            v = row.get("vllm")
            lines.append(f"| {slos} | " + " | ".join(
                "-" if a not in row else f"{row[a]:.2f}" + (
                    f" ({row[a] / v:.2f}x)" if v and a != "vllm" else "") for a in arms) + " |")
    return "\n".join(lines)


def table(summary: dict) -> str:
    lines = []
    for name, s in summary.items():
        u = s["unloaded"]
        arms = list(dict.fromkeys(a for row in s["scales"].values() for a in row
                                  if a != "tpot_binds"))
        lines += [f"\n{name}: unloaded TTFT {u['ttft_s'] * 1e3:.0f} ms, TPOT "
                  f"{u['tpot_s'] * 1e3:.1f} ms (prompt {u['prompt_tokens']:.0f} tokens); "
                  "goodput (req/s) at 90% attainment, ratio to vLLM",
                  "| SLO scale | binds | " + " | ".join(arms) + " |",
                  "|---|---|" + "---|" * len(arms)]
        for scale, row in s["scales"].items():
            v = row.get("vllm", {}).get("goodput")
            cells = ["-" if a not in row else f"{row[a]['goodput']:.2f}" + (
                f" ({row[a]['goodput'] / v:.2f}x)" if v and a != "vllm" else "") for a in arms]
            binds = {True: "TPOT", False: "TTFT", None: "-"}[row["tpot_binds"]]
            lines.append(f"| {scale} | {binds} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(summary: dict, out_dir: Path, scale: str) -> list[Path]:
    """attainment_vs_rate_<workload>.png at SLO scale `scale`, and goodput_vs_scale.png."""
    from .plots import _pyplot

    plt = _pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, s in summary.items():
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for arm, v in s["scales"][scale].items():
            if arm == "tpot_binds":
                continue
            pts = sorted((float(r), a) for r, a in v["attainment"].items())
            ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], marker="o", label=arm)
        ax.axhline(90, ls="--", c="gray")
        ax.set(title=f"{name}, SLO scale {scale}", xlabel="request rate (req/s)",
               ylabel="SLO attainment (%)", ylim=(0, 102))
        ax.legend()
        fig.tight_layout()
        paths.append(out_dir / f"attainment_vs_rate_{name}.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    fig, axes = plt.subplots(1, len(summary), figsize=(4.5 * len(summary), 3.5), squeeze=False)
    for ax, (name, s) in zip(axes[0], summary.items()):
        for arm in dict.fromkeys(a for row in s["scales"].values() for a in row
                                 if a != "tpot_binds"):
            pts = [(float(k), row[arm]["goodput"]) for k, row in s["scales"].items() if arm in row]
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=arm)
        ax.set(title=name, xlabel="SLO scale (x unloaded latency)", ylabel="goodput (req/s)")
        ax.legend()
    fig.tight_layout()
    paths.append(out_dir / "goodput_vs_scale.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths
