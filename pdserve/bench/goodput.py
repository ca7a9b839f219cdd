"""`pdserve bench goodput`: SLO attainment goodput, DistServe's measure (Zhong et al., OSDI
2024, section 2), of vLLM's CPU build and of pdserve's arms, on one box, through vLLM's
own client (`vllm bench serve`, Poisson arrivals, per-request detail).

- **SLO attainment** at a request rate: the share of requests whose TTFT <= SLO_ttft and
  whose TPOT ((E2E - TTFT) / (output tokens - 1)) <= SLO_tpot; a failed request misses;
  each rate point sends `requests` (100) requests, its share given with a 95% Wilson
  interval (knee.wilson).
- **Goodput** of an arm at an SLO pair: the highest Poisson rate at which attainment is
  >= `attainment` (0.9): the last rate before attainment first falls under it, linearly
  interpolated to the crossing with the next rate. The rates are found per arm by
  bisection (knee.py) until each of its SLO pairs' knee is known within `step` (10%)
  of itself.
- **SLO pairs**: TTFT scale x TPOT scale (DistServe's scale), each a multiple of the
  unloaded latency on this box, measured on vLLM at the start of each repetition: the
  median TTFT of lone prompts of the workload's median length and the median TPOT of
  those lone streams. An untold arm's points score every pair.
- **Repetitions** (`reps`, 3): the arms run in turn, their order reversed every other
  repetition; each figure is the median over repetitions, with the lowest and highest;
  a ratio to vLLM is taken within a repetition, then its median.

Workloads (prompt text, output tokens; ignore_eos; every arm visiting a rate gets that
rate's prompts, and a server never sees a prompt twice, so no prefix cache carries over:
Prompts):
- `chat`: ShareGPT first turns, filtered as vLLM's ShareGPT benchmark (prompt <= 1024
  tokens, prompt + reply <= 2048), the reply's length as output;
- `summarize`: the longest ShareGPT conversations as text, cut to 1000-1900 tokens,
  after "Summarize the conversation below.", answered in 64-128 tokens;
- `longanswer`: first-turn prompts of at most 64 tokens, answered in 256-512 tokens.

Arms (a fresh server per arm, workload and repetition):
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
  SLO of scale a (`--slo-ttft-ms`): the router then places each prompt by its predicted
  first token on each worker (router/placement.py, slo_choice). Its figures count at its
  own scales only; a user tells the server the SLOs the bench scores it by.
- `told`: `slo<k>t<a>` at every SLO pair of the grid (the default told the SLOs it is
  scored by).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from . import knee
from .goodput_workloads import Prompts, workload
from .peer import PeerConfig, load_tuning
from .servers import (Server, VllmSetting, bench_serve, prefills, start_pdserve, start_vllm,
                      unloaded, vllm_bin)
from .slo_attainment import (latencies, pair_name, plot, scored_at, shares, slo_scales,
                             slos, summarize, table)

ARMS = {
    "vllm": None,
    "default": (),
    "strict": ("--no-lend-idle-prefill-cores", "--no-local-prefill-when-prefill-idle",
               "--max-prefill-queue-tokens", "0"),
    "colocated": ("--local-prefill-max-tokens", "1000000", "--threads-per-worker", "2",
                  "--no-lend-idle-prefill-cores", "--max-prefill-queue-tokens", "0"),
}
SPARE = 20          # requests drawn beyond the rate points' (the unloaded latency's)
START = {"chat": 1.0, "summarize": 0.3, "longanswer": 0.5}     # req/s, the first point
FLOOR = {"chat": 0.2, "summarize": 0.1, "longanswer": 0.1}     # a knee under it counts 0


@dataclass(frozen=True)
class GoodputConfig:
    model: str = "default"
    workloads: tuple[str, ...] = ("summarize",)
    arms: tuple[str, ...] = ("vllm", "default", "told")
    ttft_scales: tuple[float, ...] = (2, 4, 8)
    tpot_scales: tuple[float, ...] = (2, 4, 8)
    reps: int = 3
    requests: int = 100               # per rate point
    step: float = 0.1                 # each knee known within this share of itself
    max_points: int = 12              # rate points per arm and repetition, at most
    #                                   (0: each arm's unloaded latency only)
    pool_points: int = 24             # distinct rates a workload's prompts are drawn for
    attainment: float = 0.9
    seed: int = 1                     # Poisson arrivals and prompt draws (0: tuning's)
    temperature: float = 0.0          # the client's (0: greedy)
    dtype: str = "fp32"
    kv_gib: float = 4.0               # both servers' KV memory
    out_dir: str = "bench/results/goodput"

    def __post_init__(self):
        if bad := {a for a in self.arms if a not in ARMS and a != "told"
                   and slo_scales(a) is None}:
            raise ValueError(f"arms {sorted(bad)}: choose from {', '.join(ARMS)}, told, "
                             "slo<k> or slo<k>t<a>")
        if bad := [a for a in self.arms if slo_scales(a) and not any(
                scored_at(a, *pair) for pair in self.pairs)]:
            raise ValueError(f"arms {bad} are told SLOs no pair of --ttft-scales x "
                             "--tpot-scales scores them at")
        if any(a == "told" or slo_scales(a) for a in self.arms) and "vllm" not in self.arms:
            raise ValueError("slo and told arms are told SLOs scaled on vLLM's unloaded "
                             "latency: add the vllm arm")
        if bad := set(self.workloads) - set(START):
            raise ValueError(f"workloads {sorted(bad)}: choose from {', '.join(START)}")
        if not 0 < self.attainment < 1:
            raise ValueError(f"attainment={self.attainment}: a share in (0, 1)")
        if self.reps < 1 or self.requests < 1 or self.max_points < 0:
            raise ValueError("reps and requests: at least 1; max_points: at least 0")

    @property
    def pairs(self) -> list[tuple[float, float]]:
        """(TTFT scale, TPOT scale) of every SLO pair scored."""
        return [(a, b) for a in self.ttft_scales for b in self.tpot_scales]

    def expanded_arms(self) -> list[str]:
        """The arms with `told` spelt out as slo<k>t<a> per pair."""
        out: list[str] = []
        for arm in self.arms:
            out += ([f"slo{b:g}t{a:g}" for a, b in self.pairs] if arm == "told" else [arm])
        return list(dict.fromkeys(out))


def arm_args(arm: str, unloaded: dict | None) -> tuple[str, ...]:
    """`pdserve serve` flags of a pdserve arm; `unloaded` ({"ttft_s", "tpot_s"}) scales
    an `slo` arm's SLOs."""
    if (scales := slo_scales(arm)) is not None:
        k, a = scales
        return ("--slo-tpot-ms", f"{k * unloaded['tpot_s'] * 1e3:.1f}") + (
            () if a is None else ("--slo-ttft-ms", f"{a * unloaded['ttft_s'] * 1e3:.0f}"))
    return ARMS[arm]


