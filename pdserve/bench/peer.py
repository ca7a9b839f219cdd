"""`pdserve bench peer`: pdserve against vLLM's CPU build, both driven by vLLM's own client
(`vllm bench serve`, ShareGPT V3, a burst of `num_prompts` requests of `output_len`
tokens, ignore_eos), as a user comparing the two would.

Design (what makes a figure hold):
- **Cells** are (dtype, temperature, prompt sample): every dtype x temperature is
  measured on `samples` prompt samples (client seeds), none of them a tune sample
  (`tune_seed` + 100 t_index, one per temperature) that vLLM's settings are swept on
  (pdserve's defaults were tuned on seed 0). Each temperature draws its own seeds
  (1 + 100 t_index + i), so no prompt repeats within a server's life and neither
  server's prefix cache serves a later cell.
- **Pairs in ABBA order**: pair k starts vLLM then pdserve when k is even, the other
  way round when odd; each start is a fresh server that runs every cell once after a
  warm-up request. A cell's figure is the median over pairs of pdserve / vLLM, with its
  min-max; the pairs' alternation cancels a drift of the machine over the run.
- **vLLM tuned as hard as pdserve** (`tune`): a coordinate sweep on the tune sample of
  `--max-num-batched-tokens` (512, 2048, 8192), then its OpenMP binding
  (`VLLM_CPU_OMP_THREADS_BIND` 0-1 or auto), then tcmalloc preloaded where the library
  is installed; the best setting per dtype is what the pairs run, named in the results.
- **KV memory**: `default`, each server sizes its own (vLLM: its --gpu-memory-utilization
  of the machine's memory less its process, 0.92 unless `vllm_memory_utilization` says
  otherwise; pdserve: its workers' shares of --gpu-memory-utilization), or `equal`, both
  given `kv_gib` (vLLM's VLLM_CPU_KVCACHE_SPACE, pdserve's --kv-cache-memory-bytes for
  its decode worker).
- **Sanity**: fp32 greedy outputs of the two servers, request by request, reported as
  the share of identical texts and the mean share of tokens up to the first difference.
- Every server's log, command line, environment and resolved configuration (vLLM's
  logged engine config, pdserve's `status`) is saved beside the results.
"""

from __future__ import annotations

import json
import os
import random
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from .servers import (DTYPES, TCMALLOC, Server, VllmSetting, resolved_config, run_client,
                      sharegpt_json, start_pdserve, start_vllm, vllm_bin)


@dataclass(frozen=True)
class PeerConfig:
    model: str = "default"
    num_prompts: int = 64
    output_len: int = 128
    dtypes: tuple[str, ...] = ("fp32", "bf16")
    temperatures: tuple[float, ...] = (0.0, 1.0)
    samples: int = 3                  # prompt samples per (dtype, temperature)
    tune_seed: int = 0                # the sample tuning used: never a cell's
    pairs: int = 3                    # ABBA pairs
    kv: str = "default"               # default | equal
    kv_gib: float = 4.0               # KV memory of both with kv="equal"
    vllm_memory_utilization: float | None = None   # vLLM's --gpu-memory-utilization with
                                      # kv="default" (None: its own 0.92, which the OOM
                                      # killer ends in the first burst on a 24 GiB box)
    max_model_len: int = 2048
    pdserve_args: tuple[str, ...] = ()
    pdserve_bin: str | None = None    # the `pdserve` that serves (another build's, to
                                      # compare two); None: this environment's
    vllm: dict[str, VllmSetting] = field(default_factory=dict)   # dtype -> setting
    out_dir: str = "bench/results/peer"
    startup_timeout_s: float = 900.0
    resume: bool = False              # keep the server sessions OUT_DIR already holds

    def __post_init__(self):
        if self.kv not in ("default", "equal"):
            raise ValueError(f"kv={self.kv!r}: default or equal")
        for d in self.dtypes:
            if d not in DTYPES:
                raise ValueError(f"dtype {d!r}: choose from {sorted(DTYPES)}")
        if self.pairs < 1 or self.samples < 1:
            raise ValueError("pairs and samples must be >= 1")

    def seeds(self, t_index: int) -> list[int]:
        """The prompt samples of the temperature at `t_index` (never a tune sample)."""
        seeds = [1 + 100 * t_index + i for i in range(self.samples)]
        assert not set(self.tune_seeds()) & set(seeds), (self.tune_seeds(), seeds)
        return seeds

    def tune_seeds(self) -> list[int]:
        """The tuning's prompt sample of each temperature: tune_seed + 100 t_index, so
        a server's second temperature does not find the first one's prompts cached."""
        return [self.tune_seed + 100 * i for i in range(len(self.temperatures))]


