"""`pdserve bench ...`: the benchmark subcommands, each against its baseline in the same
run (pdserve/cli.py adds them to its parser). The serving benchmarks (ttft, pull,
local-prefill, serve, planner) are here; peer.py, goodput.py and microbench.py add their own."""

from __future__ import annotations

import argparse
import sys

from . import write_json


def _add_common(p: argparse.ArgumentParser) -> None:
    """--model, --transport and --json, which the serving benchmarks share."""
    p.add_argument("--model", default="default")
    p.add_argument("--transport", default="tcp", choices=["tcp", "nixl", "ucx", "auto"])
    p.add_argument("--json", default=None, help="write the figures to this file")


def _bench_ttft(args) -> int:
    from . import ttft
    r = ttft.run(args.prompt_tokens, args.repeats, args.transport, args.model)
    print(f"prompt {r.prompt_tokens} tokens, {r.transport} KV transport, {r.repeats} repeats "
          f"(median): prefill alone {r.prefill_s:.3f} s, disaggregated TTFT {r.ttft_s:.3f} s, "
          f"ratio {r.ratio:.3f}")
    write_json(args.json, lambda: ttft.as_json(r))
    return 0


def _bench_tracing(args) -> int:
    from . import tracing
    if args.peer:
        return _bench_tracing_peer(args)
    runs = tracing.run(args.pairs, args.requests, args.concurrency, args.prompt_tokens,
                       args.max_tokens, args.temperature, args.model, args.transport)
    s = tracing.summary(runs)
    print(f"throughput traced / off: median {s['ratio_on_off_median']:.3f} "
          f"(pairs {', '.join(f'{r:.3f}' for r in s['ratios'])}); "
          f"{s['spans_per_request']:.1f} spans a request")
    write_json(args.json, lambda: tracing.as_json(runs, vars(args) | {"fn": None}))
    return 0


def _bench_tracing_peer(args) -> int:
    import json
    from pathlib import Path

    from . import tracing
    from .servers import vllm_bin
    if not Path(vllm_bin()).exists():
        print(f"pdserve bench tracing: no vLLM client at {vllm_bin()} (make bench-vllm "
              "builds .venv-vllm; $VLLM names another)", file=sys.stderr)
        return 2
    if args.before_bin and not Path(args.before_bin).is_file():
        print(f"pdserve bench tracing: --before-bin {args.before_bin}: no such file",
              file=sys.stderr)
        return 2
    temperatures = tuple(float(t) for t in args.temperatures.split(","))
    records = tracing.run_peer(args.pairs, args.num_prompts, args.output_len, temperatures,
                               args.dtype, args.before_bin, args.model, args.out_dir,
                               lambda line: print(line, flush=True))
    s = tracing.peer_summary(records)
    for cell, figures in s.items():
        if cell != "spans_per_request":
            print(cell + ": " + "; ".join(
                f"{name.replace('_', ' / ')} median {f['median']:.3f} "
                f"({f['min']:.3f}-{f['max']:.3f})" for name, f in figures.items()))
    print(f"{s['spans_per_request']:.1f} spans a request")
    out = Path(args.out_dir) / f"peer_{args.dtype}.json"
    out.write_text(json.dumps(tracing.peer_as_json(records, vars(args) | {"fn": None}),
                              indent=2))
    return 0


def _bench_pull(args) -> int:
    from . import kv_pull
    lengths = [int(x) for x in args.lengths.split(",")]
    print(f"history lengths {lengths}: next turn's TTFT with the history read from the "
          f"decode worker vs computed, {args.repeats} repeats each ...", flush=True)
    points = kv_pull.run(lengths, args.repeats, args.model, args.transport)
    print(kv_pull.table(points))
    latency_s, bytes_per_s = kv_pull.fit(points)
    print(f"pull cost fit: {latency_s * 1e3:.1f} ms + bytes / {bytes_per_s / 1e9:.2f} GB/s")
    write_json(args.json, lambda: kv_pull.as_json(points, vars(args) | {"fn": None}))
    return 0


