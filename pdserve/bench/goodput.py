"""`pdserve bench goodput`: SLO attainment goodput, DistServe's measure (Zhong et al., OSDI
2024, section 2), of vLLM's CPU build and of pdserve's arms, on one box, through vLLM's
own client (`vllm bench serve`, Poisson arrivals, per-request detail).

- **SLO attainment** at a request rate: the share of requests whose TTFT <= SLO_ttft and
  whose TPOT ((E2E - TTFT) / (output tokens - 1)) <= SLO_tpot; a failed request misses.
- **Goodput** of an arm at an SLO pair: the highest Poisson rate at which attainment is
  >= `attainment` (0.9), read off the sweep: the last rate before attainment first
  falls under it, linearly interpolated to the crossing with the next rate.
- **SLO scale** (DistServe's): both SLOs as multiples of the unloaded latency on this box,
  measured once per workload on the first arm (vLLM): the median TTFT of lone prompts of
  the workload's median length and the median TPOT of those lone streams. Attainment
  at every scale comes from the same runs (the per-request latencies are kept), so
  sweeping the scale costs no run.

Workloads (prompt text, output tokens; ignore_eos; a rate point's requests never repeat
a prompt another rate of the same server sent, so no prefix cache carries over):
- `chat`: ShareGPT first turns, filtered as vLLM's ShareGPT benchmark (prompt <= 1024
  tokens, prompt + reply <= 2048), the reply's length as output;
- `summarize`: the longest ShareGPT conversations as text, cut to 1000-1900 tokens,
  after "Summarize the conversation below.", answered in 64-128 tokens;
- `longanswer`: first-turn prompts of at most 64 tokens, answered in 256-512 tokens.

Arms (a fresh server per arm and workload; arms alternate order by workload):
- `vllm`: vLLM at its tuned setting (`pdserve bench peer --tune`), KV as `kv_gib`;
- `default`: `pdserve serve` as it starts with no flags;
- `strict`: every prompt on the prefill worker, no core lending
  (--no-lend-idle-prefill-cores --no-local-prefill-when-prefill-idle
  --max-prefill-queue-tokens 0): decode steps never slowed by a prefill;
- `colocated`: the decode worker prefills every prompt on both cores (vLLM's shape on
  pdserve's engine; the prefill worker idles);
- `slo<k>` (e.g. `slo3`): the default told the TPOT SLO of scale k (`--slo-tpot-ms`, k x
  the unloaded TPOT): the decode worker's steps beside running streams stay within it
  (decode_worker/step_budget.py). `slo<k>t<a>` (e.g. `slo1.5t8`) is also told the TTFT
  SLO of scale a (`--slo-ttft-ms`): the router then keeps every prompt a prefill worker
  answers in time off the decode worker (router/placement.py). Its figures count at its
  own scales only; a user tells the server the SLOs the bench scores it by.
"""

from __future__ import annotations

import json
import math
import random
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from .peer import (PeerConfig, Server, VllmSetting, _env, grpc_address, load_tuning,
                   start_pdserve, start_vllm, vllm_bin)

ARMS = {
    "vllm": None,
    "default": (),
    "strict": ("--no-lend-idle-prefill-cores", "--no-local-prefill-when-prefill-idle",
               "--max-prefill-queue-tokens", "0"),
    "colocated": ("--local-prefill-max-tokens", "1000000", "--threads-per-worker", "2",
                  "--no-lend-idle-prefill-cores", "--max-prefill-queue-tokens", "0"),
}
SPARE = 20          # requests drawn beyond the rate points' (the unloaded latency's)
RATES = {"chat": (0.5, 1.0, 1.5, 2.0, 3.0), "summarize": (0.15, 0.3, 0.45, 0.6, 0.8),
         "longanswer": (0.25, 0.5, 1.0, 1.5, 2.0)}


