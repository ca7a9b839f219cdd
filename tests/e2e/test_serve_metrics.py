"""Prometheus metrics through the real server: every component's /metrics endpoint (the
addresses come from ClusterStatus) carries each documented metric, the request metrics
move when requests are served, and the server's goodput count equals the client's own
count against the same SLOs."""

from __future__ import annotations

import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families
from serving import Served, start_ray

from pdserve.client import make_request

pytestmark = pytest.mark.slow

SLO_TTFT_MS = 700.0      # a ~20-token prompt meets it here, a ~1500-token one does not
SLO_TPOT_MS = 1000.0
MAX_TOKENS = 4

ROUTER = ["pdserve_time_to_first_token_seconds_count", "pdserve_inter_token_latency_seconds_count",
          "pdserve_time_per_output_token_seconds_count", "pdserve_request_duration_seconds_count",
          "pdserve_requests_total", "pdserve_prompt_tokens_total",
          "pdserve_generation_tokens_total", "pdserve_goodput_requests_total",
          "pdserve_num_requests_running", "pdserve_num_requests_waiting"]
WORKER = ["pdserve_num_requests_running", "pdserve_num_requests_waiting",
          "pdserve_batch_size_count", "pdserve_kv_cache_usage_ratio",
          "pdserve_prefix_cache_queries_total", "pdserve_prefix_cache_hits_total",
          "pdserve_kv_transfer_failures_total"]
PREFILL = WORKER + ["pdserve_kv_transfer_bytes_total", "pdserve_kv_transfer_seconds_count"]
DECODE = WORKER + ["pdserve_kv_reservations_active", "pdserve_kv_reservations_reclaimed_total",
                   "pdserve_num_preemptions_total"]


def scrape(address: str) -> dict[str, float]:
    """{sample name with its labels: value} of http://address/metrics."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "le")
            if "le" not in s.labels:
                out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def plain(sample: dict[str, float]) -> dict[str, float]:
    """Label-free view: values summed over label sets."""
    out: dict[str, float] = {}
    for k, v in sample.items():
        name = k.split("{")[0]
        out[name] = out.get(name, 0.0) + v
    return out


def _stream(served: Served, prompt: list[int]) -> tuple[float, float | None]:
    """(TTFT, TPOT) seconds as the client sees them."""
    t0 = time.perf_counter()
    times = []
    for msg in served.client.stream(make_request(prompt, max_tokens=MAX_TOKENS, temperature=0,
                                                 ignore_eos=True)):
        times += [time.perf_counter()] * len(msg.token_ids)
    ttft = times[0] - t0
    tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
    return ttft, tpot


def test_every_metric_exists_moves_and_goodput_matches_the_client():
    start_ray()
    served = Served(router_kw={"slo_ttft_ms": SLO_TTFT_MS, "slo_tpot_ms": SLO_TPOT_MS})
    try:
        st = served.client.status()
        router_at = st.metrics_address
        workers = {w.worker_id: (w.role, w.metrics_address) for w in st.workers}
        assert router_at and all(addr for _, addr in workers.values()), (router_at, workers)
        before_router = scrape(router_at)
        before = {wid: plain(scrape(addr)) for wid, (_, addr) in workers.items()}

        prompts = [[300 + 7 * i + j for i in range(20)] for j in range(3)]
        prompts += [[1000 + (i * 37 + j) % 20000 for i in range(1500)] for j in range(2)]
        client_good = 0
        for p in prompts:
            ttft, tpot = _stream(served, p)
            client_good += ttft * 1e3 <= SLO_TTFT_MS and (tpot is None or
                                                         tpot * 1e3 <= SLO_TPOT_MS)
        after_router = scrape(router_at)
        served.assert_all_free()
        after = {wid: plain(scrape(addr)) for wid, (_, addr) in workers.items()}

        r0, r1 = plain(before_router), plain(after_router)
        for name in ROUTER:
            assert name in r1, name
        n = len(prompts)
        assert r1["pdserve_time_to_first_token_seconds_count"] - \
            r0.get("pdserve_time_to_first_token_seconds_count", 0) == n
        assert r1["pdserve_inter_token_latency_seconds_count"] - \
            r0.get("pdserve_inter_token_latency_seconds_count", 0) == n * (MAX_TOKENS - 1)
        assert r1["pdserve_request_duration_seconds_count"] == n
        assert after_router["pdserve_requests_total{status=length}"] == n
        assert r1["pdserve_prompt_tokens_total"] == sum(map(len, prompts))
        assert r1["pdserve_generation_tokens_total"] == n * MAX_TOKENS
        # the SLO splits the workload: short prompts meet it, long ones do not
        assert 0 < client_good < n, client_good
        label = f"slo=ttft<={SLO_TTFT_MS:g}ms,tpot<={SLO_TPOT_MS:g}ms"
        assert after_router[f"pdserve_goodput_requests_total{{{label}}}"] == client_good

        # with both SLOs the router places each prompt by the first token it predicts on
        # each worker (router/placement.py): the prefill worker transfers the KV of those
        # it prefilled
        on = {w: after_router[f"pdserve_prefills_total{{on={w}}}"] - before_router.get(
            f"pdserve_prefills_total{{on={w}}}", 0) for w in ("prefill_worker", "decode_worker")}
        assert on["prefill_worker"] + on["decode_worker"] == n and on["prefill_worker"] >= 3, on
        for wid, (role, _) in workers.items():
            a, b = before[wid], after[wid]
            for name in PREFILL if role == "prefill" else DECODE:
                assert name in b, (wid, name)
            assert b["pdserve_batch_size_count"] > a.get("pdserve_batch_size_count", 0), wid
            assert b["pdserve_prefix_cache_queries_total"] > \
                a.get("pdserve_prefix_cache_queries_total", 0), wid
            if role == "prefill":
                assert b["pdserve_kv_transfer_bytes_total"] > a["pdserve_kv_transfer_bytes_total"]
                assert b["pdserve_kv_transfer_seconds_count"] - \
                    a.get("pdserve_kv_transfer_seconds_count", 0) == on["prefill_worker"]
    finally:
        served.stop()
