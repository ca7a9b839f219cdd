"""`pdserve bench serve`: one workload served several ways, side by side, per request rate.

Modes, on the same prompts (workload.py) and the same arrival times:

- `disagg`: a prefill worker and a decode worker, each pinned to its own half of this
  process's CPUs (sched_setaffinity) with that many torch threads: two "nodes" on one
  box; KV over the chosen transport.
- `colocated`: one decode worker pinned to every CPU does prefill and decode in one
  engine: every prompt is prefilled locally (local_prefill_max_tokens above the context)
  with chunked prefill (`prefill_chunk_size` prompt tokens per step, decode rows first).
  The cluster's prefill worker exists but is never called (it only holds its weights).
- `hf`: HF transformers `generate` in static batches (hf_baseline.py), in this process
  with every CPU: what a user would otherwise write.
- `vllm`: the peer a user would pick instead: a running `vllm serve` of the same model
  (`--vllm-url`; `make bench-vllm` builds vLLM's CPU package in .venv-vllm) driven over
  its OpenAI completions API by the official `openai` client, prompts as token ids,
  `ignore_eos`, streamed; a token's time is its chunk's arrival (vLLM streams a chunk a
  token; the usage's count of tokens is what counts, chunks beyond it dropped, tokens
  beyond the chunks given the last chunk's time). The server outlives the runs: start
  it with `--no-enable-prefix-caching` for a sweep of several rates, or later rates
  find the same prompts cached. The table's headline is each pdserve mode's throughput
  and goodput over this one's.

Each (rate, mode) run starts a fresh cluster (so no prefix-cache state carries over
between runs), sends one warm-up request, then the workload from a client thread per
request, each sleeping until its Poisson arrival time; timings are client-side, from
the send. After each run every KV block pool must be free again (`kv_blocks_leaked`).
Figures: workload.summarize() (TTFT, TPOT, ITL, E2E, throughput, goodput at the SLO).
"""

from __future__ import annotations

import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace

import grpc

from ..client import Client, make_request
from ..config import ClusterConfig
from .workload import BenchRequest, RequestResult, arrival_times, summarize

MODES = ("disagg", "colocated", "hf", "vllm")
_WARMUP_IDS = list(range(1000, 1040))   # a prompt no workload shares a block with


@dataclass(frozen=True)
class ServeBenchConfig:
    model: str = "default"
    modes: tuple[str, ...] = ("disagg", "colocated", "hf")   # vllm needs vllm_url
    request_rates: tuple[float, ...] = (math.inf,)   # requests/s (Poisson), inf: all at t=0
    seed: int = 0
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    transport: str = "tcp"
    prefill_chunk_size: int | None = 512       # tokens per step (both engines)
    decode_blocks: int = 4096                  # 16-token blocks: 64 ShareGPT pairs at once
    prefill_blocks: int = 1024
    hf_batch_size: int = 8
    vllm_url: str | None = None                # base URL of `vllm serve` (mode vllm)
    cpus: tuple[int, ...] = field(default_factory=lambda: tuple(sorted(os.sched_getaffinity(0))))

    def __post_init__(self):
        if bad := set(self.modes) - set(MODES):
            raise ValueError(f"modes {sorted(bad)}: choose from {', '.join(MODES)}")
        if not self.request_rates or not all(r > 0 for r in self.request_rates):
            raise ValueError(f"request_rates={self.request_rates}: each must be > 0 (or inf)")
        if "disagg" in self.modes and len(self.cpus) < 2:
            raise ValueError(f"disagg mode pins prefill and decode to separate CPUs; this "
                             f"process may use only {list(self.cpus)}")
        if self.hf_batch_size < 1:
            raise ValueError(f"hf_batch_size={self.hf_batch_size}: must be >= 1")
        if "vllm" in self.modes and not self.vllm_url:
            raise ValueError("mode vllm needs vllm_url (--vllm-url): the address of a running "
                             "`vllm serve` of the same model, e.g. http://127.0.0.1:8000")

    def cluster_config(self, mode: str) -> ClusterConfig:
        """The cluster of `mode` (disagg or colocated); see the module docstring."""
        half = len(self.cpus) // 2
        slo = {k: v for k in ("slo_ttft_ms", "slo_tpot_ms") if (v := getattr(self, k))}
        cfg = ClusterConfig.local(self.model, port=0, transport=self.transport,
                                  prefill_blocks=self.prefill_blocks,
                                  decode_blocks=self.decode_blocks, threads_per_worker=1,
                                  prefill_chunk_size=self.prefill_chunk_size, router_kw=slo)
        if mode == "disagg":
            p, d = self.cpus[:half], self.cpus[half:]
            return replace(cfg, prefill=replace(cfg.prefill, cpus=p, num_threads=len(p)),
                           decode=replace(cfg.decode, cpus=d, num_threads=len(d)))
        assert mode == "colocated", mode
        return replace(cfg, prefill=replace(cfg.prefill, cpus=self.cpus[:1]),
                       decode=replace(cfg.decode, cpus=self.cpus, num_threads=len(self.cpus),
                                      local_prefill_max_tokens=1 << 30))