def _sweep(cfg: GoodputConfig, server: Server, model_dir: str, arm: str, w: dict,
           prompts: Prompts, start: float, floor: float, runs_dir: Path, tag: str,
           progress) -> None:
    """The arm's rate points by bisection (knee.search) over the SLO pairs it is scored
    at, into w["arms"][arm] (and who prefilled each rate's prompts, w["prefills"])."""
    pairs = [p for p in cfg.pairs if scored_at(arm, *p)]
    runs = w["arms"][arm] = {}

    def measure(rate: float) -> None:
        before = None if arm == "vllm" else prefills(server)
        res = bench_serve(server, model_dir, prompts.at(rate), rate, cfg.seed,
                      runs_dir / f"{tag}_{arm}_r{rate:g}.json", cfg.temperature)
        runs[str(rate)] = lat = latencies(res)
        line = f"  {arm} {rate:g} req/s: {len(lat)} requests, {res['failed']} failed, " \
               f"TTFT p90 {res['p90_ttft_ms']:.0f} ms, TPOT mean {res['mean_tpot_ms']:.1f} ms"
        if before is not None:
            placed = {k: v - before[k] for k, v in prefills(server).items()}
            w.setdefault("prefills", {}).setdefault(arm, {})[str(rate)] = placed
            line += f", prefilled on {placed}"
        a, b = pairs[0]
        share = shares({rate: lat}, slos(w, a, b))[rate]
        lo, hi = knee.wilson(round(share * len(lat)), len(lat))
        progress(line + f"; {pair_name(a, b)}: {100 * share:.0f}% [{100 * lo:.0f}-"
                        f"{100 * hi:.0f}]")

    knee.search(measure, lambda: [shares(runs, slos(w, *p)) for p in pairs], start,
                cfg.attainment, cfg.step, floor, max_points=cfg.max_points)


def finished_reps(record: dict, cfg: GoodputConfig) -> list[dict]:
    """The repetitions of `record` (an OUT_DIR/goodput.json) in which every workload has
    every arm of `cfg` measured: those `run(resume=True)` keeps.

    Raises:
        ValueError: the record was run with another configuration (a field other than
            `reps` and `out_dir` differs), naming the fields."""
    want = json.loads(json.dumps(asdict(cfg)))
    had = json.loads(json.dumps(record.get("config", {})))
    if bad := sorted(k for k in want if k not in ("reps", "out_dir")
                     and had.get(k) != want[k]):
        raise ValueError("cannot resume: the record was run with "
                         + ", ".join(f"{k}={had.get(k)!r}" for k in bad)
                         + " (this run: " + ", ".join(f"{k}={want[k]!r}" for k in bad) + ")")
    systems = set(cfg.expanded_arms())
    out = []
    for rep in record.get("reps", []):
        ws = rep.get("workloads", {})
        if any(name not in ws or not systems <= set(ws[name].get("arms_unloaded", {}))
               or (cfg.max_points and not systems <= set(ws[name].get("arms", {})))
               for name in cfg.workloads):
            break
        out.append(rep)
    return out


