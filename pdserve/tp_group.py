"""A tensor-parallel worker's ranks on Ray (docs/tensor_parallel.md): one placement group
per worker, STRICT_PACK, one bundle per rank, so every rank runs on one node; rank 0 (the
worker actor, in bundle 0) starts ranks 1..N-1 as TPRank actors in the other bundles,
owned by it, and all join one torch.distributed group (gloo on CPU, NCCL on CUDA)
through a TCP store on the node's loopback (every rank is on that node).

    Cluster          placement_group(size, resources) -> the worker's group of bundles
    rank 0           start_ranks(config) inside its actor: TPRank actors + joins as 0;
                     wraps its runner in engine/tp_executor.py TPLeader
    rank i           TPRank: its shard of the model and its KV cache; follows rank 0's
                     step orders on a thread

Failure: Ray kills the actors an actor owns when it dies, so a killed rank 0 takes its
ranks with it and Ray's restart of rank 0 builds a new group. A rank that dies closes
its connections: rank 0's next collective raises (tp_executor.TPGroupBroken), and rank
0 must then exit so Ray restarts the group as a whole; a TPRank whose group breaks
exits at once. GROUP_TIMEOUT_S bounds a collective waiting on a rank that hangs
without dying; it is long enough for every rank to load its shard, and an idle rank 0
sends heartbeats well within it (TPLeader).
"""

from __future__ import annotations

import datetime
import functools
import logging
import os
import threading

import ray
import torch
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from .config import WorkerConfig
from .engine.parallel import TensorParallel
from .kv_transfer.tp_plan import rank_layout, rank_targets

logger = logging.getLogger(__name__)

GROUP_TIMEOUT_S = 300.0    # a collective waiting longer than this on a hung rank raises


def placement_group(size: int, resources: dict[str, float] | None = None,
                    num_gpus: float = 0, name: str = "") -> PlacementGroup:
    """The bundles of one worker of `size` ranks, packed on one node: each holds
    `num_gpus`; bundle 0 (rank 0's) also the worker's `resources` (Ray custom resources,
    which pick its node). Returns it once Ray has reserved it.

    Raises:
        ray.exceptions.GetTimeoutError: no node can hold all the bundles within 60 s.
    """
    gpu = {"GPU": num_gpus} if num_gpus else {}
    first = {"CPU": 0.001} | dict(resources or {}) | gpu     # the node is rank 0's choice
    pg = ray.util.placement_group([first] + [{"CPU": 0.001} | gpu] * (size - 1),
                                  strategy="STRICT_PACK", name=name)
    try:
        ray.get(pg.ready(), timeout=60)
    except BaseException:
        ray.util.remove_placement_group(pg)   # else it takes the resources when they come
        raise
    return pg


def in_bundle(pg: PlacementGroup, index: int) -> PlacementGroupSchedulingStrategy:
    """Ray's scheduling strategy for an actor in bundle `index` of `pg`."""
    return PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index,
                                            placement_group_capture_child_tasks=False)


def open_store(size: int) -> torch.distributed.TCPStore:
    """Rank 0's TCP store for a group of `size` ranks, listening on a loopback port the
    kernel picks (`.port`), open before any other rank starts: a port probed free and
    bound later can be taken in between (EADDRINUSE, and the other ranks wait out
    GROUP_TIMEOUT_S on a store that never opened)."""
    return torch.distributed.TCPStore("127.0.0.1", 0, size, is_master=True,
                                      timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S),
                                      wait_for_workers=False)


def join(rank: int, size: int, store_port: int, device: str,
         store: torch.distributed.TCPStore | None = None) -> TensorParallel:
    """Join the worker's group as `rank` through rank 0's store on loopback port
    `store_port` (rank 0 passes the `store` itself, from open_store); blocks until every
    rank has joined.

    Raises:
        torch.distributed.DistError: the group did not form within GROUP_TIMEOUT_S.
    """
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "gloo":   # every rank is on this node (STRICT_PACK): loopback, not the
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")   # hostname's address (a netns)
    timeout = datetime.timedelta(seconds=GROUP_TIMEOUT_S)
    if store is None:
        store = torch.distributed.TCPStore("127.0.0.1", store_port, size, is_master=False,
                                           timeout=timeout)
    torch.distributed.init_process_group(backend, store=store, rank=rank, world_size=size,
                                         timeout=timeout)
    return TensorParallel(rank, size, torch.distributed.group.WORLD)