@dataclass
class Run:
    """One (mode, rate) run: per-request results and the summary figures."""

    mode: str
    request_rate: float
    results: list[RequestResult]
    duration_s: float
    kv_blocks_leaked: int = 0

    def summary(self, cfg: ServeBenchConfig) -> dict:
        return {"mode": self.mode, "request_rate": self.request_rate,
                "kv_blocks_leaked": self.kv_blocks_leaked,
                **summarize(self.results, self.duration_s, cfg.slo_ttft_ms, cfg.slo_tpot_ms)}

    def per_request(self) -> list[dict]:
        """Each request's TTFT, TPOT and E2E (ms) and tokens, to re-judge another SLO."""
        return [{"prompt_tokens": r.prompt_tokens, "output_tokens": len(r.token_times),
                 "ttft_ms": r.ttft * 1e3 if r.token_times else None,
                 "tpot_ms": r.tpot * 1e3 if r.tpot is not None else None,
                 "e2e_ms": r.e2e * 1e3, "error": r.error} for r in self.results]


def _send(req: BenchRequest, at: float, t0: float, stream, errors: tuple) -> RequestResult:
    """Sleep until t0 + at, then `stream(times, sent)`: send the request and append each
    output token's arrival to `times`, in seconds from `sent` (perf_counter at the send).
    The request is ok when it got exactly max_tokens; an exception of `errors` becomes
    its error (a gRPC status is named by its code)."""
    time.sleep(max(0.0, t0 + at - time.perf_counter()))
    res = RequestResult(len(req.prompt_token_ids))
    sent = time.perf_counter()
    try:
        stream(res.token_times, sent)
        res.ok = len(res.token_times) == req.max_tokens
        res.error = "" if res.ok else f"{len(res.token_times)} of {req.max_tokens} tokens"
    except errors as e:
        res.error = (f"{e.code().name}: {e.details()}" if isinstance(e, grpc.RpcError)
                     else f"{type(e).__name__}: {e}")
    res.e2e = time.perf_counter() - sent
    return res


def _grpc_stream(client: Client, req: BenchRequest):
    """_send's `stream` over pdserve's gRPC Generate (a message may carry several tokens)."""
    def stream(times: list[float], sent: float) -> None:
        for msg in client.stream(make_request(req.prompt_token_ids, max_tokens=req.max_tokens,
                                              temperature=0, ignore_eos=True)):
            times += [time.perf_counter() - sent] * len(msg.token_ids)
    return stream