@dataclass(frozen=True)
class GoodputConfig:
    model: str = "default"
    workloads: tuple[str, ...] = ("chat", "summarize", "longanswer")
    arms: tuple[str, ...] = ("vllm", "default", "strict", "colocated")
    rates: dict[str, tuple[float, ...]] = field(default_factory=lambda: dict(RATES))
    duration_s: float = 60.0          # of arrivals per rate point (at least min_requests)
    min_requests: int = 30
    max_requests: int = 120
    attainment: float = 0.9
    scales: tuple[float, ...] = (1.5, 2, 3, 4, 6, 8, 12)
    seed: int = 1                     # Poisson arrivals and prompt draws (0: tuning's)
    dtype: str = "fp32"
    kv_gib: float = 4.0               # both servers' KV memory
    out_dir: str = "bench/results/goodput"

    def __post_init__(self):
        if bad := {a for a in self.arms if a not in ARMS and slo_scales(a) is None}:
            raise ValueError(f"arms {sorted(bad)}: choose from {', '.join(ARMS)}, slo<k> "
                             "or slo<k>t<a>")
        if any(slo_scales(a) for a in self.arms) and "vllm" not in self.arms[:1]:
            raise ValueError("slo arms need the unloaded latency: run vllm first")
        if bad := set(self.workloads) - set(RATES):
            raise ValueError(f"workloads {sorted(bad)}: choose from {', '.join(RATES)}")
        if not 0 < self.attainment < 1:
            raise ValueError(f"attainment={self.attainment}: a share in (0, 1)")

    def num_requests(self, rate: float) -> int:
        return int(min(max(rate * self.duration_s, self.min_requests), self.max_requests))


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


def arm_args(arm: str, unloaded: dict | None) -> tuple[str, ...]:
    """`pdserve serve` flags of a pdserve arm; `unloaded` ({"ttft_s", "tpot_s"}) scales
    an `slo` arm's SLOs."""
    if (scales := slo_scales(arm)) is not None:
        k, a = scales
        return ("--slo-tpot-ms", f"{k * unloaded['tpot_s'] * 1e3:.1f}") + (
            () if a is None else ("--slo-ttft-ms", f"{a * unloaded['ttft_s'] * 1e3:.0f}"))
    return ARMS[arm]


def workload(name: str, tokenizer, n: int, seed: int) -> list[dict]:
    """`n` requests {"prompt", "output_tokens", "prompt_tokens"} of workload `name` (the
    module docstring), drawn at random (`seed`)."""
    from ..sharegpt import conversations, first_turns

    rng = random.Random(seed)
    pool: list[dict] = []
    if name == "summarize":
        head = "Summarize the conversation below.\n\n"
        for conv in conversations():
            text = "\n".join(f"{t.get('from')}: {t.get('value')}"
                             for t in conv.get("conversations") or [])
            ids = tokenizer(head + text)["input_ids"]
            if len(ids) >= 1000:
                keep = ids[:rng.randint(1000, min(1900, len(ids)))]
                pool.append({"prompt": tokenizer.decode(keep), "output_tokens": rng.randint(64, 128)})
            if len(pool) >= 4 * n:
                break
    else:
        for prompt, reply in first_turns():
            p = len(tokenizer(prompt)["input_ids"])
            if name == "chat":
                out = len(tokenizer(reply)["input_ids"])
                if 4 <= p <= 1024 and out >= 4 and p + out <= 2048:
                    pool.append({"prompt": prompt, "output_tokens": out})
            elif 4 <= p <= 64:
                pool.append({"prompt": prompt, "output_tokens": rng.randint(256, 512)})
            if len(pool) >= 4 * n:
                break
    if len(pool) < n:
        raise ValueError(f"workload {name}: {len(pool)} requests found, {n} asked for")
    out = rng.sample(pool, n)
    for r in out:                     # as the server counts them (no chat template)
        r["prompt_tokens"] = len(tokenizer(r["prompt"])["input_ids"])
    return out


def _client(server: Server, model_dir: str, requests: list[dict], rate: float, seed: int,
            out: Path, extra: tuple[str, ...] = ()) -> dict:
    """`vllm bench serve` of `requests` at `rate` (Poisson; inf: a burst) against
    `server`; returns its result with per-request detail."""
    data = out.with_suffix(".jsonl")
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_text("".join(json.dumps({"prompt": r["prompt"], "output_tokens": r["output_tokens"]})
                            + "\n" for r in requests))
    cmd = [vllm_bin(), "bench", "serve", "--backend", "openai", "--base-url", server.url,
           "--model", model_dir, "--dataset-name", "custom", "--dataset-path", str(data),
           "--custom-output-len", "-1", "--skip-chat-template", "--disable-shuffle",
           "--num-prompts", str(len(requests)), "--ignore-eos", "--request-rate", f"{rate:g}",
           "--seed", str(seed), "--save-result", "--save-detailed", "--disable-tqdm",
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
           "--result-dir", str(out.parent), "--result-filename", out.name, *extra]
    r = subprocess.run(cmd, env=_env({}), capture_output=True, text=True, timeout=3600)
    if r.returncode != 0 or not out.is_file():
        raise RuntimeError(f"vllm bench serve failed ({r.returncode}):\n{r.stdout[-2000:]}"
                           f"\n{r.stderr[-2000:]}")
    return json.loads(out.read_text())


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


