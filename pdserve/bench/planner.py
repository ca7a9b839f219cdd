"""`pdserve bench planner`: goodput at the SLO on a shifting trace, served by the SLO
planner (router/planner.py) against fixed splits of the same number of workers.

Trace: ShareGPT V3 first turns in two phases of `phase_s` seconds each,
evenly spaced arrivals (or Poisson, seeded), the same prompts and times for every run:

- prefill-heavy: prompts of `long_prompt` to `long_prompt_max` tokens, `short_output`
  output tokens each (1: the prefill worker's token alone, so TTFT);
- decode-heavy: prompts of at most `short_prompt` tokens, each answered with its
  ShareGPT reply's length clipped to `long_output` (ignore_eos).

Runs: `planner` (starts at 1 prefill + 1 decode worker, bounds 1..budget-1 per role,
`budget` workers in all), then each fixed split P + D = budget. Each worker is one
fixed-size device, as a GPU or a CPU-limited pod is: one torch thread, capped at
`cpu_limit` cores (a cgroup quota, pdserve/cpu_limit.py), no core lending, and prompts
always prefilled by prefill workers (no conditional disaggregation). Without these an
idle worker's cores serve the busy role on one box (the OS schedules the uncapped
threads of all 3 workers on 2 cores; an idle prefill worker lends its threads; decode
workers prefill when prefill queues are long), so every split adapts by itself and
the splits hardly differ: the planner is for pools that cannot share.
Goodput (DistServe): requests per second of the trace whose TTFT and TPOT are both
within the SLO; the planner aims its means at `planner_margin` of it. Each run ends
with every KV pool checked free, and the planner's serving ("ready") workers are
counted once a second (the timeline in the JSON).
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import asdict, dataclass, replace

import grpc

from ..client import Client, make_request
from ..config import ClusterConfig, PlannerConfig
from .serve import _WARMUP_IDS, _grpc_stream, _leaked_blocks, _ratio, _send, _send_all
from .workload import BenchRequest, arrival_times, summarize


@dataclass(frozen=True)
class PlannerBenchConfig:
    model: str = "default"
    budget: int = 3                   # workers of both roles, every run
    # defaults: this 2-core box, workers of 0.5 core (cpu_limit; the other 0.5 for the
    # router, the client and Ray) and one torch thread; a prefill worker computes ~165
    # prompt tokens/s, a decode step takes ~105 ms + ~5.6 ms per row (the planner's
    # log): one worker of the role short of each phase's load, two enough
    slo_ttft_ms: float = 5000.0
    slo_itl_ms: float = 200.0
    phase_s: float = 90.0             # seconds of each phase
    prefill_rate: float = 0.5         # req/s, prefill-heavy phase: ~235 prompt tokens/s
    decode_rate: float = 1.0          # req/s, decode-heavy phase: ~95 output tokens/s
    long_prompt: int = 256            # tokens, at least (prefill-heavy)
    long_prompt_max: int = 768        # tokens, at most
    short_output: int = 1             # the prefill worker's token only: a phase of
                                      # TTFT (e.g. classification, scoring)
    short_prompt: int = 64            # tokens, at most (decode-heavy)
    long_output: int = 128
    interval_s: float = 5.0           # the planner's adjustment interval
    planner_margin: float = 0.75      # the planner's mean TTFT / ITL targets, as a share
                                      # of the SLO each request's goodput counts against
                                      # (a mean at the bound leaves half the requests over)
    cpu_limit: float | None = 0.5     # cores each worker may use (a cgroup quota, as a
                                      # pod's limits.cpu; pdserve/cpu_limit.py): each
                                      # worker one fixed-size device. None: uncapped
    conditional_disagg: bool = False  # prompts prefilled on decode workers when every
                                      # prefill queue is long (False: always on a prefill
                                      # worker, the disaggregation a planner sizes)
    rebalance_on_scale_up: bool = False   # RouterConfig's: running streams move onto
                                      # a decode worker that joins
    seed: int = 0
    poisson: bool = False             # arrivals: evenly spaced, or Poisson (seeded): at
                                      # 0.5 req/s the planner's 15 s window of Poisson
                                      # arrivals holds less than half the mean (3 or
                                      # fewer) 6% of the time, and it follows those
                                      # gaps, not the phases (seed 0: none in 16-28 s)
    transport: str = "tcp"

    def __post_init__(self):
        if self.budget < 3:
            raise ValueError(f"budget={self.budget}: need >= 3 workers (two splits to compare)")
        for name in ("phase_s", "prefill_rate", "decode_rate", "interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be > 0")

    def splits(self) -> list[tuple[int, int]]:
        return [(p, self.budget - p) for p in range(self.budget - 1, 0, -1)]

    def cluster_config(self, split: tuple[int, int] | None) -> ClusterConfig:
        """A fixed split (P, D), or the planner's cluster (split None)."""
        p, d = split or (1, 1)
        planner = None if split else PlannerConfig(
            self.slo_ttft_ms * self.planner_margin, self.slo_itl_ms * self.planner_margin,
            1, self.budget - 1, 1, self.budget - 1,
            self.budget, self.interval_s, drain_timeout_s=self.phase_s)
        cfg = ClusterConfig.local(self.model, port=0, prefill_workers=p, decode_workers=d,
                                  transport=self.transport, threads_per_worker=1,
                                  decode_blocks=2048, cpu_limit=self.cpu_limit,
                                  router_kw={"slo_ttft_ms": self.slo_ttft_ms,
                                             "slo_tpot_ms": self.slo_itl_ms}
                                  | {"rebalance_on_scale_up": self.rebalance_on_scale_up}
                                  | ({} if self.conditional_disagg
                                     else {"max_prefill_queue_tokens": 0}))
        # no core lending: an idle prefill worker's threads would run the decode steps
        # (and prompts) of its node's decode workers, which makes any split adapt on
        # one box by itself; the planner sizes pools of workers that cannot share, as
        # on separate nodes or devices
        return replace(cfg, planner=planner, lend_idle_prefill_cores=False)


