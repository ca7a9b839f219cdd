"""`pdserve bench tracing`: what tracing every request costs. Throughput of the same load
with `--otlp-traces-endpoint` at sampling 1.0 (each request's spans exported to an OTLP
gRPC collector this command runs, which counts them) against tracing off, in
alternating pairs of fresh clusters (off-on, then on-off, ...), reported as the median
of the pairs' ratios with their spread.

The load: `requests` prompts of `prompt_tokens` random tokens, `concurrency` in flight
at once (a closed loop), each generating `max_tokens` tokens (ignore_eos), greedy or
sampled; a warm-up round of `concurrency` requests first on each cluster.

`run_peer` measures on the peer harness instead (`pdserve bench tracing --peer`): vLLM's
own client (`vllm bench serve`: ShareGPT V3, a burst of `num_prompts` requests of
`output_len` tokens, ignore_eos; peer.py's sessions, each a fresh `pdserve serve`
warmed up, then every temperature on its own prompt sample) against tracing off, on
(sampling 1.0), and, given `before_bin`, another build's `pdserve serve`: the code
before tracing, to tell whether tracing off costs anything. The arms' order rotates
each pair; each figure is the median of the pairs' ratios with their min and max.
"""

from __future__ import annotations

import statistics
import threading
import time
from concurrent import futures
from dataclasses import asdict, dataclass, replace

import grpc
import torch

from ..client import Client, make_request
from ..cluster import Cluster
from ..config import ClusterConfig


@dataclass(frozen=True)
class TracingRun:
    pair: int
    traced: bool
    output_tokens_per_s: float
    requests: int               # served, the warm-up round's included
    spans: int                  # exported by this run's cluster (0 when off)


class SpanCounter:
    """An OTLP gRPC trace receiver on a free port of 127.0.0.1 that counts the spans
    exported to it."""

    def __init__(self):
        from opentelemetry.proto.collector.trace.v1 import (trace_service_pb2,
                                                            trace_service_pb2_grpc)
        counter = self
        self.lock, self.spans = threading.Lock(), 0

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):
                n = sum(len(ss.spans) for rs in request.resource_spans
                        for ss in rs.scope_spans)
                with counter.lock:
                    counter.spans += n
                return trace_service_pb2.ExportTraceServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def count(self) -> int:
        with self.lock:
            return self.spans

    def close(self) -> None:
        self.server.stop(0)


def _load(client: Client, prompts: list[list[int]], concurrency: int, max_tokens: int,
          temperature: float) -> float:
    """Output tokens per second of `prompts` served `concurrency` at a time."""
    def one(p: list[int]) -> int:
        tokens, _, _ = client.generate(make_request(p, max_tokens=max_tokens, ignore_eos=True,
                                                    temperature=temperature, seed=7))
        return len(tokens)

    with futures.ThreadPoolExecutor(concurrency) as ex:
        list(ex.map(one, prompts[:concurrency]))                 # warm-up
        t0 = time.perf_counter()
        total = sum(ex.map(one, prompts))
        return total / (time.perf_counter() - t0)


def run(pairs: int = 3, requests: int = 48, concurrency: int = 8, prompt_tokens: int = 120,
        max_tokens: int = 32, temperature: float = 0.0, model: str = "default",
        transport: str = "tcp", progress=print) -> list[TracingRun]:
    """Two TracingRuns per pair, the pair's first alternating between off and on. One
    Ray instance serves every cluster (started here unless this process has one)."""
    import os

    import ray

    from .ttft import _vocab_size

    g = torch.Generator().manual_seed(0)
    vocab = _vocab_size(model)
    prompts = torch.randint(100, vocab, (requests, prompt_tokens), generator=g).tolist()
    counter, runs = SpanCounter(), []
    owns = not ray.is_initialized()
    if owns:
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, configure_logging=False,
                 namespace=f"pdserve-bench-{os.getpid()}")
    try:
        for pair in range(pairs):
            for traced in ((False, True) if pair % 2 == 0 else (True, False)):
                kw = {"otlp_traces_endpoint": f"127.0.0.1:{counter.port}"} if traced else {}
                cfg = ClusterConfig.local(model, port=0, transport=transport, router_kw=kw)
                before = counter.count()
                with Cluster(cfg) as cluster, Client(f"127.0.0.1:{cluster.port}") as client:
                    rate = _load(client, prompts, concurrency, max_tokens, temperature)
                    if traced:
                        time.sleep(6.0)      # the exporters' last batch (every 5 s)
                runs.append(TracingRun(pair, traced, rate, requests + concurrency,
                                       counter.count() - before))
                progress(f"pair {pair} {'on ' if traced else 'off'}: {rate:.1f} tokens/s, "
                         f"{runs[-1].spans} spans")
    finally:
        counter.close()
        if owns and ray.is_initialized():
            ray.shutdown()
    return runs