def prefills(server: Server) -> dict[str, float]:
    """A pdserve server's count of request attempts by who prefilled them
    (pdserve_prefills_total: {"prefill_worker": n, "decode_worker": m})."""
    import urllib.request

    from ..client import Client

    with Client(grpc_address(server.log), timeout_s=30) as c:
        address = c.status().metrics_address
    out = {"prefill_worker": 0.0, "decode_worker": 0.0}
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=30) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("pdserve_prefills_total{"):
                on = line.split('on="')[1].split('"')[0]
                out[on] = float(line.rsplit(" ", 1)[1])
    return out


def unloaded(server: Server, model_dir: str, pool: list[dict], spare: list[dict],
             out: Path) -> dict:
    """TTFT and TPOT of lone requests of the workload's median prompt length: the
    three prompts of `spare` (sent at no rate point) nearest `pool`'s median, one at a
    time."""
    median = statistics.median(r["prompt_tokens"] for r in pool)
    lone = sorted(spare, key=lambda r: abs(r["prompt_tokens"] - median))[:3]
    res = _client(server, model_dir, lone, math.inf, 0, out, ("--max-concurrency", "1"))
    lat = [x for x in latencies(res) if x is not None]
    return {"prompt_tokens": median, "ttft_s": statistics.median(x[0] for x in lat),
            "tpot_s": statistics.median(x[1] for x in lat)}


def run(cfg: GoodputConfig, progress=print) -> dict:
    from transformers import AutoTokenizer

    from ..engine.loader import resolve_model

    model_dir = str(resolve_model(cfg.model))
    tok = AutoTokenizer.from_pretrained(model_dir)
    peer = PeerConfig(model=cfg.model, kv="equal", kv_gib=cfg.kv_gib, out_dir=cfg.out_dir)
    setting = load_tuning("bench/results/peer").get(cfg.dtype, VllmSetting())
    out = Path(cfg.out_dir)
    record: dict = {"config": asdict(cfg), "vllm_setting": asdict(setting),
                    "date": time.strftime("%Y-%m-%d"), "workloads": {}}
    for w_index, name in enumerate(cfg.workloads):
        rates = cfg.rates[name]
        need = sum(cfg.num_requests(r) for r in rates) + SPARE
        pool = workload(name, tok, need, cfg.seed + w_index)
        slices, k = {}, 0
        for r in rates:              # each rate its own prompts
            slices[r] = pool[k:k + cfg.num_requests(r)]
            k += len(slices[r])
        w = record["workloads"][name] = {"rates": list(rates), "arms": {}}
        # vLLM first (its unloaded latency sets the SLOs), the others in turn order
        rest = [a for a in cfg.arms if a != "vllm"]
        arms = [a for a in cfg.arms if a == "vllm"] + (rest if w_index % 2 == 0 else rest[::-1])
        for arm in arms:
            log = out / "logs" / f"{name}_{arm}.log"
            server = (start_vllm(peer, model_dir, cfg.dtype, setting, log) if arm == "vllm"
                      else start_pdserve(replace(peer, pdserve_args=arm_args(
                          arm, w.get("unloaded"))), model_dir, cfg.dtype, log))
            try:
                progress(f"{name} {arm}: up in {server.startup_s:.0f} s")
                server.complete(model_dir, "The capital of France is", 8)
                if "unloaded" not in w:
                    w["unloaded"] = unloaded(server, model_dir, pool[:k], pool[k:],
                                             out / "runs" / f"{name}_{arm}_unloaded.json")
                    w["unloaded"]["arm"] = arm
                    progress(f"  unloaded: TTFT {w['unloaded']['ttft_s'] * 1e3:.0f} ms, TPOT "
                             f"{w['unloaded']['tpot_s'] * 1e3:.1f} ms")
                runs, placed = {}, {}
                for r in rates:
                    before = None if arm == "vllm" else prefills(server)
                    res = _client(server, model_dir, slices[r], r, cfg.seed,
                                  out / "runs" / f"{name}_{arm}_r{r:g}.json")
                    runs[r] = latencies(res)
                    if before is not None:     # who prefilled this rate's prompts
                        placed[str(r)] = {k: v - before[k] for k, v in prefills(server).items()}
                    progress(f"  {r:g} req/s: {len(slices[r])} requests, {res['failed']} failed,"
                             f" TTFT p90 {res['p90_ttft_ms']:.0f} ms,"
                             f" TPOT mean {res['mean_tpot_ms']:.1f} ms"
                             + (f", prefilled on {placed[str(r)]}" if str(r) in placed else ""))
                w["arms"][arm] = {str(r): lat for r, lat in runs.items()}
                if placed:
                    w.setdefault("prefills", {})[arm] = placed
            finally:
                server.stop()
    record["summary"] = summarize(record, cfg)
    (out / "goodput.json").write_text(json.dumps(record, indent=1))
    (out / "goodput.md").write_text(table(record["summary"]) + "\n")
    progress(table(record["summary"]))
    return record


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


