"""What a prefill and a decode worker share as Ray actors: the model runner built,
warmed up and stepped on one EngineThread, the KV block pool (its fresh pages committed
ahead, engine/kv_prefault.py), the epoch, /metrics, drain, and the step loop::

    while not stopped:
        calls queued for the step thread run (engine_thread.py)
        out = _schedule()           the worker's scheduler: a SchedulerOutput
        _step(out) if it has rows   ModelRunner.execute, then update_from_output
        else _idle()                wait for news (new work, KV arrivals)

A subclass names its `role` and defines _schedule, _step, _idle, _metric_values and
_close (what it closes besides the engine)."""

from __future__ import annotations

import abc
import asyncio
import functools
import logging
import os
import threading
import uuid
from collections.abc import Callable

import ray

from .config import WorkerConfig
from .core_share import CompileActivity
from .engine.block_pool import BlockPool
from .engine.engine_thread import EngineThread
from .engine.kv_prefault import prefault_pool
from .engine.tp_tiers import TPTiers
from .engine.outputs import SchedulerOutput
from .kv_transfer import make_sender
from .kv_transfer.tp_plan import rank_layout, rank_targets
from . import tracing
from .messages import CacheEvents, KVPullOrder, WorkerInfo
from .prefill_worker.kv_pull import send_held_blocks
from .metrics import WorkerMetrics, serve as serve_metrics
from .tp_group import worker_runner, worker_tiers

logger = logging.getLogger(__name__)


# WorkerStatus's names of the tier counters whose /metrics names differ (kv_tier_*)
_TIER_STATUS_FIELDS = {"host_hits": "host_hit_blocks", "disk_hits": "disk_hit_blocks",
                       "dropped": "dropped_blocks"}


