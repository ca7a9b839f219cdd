"""`pdserve bench transfer|step|tp|gpu`: one component against its raw baseline, no cluster."""

from __future__ import annotations

import sys

from . import write_json


def add_transfer_parser(bsub) -> None:
    """`pdserve bench transfer` on `bsub` (the bench subcommands' argparse subparsers)."""
    bt = bsub.add_parser("transfer", help="KV transfer GB/s per transport vs its raw baseline")
    bt.add_argument("--transports", default="tcp,nixl", help="comma-separated: tcp,nixl")
    bt.add_argument("--model", default="default", help="geometry source (layers, heads, head_dim)")
    bt.add_argument("--num-requests", type=int, default=4)
    bt.add_argument("--prompt-tokens", type=int, default=512)
    bt.add_argument("--block-size", type=int, default=16)
    bt.add_argument("--repeats", type=int, default=5)
    bt.add_argument("--idle-s", type=float, default=10.0,
                    help="then measure the paired receiver's CPU time over this many idle "
                         "seconds (0: skip)")
    bt.add_argument("--json", default=None, help="write results to this file")
    bt.set_defaults(fn=_bench_transfer)


def _bench_transfer(args) -> int:
    import torch

    from . import transfer
    torch.set_num_threads(1)   # the receiver process does the same (see bench/transfer.py)
    kinds = args.transports.split(",")
    print(f"moving the KV of {args.num_requests} x {args.prompt_tokens}-token prompts "
          f"(block_size {args.block_size}, {args.repeats} repeats, median) ...", flush=True)
    results = transfer.run(kinds, args.model, args.num_requests, args.prompt_tokens,
                           args.block_size, args.repeats, idle_s=args.idle_s)
    print(transfer.table(results))
    write_json(args.json, lambda: transfer.as_json(results, vars(args) | {"fn": None}))
    return 0


def add_step_parser(bsub) -> None:
    """`pdserve bench step` on `bsub` (the bench subcommands' argparse subparsers)."""
    bst = bsub.add_parser("step", help="decode and prefill step time per engine optimization "
                                       "vs the engine without it (one process, CPU)")
    bst.add_argument("--model", default="default")
    bst.add_argument("--dtype", default="float32,bfloat16", help="comma list")
    bst.add_argument("--batch", type=int, default=64, help="decode sequences per step")
    bst.add_argument("--context", type=int, default=400, help="tokens of context per sequence")
    bst.add_argument("--prefill-tokens", type=int, default=512,
                     help="prompt tokens in the prefill step, all prompts together")
    bst.add_argument("--prefill-prompts", type=int, default=1,
                     help="prompts the prefill tokens are split over (one varlen batch)")
    bst.add_argument("--repeats", type=int, default=10)
    bst.add_argument("--threads", type=int, default=1, help="torch threads (pinned CPUs)")
    bst.add_argument("--json", default=None, help="write the figures to this file")
    bst.set_defaults(fn=_bench_step)


def _bench_step(args) -> int:
    from . import step
    if not 1 <= args.prefill_prompts <= args.prefill_tokens:
        print(f"--prefill-prompts={args.prefill_prompts}: must be in [1, --prefill-tokens="
              f"{args.prefill_tokens}]", file=sys.stderr)
        return 2
    print(f"decode step: {args.batch} sequences x {args.context} tokens of context; prefill "
          f"step: {args.prefill_tokens} tokens in {args.prefill_prompts} prompt(s); "
          f"{args.threads} thread(s), median of {args.repeats} ...", flush=True)
    results = step.run(args.model, args.dtype.split(","), args.batch, args.context,
                       args.prefill_tokens, args.repeats, args.threads,
                       prefill_prompts=args.prefill_prompts)
    print(step.table(results))
    write_json(args.json, lambda: step.as_json(results, vars(args) | {"fn": None}))
    return 0


def add_tp_parser(bsub) -> None:
    """`pdserve bench tp` on `bsub` (the bench subcommands' argparse subparsers)."""
    btp = bsub.add_parser("tp", help="a tensor-parallel model step (ranks as processes, "
                                     "gloo on CPU, NCCL on CUDA) vs TP 1, and its "
                                     "all-reduces' cost per layer")
    btp.add_argument("--model", default="llama-3.2-1b-random",
                     help="'llama-3.2-1b-random' (32 / 8 heads: TP 2, 4, 8), 'default' "
                          "(9 / 3 heads: TP 3, 9), a HF dir or .gguf")
    btp.add_argument("--sizes", default="1,2", help="comma list of TP sizes, 1 first")
    btp.add_argument("--batch", type=int, default=64, help="decode sequences per step")
    btp.add_argument("--context", type=int, default=400, help="tokens of context per sequence")
    btp.add_argument("--prefill-tokens", type=int, default=512)
    btp.add_argument("--repeats", type=int, default=10)
    btp.add_argument("--dtype", default="float32")
    btp.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    btp.add_argument("--json", default=None, help="write the figures to this file")
    btp.set_defaults(fn=_bench_tp)