def _leaked_blocks(client: Client, timeout_s: float = 10.0) -> int:
    """KV blocks still held on any worker once the run is over (frees land async)."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = sum(w.kv_blocks_total - w.kv_blocks_free for w in client.status().workers)
        if held == 0 or time.monotonic() > deadline:
            return held
        time.sleep(0.1)


def _send_all(send, n: int, progress=None, on_interrupt=None) -> tuple[list[RequestResult], float]:
    """`send(i, t0)` for requests 0..n-1, a thread each; returns their results and the
    seconds from t0 to the last one's end. `progress` (tqdm) ticks per request;
    `on_interrupt()` runs on Ctrl-C (to cancel the streams) before it propagates."""
    lock = threading.Lock()

    def one(i: int) -> RequestResult:
        r = send(i, t0)
        if progress is not None:
            with lock:
                progress.update(1)
        return r

    t0 = time.perf_counter()
    ex = ThreadPoolExecutor(n)
    try:
        results = list(ex.map(one, range(n)))
    except BaseException:
        if on_interrupt is not None:
            on_interrupt()
        raise
    finally:
        ex.shutdown(wait=True, cancel_futures=True)
    return results, time.perf_counter() - t0


def run_cluster(cfg: ServeBenchConfig, mode: str, rate: float, requests: list[BenchRequest],
                arrivals: list[float], progress=None) -> Run:
    """Serve `requests` on a fresh `mode` cluster; `progress` (tqdm) ticks per request."""
    from ..cluster import Cluster

    with Cluster(cfg.cluster_config(mode)) as cluster, \
            Client(f"127.0.0.1:{cluster.port}", timeout_s=3600) as client:
        client.generate(make_request(_WARMUP_IDS, max_tokens=2))   # connect, first step
        results, duration = _send_all(
            lambda i, t0: _send(requests[i], arrivals[i], t0, _grpc_stream(client, requests[i]),
                                (grpc.RpcError,)), len(requests), progress,
            on_interrupt=client.close)   # Ctrl-C: cancel every stream so the threads end now
        return Run(mode, rate, results, duration, _leaked_blocks(client))


def _openai_stream(client, model: str, req: BenchRequest):
    """_send's `stream` over an OpenAI completions stream (the `vllm` mode): a chunk a
    token; the usage's token count is what counts (chunks beyond it dropped, tokens
    beyond the chunks given the last chunk's time)."""
    def stream(times: list[float], sent: float) -> None:
        completion_tokens = None
        for chunk in client.completions.create(
                model=model, prompt=req.prompt_token_ids, max_tokens=req.max_tokens,
                temperature=0, stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True}):
            if chunk.choices:   # a chunk a token, its text possibly held back (UTF-8)
                times.append(time.perf_counter() - sent)
            if chunk.usage is not None:
                completion_tokens = chunk.usage.completion_tokens
        if completion_tokens is not None and times:
            times[:] = times[:completion_tokens] + [times[-1]] * (completion_tokens - len(times))
    return stream


def run_openai(url: str, rate: float, requests: list[BenchRequest], arrivals: list[float],
               progress=None, mode: str = "vllm") -> Run:
    """Serve `requests` on the OpenAI-compatible server at `url` (the first model it lists),
    each request sent at its arrival time; `progress` (tqdm) ticks per request.

    Raises:
        openai.APIConnectionError: nothing answers at `url`.
    """
    import openai

    with openai.OpenAI(base_url=url.rstrip("/") + "/v1", api_key="EMPTY", max_retries=0,
                       timeout=3600) as client:
        model = client.models.list().data[0].id
        client.completions.create(model=model, prompt=_WARMUP_IDS, max_tokens=2)   # warm-up
        results, duration = _send_all(
            lambda i, t0: _send(requests[i], arrivals[i], t0,
                                _openai_stream(client, model, requests[i]), (openai.APIError,)),
            len(requests), progress, on_interrupt=client.close)
        return Run(mode, rate, results, duration)


def run_hf(cfg: ServeBenchConfig, hf_model, rate: float, requests: list[BenchRequest],
           arrivals: list[float], progress=None) -> Run:
    from .hf_baseline import run_hf as hf

    results, duration = hf(hf_model, requests, arrivals, cfg.hf_batch_size,
                           on_done=progress.update if progress is not None else None)
    return Run("hf", rate, results, duration)