def _warm_up(server: Server, model_dir: str) -> None:
    server.complete(model_dir, "The capital of France is", 8)


def session(cfg: PeerConfig, model_dir: str, system: str, dtype: str, tag: str,
            cells: list[tuple[float, int]], setting: VllmSetting | None = None,
            progress=print, sub: str = "") -> dict:
    """A fresh server running every cell once; returns {"config": ..., "runs": {(t,
    seed) key: result}}. Logs, configurations and run results go under OUT_DIR/`sub`;
    with `cfg.resume`, a session whose configuration and runs are all there already is
    read back instead of run (a session's configuration is written when it ends)."""
    out = Path(cfg.out_dir) / sub
    log = out / "logs" / f"{tag}_{system}_{dtype}.log"
    conf_path = out / "logs" / f"{tag}_{system}_{dtype}.config.json"
    run_paths = {f"t{t:g}_s{seed}": out / "runs" / f"{tag}_{system}_{dtype}_t{t:g}_s{seed}.json"
                 for t, seed in cells}
    (out / "runs").mkdir(parents=True, exist_ok=True)
    if cfg.resume and conf_path.is_file() and all(p.is_file() for p in run_paths.values()):
        progress(f"  {system} {dtype} ({tag}): kept from {out}")
        return {"config": json.loads(conf_path.read_text()),
                "runs": {k: json.loads(p.read_text()) for k, p in run_paths.items()}}
    server = (start_vllm(cfg, model_dir, dtype, setting, log) if system == "vllm"
              else start_pdserve(cfg, model_dir, dtype, log))
    try:
        progress(f"  {system} {dtype} up in {server.startup_s:.0f} s ({tag})")
        _warm_up(server, model_dir)
        conf = resolved_config(system, server)
        if setting is not None:
            conf["setting"] = asdict(setting)
        runs = {}
        for temperature, seed in cells:
            res = run_client(cfg, server, model_dir, system, dtype, temperature, seed,
                             run_paths[f"t{temperature:g}_s{seed}"])
            runs[f"t{temperature:g}_s{seed}"] = res
            progress(f"    t={temperature:g} seed={seed}: {res['output_throughput']:.1f} tok/s, "
                     f"TTFT p99 {res['p99_ttft_ms']:.0f} ms, TPOT {res['mean_tpot_ms']:.1f} ms")
    finally:
        server.stop()
    conf_path.write_text(json.dumps(conf, indent=2))
    return {"config": conf, "runs": runs}


def tune(cfg: PeerConfig, model_dir: str, progress=print) -> dict[str, VllmSetting]:
    """vLLM's best setting per dtype on the tune samples (one per temperature): a
    coordinate sweep of max_num_batched_tokens, then the OpenMP binding, then tcmalloc."""
    best: dict[str, VllmSetting] = {}
    record: dict[str, list] = {}
    cells = [(t, seed) for t, seed in zip(cfg.temperatures, cfg.tune_seeds())]

    def score(dtype: str, s: VllmSetting) -> float:
        got = session(cfg, model_dir, "vllm", dtype, f"tune_{len(record[dtype])}", cells, s,
                      progress, sub="tune")
        tps = statistics.mean(r["output_throughput"] for r in got["runs"].values())
        record[dtype].append({"setting": asdict(s), "output_throughput": tps})
        progress(f"  {s.name()}: {tps:.1f} tok/s")
        return tps

    for dtype in cfg.dtypes:
        record[dtype] = []
        progress(f"tuning vLLM {dtype} on seeds {cfg.tune_seeds()}")
        scored = {s: score(dtype, s) for s in (VllmSetting(m) for m in (512, 2048, 8192))}
        top = max(scored, key=scored.get)
        for s in (replace(top, omp_bind="auto"),) + (
                (replace(top, tcmalloc=True),) if os.path.exists(TCMALLOC) else ()):
            scored[s] = score(dtype, s)
            top = max(scored, key=scored.get)
        best[dtype] = top
        progress(f"  best {dtype}: {top.name()}")
    Path(cfg.out_dir).mkdir(parents=True, exist_ok=True)
    (Path(cfg.out_dir) / "vllm_tuning.json").write_text(json.dumps(
        {"tune_seeds": cfg.tune_seeds(), "runs": record,
         "best": {d: asdict(s) for d, s in best.items()}}, indent=2))
    return best


def load_tuning(out_dir: str) -> dict[str, VllmSetting]:
    path = Path(out_dir) / "vllm_tuning.json"
    if not path.is_file():
        return {}
    return {d: VllmSetting(**s) for d, s in json.loads(path.read_text())["best"].items()}


