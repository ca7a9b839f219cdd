"""Start and stop a pdserve cluster on Ray: prefill and decode worker actors + router.

With `ray_address=None` a local Ray instance is started (and stopped again by `stop`);
otherwise the cluster joins the given Ray cluster ("auto" for the one this node is in)
and leaves it running on `stop`. Only this cluster's own actors are ever killed.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import signal
import tempfile
import threading
import time
import uuid
from dataclasses import replace

import psutil
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from . import cpu_limit
from .config import ClusterConfig

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 300.0   # first start converts the GGUF (~15 s) and loads weights per worker
ROUTER_WATCH_S = 0.5        # how often the cluster asks the router whether it serves
ROUTER_CALL_TIMEOUT_S = 5.0


def _core_share_dir() -> str:
    """A directory name for this start's core-lending flags (pdserve/core_share.py): in
    /dev/shm (memory, node-local) where it exists. The workers create it on their nodes."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(base, f"pdserve-cores-{uuid.uuid4().hex[:12]}")


def start_worker(cfg: ClusterConfig, role: str, worker_id: str):
    """Start one `role` ("prefill" | "decode") worker actor named `worker_id` with the
    cluster's options (Cluster.start, and the router scaling at runtime); a
    tensor-parallel one in bundle 0 of a placement group of its own (tp_group.py: its
    ranks take the other bundles, on the same node). Returns (handle, that placement
    group or None); the actor is starting (its ready() says when it serves).

    Raises:
        ray.exceptions.GetTimeoutError: no node can hold the placement group.
        ray.exceptions.ActorAlreadyExistsError: an actor of this Ray namespace has the
            name `worker_id` already.
    """
    from .decode_worker.worker import DecodeWorker
    from .prefill_worker.worker import PrefillWorker
    from .tp_group import in_bundle, placement_group

    cls, wcfg, resources = ((PrefillWorker, cfg.prefill, cfg.prefill_resources)
                            if role == "prefill" else
                            (DecodeWorker, cfg.decode, cfg.decode_resources))
    # Actors take no Ray CPUs: each worker pins its own torch threads (num_threads), so
    # several workers share a small box without Ray refusing to place them. A dead
    # worker is restarted by Ray (new epoch); the router retries its requests itself
    # (router.py), so Ray never re-runs a call on its own.
    opts = {"num_cpus": 0, "max_concurrency": 1000, "name": worker_id,
            "max_restarts": cfg.max_worker_restarts, "max_task_retries": 0}
    if wcfg.tensor_parallel_size == 1:
        return ray.remote(cls).options(resources=resources or None,
                                       num_gpus=cfg.gpus_per_worker, **opts).remote(
            worker_id, wcfg), None
    pg = placement_group(wcfg.tensor_parallel_size, resources, num_gpus=cfg.gpus_per_worker,
                         name=f"{worker_id}-ranks")
    try:
        return ray.remote(cls).options(scheduling_strategy=in_bundle(pg, 0), **opts).remote(
            worker_id, wcfg), pg
    except BaseException:
        ray.util.remove_placement_group(pg)
        raise


class ClusterStartError(RuntimeError):
    """A worker or the router failed to start; the message names the first cause
    (e.g. a KV layout mismatch between a prefill and a decode worker)."""


def kv_secret() -> str:
    """The cluster secret of a start that was given none: $PDSERVE_KV_SECRET (kept across
    starts, so the disk KV tier's entries are read by the next one too), else a new
    random one per start."""
    return os.environ.get("PDSERVE_KV_SECRET") or secrets.token_hex(32)