def rank_cpus(cpus: tuple[int, ...] | None, size: int, rank: int) -> tuple[int, ...] | None:
    """Rank `rank`'s share of the worker's pinned CPUs (an even split, in order); None
    when the worker is not pinned, or has fewer CPUs than ranks (then all share them)."""
    if cpus is None or len(cpus) < size:
        return cpus
    per = len(cpus) // size
    return tuple(cpus[rank * per:(rank + 1) * per])


class TPRank:
    """Ray actor: rank `rank` > 0 of worker `worker_id`. It loads its shard, then runs
    rank 0's step orders (tp_executor.follow) on a thread until rank 0 stops them; if
    the group breaks (rank 0 died), the process exits."""

    def __init__(self, worker_id: str, rank: int, size: int, store_port: int,
                 config: WorkerConfig, role: str | None = None, epoch: int = 0):
        from .engine.engine_thread import EngineThread
        from .engine.model_runner import ModelRunner

        logging.basicConfig(level=config.log_level)
        self.worker_id, self.rank = worker_id, rank
        _cap(worker_id, config)
        self.tp = join(rank, size, store_port, config.device)
        # built and stepped on one thread (engine/engine_thread.py)
        self.engine = EngineThread(f"tp-rank-{rank}")
        self.runner = self.engine.call(ModelRunner, config.model, config.cache_config(),
                                       config.num_threads, rank_cpus(config.cpus, size, rank),
                                       tp=self.tp)
        self.config, self.epoch = config, epoch
        # (P rank, KV heads) this rank sends to, for a receiving worker of n ranks
        self.targets = functools.partial(rank_targets, self.runner.config.num_kv_heads,
                                         size, rank)
        self.handler = _handler(role, self.runner, self.tp, config, epoch, self.targets)
        self.pull = None       # a prefill rank's pull receiver (kv_pull)
        if role == "prefill" and config.kv_pull:
            from .kv_transfer.tp_receiver import RankPullReceiver
            self.pull = RankPullReceiver(_receiver(config, self.runner, self.tp, epoch))
        self._pull_tx = None   # to pulling prefill workers' ranks (send_held_kv), lazily
        self._pull_lock = threading.Lock()
        self.tiers = None      # this rank's KV heads of rank 0's tier entries (tp_tiers.py)
        if config.kv_host_cache_gib > 0:
            from .engine.tp_tiers import RankTiers
            self.tiers = RankTiers(worker_tiers(worker_id, config, self.runner, self.tp, None))
        self.calls = 0
        self.engine.start(self._follow)

    def _follow(self) -> None:
        from .engine.tp_executor import follow
        try:
            self.calls = follow(self.runner, self.tp,
                                handlers=(self.handler, self.tiers, self.pull),
                                on_layer_done=getattr(self.handler, "on_layer_done", None))
        except Exception as e:            # rank 0 gone, or a step failed here
            logger.error("%s rank %d: its group broke (%r); exiting", self.worker_id,
                         self.rank, e)
            os._exit(1)
        for handler in (self.handler, self.tiers, self.pull):
            if handler is not None:
                handler.close()
        with self._pull_lock:
            if self._pull_tx is not None:
                self._pull_tx.close()
        torch.distributed.destroy_process_group()

    def ready(self) -> dict:
        """pid, node, the KV heads this rank's cache holds; a decode rank's KV receiver
        address and its reservations still open (0 when idle); a prefill rank's pull
        receiver address and its pulls still open (with kv_pull)."""
        out = {"pid": os.getpid(), "node_ip": ray.util.get_node_ip_address(),
               "kv_heads": tuple(self.tp.kv_heads(self.runner.config)),
               "kv_cache_shape": tuple(self.runner.kv_cache.shape)}
        if hasattr(self.handler, "receiver"):
            out |= {"kv_address": self.handler.address,
                    "kv_reservations": self.handler.receiver.num_active()}
        if self.pull is not None:
            out |= {"pull_address": self.pull.address,
                    "pulls": self.pull.receiver.num_active()}
        return out

    def kv_address(self) -> tuple[str, int]:
        """A decode rank's KV receiver (kv_transfer/tp_receiver.py)."""
        return self.handler.address

    def kv_expect(self, request_id: str, block_ids: list[int], seq: int) -> None:
        self.handler.kv_expect(request_id, block_ids, seq)

    def kv_forget(self, request_id: str, seq: int, lease_timeout_s: float | None = None) -> None:
        self.handler.kv_forget(request_id, seq, lease_timeout_s)

    def pull_address(self) -> tuple[str, int]:
        """A prefill rank's pull receiver (kv_pull)."""
        return self.pull.address

    def pull_expect(self, request_id: str, block_ids: list[int], seq: int) -> None:
        self.pull.kv_expect(request_id, block_ids, seq)

    def pull_forget(self, request_id: str, seq: int, lease_timeout_s: float | None = None
                    ) -> None:
        self.pull.kv_forget(request_id, seq, lease_timeout_s)

    @ray.method(concurrency_group="kv_pull")
    def send_held_kv(self, order, blocks: list[int], expires: float | None = None) -> int:
        """Send a pulling prefill worker's ranks this rank's KV heads of `blocks`, which
        rank 0 holds for `order` (a KVPullOrder) until this returns: every layer, then
        DONE for those heads (prefill_worker/kv_pull.py send_held_blocks; no layer after
        `expires`, rank 0's pull_expiry). Returns the payload bytes sent. Raises what the sender raised (the ranks it sends to were
        sent ABORT where they could be reached). Runs beside the step orders (its own
        concurrency group): the blocks are held, no step writes them."""
        from .prefill_worker.kv_pull import send_held_blocks

        with self._pull_lock:
            if self._pull_tx is None:
                self._pull_tx = _sender(self.config, self.runner, self.tp, self.epoch)
        return send_held_blocks(self._pull_tx, order, blocks, self.runner.config.num_layers,
                                self.targets, expires)

    def stopped(self, timeout_s: float = 10.0) -> int:
        """Wait for the step-order loop to end (rank 0's stop()); the calls it ran."""
        self.engine.close(timeout_s)
        return self.calls


