"""Start and stop a pdserve cluster on Ray: prefill and decode worker actors + router.

With `ray_address=None` a local Ray instance is started (and stopped again by `stop`);
otherwise the cluster joins the given Ray cluster ("auto" for the one this node is in)
and leaves it running on `stop`. Only this cluster's own actors are ever killed.
"""

from __future__ import annotations

import logging
import os
import secrets
import uuid
from dataclasses import replace

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from .config import ClusterConfig

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 300.0   # first start converts the GGUF (~15 s) and loads weights per worker


class ClusterStartError(RuntimeError):
    """A worker or the router failed to start; the message names the first cause
    (e.g. a KV layout mismatch between a prefill and a decode worker)."""


class Cluster:
    def __init__(self, config: ClusterConfig):
        self.config = config
        self.port: int | None = None
        self.http_port: int | None = None   # the OpenAI-compatible HTTP API's, when on
        self.router = None
        self.prefill: list = []
        self.decode: list = []
        self._owns_ray = False

    def start(self) -> int:
        """Start Ray (if needed), the workers and the router. Returns the gRPC port;
        `http_port` is then the HTTP API's (config.router.http_port set) or None.

        Raises:
            ray.exceptions.RayActorError / GetTimeoutError: a worker failed to start.
        """
        from .decode_worker.worker import DecodeWorker
        from .prefill_worker.worker import PrefillWorker
        from .router.router import Router

        cfg = self.config
        if cfg.prefill.kv_secret is None and cfg.decode.kv_secret is None:
            # KV ports pair only with peers proving this (kv_transfer/auth.py); one per start
            secret = secrets.token_hex(32)
            cfg = replace(cfg, prefill=replace(cfg.prefill, kv_secret=secret),
                          decode=replace(cfg.decode, kv_secret=secret))
        if not ray.is_initialized():
            if cfg.ray_address is None:
                ray.init(num_cpus=os.cpu_count(), include_dashboard=False,
                         namespace=f"pdserve-{uuid.uuid4().hex[:8]}", log_to_driver=True,
                         configure_logging=False)
                self._owns_ray = True
            else:
                ray.init(address=cfg.ray_address, namespace="pdserve")
        # Actors take no Ray CPUs: each worker pins its own torch threads (num_threads),
        # so several workers share a small box without Ray refusing to place them.
        opts = {"num_cpus": 0, "max_concurrency": 1000}
        # A dead worker is restarted by Ray (new epoch); the router retries its requests
        # itself (router.py), so Ray never re-runs a call on its own.
        wopts = opts | {"max_restarts": cfg.max_worker_restarts, "max_task_retries": 0,
                        "num_gpus": cfg.gpus_per_worker}
        self.decode = [ray.remote(DecodeWorker).options(
            name=f"decode-{i}", resources=cfg.decode_resources or None, **wopts)
            .remote(f"decode-{i}", cfg.decode) for i in range(cfg.num_decode_workers)]
        self.prefill = [ray.remote(PrefillWorker).options(
            name=f"prefill-{i}", resources=cfg.prefill_resources or None, **wopts)
            .remote(f"prefill-{i}", cfg.prefill) for i in range(cfg.num_prefill_workers)]
        # The router serves gRPC and /metrics where `serve` runs (the head: its Service,
        # security group and port-forwards point there), never on a worker node.
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(),
                                              soft=False)
        self.router = ray.remote(Router).options(name="router", scheduling_strategy=here,
                                                 **opts).remote(
            cfg, self.prefill, self.decode)
        try:
            self.port = ray.get(self.router.start.remote(), timeout=STARTUP_TIMEOUT_S)
            if cfg.router.http_port is not None:
                self.http_port = ray.get(self.router.http_port.remote(), timeout=30)
        except BaseException as e:
            self.stop()         # a worker failed to start: do not leave the others running
            if isinstance(e, ray.exceptions.RayTaskError):
                cause = e.cause if e.cause is not None else e
                raise ClusterStartError(f"{type(cause).__name__}: {cause}") from e
            raise
        return self.port

    def stop(self) -> None:
        """Stop serving, shut the workers down, and stop Ray if this cluster started it."""
        if self.router is not None:
            try:
                ray.get(self.router.stop.remote(), timeout=10)
            except Exception as e:  # a dead router must not keep the workers alive
                logger.warning("router stop failed: %s", e)
        for w in self.prefill + self.decode:
            try:
                ray.get(w.shutdown.remote(), timeout=15)
            except Exception as e:
                logger.warning("worker shutdown failed: %s", e)
        for a in [self.router, *self.prefill, *self.decode]:
            if a is not None:
                ray.kill(a)
        self.router, self.prefill, self.decode = None, [], []
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False

    def __enter__(self) -> "Cluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