def trace(cfg: PlannerBenchConfig, tokenizer) -> tuple[list[BenchRequest], list[float]]:
    """The two phases' requests and send times (s from the start); see the docstring."""
    from ..sharegpt import first_turns

    rng = random.Random(cfg.seed)
    counts = [int(cfg.phase_s * cfg.prefill_rate * 2) + 8,
              int(cfg.phase_s * cfg.decode_rate * 2) + 8]
    long_, short = [], []
    for prompt, reply in first_turns():
        ids = tokenizer(prompt)["input_ids"]
        out = len(tokenizer(reply)["input_ids"])
        if cfg.long_prompt <= len(ids) <= cfg.long_prompt_max and len(long_) < counts[0]:
            long_.append(BenchRequest(list(ids), cfg.short_output))
        elif 4 <= len(ids) <= cfg.short_prompt and out >= 16 and len(short) < counts[1]:
            short.append(BenchRequest(list(ids), min(out, cfg.long_output)))
        if len(long_) == counts[0] and len(short) == counts[1]:
            break
    requests, times = [], []
    for k, (pool, rate) in enumerate(((long_, cfg.prefill_rate), (short, cfg.decode_rate))):
        at = ([t for t in arrival_times(len(pool), rate, cfg.seed + k) if t < cfg.phase_s]
              if cfg.poisson else [i / rate for i in range(int(cfg.phase_s * rate))]
              )[:len(pool)]
        rng.shuffle(pool)
        requests += pool[:len(at)]
        times += [k * cfg.phase_s + t for t in at]
    return requests, times