def ratios(runs: list[TracingRun]) -> list[float]:
    """Each pair's throughput on ÷ off."""
    by = {(r.pair, r.traced): r.output_tokens_per_s for r in runs}
    return [by[p, True] / by[p, False] for p in sorted({r.pair for r in runs})]


def summary(runs: list[TracingRun]) -> dict:
    rs = ratios(runs)
    traced = [r for r in runs if r.traced]
    return {"ratio_on_off_median": statistics.median(rs), "ratio_on_off_min": min(rs),
            "ratio_on_off_max": max(rs), "ratios": rs,
            "spans_per_request": statistics.median(r.spans / r.requests for r in traced)}


def as_json(runs: list[TracingRun], config: dict) -> dict:
    return {"config": config, "runs": [asdict(r) for r in runs], "summary": summary(runs)}


ARMS = ("off", "on", "before")


def run_peer(pairs: int = 3, num_prompts: int = 64, output_len: int = 128,
             temperatures: tuple[float, ...] = (0.0, 1.0), dtype: str = "fp32",
             before_bin: str | None = None, model: str = "default",
             out_dir: str = "bench/results/tracing/peer", progress=print) -> list[dict]:
    """One record per (pair, arm): {"pair", "arm", "spans", "runs": {cell: vllm bench
    serve's result}}; arms "off", "on" and, with `before_bin` (a `pdserve` executable of
    another build), "before", in an order that rotates each pair. Logs and each run's
    result under `out_dir`.

    Raises:
        RuntimeError: a server did not start, or vLLM's client failed.
    """
    from ..engine.loader import resolve_model
    from .peer import PeerConfig, session
    from .servers import sharegpt_json

    model_dir = str(resolve_model(model))
    sharegpt_json()
    base = PeerConfig(model=model, num_prompts=num_prompts, output_len=output_len,
                      dtypes=(dtype,), temperatures=temperatures, samples=1, pairs=pairs,
                      out_dir=out_dir)
    cells = [(t, base.seeds(i)[0]) for i, t in enumerate(temperatures)]
    arms = ARMS if before_bin else ARMS[:2]
    counter, records = SpanCounter(), []
    configs = {"off": base, "before": replace(base, pdserve_bin=before_bin),
               "on": replace(base, pdserve_args=("--otlp-traces-endpoint",
                                                 f"127.0.0.1:{counter.port}"))}
    try:
        for pair in range(pairs):
            order = arms[pair % len(arms):] + arms[:pair % len(arms)]
            progress(f"pair {pair + 1}/{pairs}: {' then '.join(order)}")
            for arm in order:
                before = counter.count()
                got = session(configs[arm], model_dir, "pdserve", dtype, f"pair{pair}_{arm}",
                              cells, None, progress)
                if arm == "on":
                    time.sleep(6.0)          # the exporters' last batch (every 5 s)
                records.append({"pair": pair, "arm": arm, "spans": counter.count() - before,
                                **got})
    finally:
        counter.close()
    return records


def peer_summary(records: list[dict]) -> dict:
    """Per temperature cell: output throughput on ÷ off and off ÷ before, each pair's,
    with the median, min and max; spans per request of the traced runs."""
    by = {(r["pair"], r["arm"]): r for r in records}
    out: dict = {}
    for cell in sorted(records[0]["runs"]):
        for name, num, den in (("on_off", "on", "off"), ("off_before", "off", "before")):
            rs = [by[p, num]["runs"][cell]["output_throughput"]
                  / by[p, den]["runs"][cell]["output_throughput"]
                  for p in sorted({r["pair"] for r in records}) if (p, den) in by]
            if rs:
                out.setdefault(cell, {})[name] = {"median": statistics.median(rs),
                                                  "min": min(rs), "max": max(rs), "pairs": rs}
    traced = [r for r in records if r["arm"] == "on"]
    served = [sum(res["completed"] for res in r["runs"].values()) + 1 for r in traced]  # +warm-up
    out["spans_per_request"] = statistics.median(r["spans"] / n for r, n in zip(traced, served))
    return out


def peer_as_json(records: list[dict], config: dict) -> dict:
    """What `bench tracing --peer` writes: its config, the date, peer_summary, and each
    session's record without the client's per-run results."""
    return {"config": config, "date": time.strftime("%Y-%m-%d"),
            "summary": peer_summary(records),
            "sessions": [{k: v for k, v in r.items() if k != "runs"} for r in records]}
