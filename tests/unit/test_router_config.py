"""pdserve/config.py RouterConfig (admission bounds) and how `pdserve serve` sets it.

No cluster is started: `serve` runs against a stand-in Cluster that records its config.
"""


import pytest

from recording_cluster import recording  # noqa: F401  (fixture)

from pdserve import cli
from pdserve.config import ClusterConfig, RouterConfig


def test_admission_bounds_default_and_validate():
    rc = RouterConfig()
    assert (rc.max_queued_requests, rc.max_queued_tokens) == (256, 262144)
    assert RouterConfig(max_queued_requests=1, max_queued_tokens=1).max_queued_requests == 1


@pytest.mark.parametrize("field", ["max_queued_requests", "max_queued_tokens"])
@pytest.mark.parametrize("value", [0, -3])
def test_bound_below_one_is_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field}={value}: must be >= 1"):
        RouterConfig(**{field: value})


def test_cluster_local_passes_router_kw():
    cfg = ClusterConfig.local(port=0, router_kw={"max_queued_requests": 2,
                                                 "max_queued_tokens": 500})
    assert (cfg.router.port, cfg.router.max_queued_requests, cfg.router.max_queued_tokens) \
        == (0, 2, 500)
    assert ClusterConfig.local().router.max_queued_requests == RouterConfig().max_queued_requests


def test_serve_flags_set_the_admission_bounds(recording):
    assert cli.main(["serve", "--max-queued-requests", "3", "--max-queued-tokens", "4096"]) == 1
    rc = recording[0].router
    assert (rc.max_queued_requests, rc.max_queued_tokens) == (3, 4096)


def test_serve_without_flags_keeps_router_defaults(recording):
    assert cli.main(["serve"]) == 1
    assert recording[0].router == RouterConfig()


def test_serve_refuses_a_bad_bound_before_starting(recording, capsys):
    assert cli.main(["serve", "--max-queued-tokens", "0"]) == 2
    assert "max_queued_tokens=0: must be >= 1" in capsys.readouterr().err
    assert recording == []


def test_serve_failure_flags(recording):
    assert cli.main(["serve", "--max-migrations", "1", "--max-worker-restarts", "-1"]) == 1
    assert recording[0].router.max_migrations == 1
    assert recording[0].max_worker_restarts == -1


@pytest.mark.parametrize("argv, msg", [
    (["--max-migrations", "-1"], "max_migrations=-1: must be >= 0"),
    (["--max-worker-restarts", "-2"], "max_worker_restarts=-2: must be >= -1"),
])
def test_serve_refuses_bad_failure_flags(recording, capsys, argv, msg):
    assert cli.main(["serve", *argv]) == 2
    assert msg in capsys.readouterr().err


def test_serve_multi_node_flags(recording):
    assert cli.main(["serve", "--address", "auto", "--host", "0.0.0.0", "--kv-host", "auto",
                     "--prefill-resources", '{"pdserve_prefill": 1}',
                     "--decode-resources", '{"pdserve_decode": 2}']) == 1
    cfg = recording[0]
    assert cfg.ray_address == "auto" and cfg.router.host == "0.0.0.0"
    assert cfg.prefill.host == cfg.decode.host == "auto"
    assert cfg.prefill_resources == {"pdserve_prefill": 1.0}
    assert cfg.decode_resources == {"pdserve_decode": 2.0}
    assert cfg.gpus_per_worker == 0 and cfg.prefill.device == "cpu"


def test_gpus_per_worker_runs_workers_on_cuda(recording):
    assert cli.main(["serve", "--gpus-per-worker", "1", "--dtype", "bfloat16"]) == 1
    cfg = recording[0]
    assert cfg.gpus_per_worker == 1 and cfg.decode.device == "cuda"
    assert cfg.decode.dtype == "bfloat16"


@pytest.mark.parametrize("argv, msg", [
    (["--host", "0.0.0.0"], "host='0.0.0.0': the KV port binds to the worker's own"),
    (["--prefill-resources", '{"GPU": 1}'], "prefill_resources: 'GPU'=1.0"),
    (["--decode-resources", '{"pdserve_decode": 0}'], "decode_resources: 'pdserve_decode'=0.0"),
])
def test_serve_refuses_bad_placement(recording, capsys, argv, msg):
    assert cli.main(["serve", *argv]) == 2
    assert msg in capsys.readouterr().err


