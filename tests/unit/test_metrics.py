"""pdserve/metrics.py: request timing, goodput against the SLOs, worker values at scrape
time (no server: the registries are read directly)."""

from unittest import mock

import pytest

from pdserve import metrics
from pdserve.metrics import RouterMetrics, WorkerMetrics, slo_label


def value(registry, name, **labels):
    v = registry.get_sample_value(name, labels)
    return 0.0 if v is None else v


def at(*times):
    """Patch time.perf_counter to return `times` in order."""
    return mock.patch.object(metrics.time, "perf_counter", side_effect=list(times))


def test_ttft_itl_tpot_e2e_and_tokens_of_one_request():
    m = RouterMetrics(waiting=lambda: 3)
    r = m.registry
    with at(10.0, 10.5, 10.7, 11.1, 11.2):
        t = m.request()                    # arrives at 10.0
        t.tokens(1)                        # first token at 10.5: TTFT 0.5
        assert value(r, "pdserve_num_requests_running") == 1
        t.tokens(1)                        # 10.7: ITL 0.2
        t.tokens(2)                        # 11.1: two coalesced tokens, 0.2 each
        t.finish("length", prompt_tokens=7)    # 11.2
    assert value(r, "pdserve_time_to_first_token_seconds_sum") == pytest.approx(0.5)
    assert value(r, "pdserve_inter_token_latency_seconds_count") == 3
    assert value(r, "pdserve_inter_token_latency_seconds_sum") == pytest.approx(0.6)
    assert value(r, "pdserve_time_per_output_token_seconds_sum") == pytest.approx(0.6 / 3)
    assert value(r, "pdserve_request_duration_seconds_sum") == pytest.approx(1.2)
    assert value(r, "pdserve_requests_total", status="length") == 1
    assert value(r, "pdserve_prompt_tokens_total") == 7
    assert value(r, "pdserve_generation_tokens_total") == 4
    assert value(r, "pdserve_num_requests_running") == 0
    assert value(r, "pdserve_num_requests_waiting") == 3
    assert value(r, "pdserve_goodput_requests_total", slo="none") == 1


@pytest.mark.parametrize("ttft, gaps, status, good", [
    (0.9, [0.1, 0.1], "stop", True),
    (1.1, [0.1, 0.1], "stop", False),       # TTFT over 1000 ms
    (0.5, [0.1, 0.3], "length", False),     # TPOT 0.2 s over 150 ms
    (0.5, [], "stop", True),                # one token: no TPOT to judge
    (0.5, [0.1], "error", False),           # failed requests are never goodput
])
def test_goodput_counts_requests_within_both_slos(ttft, gaps, status, good):
    m = RouterMetrics(waiting=lambda: 0, slo_ttft_ms=1000, slo_tpot_ms=150)
    times, now = [0.0, ttft], ttft
    for g in gaps:
        now += g
        times.append(now)
    with at(*times, now):
        t = m.request()
        for _ in range(1 + len(gaps)):
            t.tokens(1)
        t.finish(status)
        t.finish("stop")                   # a second finish is ignored
    label = "ttft<=1000ms,tpot<=150ms"
    assert value(m.registry, "pdserve_goodput_requests_total", slo=label) == int(good)
    assert value(m.registry, "pdserve_requests_total", status=status) == 1


def test_a_request_refused_before_any_token_counts_its_status_only():
    m = RouterMetrics(waiting=lambda: 0)
    t = m.request()
    t.finish("resource_exhausted")
    r = m.registry
    assert value(r, "pdserve_requests_total", status="resource_exhausted") == 1
    assert value(r, "pdserve_time_to_first_token_seconds_count") == 0
    assert value(r, "pdserve_num_requests_running") == 0


def test_slo_label():
    assert slo_label(None, None) == "none"
    assert slo_label(2000, None) == "ttft<=2000ms"
    assert slo_label(2000, 100.5) == "ttft<=2000ms,tpot<=100.5ms"


def test_worker_values_are_read_at_scrape_time():
    state = {"num_requests_running": 1, "kv_cache_usage_ratio": 0.25, "kv_transfer_bytes": 10}
    w = WorkerMetrics("prefill", lambda: dict(state))
    r = w.registry
    assert value(r, "pdserve_num_requests_running") == 1
    state["kv_transfer_bytes"] = 30
    assert value(r, "pdserve_kv_transfer_bytes_total") == 30
    assert r.get_sample_value("pdserve_num_preemptions_total") is None   # not this role's
    w.batch_size.labels(phase="prefill").observe(3)
    assert value(r, "pdserve_batch_size_count", phase="prefill") == 1