def add_parser(bsub) -> None:
    """`pdserve bench goodput` on `bsub` (the bench subcommands' argparse subparsers)."""
    p = bsub.add_parser("goodput", help="SLO attainment goodput (DistServe) of vLLM and "
                                        "pdserve's arms per workload and SLO scale")
    p.add_argument("--model", default="default")
    p.add_argument("--workloads", default="chat,summarize,longanswer")
    p.add_argument("--arms", default="vllm,default,strict,colocated")
    p.add_argument("--duration-s", type=float, default=60.0,
                   help="seconds of Poisson arrivals per rate point")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--kv-gib", type=float, default=4.0)
    p.add_argument("--plot-scale", default="4", help="the SLO scale of the attainment plots")
    p.add_argument("--out-dir", default="bench/results/goodput")
    p.add_argument("--ttft-scales", default="",
                   help="also score TTFT and TPOT SLOs scaled apart: these TTFT scales x "
                        "--tpot-scales (OUT_DIR/goodput_grid.md)")
    p.add_argument("--tpot-scales", default="1.5,2,3,4")
    p.add_argument("--rescore", action="store_true",
                   help="run nothing: score OUT_DIR/goodput.json again (with --ttft-scales)")
    p.set_defaults(fn=_command)


def _command(args) -> int:
    import sys

    try:
        cfg = GoodputConfig(model=args.model, workloads=tuple(args.workloads.split(",")),
                            arms=tuple(args.arms.split(",")), duration_s=args.duration_s,
                            seed=args.seed, dtype=args.dtype, kv_gib=args.kv_gib,
                            out_dir=args.out_dir)
    except ValueError as e:
        print(f"pdserve bench goodput: {e}", file=sys.stderr)
        return 2
    try:
        scales = [tuple(float(x) for x in v.split(",")) if v else ()
                  for v in (args.ttft_scales, args.tpot_scales)]
    except ValueError as e:
        print(f"pdserve bench goodput: --ttft-scales / --tpot-scales: {e}", file=sys.stderr)
        return 2
    out = Path(cfg.out_dir)
    if args.rescore:
        if not (out / "goodput.json").is_file():
            print(f"pdserve bench goodput: no {out / 'goodput.json'} to rescore",
                  file=sys.stderr)
            return 2
        record = json.loads((out / "goodput.json").read_text())
    elif "vllm" in cfg.arms and not Path(vllm_bin()).exists():
        print(f"pdserve bench goodput: no vLLM at {vllm_bin()} (make bench-vllm builds it)",
              file=sys.stderr)
        return 2
    else:
        record = run(cfg, lambda line: print(line, flush=True))
    plot(record["summary"], out, args.plot_scale)
    if scales[0]:
        text = grid_table(grid(record, *scales, cfg.attainment))
        (out / "goodput_grid.md").write_text(text + "\n")
        print(text)
    return 0