class Cluster:
    def __init__(self, config: ClusterConfig):
        self.config = config
        self.port: int | None = None
        self.http_port: int | None = None   # the OpenAI-compatible HTTP API's, when on
        self.router = None              # routers[0]: Admin calls, status
        self.routers: list = []         # every router replica (ClusterConfig.num_routers)
        self.prefill: list = []
        self.decode: list = []
        self._owns_ray = False
        self._core_share_dir: str | None = None   # pdserve/core_share.py, this start's
        self._ray_processes: list[psutil.Process] = []   # GCS, raylet... when _owns_ray
        self._placement_groups: list = []   # one per tensor-parallel worker (tp_group.py)
        self._cpu_limit_group: str | None = None   # pdserve/cpu_limit.py, this start's
        self._watch: threading.Thread | None = None  # _watch_routers
        self._router_args: list = []    # ObjectRefs of the router's constructor arguments
        self._watch_stop = threading.Event()

    def start(self) -> int:
        """Start Ray (if needed), the workers and the router. Returns the gRPC port;
        `http_port` is then the HTTP API's (config.router.http_port set) or None.

        Raises:
            ray.exceptions.RayActorError / GetTimeoutError: a worker failed to start.
        """
        from .router.router import Router

        cfg = self.config
        if cfg.prefill.kv_secret is None and cfg.decode.kv_secret is None:
            # KV ports pair only with peers proving this (kv_transfer/auth.py), and the
            # disk KV tier's entries are keyed by it (engine/kv_disk_tier.py)
            secret = kv_secret()
            cfg = replace(cfg, prefill=replace(cfg.prefill, kv_secret=secret),
                          decode=replace(cfg.decode, kv_secret=secret))
        if cfg.lends_idle_prefill_cores():
            self._core_share_dir = _core_share_dir()
            cfg = replace(cfg, prefill=replace(cfg.prefill, core_share_dir=self._core_share_dir),
                          decode=replace(cfg.decode, core_share_dir=self._core_share_dir))
        if cfg.prefill.cpu_limit or cfg.decode.cpu_limit:
            self._cpu_limit_group = cpu_limit.group_name()
            cfg = replace(cfg, prefill=replace(cfg.prefill, cpu_limit_group=self._cpu_limit_group),
                          decode=replace(cfg.decode, cpu_limit_group=self._cpu_limit_group))
        if not ray.is_initialized():
            with _keep_signal_handlers():
                if cfg.ray_address is None:
                    before = {p.pid for p in psutil.Process().children()}
                    ray.init(num_cpus=os.cpu_count(), include_dashboard=False,
                             namespace=f"pdserve-{uuid.uuid4().hex[:8]}", log_to_driver=True,
                             configure_logging=False)
                    self._owns_ray = True
                    self._ray_processes = [p for p in psutil.Process().children()
                                           if p.pid not in before]
                else:
                    ray.init(address=cfg.ray_address, namespace="pdserve")
        opts = {"num_cpus": 0, "max_concurrency": 1000}
        try:
            for role, n, workers in (("decode", cfg.num_decode_workers, self.decode),
                                     ("prefill", cfg.num_prefill_workers, self.prefill)):
                for i in range(n):
                    handle, pg = start_worker(cfg, role, f"{role}-{i}")
                    workers.append(handle)
                    self._placement_groups += [pg] if pg is not None else []
        except ray.exceptions.GetTimeoutError as e:
            self.stop()
            raise ClusterStartError(f"a tensor-parallel worker's ranks cannot be placed on "
                                    f"one node: {e}") from e
        # The router serves gRPC and /metrics where `serve` runs (the head: its Service,
        # security group and port-forwards point there), never on a worker node.
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(),
                                              soft=False)
        # Ray restarts a router whose process died (max_task_retries 0: a call in flight
        # fails, the client retries); _watch_routers starts it on the same ports.
        # ...from its constructor's arguments, which Ray keeps in the object store: held
        # here, so they outlive the call (ray-project/ray#53727)
        self._router_args = [ray.put(a) for a in (cfg, self.prefill, self.decode)]
        self.routers = [ray.remote(Router).options(
            name="router" if i == 0 else f"router-{i}", scheduling_strategy=here,
            max_restarts=cfg.max_router_restarts, max_task_retries=0, **opts).remote(
                *self._router_args, i) for i in range(cfg.num_routers)]
        self.router = self.routers[0]
        try:
            self.port = ray.get(self.router.start.remote(), timeout=STARTUP_TIMEOUT_S)
            if cfg.router.http_port is not None:
                self.http_port = ray.get(self.router.http_port.remote(), timeout=30)
            ports = [ray.get(self.router.serving.remote(), timeout=30)]
            shared = {k: v for k, v in ports[0].items() if k != "metrics"}
            ray.get([r.start.remote(shared) for r in self.routers[1:]],
                    timeout=STARTUP_TIMEOUT_S)       # replicas: the same gRPC and HTTP ports
            ports += ray.get([r.serving.remote() for r in self.routers[1:]], timeout=30)
        except BaseException as e:
            self.stop()         # a worker failed to start: do not leave the others running
            if isinstance(e, ray.exceptions.RayTaskError):
                cause = e.cause if e.cause is not None else e
                raise ClusterStartError(f"{type(cause).__name__}: {cause}") from e
            raise
        self._watch_stop.clear()
        self._watch = threading.Thread(target=self._watch_routers,
                                       args=(list(zip(self.routers, ports)),),
                                       name="pdserve-router-watch", daemon=True)
        self._watch.start()
        return self.port

    def _watch_routers(self, routers: list[tuple[object, dict[str, int]]]) -> None:
        """Until stop(): ask each router (handle, its ports) every ROUTER_WATCH_S whether
        it serves; one that Ray restarted after its process died (a kill -9, the OOM
        killer, a native crash in a tokenizer) is started again on its ports, its
        previous incarnation's. A call in flight when it died failed on its client
        (gRPC UNAVAILABLE); new connections go to the other replicas meanwhile, or are
        refused until it serves again when it is the only one. A router that Ray gave
        up restarting (max_router_restarts) is logged."""
        dead_logged: set[int] = set()
        while not self._watch_stop.wait(ROUTER_WATCH_S):
            for i, (router, ports) in enumerate(routers):
                if self._watch_stop.is_set():
                    return
                try:
                    serving = ray.get(router.serving.remote(), timeout=ROUTER_CALL_TIMEOUT_S)
                except ray.exceptions.GetTimeoutError:   # restarting, or its loop is busy
                    continue
                except ray.exceptions.RayActorError as e:
                    if i not in dead_logged:
                        logger.error("router %d died (%s); Ray restarts it unless it ran "
                                     "out of max_router_restarts", i, e.__class__.__name__)
                        dead_logged.add(i)
                    continue
                except Exception as e:   # Ray going away
                    logger.debug("router watch: %r", e)
                    continue
                dead_logged.discard(i)
                if serving is None and not self._watch_stop.is_set():
                    self._restart_router(i, router, ports)

    def _restart_router(self, i: int, router, ports: dict[str, int]) -> None:
        logger.warning("router %d was restarted (its process died): starting it on gRPC %s",
                       i, ports.get("grpc"))
        t = time.monotonic()
        try:
            ray.get(router.start.remote(ports, restarted=True), timeout=STARTUP_TIMEOUT_S)
        except Exception as e:    # the next round asks again
            logger.error("starting restarted router %d failed: %r", i, e)
            return
        logger.warning("router %d serving again after %.1f s", i, time.monotonic() - t)

    def stop(self) -> None:
        """Stop serving, shut the workers down, and stop Ray if this cluster started it.

        When the Ray processes this cluster started are already gone (a SIGTERM to the
        whole process group, as systemd's stop sends, reaches GCS and the raylet too, and
        the actors die with them), there is nothing to call: only Ray's driver state is
        shut down, so the process exits cleanly instead of waiting on dead actors."""
        self._watch_stop.set()          # before the router stops: not restarted then
        if self._watch is not None:
            self._until(self._watch.is_alive, ROUTER_CALL_TIMEOUT_S + 5)
            self._watch = None
        if self._owns_ray and not self._ray_alive():
            logger.info("Ray's processes have exited (signalled with this process's group); "
                        "the workers went with them")
        else:
            self._stop_actors()
            for pg in self._placement_groups:
                try:
                    ray.util.remove_placement_group(pg)
                except Exception as e:     # Ray went away meanwhile: nothing to release
                    logger.debug("placement group not removed: %s", e)
        self.router, self.routers, self.prefill, self.decode = None, [], [], []
        self._router_args, self._placement_groups = [], []
        if self._core_share_dir is not None:
            shutil.rmtree(self._core_share_dir, ignore_errors=True)
            self._core_share_dir = None
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray, self._ray_processes = False, []
        if self._cpu_limit_group is not None:     # once the workers' processes are gone
            cpu_limit.remove_group(self._cpu_limit_group)
            self._cpu_limit_group = None

    def _stop_actors(self) -> None:
        """The router first (no new requests), then each worker; a call that fails is
        logged and the rest go on, unless Ray itself went away meanwhile."""
        calls = [("router stop", r, lambda a: a.stop.remote(), 10) for r in self.routers]
        calls += [("worker shutdown", w, lambda a: a.shutdown.remote(), 15)
                  for w in self.prefill + self.decode]
        for what, actor, call, timeout_s in calls:
            if self._owns_ray and not self._ray_alive():
                logger.info("Ray's processes exited while stopping; the workers went with them")
                return
            ref = call(actor)
            try:
                if self._until(lambda: not ray.wait([ref], timeout=0)[0], timeout_s):
                    ray.get(ref)
                else:
                    logger.warning("%s: no answer in %.0f s, or Ray went away", what, timeout_s)
            except Exception as e:  # a dead router must not keep the workers alive
                logger.warning("%s failed: %s", what, e)
        for a in [*self.routers, *self.prefill, *self.decode]:
            ray.kill(a)

    def _until(self, pending, timeout_s: float) -> bool:
        """Wait while `pending()` holds, `timeout_s` seconds at most, and no longer once
        the Ray processes this cluster started have exited (a SIGTERM to the whole process
        group: nothing will answer). Returns whether `pending()` stopped holding."""
        deadline = time.monotonic() + timeout_s
        while pending():
            if time.monotonic() > deadline or (self._owns_ray and not self._ray_alive()):
                return False
            time.sleep(0.05)
        return True

    def _ray_alive(self) -> bool:
        """Whether every process `ray.init` started for this cluster still runs."""
        try:
            return all(p.is_running() and p.status() != psutil.STATUS_ZOMBIE
                       for p in self._ray_processes)
        except psutil.NoSuchProcess:
            return False
    def __enter__(self) -> "Cluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class _keep_signal_handlers:
    """Keep this process's SIGTERM/SIGINT handlers across `ray.init`, which replaces them
    (Python's with `sys.exit`, and a C-level failure handler that dumps a stack and
    aborts the driver on SIGTERM): the caller's shutdown (`pdserve serve`'s) must run."""

    _SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __enter__(self):
        self._main = threading.current_thread() is threading.main_thread()
        self._saved = {s: signal.getsignal(s) for s in self._SIGNALS} if self._main else {}

    def __exit__(self, *exc) -> None:
        for sig, handler in self._saved.items():
            if handler is not None:     # None: set from C, not restorable from Python
                signal.signal(sig, handler)