def _bench_tp(args) -> int:
    from . import tp
    try:
        sizes = [int(x) for x in args.sizes.split(",")]
        print(f"tensor-parallel step of {args.model} at TP {sizes} ({args.device}): decode "
              f"{args.batch} x {args.context} tokens, prefill {args.prefill_tokens} tokens, "
              f"median of {args.repeats} ...", flush=True)
        results = tp.run(args.model, sizes, args.batch, args.context, args.prefill_tokens,
                         args.repeats, args.dtype, args.device)
    except ValueError as e:
        print(f"pdserve bench tp: {e}", file=sys.stderr)
        return 2
    print(tp.table(results))
    write_json(args.json, lambda: tp.as_json(results, vars(args) | {"fn": None}))
    return 0


def add_gpu_parser(bsub) -> None:
    """`pdserve bench gpu` on `bsub` (the bench subcommands' argparse subparsers)."""
    bg = bsub.add_parser("gpu", help="on the CUDA device: prefill MFU vs a measured bf16 GEMM "
                                     "peak, decode GB/s vs a measured device copy, KV transfer "
                                     "device to device between two processes")
    bg.add_argument("--models", default="llama-3.2-1b-random,default",
                    help="comma-separated: 'llama-3.2-1b-random' (random weights, "
                         "Llama-3.2-1B's shape), 'default', a HF dir or .gguf")
    bg.add_argument("--num-prompts", type=int, default=4, help="prompts per prefill batch")
    bg.add_argument("--prompt-tokens", type=int, default=4096)
    bg.add_argument("--decode-batch", type=int, default=64, help="sequences per decode step")
    bg.add_argument("--decode-context", type=int, default=1024,
                    help="tokens of context per decode sequence")
    bg.add_argument("--gemm-n", type=int, default=8192, help="square bf16 GEMM size")
    bg.add_argument("--copy-mib", type=int, default=1024, help="device copy buffer (MiB)")
    bg.add_argument("--repeats", type=int, default=10)
    bg.add_argument("--decode-steps", type=int, default=50, help="timed decode steps")
    bg.add_argument("--block-size", type=int, default=None,
                    help="KV block tokens (default: 256 with flash-attn, whose paged kernels "
                         "need a multiple of 256; else 16)")
    bg.add_argument("--enforce-eager", action="store_true",
                    help="decode without CUDA graphs (eager figures are reported anyway)")
    bg.add_argument("--transports", default="nixl,tcp",
                    help="KV transfer transports, comma-separated ('' skips the transfer)")
    bg.add_argument("--kv-requests", type=int, default=4)
    bg.add_argument("--kv-prompt-tokens", type=int, default=4096)
    bg.add_argument("--json", default=None, help="write the figures to this file")
    bg.set_defaults(fn=_bench_gpu)


def _bench_gpu(args) -> int:
    import tempfile
    from pathlib import Path

    import torch

    if not torch.cuda.is_available():
        print("pdserve bench gpu needs a CUDA device: torch.cuda.is_available() is False",
              file=sys.stderr)
        return 2
    from . import gpu
    try:
        cfg = gpu.GpuBenchConfig(
            models=tuple(m for m in args.models.split(",") if m), num_prompts=args.num_prompts,
            prompt_tokens=args.prompt_tokens, decode_batch=args.decode_batch,
            decode_context=args.decode_context, gemm_n=args.gemm_n, copy_mib=args.copy_mib,
            repeats=args.repeats, decode_steps=args.decode_steps, block_size=args.block_size,
            enforce_eager=args.enforce_eager,
            transports=tuple(t for t in args.transports.split(",") if t),
            kv_requests=args.kv_requests, kv_prompt_tokens=args.kv_prompt_tokens)
    except ValueError as e:
        print(f"pdserve bench gpu: {e}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-gpu-") as tmp:
        report = gpu.run(cfg, Path(tmp), log=lambda s: print(s, flush=True))
    print(gpu.table(report))
    for goal, met in report.goals().items():
        print(f"goal {goal}: {'met' if met else 'missed'}")
    write_json(args.json, lambda: gpu.as_json(report, cfg) | {"command": " ".join(sys.argv)})
    return 0