def pairs(cfg: PeerConfig, model_dir: str, progress=print) -> list[dict]:
    """Every dtype's ABBA pairs; returns one record per (dtype, pair, system)."""
    cells = [(t, s) for i, t in enumerate(cfg.temperatures) for s in cfg.seeds(i)]
    records = []
    for dtype in cfg.dtypes:
        setting = cfg.vllm.get(dtype, VllmSetting())
        for k in range(cfg.pairs):
            order = ("vllm", "pdserve") if k % 2 == 0 else ("pdserve", "vllm")
            progress(f"{dtype} pair {k + 1}/{cfg.pairs}: {' then '.join(order)}")
            for system in order:
                got = session(cfg, model_dir, system, dtype, f"pair{k}", cells,
                              setting if system == "vllm" else None, progress, sub=cfg.kv)
                records.append({"dtype": dtype, "pair": k, "system": system, **got})
    return records


def _spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def summarize(records: list[dict], tokenizer=None) -> dict:
    """Per cell (dtype, temperature, seed): pdserve / vLLM of output throughput, mean
    and p99 TTFT, mean TPOT, over pairs (median, min, max); per (dtype, temperature):
    the same over every pair and sample; fp32 greedy agreement."""
    by = {}
    for r in records:
        for key, res in r["runs"].items():
            by.setdefault((r["dtype"], key, r["pair"]), {})[r["system"]] = res
    cells: dict[tuple[str, str], dict[str, list[float]]] = {}
    for (dtype, key, _), both in by.items():
        if set(both) != {"vllm", "pdserve"}:
            continue
        p, v = both["pdserve"], both["vllm"]
        c = cells.setdefault((dtype, key), {})
        for name, field_, higher in (("output_throughput", "output_throughput", True),
                                     ("mean_ttft", "mean_ttft_ms", False),
                                     ("p99_ttft", "p99_ttft_ms", False),
                                     ("mean_tpot", "mean_tpot_ms", False)):
            c.setdefault(name, []).append(p[field_] / v[field_])
        c.setdefault("vllm_tok_s", []).append(v["output_throughput"])
        c.setdefault("pdserve_tok_s", []).append(p["output_throughput"])
    table = {f"{d} {k}": {n: _spread(xs) for n, xs in c.items()} for (d, k), c in sorted(cells.items())}
    groups: dict[str, dict[str, list[float]]] = {}
    for (d, k), c in cells.items():
        g = groups.setdefault(f"{d} {k.split('_')[0]}", {})
        for n, xs in c.items():
            g.setdefault(n, []).extend(xs)
    out = {"cells": table, "groups": {g: {n: _spread(xs) for n, xs in c.items()}
                                      for g, c in sorted(groups.items())}}
    if tokenizer is not None:
        out["greedy_agreement"] = greedy_agreement(by, tokenizer)
    return out


def greedy_agreement(by: dict, tokenizer) -> dict:
    """fp32 temperature-0 outputs of the two servers on the same prompts: the share of
    identical texts, and the mean share of each output's tokens before the first
    difference."""
    same = total = 0
    prefix: list[float] = []
    for (dtype, key, _), both in by.items():
        if dtype != "fp32" or not key.startswith("t0_") or set(both) != {"vllm", "pdserve"}:
            continue
        for a, b in zip(both["pdserve"]["generated_texts"], both["vllm"]["generated_texts"]):
            total += 1
            same += a == b
            ta, tb = tokenizer(a)["input_ids"], tokenizer(b)["input_ids"]
            n = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
            prefix.append(n / max(len(ta), len(tb), 1))
    return {"requests": total, "identical_share": same / total if total else None,
            "mean_matching_prefix_share": statistics.mean(prefix) if prefix else None}


def table(summary: dict) -> str:
    """The per-cell and per-group ratios as a Markdown table."""
    def f(s: dict) -> str:
        return f"{s['median']:.2f}x ({s['min']:.2f}-{s['max']:.2f})"

    lines = ["| cell | vLLM tok/s | pdserve tok/s | throughput | mean TTFT | p99 TTFT | mean TPOT |",
             "|---|---|---|---|---|---|---|"]
    for section in ("groups", "cells"):
        for name, c in summary[section].items():
            lines.append(f"| {'**' + name + '**' if section == 'groups' else name} | "
                         f"{c['vllm_tok_s']['median']:.0f} | {c['pdserve_tok_s']['median']:.0f} | "
                         f"{f(c['output_throughput'])} | {f(c['mean_ttft'])} | "
                         f"{f(c['p99_ttft'])} | {f(c['mean_tpot'])} |")
    if (g := summary.get("greedy_agreement")) and g["requests"]:
        lines.append(f"\nfp32 greedy: {g['identical_share']:.0%} of {g['requests']} outputs "
                     f"identical; {g['mean_matching_prefix_share']:.0%} of tokens before the "
                     "first difference on average")
    return "\n".join(lines)


