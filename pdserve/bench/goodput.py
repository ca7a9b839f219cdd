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

from .peer import PeerConfig, load_tuning
from .servers import (Server, VllmSetting, _env, grpc_address, start_pdserve, start_vllm,
                      vllm_bin)
from .slo_attainment import grid, grid_table, latencies, plot, slo_scales, summarize, table

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
