"""The SLO planner on a load that shifts (issue 21): ShareGPT's long prompts with short
answers, then short prompts with long answers, on the default model with 1..2 workers
per role and 3 in all. The planner moves the split prefill-heavy (2P+1D) in the first
phase and decode-heavy (1P+2D) in the second, never outside the bounds; no request is
refused or lost, the retired workers' actors are gone, every KV pool is free."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import ray
from serving import Served, start_ray

from pdserve.config import PlannerConfig

pytestmark = pytest.mark.slow

PHASE_S = 40.0   # each phase several of the planner's windows long (3 s x 3), with a
                 # worker start (~5-10 s here) and a settling interval in between


def test_planner_moves_the_split_the_right_way():
    from transformers import AutoTokenizer

    from pdserve.bench.planner import PlannerBenchConfig, trace
    from pdserve.bench.serve import _grpc_stream, _send, _send_all
    from pdserve.engine.loader import resolve_model

    start_ray()
    # one thread per worker, 3 workers on 2 cores: a prefill worker computes ~350-400
    # prompt tokens/s, a decode step takes ~7-9 ms per token; so 0.6 long (~800-token)
    # prompts/s overload one prefill worker (~1.4 needed for a 4 s mean TTFT), and 1.8
    # answers/s of ~110 tokens need ~1.5-2 decode workers for a 100 ms mean ITL, the
    # other pool one worker each time
    bench = PlannerBenchConfig(phase_s=PHASE_S, prefill_rate=0.6, decode_rate=1.8,
                               slo_ttft_ms=4000, slo_itl_ms=100, short_output=4, long_output=128,
                               interval_s=3.0, poisson=False, long_prompt=600,
                               long_prompt_max=1024)
    requests, times = trace(bench, AutoTokenizer.from_pretrained(resolve_model("default")))
    planner = PlannerConfig(bench.slo_ttft_ms, bench.slo_itl_ms, 1, 2, 1, 2, max_workers=3,
                            adjustment_interval_s=bench.interval_s, drain_timeout_s=30)
    served = Served("default", planner=planner, threads_per_worker=1, decode_blocks=2048)
    pools: list[tuple[float, int, int]] = []      # (s from the start, P, D)
    done = threading.Event()
    t0 = time.perf_counter()

    def sample():
        while not done.wait(0.5):
            roles = [w.role for w in served.client.status().workers if w.state == "ready"]
            pools.append((time.perf_counter() - t0, roles.count("prefill"),
                          roles.count("decode")))

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        results, _ = _send_all(lambda i, start: _send(
            requests[i], times[i], start, _grpc_stream(served.client, requests[i]),
            (grpc.RpcError,)), len(requests))
    finally:
        done.set()
        sampler.join()
    try:
        failed = [r.error for r in results if not r.ok]
        assert not failed, failed[:3]
        assert all(1 <= p <= 2 and 1 <= d <= 2 for _, p, d in pools), pools
        first = {(p, d) for t, p, d in pools if t < PHASE_S}
        second = {(p, d) for t, p, d in pools if t >= PHASE_S}
        assert (2, 1) in first, pools
        assert (1, 2) in second, pools
        names = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}
        serving = {w.worker_id for w in served.client.status().workers}
        assert {n for n in names if n.startswith(("prefill-", "decode-"))} == serving, names
    finally:
        served.stop()