def test_resources_flag_must_be_a_json_object(capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--prefill-resources", "pdserve_prefill=1"])
    assert "--prefill-resources: not JSON" in capsys.readouterr().err


def test_max_prefill_queue_tokens_flag_default_and_bound(recording):
    assert RouterConfig().max_prefill_queue_tokens is None   # a prefill step's budget
    with pytest.raises(ValueError, match="^max_prefill_queue_tokens=-1: must be >= 0"):
        RouterConfig(max_prefill_queue_tokens=-1)
    assert cli.main(["serve", "--max-prefill-queue-tokens", "0"]) == 1
    assert recording[0].router.max_prefill_queue_tokens == 0


def test_lend_idle_prefill_cores_is_on_unless_turned_off(recording):
    assert cli.main(["serve"]) == 1 and recording[0].lend_idle_prefill_cores
    assert cli.main(["serve", "--no-lend-idle-prefill-cores"]) == 1
    assert not recording[1].lend_idle_prefill_cores


def test_local_prefill_when_prefill_idle_is_on_unless_turned_off(recording):
    assert cli.main(["serve"]) == 1 and recording[0].router.local_prefill_when_prefill_idle
    assert cli.main(["serve", "--no-local-prefill-when-prefill-idle"]) == 1
    assert not recording[1].router.local_prefill_when_prefill_idle


def test_the_request_deadline_caps_the_client_s():
    import time
    rc = RouterConfig(request_timeout_s=10.0)
    now = time.monotonic()
    assert rc.deadline(None) - now == pytest.approx(10.0, abs=0.5)
    assert rc.deadline(3600.0) - now == pytest.approx(10.0, abs=0.5)   # capped
    assert rc.deadline(2.0) - now == pytest.approx(2.0, abs=0.5)       # shorter: kept


def test_admin_key_worker_bound_and_metrics_host_flags(recording, monkeypatch):
    monkeypatch.setenv("PDSERVE_ADMIN_API_KEY", "adm1n")
    assert cli.main(["serve", "--max-workers", "6", "--metrics-host", "10.1.2.3",
                     "--request-timeout-s", "30"]) == 1
    rc = recording[0].router
    assert (rc.admin_api_key, rc.max_workers, rc.metrics_host, rc.request_timeout_s) == \
        ("adm1n", 6, "10.1.2.3", 30.0)
    monkeypatch.delenv("PDSERVE_ADMIN_API_KEY")
    assert cli.main(["serve"]) == 1
    rc = recording[1].router
    assert (rc.admin_api_key, rc.max_workers, rc.metrics_host) == (None, 16, None)


@pytest.mark.parametrize("kw, message", [
    ({"decode_routing_policy": "random"}, "^decode_routing_policy='random': choose one of"),
    ({"cache_threshold": 1.5}, r"^cache_threshold=1.5: must be in \[0, 1\]"),
    ({"balance_abs_threshold": -1}, "^balance_abs_threshold=-1: must be >= 0 streams"),
    ({"balance_rel_threshold": 0.5}, "^balance_rel_threshold=0.5: must be >= 1")])
def test_decode_routing_settings_are_checked_naming_the_field(kw, message):
    with pytest.raises(ValueError, match=message):
        RouterConfig(**kw)


def test_serve_passes_the_decode_routing_flags(recording):
    assert cli.main(["serve", "--decode-routing-policy", "cache_aware", "--cache-threshold",
                     "0.5", "--balance-abs-threshold", "8", "--balance-rel-threshold", "2"]) == 1
    rc = recording[0].router
    assert (rc.decode_routing_policy, rc.cache_threshold, rc.balance_abs_threshold,
            rc.balance_rel_threshold) == ("cache_aware", 0.5, 8, 2.0)


def test_serve_passes_the_tracing_sample_ratios(recording):
    assert cli.main(["serve", "--otlp-traces-endpoint", "127.0.0.1:4317",
                     "--otlp-traces-sample-ratio", "0.25",
                     "--otlp-traces-client-sample-ratio", "0"]) == 1
    rc = recording[0].router
    assert (rc.otlp_traces_sample_ratio, rc.otlp_traces_client_sample_ratio) == (0.25, 0.0)
    assert RouterConfig().otlp_traces_client_sample_ratio == 1.0   # OpenTelemetry's default
