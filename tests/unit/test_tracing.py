"""pdserve/tracing.py off (the default): no trace, no carrier, nothing read from the
headers; the config refuses a sample ratio outside [0, 1] and the workers trace where
the router does."""

import pytest

from pdserve import tracing
from pdserve.config import ClusterConfig
from pdserve.router.config import RouterConfig


def test_off_by_default_nothing_is_built():
    assert not tracing.enabled()
    assert tracing.request_trace("llm_request", {"traceparent": "x"}, {}) is None
    assert tracing.trace_headers([("traceparent", f"00-{'1' * 32}-{'2' * 16}-01")]) is None
    assert tracing.worker_span("prefill_worker", {"traceparent": "x"}) is None
    assert tracing.configure(None, "pdserve-router") is False and not tracing.enabled()


def test_config_bounds_and_the_workers_follow_the_router():
    with pytest.raises(ValueError, match="otlp_traces_sample_ratio"):
        RouterConfig(otlp_traces_sample_ratio=1.5)
    cfg = ClusterConfig(router=RouterConfig(otlp_traces_endpoint="127.0.0.1:4317"))
    assert cfg.prefill.otlp_traces_endpoint == cfg.decode.otlp_traces_endpoint == "127.0.0.1:4317"
    assert ClusterConfig().decode.otlp_traces_endpoint is None
