"""Prometheus metrics (prometheus-client) of every component, each served on its own
`/metrics` HTTP endpoint (docs/architecture.md, "Observability").

Names carry the `pdserve_` prefix and follow vLLM's and the Prometheus conventions
(units in the name, `_total` counters, base units: seconds, bytes, tokens):

router (`RouterMetrics`, observed per request by the gRPC Generate handler)
    pdserve_time_to_first_token_seconds           histogram: arrival to first token
    pdserve_inter_token_latency_seconds           histogram: gap between tokens (ITL)
    pdserve_time_per_output_token_seconds         histogram: per request, (E2E - TTFT)
                                                  / (tokens - 1) (TPOT)
    pdserve_request_duration_seconds              histogram: arrival to last message
    pdserve_requests_total{status}                counter: stop | length | cancelled |
                                                  error | a gRPC status code, lower case
    pdserve_prompt_tokens_total, pdserve_generation_tokens_total    counters
    pdserve_request_retries_total{reason}         counter: attempts retried after a worker
                                                  died or a transfer failed (prefill |
                                                  decode), or moved to a decode worker
                                                  that joined (rebalance)
    pdserve_prefills_total{on}                    counter: request attempts by who
                                                  prefilled the prompt: prefill_worker |
                                                  decode_worker (conditional
                                                  disaggregation, local prefill)
    pdserve_streams_stalled_total                 counter: streams aborted because their
                                                  client read nothing for
                                                  stream_stall_timeout_s (router/stalls.py)
    pdserve_goodput_requests_total{slo}           counter: finished requests within the
                                                  TTFT and TPOT SLOs (DistServe's goodput)
    pdserve_num_requests_running / _waiting       gauges: streaming / queued for the
                                                  first token (admission queue)
planner (`PlannerMetrics`, serve --planner slo: router/planner.py; on the router's endpoint)
    pdserve_planner_workers_needed{role}          gauge: the last interval's fractional
                                                  workers needed at the SLO (-1: no
                                                  number of workers meets it)
    pdserve_planner_workers_target{role}          gauge: the workers the planner asked for
    pdserve_planner_scale_actions_total{role,direction}   counter: up | down
workers (`WorkerMetrics`; values read from the worker at scrape time, plus histograms)
    pdserve_num_requests_running / _waiting       gauges
    pdserve_batch_size{phase}                     histogram: requests per prefill/decode step
    pdserve_kv_cache_usage_ratio                  gauge: held blocks / all blocks
    pdserve_prefix_cache_queries_total / _hits_total   counters, in blocks
    pdserve_kv_transfer_bytes_total               counter (prefill: K/V payload sent)
    pdserve_kv_transfer_seconds                   histogram (prefill: first KV frame of a
                                                  request handed to the transport to its
                                                  done frame sent)
    pdserve_kv_transfer_failures_total            counter (prefill: sends that failed;
                                                  decode: transfers that failed to arrive)
    pdserve_kv_reservations_active                gauge (decode: waiting for prefill's KV)
    pdserve_kv_reservations_reclaimed_total       counter (decode: lease expired)
    pdserve_num_preemptions_total                 counter (decode)
    pdserve_kv_tier_{host,disk}_hits_total        counters: blocks loaded back from
                                                  the host / disk KV tier (engine/kv_tiers.py)
    pdserve_kv_tier_bytes_loaded_total            counter: bytes those loads moved
    pdserve_kv_tier_load_seconds_total            counter: seconds of those loads
    pdserve_kv_tier_dropped_total                 counter: disk entries failing their check
    pdserve_kv_tier_disk_writes_dropped_total     counter: blocks not moved to disk (behind)
    pdserve_kv_tier_loads_timed_out_total         counter: loads cut at their budget
    pdserve_kv_tier_{host,disk}_blocks            gauges: blocks each tier holds
    pdserve_kv_pulled_blocks_total                counters: prompt blocks (bytes, seconds)
    pdserve_kv_pull_{bytes,seconds}_total         a prefill worker read from a decode
    pdserve_kv_pull_failures_total                worker, and pulls failed (kv_pull.py)

Histogram buckets span CPU and GPU speeds: a GPU's TTFT is ~10 ms, a 2-core CPU's
several seconds.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

# seconds
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
               0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0,
               600.0)
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                    2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def serve(registry: CollectorRegistry, host: str, port: int) -> tuple[str, int]:
    """Serve `registry` at http://host:port/metrics from a daemon thread; port 0 picks a
    free one. Returns the bound (host, port). Raises OSError when it cannot bind."""
    server, _ = start_http_server(port, addr=host, registry=registry)
    return host, server.server_port


def slo_label(ttft_ms: float | None, tpot_ms: float | None) -> str:
    """The `slo` label value, e.g. "ttft<=2000ms,tpot<=100ms" ("none": no SLO set)."""
    parts = [f"{name}<={v:g}ms" for name, v in (("ttft", ttft_ms), ("tpot", tpot_ms))
             if v is not None]
    return ",".join(parts) or "none"


@dataclass
class RouterTotals:
    """Cumulative figures the SLO planner differences per interval (router/planner.py):
    finished requests and their output tokens, the sums and counts of TTFT and ITL
    (sample 0's tokens), and every sample's tokens of the completed requests against
    their max_tokens."""

    finished: int = 0
    output_tokens: int = 0
    completed_tokens: int = 0        # every sample's tokens, of the requests that ran
                                     # to their end (router.generate), and
    completed_max_tokens: int = 0    # their max_tokens x samples

    def complete(self, tokens: int, max_tokens: int) -> None:
        """A request ran to its end with `tokens` of at most `max_tokens` (all samples)."""
        self.completed_tokens += tokens
        self.completed_max_tokens += max_tokens
    ttft_s: float = 0.0
    ttft_count: int = 0
    itl_s: float = 0.0
    itl_count: int = 0


class RouterMetrics:
    """The router's request metrics in their own registry (see the module docstring).

    `waiting` is read at scrape time; requests count as running from their first token
    to their finish. `slo_ttft_ms` / `slo_tpot_ms` (None: unconstrained) define goodput."""

    def __init__(self, waiting: Callable[[], int], slo_ttft_ms: float | None = None,
                 slo_tpot_ms: float | None = None):
        r = self.registry = CollectorRegistry()
        self.running = 0
        self.totals = RouterTotals()
        p = "pdserve_"
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Time to first token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(p + "inter_token_latency_seconds",
                             "Time between consecutive output tokens of a request.",
                             buckets=ITL_BUCKETS, registry=r)
        self.tpot = Histogram(p + "time_per_output_token_seconds",
                              "Per request: (E2E - TTFT) / (output tokens - 1).",
                              buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(p + "request_duration_seconds",
                             "Request arrival to its last message.",
                             buckets=E2E_BUCKETS, registry=r)
        self.requests = Counter(p + "requests", "Requests by final status.", ["status"],
                                registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of served requests.",
                                     registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated.",
                                         registry=r)
        self.retries = Counter(p + "request_retries",
                               "Request attempts retried on live workers after a worker died "
                               "or a KV transfer failed, by the phase that failed (rebalance: "
                               "moved to a decode worker that joined).", ["reason"],
                               registry=r)
        self.prefills = Counter(p + "prefills",
                                "Request attempts by who prefilled their prompt: a prefill "
                                "worker, or the decode worker itself (conditional "
                                "disaggregation, router/placement.py).", ["on"], registry=r)
        for on in ("prefill_worker", "decode_worker"):
            self.prefills.labels(on=on)   # exported at 0 from the start
        self.decode_placements = Counter(
            p + "decode_placements", "Request attempts by why the decode worker that took "
            "them was asked: by='cache', it came first for holding the longest run of the "
            "prompt's blocks (--decode-routing-policy cache_aware); by='load', by its load "
            "(fewest streams; or the next after one that refused).", ["by"], registry=r)
        for by in ("cache", "load"):
            self.decode_placements.labels(by=by)
        self.decode_refusals = Counter(
            p + "decode_refusals", "Reservations a decode worker refused for want of free KV "
            "blocks (or could not take, dead), the next in decode_order asked instead.",
            registry=r)
        self.stalled = Counter(p + "streams_stalled",
                               "Streams aborted because their client read nothing for "
                               "stream_stall_timeout_s.", registry=r)
        self.slo = slo_label(slo_ttft_ms, slo_tpot_ms)
        self.slo_ttft_s = None if slo_ttft_ms is None else slo_ttft_ms / 1e3
        self.slo_tpot_s = None if slo_tpot_ms is None else slo_tpot_ms / 1e3
        self.goodput = Counter(p + "goodput_requests",
                               "Finished requests that met the TTFT and TPOT SLOs.", ["slo"],
                               registry=r)
        self.goodput.labels(slo=self.slo)   # exported at 0 from the start
        Gauge(p + "num_requests_running", "Requests streaming tokens.",
              registry=r).set_function(lambda: self.running)
        Gauge(p + "num_requests_waiting", "Requests admitted, waiting for the first token.",
              registry=r).set_function(waiting)

    def request(self) -> "RequestTimer":
        return RequestTimer(self)

    def meets_slo(self, ttft_s: float, tpot_s: float | None) -> bool:
        """TTFT within its SLO and, with more than one output token, TPOT within its."""
        return ((self.slo_ttft_s is None or ttft_s <= self.slo_ttft_s)
                and (self.slo_tpot_s is None or tpot_s is None or tpot_s <= self.slo_tpot_s))


class RequestTimer:
    """One request's timing; call `tokens(n)` per message with n new tokens, then
    `finish(status, prompt_tokens)` once (later calls do nothing)."""

    def __init__(self, m: RouterMetrics):
        self.m = m
        self.t0 = self.last = time.perf_counter()
        self.first: float | None = None
        self.num_tokens = 0
        self.other_tokens = 0            # of samples 1.. (sampling.n > 1)
        self.done = False

    def tokens(self, n: int, sample: int = 0) -> None:
        """`n` new tokens of sample `sample` (sampling.n); TTFT and ITL are sample 0's."""
        if sample:
            self.other_tokens += n
            return
        if n <= 0:
            return
        now = time.perf_counter()
        self.num_tokens += n
        if self.first is None:
            self.first = self.last = now
            self.m.ttft.observe(now - self.t0)
            self.m.totals.ttft_s += now - self.t0
            self.m.totals.ttft_count += 1
            self.m.running += 1
            n -= 1                       # the first token has a TTFT, not an ITL
        for _ in range(n):               # tokens coalesced in one message share its gap
            self.m.itl.observe((now - self.last) / n)
        if n > 0:
            self.m.totals.itl_s += now - self.last
            self.m.totals.itl_count += n
        self.last = now

    def finish(self, status: str, prompt_tokens: int = 0) -> None:
        if self.done:
            return
        self.done = True
        now = time.perf_counter()
        m = self.m
        m.requests.labels(status=status).inc()
        m.e2e.observe(now - self.t0)
        m.prompt_tokens.inc(prompt_tokens)
        m.generation_tokens.inc(self.num_tokens + self.other_tokens)
        if status in ("stop", "length"):
            m.totals.finished += 1
            m.totals.output_tokens += self.num_tokens + self.other_tokens
        if self.first is None:
            return
        m.running -= 1
        ttft = self.first - self.t0
        tpot = (self.last - self.first) / (self.num_tokens - 1) if self.num_tokens > 1 else None
        if tpot is not None:
            m.tpot.observe(tpot)
        if status in ("stop", "length") and m.meets_slo(ttft, tpot):
            m.goodput.labels(slo=m.slo).inc()


class PlannerMetrics:
    """The SLO planner's decisions (router/planner.py), in the router's registry."""

    def __init__(self, registry: CollectorRegistry):
        p = "pdserve_planner_"
        self.needed = Gauge(p + "workers_needed", "Workers the last interval's load needs "
                            "at the SLO (fractional), by role.", ["role"], registry=registry)
        self.target = Gauge(p + "workers_target", "Workers the planner asks for, by role.",
                            ["role"], registry=registry)
        self.actions = Counter(p + "scale_actions", "Scale actions the planner took, by "
                               "role and direction (up, down).", ["role", "direction"],
                               registry=registry)


class WorkerMetrics:
    """A worker's metrics: `values()` (called at scrape time) returns the current
    gauges and counters by short name (see `GAUGES`, `COUNTERS`; missing ones are not
    exported), and the worker observes `batch_size` and `kv_transfer_seconds`."""

    GAUGES = {
        "num_requests_running": "Requests computing (prefill) or in the batch (decode).",
        "num_requests_waiting": "Requests queued (prefill) or waiting for KV (decode).",
        "kv_cache_usage_ratio": "Fraction of KV blocks held by requests.",
        "kv_reservations_active": "Reservations waiting for prefill's KV.",
        "kv_tier_host_blocks": "KV blocks the host tier holds.",
        "kv_tier_disk_blocks": "KV blocks the disk tier holds.",
    }
    COUNTERS = {
        "prefix_cache_queries": "Prompt blocks looked up in the prefix cache.",
        "prefix_cache_hits": "Prompt blocks found in the prefix cache.",
        "kv_transfer_bytes": "K/V payload bytes sent to decode workers.",
        "kv_transfer_failures": "KV transfers that failed.",
        "kv_reservations_reclaimed": "Reservations reclaimed after their lease expired.",
        "num_preemptions": "Running requests preempted for lack of KV blocks.",
        "kv_tier_host_hits": "Prefix blocks loaded back from the host KV tier.",
        "kv_tier_disk_hits": "Prefix blocks loaded back from the disk KV tier.",
        "kv_tier_bytes_loaded": "Bytes loaded back from the KV tiers into the pool.",
        "kv_tier_load_seconds": "Seconds of the KV tiers' loads, summed.",
        "kv_tier_dropped": "Disk KV tier entries dropped when their MAC check failed.",
        "kv_tier_disk_writes_dropped": "Blocks not moved to the disk KV tier: it was behind "
                                       "or off.",
        "kv_tier_loads_timed_out": "KV tier loads cut at their budget (a disk read "
                                   "abandoned); the rest was computed.",
        "kv_pulled_blocks": "Prompt blocks read from a decode worker instead of computed.",
        "kv_pull_bytes": "K/V bytes read from decode workers (kv_pull).",
        "kv_pull_seconds": "Seconds of the pulls from decode workers, asked to done, summed.",
        "kv_pull_failures": "Pulls from a decode worker that failed or were given up.",
    }

    def __init__(self, role: str, values: Callable[[], dict[str, float]]):
        r = self.registry = CollectorRegistry()
        self.batch_size = Histogram("pdserve_batch_size", "Requests per model step.",
                                    ["phase"], buckets=BATCH_BUCKETS, registry=r)
        self.kv_transfer_seconds = Histogram(
            "pdserve_kv_transfer_seconds",
            "Per request: first KV frame handed to the transport to its done frame sent.",
            buckets=TRANSFER_BUCKETS, registry=r)
        r.register(_ValuesCollector(role, values))


class _ValuesCollector(Collector):
    def __init__(self, role: str, values: Callable[[], dict[str, float]]):
        self.role, self.values = role, values

    def collect(self):
        v = self.values()
        for name, doc in WorkerMetrics.GAUGES.items():
            if name in v and not math.isnan(v[name]):
                yield GaugeMetricFamily("pdserve_" + name, doc, value=v[name])
        for name, doc in WorkerMetrics.COUNTERS.items():
            if name in v:
                yield CounterMetricFamily("pdserve_" + name, doc, value=v[name])
