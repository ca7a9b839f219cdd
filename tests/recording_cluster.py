"""A stand-in for pdserve.cluster.Cluster that records the config `pdserve serve` built,
then fails to start: CLI tests check flags -> config with no cluster started.

    from recording_cluster import recording   # the fixture; yields the recorded configs
"""

from __future__ import annotations

from typing import ClassVar

import pytest

from pdserve import cluster, serve


class RecordingCluster:
    """Records the config, then fails to start."""

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
    monkeypatch.setattr(serve.signal, "signal", lambda *a: None)   # keep pytest's handlers
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    # as in serve's child process (serve._supervise): build the config here, in-process
    monkeypatch.setenv(serve._SERVE_CHILD_ENV, "1")
    RecordingCluster.configs = []
    return RecordingCluster.configs