def run(cfg: ServeBenchConfig, requests: list[BenchRequest], show_progress: bool = True
        ) -> list[Run]:
    """Every (rate, mode) of `cfg` on `requests`, rate by rate; see the module docstring.

    Starts a local Ray instance when none is running (and stops it at the end).
    """
    import ray
    import torch
    from tqdm import tqdm

    owns_ray = not ray.is_initialized()
    if owns_ray and {"disagg", "colocated"} & set(cfg.modes):
        ray.init(num_cpus=len(cfg.cpus), include_dashboard=False, configure_logging=False,
                 namespace=f"pdserve-bench-{os.getpid()}")
    hf_model = None
    if "hf" in cfg.modes:
        from .hf_baseline import load_hf
        torch.set_num_threads(len(cfg.cpus))
        hf_model = load_hf(cfg.model)
    runs = []
    try:
        for rate in cfg.request_rates:
            arrivals = arrival_times(len(requests), rate, cfg.seed)
            for mode in cfg.modes:
                bar = tqdm(total=len(requests), desc=f"{mode} @ {rate:g} req/s", unit="req",
                           disable=not show_progress, leave=True)
                with bar:
                    if mode == "hf":
                        runs.append(run_hf(cfg, hf_model, rate, requests, arrivals, bar))
                    elif mode == "vllm":
                        runs.append(run_openai(cfg.vllm_url, rate, requests, arrivals, bar))
                    else:
                        runs.append(run_cluster(cfg, mode, rate, requests, arrivals, bar))
    finally:
        if owns_ray and ray.is_initialized():
            ray.shutdown()
    return runs


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "-"


def table(summaries: list[dict]) -> str:
    """Per rate, each mode's figures; then its output-throughput and goodput ratios to
    `vllm` (the headline), and its throughput ratio to `hf` and to `colocated` (each where
    that mode ran at the same rate)."""
    head = (f"{'rate':>6} {'mode':>10} {'req/s':>7} {'out tok/s':>10} {'goodput':>8} "
            f"{'TTFT p50':>9} {'TTFT p90':>9} {'TPOT p50':>9} {'TPOT p90':>9} {'ITL p90':>8} "
            f"{'E2E p50':>9} {'tok/s vs vllm':>13} {'goodput vs vllm':>15} {'vs hf':>6} "
            f"{'vs coloc':>9}")
    rows = [head]
    for s in summaries:
        same = {o["mode"]: o for o in summaries if o["request_rate"] == s["request_rate"]}
        hf, co, vl = same.get("hf"), same.get("colocated"), same.get("vllm")
        rows.append(
            f"{s['request_rate']:>6g} {s['mode']:>10} {s['request_throughput_req_s']:>7.3f} "
            f"{s['output_throughput_tok_s']:>10.1f} {s['goodput_req_s']:>8.3f} "
            f"{s['ttft_ms']['p50']:>7.0f}ms {s['ttft_ms']['p90']:>7.0f}ms "
            f"{s['tpot_ms']['p50']:>7.0f}ms {s['tpot_ms']['p90']:>7.0f}ms "
            f"{s['itl_ms']['p90']:>6.0f}ms {s['e2e_ms']['p50'] / 1e3:>8.1f}s "
            f"{_ratio(s['output_throughput_tok_s'], vl['output_throughput_tok_s']) if vl else '-':>13} "
            f"{_ratio(s['goodput_req_s'], vl['goodput_req_s']) if vl else '-':>15} "
            f"{_ratio(s['output_throughput_tok_s'], hf['output_throughput_tok_s']) if hf else '-':>6} "
            f"{_ratio(s['output_throughput_tok_s'], co['output_throughput_tok_s']) if co else '-':>9}")
        if s["failed"] or s.get("kv_blocks_leaked"):
            rows.append(f"{'':>17} {s['failed']} failed, {s.get('kv_blocks_leaked', 0)} KV "
                        "blocks not freed")
    return "\n".join(rows)


def as_json(cfg: ServeBenchConfig, runs: list[Run], workload: dict) -> dict:
    """The run as JSON: {"config", "modes": [summary per (mode, rate)]}."""
    conf = asdict(cfg) | {"workload": workload}
    conf["request_rates"] = [r if math.isfinite(r) else "inf" for r in cfg.request_rates]
    modes = []
    for run_ in runs:
        s = run_.summary(cfg)
        s["request_rate"] = s["request_rate"] if math.isfinite(s["request_rate"]) else "inf"
        modes.append(s | {"requests": run_.per_request()})
    return {"config": conf, "modes": modes}