def _handler(role: str | None, runner, tp: TensorParallel, config: WorkerConfig,
             epoch: int, targets):
    """What a follower runs beside the model for its worker's `role`: a prefill rank
    sends its KV heads to the receiving ranks `targets(n)` names (prefill_worker/rank.py),
    a decode rank receives them (kv_transfer/tp_receiver.py); None: the model calls
    only."""
    if role is None:
        return None
    if role == "decode":
        from .kv_transfer.tp_receiver import RankReceiver

        return RankReceiver(_receiver(config, runner, tp, epoch))
    from .prefill_worker.rank import PrefillRankKV

    return PrefillRankKV(_sender(config, runner, tp, epoch), runner.config.num_layers,
                         targets)


def _receiver(config: WorkerConfig, runner, tp: TensorParallel, epoch: int):
    """A KV receiver over this rank's cache (its layout: its KV heads), not started."""
    from .kv_transfer import make_receiver

    model = runner.config
    return make_receiver(
        config.transport, runner.kv_cache,
        rank_layout(runner.kv_cache, model.model_id, model.num_kv_heads, tp), epoch,
        host=config.node_host(), secret=config.kv_secret)


def _sender(config: WorkerConfig, runner, tp: TensorParallel, epoch: int):
    """A KV sender over this rank's cache (its layout: its KV heads)."""
    from .kv_transfer import make_sender

    model = runner.config
    return make_sender(config.transport, runner.kv_cache,
                       rank_layout(runner.kv_cache, model.model_id, model.num_kv_heads, tp),
                       checksum=config.kv_checksum, secret=config.kv_secret, epoch=epoch,
                       host=config.node_host())


def rank_addresses(ranks, method: str = "kv_address") -> tuple[tuple[str, int], ...]:
    """The KV receivers' addresses of ranks 1..N-1 (TPRank.kv_address, or
    TPRank.pull_address: a prefill rank's pull receiver)."""
    return tuple(tuple(a) for a in ray.get([getattr(r, method).remote() for r in ranks]))


def worker_tiers(worker_id: str, config: WorkerConfig, runner, tp: TensorParallel, pool,
                 notify=None):
    """This rank's KV tiers under its cache (engine/kv_tiers.py): config's host size
    split evenly over the tp.size ranks (each holds its KV heads of every entry), its
    disk directory's bound shared by every live slab there (a rank's among them);
    `pool`: rank 0's block pool, None on a follower rank. Raises what KVTiers raises."""
    from .engine.kv_disk_tier import disk_key
    from .engine.kv_tiers import KVTiers, fingerprint

    model = runner.config
    fp = fingerprint(model.model_id, runner.kv_cache, runner.model_dir, tp.rank, tp.size,
                     tp.kv_heads(model))
    return KVTiers(pool, runner.kv_cache, fp, config.kv_host_cache_gib / tp.size,
                   config.kv_disk_cache_dir, config.kv_disk_cache_gib,
                   name=worker_id, notify=notify, key=disk_key(config.kv_secret),
                   load_timeout_s=config.kv_tier_load_timeout_s,
                   reclaim_after_s=config.kv_disk_reclaim_after_s)