def run(cfg: GoodputConfig, progress=print, resume: bool = False) -> dict:
    """Every repetition of every workload and arm (the module docstring); writes
    OUT_DIR/goodput.json (after each arm, so a long run stopped keeps what it measured)
    and goodput.md.

    With `resume`, an OUT_DIR/goodput.json of the same configuration keeps its finished
    repetitions (finished_reps) and only the rest, up to `cfg.reps`, run: so the
    repetitions of a measure longer than one sitting can run on different days, each
    scored against the SLO base measured in it. Every rate keeps the prompt slice it had.

    Raises:
        ValueError: `resume` and a record of another configuration (finished_reps) or
            of another vLLM setting."""
    from transformers import AutoTokenizer

    from ..engine.loader import resolve_model

    model_dir = str(resolve_model(cfg.model))
    tok = AutoTokenizer.from_pretrained(model_dir)
    peer = PeerConfig(model=cfg.model, kv="equal", kv_gib=cfg.kv_gib, out_dir=cfg.out_dir)
    setting = load_tuning("bench/results/peer").get(cfg.dtype, VllmSetting())
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    record: dict = {"config": asdict(cfg), "vllm_setting": asdict(setting),
                    "date": time.strftime("%Y-%m-%d"), "reps": [], "slices": {}}
    if resume and (out / "goodput.json").is_file():
        before = json.loads((out / "goodput.json").read_text())
        if before.get("vllm_setting", record["vllm_setting"]) != record["vllm_setting"]:
            raise ValueError(f"cannot resume: the record's vLLM setting "
                             f"{before['vllm_setting']} is not this run's "
                             f"{record['vllm_setting']} (bench/results/peer's tuning)")
        record.update(reps=finished_reps(before, cfg), slices=before.get("slices", {}),
                      date=before.get("date", record["date"]))
        progress(f"resuming {out / 'goodput.json'}: {len(record['reps'])} of {cfg.reps} "
                 "repetitions finished")
    arms = cfg.expanded_arms()
    pools = {}
    for w_index, name in enumerate(cfg.workloads):
        pool = workload(name, tok, cfg.requests * cfg.pool_points + SPARE,
                        cfg.seed + w_index, at_most=True)
        prompts = Prompts(pool[SPARE:], cfg.requests, record["slices"].get(name))
        pools[name] = pool[:SPARE], prompts
        record["slices"][name] = prompts.slices       # a rate keeps its slice on resume
    for rep in range(len(record["reps"]), cfg.reps):
        order = arms if rep % 2 == 0 else arms[::-1]
        record["reps"].append({"order": order, "workloads": {},
                               "date": time.strftime("%Y-%m-%d")})
        for name in cfg.workloads:
            spare, prompts = pools[name]
            w = record["reps"][-1]["workloads"][name] = {"arms": {}}
            tag = f"rep{rep}_{name}"
            # the SLO base: vLLM's unloaded latency in this repetition (its own server
            # when vLLM's turn comes later), or the first arm's without vLLM
            turns = (["base"] if "vllm" in order[1:] else []) + order
            for i, arm in enumerate(turns):
                system = "vllm" if arm == "base" else arm
                log = out / "logs" / f"{tag}_{arm}.log"
                server = (start_vllm(peer, model_dir, cfg.dtype, setting, log)
                          if system == "vllm" else start_pdserve(replace(
                              peer, pdserve_args=arm_args(arm, w.get("unloaded"))),
                              model_dir, cfg.dtype, log))
                try:
                    progress(f"rep {rep + 1}/{cfg.reps} {name} {arm}: up in "
                             f"{server.startup_s:.0f} s")
                    server.complete(model_dir, "The capital of France is", 8)
                    # every arm's unloaded latency (the first one's is the SLO base)
                    lone = unloaded(server, model_dir, prompts.pool, spare,
                                    out / "runs" / f"{tag}_{arm}_unloaded.json")
                    w.setdefault("unloaded", dict(lone, arm=system))
                    w.setdefault("arms_unloaded", {})[system] = lone
                    progress(f"  unloaded: TTFT {lone['ttft_s'] * 1e3:.0f} ms, TPOT "
                             f"{lone['tpot_s'] * 1e3:.1f} ms")
                    if arm != "base" and cfg.max_points:
                        before = record["reps"][-2]["workloads"][name] if rep else None
                        _sweep(cfg, server, model_dir, arm, w, prompts,
                               _start(cfg, name, arm, before), FLOOR[name],
                               out / "runs", tag, progress)
                finally:
                    server.stop()
                (out / "goodput.json").write_text(json.dumps(record, indent=1))
    (out / "goodput.json").write_text(json.dumps(record, indent=1))
    text = table(summarize(record, cfg.pairs, cfg.attainment))
    (out / "goodput.md").write_text(text + "\n")
    progress(text)
    return record