def run_one(cfg: PlannerBenchConfig, split: tuple[int, int] | None,
            requests: list[BenchRequest], times: list[float], progress=None) -> dict:
    """Serve the trace on a fresh cluster (`split` fixed, or None: the planner)."""
    from ..cluster import Cluster

    name = "planner" if split is None else f"fixed {split[0]}P+{split[1]}D"
    timeline: list[tuple[float, int, int]] = []
    with Cluster(cfg.cluster_config(split)) as cluster, \
            Client(f"127.0.0.1:{cluster.port}", timeout_s=3600) as client:
        client.generate(make_request(_WARMUP_IDS, max_tokens=2))
        done = threading.Event()
        t0 = time.perf_counter()

        def sample() -> None:          # the pools' sizes, once a second
            while not done.wait(1.0):
                roles = [w.role for w in client.status().workers if w.state == "ready"]
                timeline.append((round(time.perf_counter() - t0, 1), roles.count("prefill"),
                                 roles.count("decode")))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            results, duration = _send_all(
                lambda i, start: _send(requests[i], times[i], start,
                                       _grpc_stream(client, requests[i]), (grpc.RpcError,)),
                len(requests), progress, on_interrupt=client.close)
        finally:
            done.set()
            sampler.join()
        leaked = _leaked_blocks(client)
    # goodput over the trace's length: a run that falls behind is not rewarded for it
    s = summarize(results, max(duration, 2 * cfg.phase_s), cfg.slo_ttft_ms, cfg.slo_itl_ms)
    half = [summarize([r for r, t in zip(results, times) if (t >= cfg.phase_s) == k],
                      cfg.phase_s, cfg.slo_ttft_ms, cfg.slo_itl_ms) for k in (0, 1)]
    return {"run": name, "kv_blocks_leaked": leaked, **s,
            "phases": [{"phase": p, "goodput_req_s": h["goodput_req_s"],
                        "ttft_ms": h["ttft_ms"], "tpot_ms": h["tpot_ms"]}
                       for p, h in zip(("prefill-heavy", "decode-heavy"), half)],
            "timeline": timeline}


def run(cfg: PlannerBenchConfig, requests, times, show_progress: bool = True) -> list[dict]:
    """The planner's run, then each fixed split's, on one local Ray instance."""
    import os

    import ray
    from tqdm import tqdm

    owns = not ray.is_initialized()
    if owns:
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, configure_logging=False,
                 namespace=f"pdserve-bench-{os.getpid()}")
    out = []
    try:
        for split in [None, *cfg.splits()]:
            with tqdm(total=len(requests), desc="planner" if split is None else
                      f"{split[0]}P+{split[1]}D", unit="req", disable=not show_progress) as bar:
                out.append(run_one(cfg, split, requests, times, bar))
    finally:
        if owns and ray.is_initialized():
            ray.shutdown()
    return out


def table(cfg: PlannerBenchConfig, runs: list[dict]) -> str:
    """Each run's goodput (whole trace and per phase), then the planner's over the best
    and the worst fixed split's."""
    rows = [f"{'run':>14} {'goodput':>8} {'prefill-heavy':>14} {'decode-heavy':>13} "
            f"{'TTFT p50':>9} {'TPOT p50':>9} {'failed':>7} {'leaked':>7}"]
    for r in runs:
        rows.append(f"{r['run']:>14} {r['goodput_req_s']:>8.3f} "
                    f"{r['phases'][0]['goodput_req_s']:>14.3f} "
                    f"{r['phases'][1]['goodput_req_s']:>13.3f} {r['ttft_ms']['p50']:>7.0f}ms "
                    f"{r['tpot_ms']['p50']:>7.0f}ms {r['failed']:>7} {r['kv_blocks_leaked']:>7}")
    fixed = [r["goodput_req_s"] for r in runs if r["run"] != "planner"]
    planner = next(r["goodput_req_s"] for r in runs if r["run"] == "planner")
    rows.append(f"planner / best fixed: {_ratio(planner, max(fixed))}, planner / worst "
                f"fixed: {_ratio(planner, min(fixed))} "
                f"(SLO TTFT {cfg.slo_ttft_ms:g} ms, TPOT {cfg.slo_itl_ms:g} ms)")
    return "\n".join(rows)


def as_json(cfg: PlannerBenchConfig, runs: list[dict]) -> dict:
    return {"config": asdict(cfg), "runs": runs}