def _bench_local_prefill(args) -> int:
    from . import local_prefill
    lengths = [int(x) for x in args.lengths.split(",")]
    print(f"sweeping uncached prompt lengths {lengths}: remote vs local prefill, "
          f"{args.repeats} repeats each, {args.background} background streams ...", flush=True)
    points = local_prefill.run(lengths, args.repeats, args.background, args.model,
                               args.transport)
    threshold = local_prefill.pick_threshold(points, args.itl_tolerance)
    print(local_prefill.table(points, threshold))
    write_json(args.json,
               lambda: local_prefill.as_json(points, threshold, vars(args) | {"fn": None}))
    return 0


def _bench_serve(args) -> int:
    import math
    from pathlib import Path

    from transformers import AutoConfig, AutoTokenizer

    from . import serve, workload
    from ..engine.loader import resolve_model

    try:
        rates = tuple(float(r) for r in args.request_rate.split(","))
        cfg = serve.ServeBenchConfig(
            model=args.model, modes=tuple((args.modes or "disagg,colocated,hf"
                                           + (",vllm" if args.vllm_url else "")).split(",")), request_rates=rates,
            seed=args.seed, slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms,
            transport=args.transport, prefill_chunk_size=args.prefill_chunk_size,
            decode_blocks=args.decode_kv_blocks, hf_batch_size=args.hf_batch_size,
            vllm_url=args.vllm_url)
    except ValueError as e:
        print(f"pdserve bench serve: {e}", file=sys.stderr)
        return 2
    model_dir = resolve_model(args.model)
    if args.dataset == "sharegpt":
        reqs = workload.sharegpt_workload(
            AutoTokenizer.from_pretrained(model_dir), args.num_prompts, args.seed,
            getattr(AutoConfig.from_pretrained(model_dir), "max_position_embeddings", 8192))
    else:
        lens = [tuple(int(x) for x in v.split(",")) for v in (args.random_prompt_len,
                                                               args.random_output_len)]
        reqs = workload.random_workload(args.num_prompts,
                                        AutoConfig.from_pretrained(model_dir).vocab_size,
                                        lens[0], lens[1], args.seed)
    if args.max_output_tokens:
        from dataclasses import replace
        reqs = [replace(r, max_tokens=min(r.max_tokens, args.max_output_tokens)) for r in reqs]
    wl = {"dataset": args.dataset, "num_prompts": len(reqs),
          "max_output_tokens": args.max_output_tokens,
          "prompt_tokens": sum(len(r.prompt_token_ids) for r in reqs),
          "output_tokens": sum(r.max_tokens for r in reqs)}
    print(f"{wl['num_prompts']} {args.dataset} prompts ({wl['prompt_tokens']} prompt, "
          f"{wl['output_tokens']} output tokens); modes {', '.join(cfg.modes)}; rates "
          f"{', '.join(f'{r:g}' for r in rates)} req/s; SLO TTFT {args.slo_ttft_ms} ms, "
          f"TPOT {args.slo_tpot_ms} ms; CPUs {list(cfg.cpus)}", flush=True)
    runs = serve.run(cfg, reqs)
    summaries = [r.summary(cfg) for r in runs]
    print(serve.table(summaries))
    write_json(args.json,
               lambda: serve.as_json(cfg, runs, wl) | {"command": " ".join(sys.argv)})
    if args.plot:
        from . import plots
        out = Path(args.plot)
        out.mkdir(parents=True, exist_ok=True)
        for rate in rates:
            plots.plot_cdfs([(f"{r.mode} @ {rate:g} req/s", r.results) for r in runs
                             if r.request_rate == rate], out,
                            tag="" if len(rates) == 1 else f"_rate{rate:g}")
        plots.plot_vs_rate([s for s in summaries if math.isfinite(s["request_rate"])], out,
                           args.slo_ttft_ms, args.slo_tpot_ms)
    return 1 if any(s["failed"] or s["kv_blocks_leaked"] for s in summaries) else 0