def model_config(model: str):
    """The engine's ModelConfig of `model` (a name, directory or .gguf), from its HF
    config alone (no weights loaded)."""
    from .engine.config import ModelConfig
    from .engine.loader import resolve_model

    return ModelConfig.of(resolve_model(model))


def check_model(model: str, size: int) -> None:
    """Raises ValueError naming the model field that `size` ranks cannot split (before
    any rank starts: a rank that fails to load would leave the others waiting)."""
    TensorParallel(0, size, group=object()).check(model_config(model))


def start_ranks(worker_id: str, config: WorkerConfig, pg: PlacementGroup | None = None,
                role: str | None = None, epoch: int = 0) -> tuple[TensorParallel, list]:
    """Rank 0's part, called inside its actor: start ranks 1..N-1 (N =
    config.tensor_parallel_size) in bundles 1..N-1 of `pg` (default: the placement
    group this actor runs in, whose bundle 0 it holds), and join the group with them.
    `role` ("prefill", "decode"; None: the model only) says what the ranks do beside it,
    `epoch` is the worker's (its KV handshakes). Returns (this rank's TensorParallel,
    their handles).

    Raises:
        ValueError: the model's heads, columns or vocabulary do not split N ways.
        RuntimeError: no placement group of N bundles (Cluster places a
            tensor-parallel worker in one).
    """
    size = config.tensor_parallel_size
    check_model(config.model, size)
    pg = pg or ray.util.get_current_placement_group()
    if pg is None or len(pg.bundle_specs) != size:
        raise RuntimeError(f"{worker_id}: tensor_parallel_size={size} needs the worker in a "
                           f"placement group of {size} bundles (tp_group.placement_group)")
    store = open_store(size)           # every rank is on this node
    gpus = 1 if config.device.startswith("cuda") else 0      # placement_group(num_gpus=1)
    # send_held_kv in a group of its own: a pull's send never waits behind kv_expect
    actor = ray.remote(concurrency_groups={"kv_pull": 2})(TPRank)
    ranks = [actor.options(num_cpus=0, max_restarts=0, num_gpus=gpus,
                           scheduling_strategy=in_bundle(pg, r))
             .remote(worker_id, r, size, store.port, config, role, epoch)
             for r in range(1, size)]
    tp = join(0, size, store.port, config.device, store=store)
    logger.info("%s: tensor-parallel group of %d ranks joined", worker_id, size)
    return tp, ranks


def _cap(worker_id: str, config: WorkerConfig) -> None:
    """This process into its worker's CPU cap (WorkerConfig.cpu_limit), if it has one.
    Raises cpu_limit.CpuLimitError when the cap cannot be set."""
    if config.cpu_limit is not None:
        from .cpu_limit import join as join_cap
        path = join_cap(config.cpu_limit_group or "pdserve", worker_id, config.cpu_limit)
        logger.info("%s: capped at %g cores (%s)", worker_id, config.cpu_limit, path)


def worker_runner(worker_id: str, config: WorkerConfig, role: str, epoch: int,
                  on_broken=None, **runner_kw) -> tuple[TensorParallel, list, object]:
    """A worker's model runner, built by its actor (rank 0): with
    config.tensor_parallel_size N > 1, ranks 1..N-1 started first (start_ranks, `role`
    and `epoch` for their KV endpoints) and the runner a TPLeader over this rank's
    shard (`on_broken(error)`: its idle heartbeat found a rank gone). `runner_kw` go to
    ModelRunner. The KV pool's size is resolved here, before any rank allocates it
    (kv_memory.resolve_kv_blocks), so every rank holds the same blocks. Returns (tp,
    the ranks' handles, runner).
    Raises what resolve_kv_blocks, start_ranks and ModelRunner raise."""
    from .engine.model_runner import ModelRunner
    from .engine.parallel import SINGLE
    from .engine.tp_executor import TPLeader
    from .kv_memory import resolve_kv_blocks

    _cap(worker_id, config)
    if config.num_kv_blocks is None:
        config = resolve_kv_blocks(config, model_config(config.model))
    tp, ranks = SINGLE, []
    if config.tensor_parallel_size > 1:
        tp, ranks = start_ranks(worker_id, config, role=role, epoch=epoch)
    runner = ModelRunner(config.model, config.cache_config(), config.num_threads,
                         rank_cpus(config.cpus, tp.size, 0), tp=tp, **runner_kw)
    return tp, ranks, runner if tp.size == 1 else TPLeader(runner, tp, on_broken=on_broken)
