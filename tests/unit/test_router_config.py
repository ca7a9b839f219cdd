"""pdserve/config.py RouterConfig (admission bounds) and how `pdserve serve` sets it.

No cluster is started: `serve` runs against a stand-in Cluster that records its config.
"""

from typing import ClassVar

import pytest

from pdserve import cli, cluster
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


class RecordingCluster:
    """Stands in for pdserve.cluster.Cluster: records the config, then fails to start."""

    configs: ClassVar[list] = []

    def __init__(self, config):
        self.configs.append(config)

    def start(self):
        raise cluster.ClusterStartError("not started (test)")

    def stop(self):
        pass


@pytest.fixture
def recording(monkeypatch):
    monkeypatch.setattr(cluster, "Cluster", RecordingCluster)
    monkeypatch.setattr(cli.signal, "signal", lambda *a: None)   # keep pytest's handlers
    RecordingCluster.configs = []
    return RecordingCluster.configs


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
