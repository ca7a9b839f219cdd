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


def test_log_records_name_the_request_their_task_serves():
    """configure_logging's filter: a record logged by a request's asyncio task (and the
    tasks it starts) names the request, and its trace when traced; others nothing."""
    import asyncio
    import io
    import logging

    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter(tracing.LOG_FORMAT))
    handler.addFilter(tracing.RequestInLogs())
    log = logging.getLogger("pdserve.test-request-logs")
    log.addHandler(handler)
    log.propagate = False

    class Traced:
        def get_span_context(self):
            return type("C", (), {"trace_id": 0x4BF92F3577B34DA6A3CE929D0E0E4736})()

    async def serve(rid, span):
        tracing.set_log_request(rid, span)
        log.warning("in %s", rid)
        await asyncio.get_running_loop().create_task(asyncio.sleep(0))
        await asyncio.create_task(asyncio.to_thread(log.warning, "its thread"))

    async def main():
        await asyncio.gather(serve("a", None), serve("b", Traced()))
        log.warning("outside")

    try:
        asyncio.run(main())
    finally:
        log.removeHandler(handler)
    lines = out.getvalue().splitlines()
    assert "WARNING pdserve.test-request-logs [request a]: in a" in lines
    assert ("WARNING pdserve.test-request-logs [request b trace "
            "4bf92f3577b34da6a3ce929d0e0e4736]: in b") in lines
    assert "WARNING pdserve.test-request-logs [request a]: its thread" in lines
    assert lines[-1] == "WARNING pdserve.test-request-logs: outside"