def _bench_planner(args) -> int:
    from transformers import AutoTokenizer

    from . import planner
    from ..engine.loader import resolve_model

    try:
        cfg = planner.PlannerBenchConfig(
            model=args.model, budget=args.budget, slo_ttft_ms=args.slo_ttft_ms,
            slo_itl_ms=args.slo_itl_ms, phase_s=args.phase_s, prefill_rate=args.prefill_rate,
            decode_rate=args.decode_rate, interval_s=args.planner_interval_s,
            planner_margin=args.planner_margin, seed=args.seed,
            cpu_limit=args.cpu_limit or None, conditional_disagg=args.conditional_disagg,
            poisson=args.poisson, rebalance_on_scale_up=args.rebalance_on_scale_up,
            transport=args.transport)
    except ValueError as e:
        print(f"pdserve bench planner: {e}", file=sys.stderr)
        return 2
    if cfg.cpu_limit is not None:
        from ..cpu_limit import CpuLimitError, writable
        try:
            writable()
        except CpuLimitError as e:
            print(f"pdserve bench planner: {e} (--cpu-limit 0: uncapped workers)",
                  file=sys.stderr)
            return 2
    requests, times = planner.trace(cfg, AutoTokenizer.from_pretrained(resolve_model(cfg.model)))
    print(f"{len(requests)} ShareGPT requests over 2 x {cfg.phase_s:g} s; runs: planner, "
          + ", ".join(f"{p}P+{d}D" for p, d in cfg.splits()), flush=True)
    runs = planner.run(cfg, requests, times)
    print(planner.table(cfg, runs))
    write_json(args.json, lambda: planner.as_json(cfg, runs) | {"command": " ".join(sys.argv)})
    return 0