class EngineActor(abc.ABC):
    """Base of PrefillWorker and DecodeWorker; see the module docstring. `runner_kw` go
    to ModelRunner (tp_group.worker_runner). Raises what worker_runner raises."""

    role = ""     # "prefill" | "decode"

    def __init__(self, worker_id: str, config: WorkerConfig, **runner_kw):
        tracing.configure_logging(config.log_level)
        self.worker_id, self.config = worker_id, config
        tracing.configure(config.otlp_traces_endpoint, f"pdserve-{self.role}",
                          attributes={"pdserve.worker_id": worker_id})
        self.epoch = uuid.uuid4().int & (2**63 - 1)   # this incarnation (new on Ray restart)
        self.draining = False            # drain(): no new requests from any router
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()   # the step loop's: new work, or KV news
        # one thread builds, warms up and steps the runner: one OpenMP team per process
        self.engine = EngineThread(f"{self.role}-step", wake=self._wake.set)
        # tensor-parallel: ranks 1..N-1 follow the runner's step calls (tp_executor.py)
        self.tp, self._ranks, self.runner = self.engine.call(
            worker_runner, worker_id, config, self.role, self.epoch, self._group_broken,
            **runner_kw)
        self.pool = BlockPool(self.runner.cache_config.num_blocks)
        self.prefault = prefault_pool(self.pool, self.runner.kv_cache)
        model = self.runner.config
        self.kv_layout = rank_layout(self.runner.kv_cache, model.model_id,
                                     model.num_kv_heads, self.tp)
        self.compile_flag = CompileActivity.on(config.core_share_dir, worker_id)
        self._pull_tx = None             # to prefill workers' pull receivers (lazily)
        self._pull_targets = functools.partial(rank_targets, model.num_kv_heads,
                                               self.tp.size, 0)
        self._pull_lock = threading.Lock()
        self.tiers = None              # host and disk KV tiers below the pool (kv_tiers.py)
        if config.kv_host_cache_gib > 0:
            self.tiers = worker_tiers(worker_id, config, self.runner, self.tp, self.pool,
                                      self._wake.set)
            if self.tp.size > 1:       # the ranks' tiers follow rank 0's (tp_tiers.py)
                self.tiers = TPTiers(self.tiers, self.runner, self.tp.size,
                                     self._group_broken, self._wake.set)

    def _serve_metrics(self) -> None:
        """/metrics of this worker (pdserve/metrics.py), its values from _metric_values."""
        self.metrics = WorkerMetrics(self.role, self._metric_values)
        self.metrics_address = "%s:%d" % serve_metrics(
            self.metrics.registry, self.config.node_host(), self.config.metrics_port)

    # --- RPCs -------------------------------------------------------------------------

    async def cache_events(self, since: int, tier_since: int = 0) -> CacheEvents:
        """Prefix-cache changes after event `since` (engine/block_pool.py) and KV-tier
        changes after tier event `tier_since` (engine/kv_tiers.py), each a snapshot when
        too old; the router polls it (routing.py: kv_aware and kv_pull over prefill
        workers, cache_aware over decode workers)."""
        seq, events, snapshot = self.pool.cache_events(since)
        if self.tiers is None:
            return CacheEvents(self.epoch, seq, events, snapshot)
        return CacheEvents(self.epoch, seq, events, snapshot, *self.tiers.cache_events(tier_since))

    async def ready(self) -> WorkerInfo:
        self._loop = asyncio.get_running_loop()
        return WorkerInfo(self.worker_id, self.role, self.epoch, self.pool.num_blocks,
                          self.runner.block_size, ray.util.get_node_ip_address(),
                          *self._kv_endpoints(), draining=self.draining)

    async def drain(self) -> None:
        """Take no new request from any router (ready() says so to the replicas that
        did not drain it: router/admin.py sync_members); until it restarts."""
        self.draining = True

    async def ranks(self) -> list[dict]:
        """Ranks 1..N-1 of a tensor-parallel worker: pid, node, KV heads and KV endpoint
        each (tp_group.TPRank.ready); [] at TP 1."""
        return [await r.ready.remote() for r in self._ranks]

    async def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        self.engine.close(timeout_s=10)
        if self.prefault is not None:
            self.prefault.close()
        if self.tp.size > 1:
            self.runner.stop()       # the ranks' loops end; Ray kills them with this actor
        self._close()
        self.compile_flag.close()

    # --- the step thread ----------------------------------------------------------------

    def _step_loop(self) -> None:
        while not self._stop.is_set():
            self.engine.run_calls()
            out = self._schedule()
            if out.requests:
                self._step(out)
            else:
                self._idle()

    @abc.abstractmethod
    def _schedule(self) -> SchedulerOutput:
        """See the module docstring."""

    @abc.abstractmethod
    def _step(self, out: SchedulerOutput) -> None:
        """See the module docstring."""

    @abc.abstractmethod
    def _idle(self) -> None:
        """See the module docstring."""

    @abc.abstractmethod
    def _metric_values(self) -> dict[str, float]:
        """See the module docstring."""

    @abc.abstractmethod
    def _close(self) -> None:
        """See the module docstring."""

    def _tier_values(self, status: bool = False) -> dict:
        """The KV tiers' counters by /metrics name (pdserve/metrics.py), or with
        `status` by WorkerStatus field; {} without tiers."""
        if self.tiers is None:
            return {}
        st, disk = self.tiers.stats, self.tiers.disk
        values = {"host_hits": st.host_hits, "disk_hits": st.disk_hits,
                  "bytes_loaded": st.bytes_loaded, "load_seconds": st.load_seconds,
                  "dropped": st.dropped, "disk_writes_dropped": st.disk_writes_dropped,
                  "loads_timed_out": st.loads_timed_out,
                  "host_blocks": len(self.tiers.host.index),
                  "disk_blocks": 0 if disk is None else len(disk.index)}
        names = _TIER_STATUS_FIELDS if status else {}
        return {"kv_tier_" + names.get(k, k): v for k, v in values.items()}

    async def _send_held_kv(self, order: KVPullOrder, blocks: list[int] | None,
                            release: Callable[[list[int]], None],
                            expires: float | None = None) -> int:
        """Send a prefill worker's pull receivers the K/V of `blocks` (held for `order`;
        None: this worker does not hold them), every layer, then DONE with no token
        (prefill_worker/kv_pull.py send_held_blocks: the frames and checks of a
        prefill's send; a tensor-parallel worker's every rank its KV heads, at once);
        `release(blocks)` once every rank sent or failed. Returns the payload bytes
        sent; 0 when nothing was sent or a rank failed (P's rank 0 is sent ABORT where
        it can be reached; the pulling worker gives up on a 0 either way and computes
        the blocks); no layer is sent after `expires` (pull_expiry, taken when the
        order came). Used by send_prompt_kv of both roles."""
        addr, pull_id, epoch = tuple(order.kv_address), order.pull_id, order.epoch
        reason = f"{self.worker_id} no longer holds those blocks of {order.request_id}"
        if blocks is not None:
            calls: list = [asyncio.to_thread(lambda: send_held_blocks(
                self._pull_sender(), order, blocks, self.runner.config.num_layers,
                self._pull_targets, expires))]
            for rank in self._ranks:
                try:
                    calls.append(rank.send_held_kv.remote(order, blocks, expires))
                except Exception as e:      # not made: that rank's share failed
                    calls.append(asyncio.sleep(0, e))
            sends = asyncio.gather(*calls, return_exceptions=True)
            try:
                shares = await asyncio.shield(sends)
            finally:
                if not sends.done():   # cancelled: the ranks may still read the blocks
                    await asyncio.wait([sends])
                release(blocks)
            errors = [(rank, e) for rank, e in enumerate(shares) if isinstance(e, BaseException)]
            if not errors:
                return sum(shares)
            reason = "; ".join(f"rank {rank}: {type(e).__name__}: {e}" for rank, e in errors)
            logger.warning("prompt KV of %s not sent to %s: %s", order.request_id, addr, reason)
        try:
            await asyncio.to_thread(self._pull_sender().send_abort, addr, pull_id, epoch, reason)
        except Exception as e:      # unreachable: the puller gives up on the 0 returned
            logger.debug("ABORT of %s not sent to %s: %s", pull_id, addr, e)
        return 0

    def _pull_sender(self):
        """The KV sender to prefill workers' pull receivers, made on first use (beside
        a prefill worker's sender to decode workers, used by its step thread)."""
        with self._pull_lock:
            if self._pull_tx is None:
                self._pull_tx = make_sender(
                    self.config.transport, self.runner.kv_cache, self.kv_layout,
                    checksum=self.config.kv_checksum, secret=self.config.kv_secret,
                    epoch=self.epoch, host=self.config.node_host())
            return self._pull_tx

    def _close_pull_sender(self) -> None:
        with self._pull_lock:
            if self._pull_tx is not None:
                self._pull_tx.close()

    def _kv_endpoints(self) -> tuple:
        """(kv_address, kv_rank_addresses) for WorkerInfo: a decode worker's receivers."""
        return None, ()

    def _group_broken(self, e: Exception) -> None:
        """A rank is lost (or out of step): exit, so Ray restarts this actor and its
        ranks as a whole (new epoch; the router retries what was in flight)."""
        logger.critical("%s: %s; exiting so Ray restarts the worker's ranks as a whole",
                        self.worker_id, e)
        logging.shutdown()
        os._exit(1)