def main(cfg: PeerConfig, do_tune: bool, progress=print) -> dict:
    from transformers import AutoTokenizer

    from ..engine.loader import resolve_model

    model_dir = str(resolve_model(cfg.model))
    sharegpt_json()
    random.seed(0)
    if do_tune:
        cfg = replace(cfg, vllm=tune(cfg, model_dir, progress) | cfg.vllm)
    elif not cfg.vllm:
        cfg = replace(cfg, vllm=load_tuning(cfg.out_dir))
    records = pairs(cfg, model_dir, progress)
    summary = summarize(records, AutoTokenizer.from_pretrained(model_dir))
    result = {"config": asdict(cfg) | {"cells_seeds": {f"t{t:g}": cfg.seeds(i) for i, t in
                                                       enumerate(cfg.temperatures)}},
              "date": time.strftime("%Y-%m-%d"), "summary": summary,
              "sessions": [{k: v for k, v in r.items() if k != "runs"} for r in records]}
    out = Path(cfg.out_dir) / f"peer_{cfg.kv}.json"
    out.write_text(json.dumps(result, indent=2))
    (Path(cfg.out_dir) / f"peer_{cfg.kv}.md").write_text(table(summary) + "\n")
    progress(table(summary))
    return result


def add_parser(bsub) -> None:
    """`pdserve bench peer` on `bsub` (the bench subcommands' argparse subparsers)."""
    p = bsub.add_parser("peer", help="pdserve vs vLLM's CPU build, both driven by `vllm bench "
                                     "serve`: ABBA pairs per dtype, temperature and prompt "
                                     "sample, vLLM's settings swept first")
    p.add_argument("--model", default="default")
    p.add_argument("--tune", action="store_true",
                   help="sweep vLLM's settings on the tune sample first (else the last "
                        "sweep's best, OUT_DIR/vllm_tuning.json, or vLLM's defaults)")
    p.add_argument("--kv", choices=["default", "equal"], default="default",
                   help="KV memory: each server's own default sizing, or both --kv-gib")
    p.add_argument("--kv-gib", type=float, default=4.0)
    p.add_argument("--vllm-gpu-memory-utilization", type=float, default=None,
                   help="--kv default: vLLM's --gpu-memory-utilization (default: its own, "
                        "0.92, which a 24 GiB box's OOM killer ends in the first burst)")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--samples", type=int, default=3, help="prompt samples per dtype x temperature")
    p.add_argument("--tune-seed", type=int, default=0)
    p.add_argument("--pairs", type=int, default=3, help="ABBA pairs of server starts")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--pdserve-args", default="", help="more `pdserve serve` flags")
    p.add_argument("--out-dir", default="bench/results/peer",
                   help="vllm_tuning.json and peer_<kv>.{json,md} here; server logs, "
                        "configurations and per-run results under tune/ and <kv>/")
    p.add_argument("--resume", action="store_true",
                   help="keep the server sessions already complete under OUT_DIR (an "
                        "interrupted run goes on where it stopped)")
    p.set_defaults(fn=_command)


def _command(args) -> int:
    try:
        cfg = PeerConfig(
            model=args.model, num_prompts=args.num_prompts, output_len=args.output_len,
            dtypes=tuple(args.dtypes.split(",")),
            temperatures=tuple(float(t) for t in args.temperatures.split(",")),
            samples=args.samples, tune_seed=args.tune_seed, pairs=args.pairs, kv=args.kv,
            kv_gib=args.kv_gib, vllm_memory_utilization=args.vllm_gpu_memory_utilization,
            pdserve_args=tuple(shlex.split(args.pdserve_args)),
            out_dir=args.out_dir, resume=args.resume)
        cfg.seeds(len(cfg.temperatures) - 1)
    except (ValueError, AssertionError) as e:
        print(f"pdserve bench peer: {e}", file=sys.stderr)
        return 2
    if not Path(vllm_bin()).exists():
        print(f"pdserve bench peer: no vLLM at {vllm_bin()} (make bench-vllm builds "
              ".venv-vllm; $VLLM names another)", file=sys.stderr)
        return 2
    main(cfg, args.tune, lambda line: print(line, flush=True))
    return 0