def add_bench_parser(sub) -> None:
    """The `bench` subcommand and its own subcommands, on `sub` (argparse subparsers)."""
    b = sub.add_parser("bench", help="benchmarks, each against its baseline in the same run")
    bsub = b.add_subparsers(dest="bench", required=True)
    from .goodput import add_parser as add_goodput
    from .microbench import add_gpu_parser, add_step_parser, add_tp_parser, add_transfer_parser
    from .multiturn import add_parser as add_multiturn
    from .peer import add_parser as add_peer
    add_peer(bsub)
    add_goodput(bsub)
    add_multiturn(bsub)
    add_transfer_parser(bsub)
    bf = bsub.add_parser("ttft", help="disaggregated TTFT vs prefill alone on the same worker")
    bf.add_argument("--prompt-tokens", type=int, default=1024)
    bf.add_argument("--repeats", type=int, default=5)
    _add_common(bf)
    bf.set_defaults(fn=_bench_ttft)
    bp = bsub.add_parser("pull", help="a next turn's TTFT with its history read from the "
                                      "decode worker (--kv-pull) vs computed, and the pull "
                                      "cost model's rates")
    bp.add_argument("--lengths", default="256,512,1024,2048",
                    help="comma-separated history lengths (tokens)")
    bp.add_argument("--repeats", type=int, default=3)
    _add_common(bp)
    bp.set_defaults(fn=_bench_pull)
    bt = bsub.add_parser("tracing", help="throughput with every request traced "
                                         "(--otlp-traces-endpoint, sampling 1.0) vs off, "
                                         "in alternating pairs")
    bt.add_argument("--pairs", type=int, default=3)
    bt.add_argument("--requests", type=int, default=48)
    bt.add_argument("--concurrency", type=int, default=8)
    bt.add_argument("--prompt-tokens", type=int, default=120)
    bt.add_argument("--max-tokens", type=int, default=32)
    bt.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    bt.add_argument("--peer", action="store_true",
                    help="on the peer harness instead: vLLM's client (`vllm bench serve`, "
                         "ShareGPT) against `pdserve serve` processes, tracing off and on")
    bt.add_argument("--before-bin", default=None,
                    help="--peer: another build's `pdserve` executable as a third arm (the "
                         "code before tracing: what tracing off costs)")
    bt.add_argument("--num-prompts", type=int, default=64, help="--peer: each burst's")
    bt.add_argument("--output-len", type=int, default=128, help="--peer: tokens a request")
    bt.add_argument("--temperatures", default="0,1", help="--peer: one cell each")
    bt.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="--peer")
    bt.add_argument("--out-dir", default="bench/results/tracing/peer",
                    help="--peer: logs, each run's result and peer_<dtype>.json")
    _add_common(bt)
    bt.set_defaults(fn=_bench_tracing)
    bl = bsub.add_parser("local-prefill", help="TTFT and running-stream ITL of prefilling on "
                                               "the decode worker vs a prefill worker, per "
                                               "uncached prompt length (picks the threshold)")
    bl.add_argument("--lengths", default="16,32,64,128,256,512",
                    help="comma-separated uncached prompt lengths (tokens)")
    bl.add_argument("--repeats", type=int, default=5)
    bl.add_argument("--background", type=int, default=4,
                    help="long streams decoding on the decode worker throughout")
    bl.add_argument("--itl-tolerance", type=float, default=1.5,
                    help="largest allowed ratio of background p90 ITL, local / remote")
    _add_common(bl)
    bl.set_defaults(fn=_bench_local_prefill)

    bs = bsub.add_parser("serve", help="TTFT, TPOT, ITL, throughput and goodput of a "
                                       "workload served disaggregated, colocated, by HF "
                                       "generate and by a running vLLM, side by side, per "
                                       "request rate")
    bs.add_argument("--dataset", default="sharegpt", choices=["sharegpt", "random"],
                    help="ShareGPT V3 first turns (filtered as vLLM's benchmark) or random ids")
    bs.add_argument("--num-prompts", type=int, default=64)
    bs.add_argument("--request-rate", default="inf",
                    help="requests/s of a Poisson process, or inf (all at once); a "
                         "comma-separated list sweeps them")
    bs.add_argument("--seed", type=int, default=0)
    bs.add_argument("--modes", default=None,
                    help="comma-separated, of disagg,colocated,hf,vllm (default: "
                         "disagg,colocated,hf, and vllm when --vllm-url is given)")
    bs.add_argument("--vllm-url", default=None,
                    help="a running `vllm serve` of the same model (e.g. "
                         "http://127.0.0.1:8000): the vllm mode, the headline ratios' base")
    bs.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput SLO: TTFT bound")
    bs.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput SLO: TPOT bound")
    bs.add_argument("--prefill-chunk-size", type=int, default=512,
                    help="prompt tokens per prefill step, both engines (tokens)")
    bs.add_argument("--decode-kv-blocks", type=int, default=4096)
    bs.add_argument("--hf-batch-size", type=int, default=8,
                    help="static batch size of the hf mode")
    bs.add_argument("--random-prompt-len", default="64,512", help="random dataset: lo,hi tokens")
    bs.add_argument("--random-output-len", default="16,256", help="random dataset: lo,hi tokens")
    bs.add_argument("--max-output-tokens", type=int, default=None,
                    help="cap each request's max_tokens (ShareGPT: its reply's length) at "
                         "this many tokens (as vLLM's --sharegpt-output-len fixes it)")
    bs.add_argument("--plot", default=None, help="write PNG plots into this directory")
    _add_common(bs)
    bs.set_defaults(fn=_bench_serve)

    bp = bsub.add_parser("planner", help="goodput at the SLO on a trace shifting from "
                                         "prefill-heavy to decode-heavy: the SLO planner vs "
                                         "every fixed split of the same workers")
    bp.add_argument("--budget", type=int, default=3, help="workers of both roles, every run")
    bp.add_argument("--slo-ttft-ms", type=float, default=5000.0)
    bp.add_argument("--slo-itl-ms", type=float, default=200.0,
                    help="the planner's ITL target, and goodput's TPOT bound")
    bp.add_argument("--phase-s", type=float, default=90.0, help="seconds of each phase")
    bp.add_argument("--prefill-rate", type=float, default=0.5,
                    help="req/s of the prefill-heavy phase (long prompts, 1 token out)")
    bp.add_argument("--decode-rate", type=float, default=1.0,
                    help="req/s of the decode-heavy phase (short prompts, long answers)")
    bp.add_argument("--planner-interval-s", type=float, default=5.0)
    bp.add_argument("--planner-margin", type=float, default=0.75,
                    help="the planner's mean TTFT/ITL targets as a share of the SLO "
                         "goodput counts each request against")
    bp.add_argument("--cpu-limit", type=float, default=0.5,
                    help="cores each worker may use (a cgroup quota, as a pod's limits.cpu; "
                         "needs root): each worker one fixed-size device. 0: uncapped")
    bp.add_argument("--conditional-disagg", action="store_true",
                    help="let decode workers prefill when every prefill queue is long")
    bp.add_argument("--rebalance-on-scale-up", action="store_true",
                    help="move running streams onto a decode worker that joins")
    bp.add_argument("--poisson", action="store_true",
                    help="Poisson arrivals (seeded) instead of evenly spaced ones")
    bp.add_argument("--seed", type=int, default=0)
    _add_common(bp)
    bp.set_defaults(fn=_bench_planner)

    add_step_parser(bsub)
    add_tp_parser(bsub)
    add_gpu_parser(bsub)