def _start(cfg: GoodputConfig, name: str, arm: str, before: dict | None) -> float:
    """The first rate of an arm's sweep: the highest rate meeting the attainment at its
    first SLO pair in the repetition `before` (that repetition's workload record), or
    the workload's START."""
    runs = None if before is None else before["arms"].get(arm)
    if runs:
        a, b = next(p for p in cfg.pairs if scored_at(arm, *p))
        ok = [r for r, share in shares(runs, slos(before, a, b)).items()
              if share >= cfg.attainment]
        if ok:
            return max(ok)
    return START[name]


def add_parser(bsub) -> None:
    """`pdserve bench goodput` on `bsub` (the bench subcommands' argparse subparsers)."""
    d = GoodputConfig()
    p = bsub.add_parser("goodput", help="SLO attainment goodput (DistServe) of vLLM and "
                                        "pdserve's arms per workload and SLO pair, each "
                                        "knee found by bisection, over repetitions")
    p.add_argument("--model", default=d.model)
    p.add_argument("--workloads", default=",".join(d.workloads),
                   help=f"of {', '.join(START)}")
    p.add_argument("--arms", default=",".join(d.arms),
                   help=f"of {', '.join(ARMS)}, told (slo<k>t<a> at every pair), slo<k>, "
                        "slo<k>t<a>")
    p.add_argument("--ttft-scales", default=",".join(f"{x:g}" for x in d.ttft_scales),
                   help="TTFT SLOs, x vLLM's unloaded TTFT; every one with every "
                        "--tpot-scales")
    p.add_argument("--tpot-scales", default=",".join(f"{x:g}" for x in d.tpot_scales),
                   help="TPOT SLOs, x vLLM's unloaded TPOT")
    p.add_argument("--reps", type=int, default=d.reps,
                   help="repetitions, the arms' order reversed every other one")
    p.add_argument("--requests", type=int, default=d.requests, help="per rate point")
    p.add_argument("--step", type=float, default=d.step,
                   help="bisect until each knee is known within this share of itself")
    p.add_argument("--max-points", type=int, default=d.max_points,
                   help="rate points per arm and repetition, at most (0: each arm's "
                        "unloaded latency only)")
    p.add_argument("--seed", type=int, default=d.seed, help="the prompt sample and arrivals")
    p.add_argument("--temperature", type=float, default=d.temperature,
                   help="the client's sampling temperature (0: greedy)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default=d.dtype)
    p.add_argument("--kv-gib", type=float, default=d.kv_gib)
    p.add_argument("--plot-pair", default="",
                   help="the SLO pair of the attainment plots, e.g. 'ttft x4 tpot x4' "
                        "(default: the middle of the grid)")
    p.add_argument("--out-dir", default=d.out_dir)
    p.add_argument("--resume", action="store_true",
                   help="keep OUT_DIR/goodput.json's finished repetitions (the same "
                        "flags, --reps the total) and run the rest")
    p.add_argument("--rescore", action="store_true",
                   help="run nothing: score OUT_DIR/goodput.json again at these scales")
    p.set_defaults(fn=_command)


def _command(args) -> int:
    import sys

    try:
        scales = [tuple(float(x) for x in v.split(",")) for v in (args.ttft_scales,
                                                                   args.tpot_scales)]
        cfg = GoodputConfig(model=args.model, workloads=tuple(args.workloads.split(",")),
                            arms=tuple(args.arms.split(",")), ttft_scales=scales[0],
                            tpot_scales=scales[1], reps=args.reps, requests=args.requests,
                            step=args.step, max_points=args.max_points, seed=args.seed,
                            temperature=args.temperature, dtype=args.dtype,
                            kv_gib=args.kv_gib, out_dir=args.out_dir)
    except ValueError as e:
        print(f"pdserve bench goodput: {e}", file=sys.stderr)
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
        try:
            record = run(cfg, lambda line: print(line, flush=True), resume=args.resume)
        except ValueError as e:
            print(f"pdserve bench goodput: {e}", file=sys.stderr)
            return 2
    summary = summarize(record, cfg.pairs, cfg.attainment)
    text = table(summary)
    (out / "goodput.md").write_text(text + "\n")
    if args.rescore:
        print(text)
    pairs = cfg.pairs
    plot(summary, out, args.plot_pair or pair_name(*pairs[len(pairs) // 2]))
    return 0
