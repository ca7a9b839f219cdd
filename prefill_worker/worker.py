"""Prefill worker: a Ray actor that batches prompts, runs full-attention prefill, and
streams each layer's KV to the decode worker that reserved blocks for it.

Request lifecycle here (see scheduler.py):

    router ── prefill(PrefillOrder) (pdserve/messages.py) ──▶ queue
    step thread:  schedule() (prefix-cache lookup, chunking) → SchedulerOutput →
                  ModelRunner.execute(out, on_layer_done), computing each prompt's next
                  uncached chunk and sampling the first token of each prompt it completes
                  on_layer_done(i): layer i of the blocks each chunk completed (that D
                  lacks: D's cached prefix is skipped) → connector.save_layers
                  → update_from_output() → connector.request_finished(first token)
    connector:    (connector.py, its send thread) the layers to D (block_start = the
                  position in D's reserved blocks) while layer i+1 or the next chunk
                  computes; then DONE with the first token, upon which the router's
                  call returns that token (TTFT)
    step thread:  connector.get_finished(), polled each step and between layers: the
                  request's blocks are released (a failed one's call raises)

With kv_pull, a prompt whose leading blocks its decode worker (or another prefill
worker) holds reads them from there into its blocks before it computes the rest
(kv_pull.py; this worker's pull receiver, the holder's send_prompt_kv); this worker
sends another prefill worker the blocks its prefix cache holds (send_prompt_kv).

A transfer failure fails that one request (the router sees KVTransferError); the
worker keeps serving.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time

import ray
import torch

from .. import tracing
from ..config import WorkerConfig
from ..core_share import PrefillActivity
from ..engine.block_pool import blocks_needed
from ..engine.input_batch import PrefillSeq
from ..engine.outputs import SchedulerOutput
from ..engine.request import RequestState
from ..engine.tp_executor import TPGroupBroken
from ..engine_actor import EngineActor
from ..kv_transfer import KVTransferError, make_sender
from ..kv_transfer.tp_plan import rank_targets
from ..messages import (KVPullOrder, PrefillOrder, PrefillResult, StepStats,
                        WorkerStatus)
from ..request_ids import router_of
from .connector import PrefillKVConnector
from .kv_pull import pull_expiry, worker_pulls
from .rank import PrefillRanks
from .requests import FinishCause, PrefillAborted, PrefillFailed, PrefillRequest, fail
from . import spans
from .scheduler import PrefillScheduler

__all__ = ["PrefillAborted", "PrefillFailed", "PrefillWorker"]

logger = logging.getLogger(__name__)


class PrefillWorker(EngineActor):
    """Ray actor (see cluster.py); methods are called by the router."""

    role = "prefill"

    def __init__(self, worker_id: str, config: WorkerConfig):
        # busy flag a decode worker of this node reads (core_share): published busy before
        # the model loads, so a restarted worker's old "idle" file lends nothing meanwhile
        self.activity = None
        if config.core_share_dir is not None:
            try:
                self.activity = PrefillActivity(config.core_share_dir, worker_id,
                                                config.num_threads)
            except OSError as e:
                logger.warning("idle cores not lent to decode: %s", e)
        super().__init__(worker_id, config,
                         compile_model=config.compile and not config.enforce_eager)
        self.num_layers = self.runner.config.num_layers
        self.pulls = None   # D's cached prompt blocks read into P's (kv_pull.py)
        if config.kv_pull:
            self.pulls = worker_pulls(config, self.runner, self.kv_layout, self.epoch,
                                      self.pool, self._wake.set, self._ranks,
                                      self._group_broken, lambda: self._loop)
        self.scheduler = PrefillScheduler(self.pool, self.runner.block_size,
                                          config.max_num_batched_tokens,
                                          config.enable_prefix_caching,
                                          config.prefill_chunk_size,
                                          config.schedule_policy, self.tiers, self.pulls)
        self.sender = make_sender(config.transport, self.runner.kv_cache, self.kv_layout,
                                  checksum=config.kv_checksum, secret=config.kv_secret,
                                  epoch=self.epoch, host=config.node_host())
        self._serve_metrics()
        self._benching = False   # bench_prefill computing: busy to the node's decode workers
        self.step_stats = StepStats()   # (prompt tokens, seconds) of every step (the planner)
        self.connector = PrefillKVConnector(
            self.sender, self.num_layers, self._wake.set,
            on_done=lambda req, token: self._resolve(
                req, result=PrefillResult(token, req.logprobs, tuple(req.prompt_logprobs),
                                          self.scheduler.active_tokens(but=req))),
            observe_transfer_s=self.metrics.kv_transfer_seconds.observe,
            targets=functools.partial(rank_targets, self.runner.config.num_kv_heads,
                                      self.tp.size, 0))
        # tensor-parallel: the ranks' KV sends, ordered around each step (rank.py)
        self.tp_ranks = (PrefillRanks(self.runner, self.sender, self.tp.size,
                                      self._group_broken) if self.tp.size > 1 else None)
        self._sent: list[PrefillRequest] = []   # transfer ended, a rank still sending
        self.engine.start(self._step_loop)

    # --- RPCs -------------------------------------------------------------------------

    async def pair(self, kv_addresses: list[tuple[str, int]]) -> list[int]:
        """Connect to each decode worker's KV receiver and exchange layouts and epochs.

        Returns the decode workers' epochs. Raises KVLayoutMismatch naming every field
        that differs (block_size, dtype, model_id, ...) with both values; with tensor
        parallelism, every rank pairs, and KVTransferError names a rank that cannot.
        """
        epochs = [await asyncio.to_thread(self.sender.connect, tuple(a)) for a in kv_addresses]
        if self.tp_ranks is not None:      # ranks 1..N-1 send their heads there too
            errors = await asyncio.to_thread(self.tp_ranks.pair, [tuple(a) for a in kv_addresses])
            if errors:
                raise KVTransferError("; ".join(errors))
        return epochs

    async def prefill(self, order: PrefillOrder) -> PrefillResult:
        """Prefill `order.token_ids` into the decode worker's reserved blocks at
        `order.kv_address`; the first `order.num_cached_blocks` prompt blocks are not
        sent (D has them cached: its reserved blocks start after them).

        Returns the first sampled token (and its logprobs, if asked) once every KV frame
        and the done frame are sent.
        Raises:
            ValueError: the prompt does not fit this worker's block pool,
                num_cached_blocks is not below the prompt's block count, or the
                structured output's grammar does not compile.
            KVTransferError: sending to the decode worker failed.
            PrefillFailed: the model step computing the prompt raised.
            PrefillAborted: abort(request_id) was called first.
        """
        num_blocks = blocks_needed(len(order.token_ids), self.runner.block_size)
        if not 0 <= order.num_cached_blocks < num_blocks:
            raise ValueError(f"num_cached_blocks={order.num_cached_blocks} must be in "
                             f"[0, {num_blocks}) for a prompt of {len(order.token_ids)} tokens")
        self._loop = asyncio.get_running_loop()
        so = order.params.structured_outputs
        grammar = None if so is None else await self._compile(so)
        req = PrefillRequest(order.request_id, list(order.token_ids), order.params,
                             tuple(order.kv_address), order.epoch,
                             future=self._loop.create_future(),
                             num_cached_blocks=order.num_cached_blocks,
                             kv_rank_addresses=tuple(map(tuple, order.kv_rank_addresses)),
                             kv_source=order.kv_source, kv_peer=order.kv_peer,
                             peer_blocks=order.peer_blocks,
                             grammar=grammar)
        req.span = span = spans.start(self.worker_id, order, req)
        tracing.set_log_request(order.request_id, span)
        try:
            self.scheduler.add(req)
            self._wake.set()
            result = await req.future
        except BaseException as e:
            if isinstance(e, asyncio.CancelledError):
                self._abort(order.request_id)
            if span is not None:
                spans.end(span, req, order, self.config.transport, self.runner.block_size,
                          self.num_layers, None if isinstance(e, asyncio.CancelledError) else e)
            raise
        if span is not None:
            spans.end(span, req, order, self.config.transport, self.runner.block_size,
                      self.num_layers)
        return result

    async def _compile(self, so):
        """`so` compiled off the step thread, published meanwhile (core_share: no decode
        worker of this node runs on lent threads while a compile shares the cores)."""
        with self.compile_flag.compiling():
            return await self.runner.compile_grammar(so)

    async def bench_prefill(self, num_tokens: int, seed: int = 0) -> float:
        """Seconds for one prefill step of `num_tokens` random tokens on this worker
        (same process, threads and batch path as serving; nothing sent). The baseline
        of `pdserve bench ttft`.

        Raises:
            NoFreeBlocksError: the pool cannot hold the prompt now.
        """
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, self.runner.config.vocab_size, (num_tokens,), generator=g).tolist()
        blocks = self.pool.allocate(blocks_needed(num_tokens, self.runner.block_size))
        self._benching = True      # as a served step: no decode worker borrows these cores
        if self.activity is not None:
            self.activity.set_busy(True)
        try:
            def step() -> float:     # on the engine thread: between two of its steps
                if self.tp_ranks is not None:
                    self.tp_ranks.sends([])   # the ranks: nothing to send of it
                t0 = time.perf_counter()
                self.runner.prefill([PrefillSeq(ids, blocks)])
                return time.perf_counter() - t0
            return await asyncio.wrap_future(self.engine.submit(step))
        finally:
            self._benching = False
            self.pool.free(blocks)

    async def abort(self, request_id: str) -> None:
        self._abort(request_id)

    async def abort_all(self, router: int = 0) -> int:
        """Abort every request router replica `router` has on this worker (a restarted
        replica's: their callers died with it; pdserve/request_ids.py). Returns how
        many there were."""
        ids = [rid for rid in self.scheduler.request_ids() if router_of(rid) == router]
        for rid in ids:
            self._abort(rid)
        return len(ids)

    async def send_prompt_kv(self, order: KVPullOrder) -> int:
        """Send another prefill worker the K/V of the prompt blocks `order.block_hashes`
        this worker holds in its prefix cache, or in its KV tiers past a leading run
        its cache holds (loaded into its pool first: PrefillScheduler.export), every
        layer, into its pull receiver, then DONE with no token (kv_pull.py). Returns the
        payload bytes sent; 0 when this worker lacks any of them or the send failed (the
        puller then computes them)."""
        expires = pull_expiry(order)          # the puller's clock runs from its ask
        blocks = await asyncio.wrap_future(self.scheduler.export(list(order.block_hashes)))
        return await self._send_held_kv(order, blocks, self._end_export, expires)

    def _end_export(self, blocks: list[int]) -> None:
        self.scheduler.end_export(blocks)
        self._wake.set()            # a prompt waiting for blocks may take them now

    async def status(self) -> WorkerStatus:
        running, waiting = self.scheduler.counts()
        return WorkerStatus(
            worker_id=self.worker_id, role="prefill", pid=os.getpid(),
            node_ip=ray.util.get_node_ip_address(), state="ready", epoch=self.epoch,
            kv_blocks_total=self.pool.num_blocks, kv_blocks_free=self.pool.num_free,
            running_requests=running, waiting_requests=waiting,
            metrics_address=self.metrics_address,
            queued_tokens=self.scheduler.queued_tokens(),
            prefill_tokens_computed=self.scheduler.computed_tokens,
            prefix_cache_hit_tokens=self.scheduler.cached_tokens,
            prefix_cache_queries=self.scheduler.prefix_queries,
            prefix_cache_hits=self.scheduler.prefix_hits,
            prefix_cache_blocks=self.pool.num_cached,
            kv_bytes_sent=self.connector.kv_bytes_sent, tensor_parallel_size=self.tp.size,
            step_stats=self.step_stats, **self._pull_values(),
            **self._tier_values(status=True))

    def _metric_values(self) -> dict[str, float]:
        """Current gauges and counters for /metrics (pdserve/metrics.py), at scrape time."""
        running, waiting = self.scheduler.counts()
        return {"num_requests_running": running, "num_requests_waiting": waiting,
                "kv_cache_usage_ratio": self.pool.usage,
                "prefix_cache_queries": self.scheduler.prefix_queries,
                "prefix_cache_hits": self.scheduler.prefix_hits,
                "kv_transfer_bytes": self.connector.kv_bytes_sent,
                "kv_transfer_failures": self.connector.kv_send_failures,
                **self._pull_values(), **self._tier_values()}

    def _pull_values(self) -> dict[str, int]:
        """kv_pull's counters by WorkerStatus (and /metrics) name; {} without it."""
        p = self.pulls
        return {} if p is None else {"kv_pulled_blocks": p.pulled_blocks,
                                     "kv_pull_bytes": p.bytes_pulled,
                                     "kv_pull_seconds": p.pull_seconds,
                                     "kv_pull_failures": p.num_failed}

    def _close(self) -> None:
        self.connector.close()
        if self.pulls is not None:
            self.pulls.receiver.close()
        self._close_pull_sender()
        self._finish_sent(ranks_stopped=True)
        if self.tiers is not None:
            self.tiers.close()
        if self.activity is not None:
            self.activity.close()

    # --- helpers ------------------------------------------------------------------------

    def _abort(self, request_id: str) -> None:
        queued = self.scheduler.abort(request_id)
        if queued is not None:
            self._resolve(queued, error=queued.finish.error())

    def _resolve(self, req: PrefillRequest, result: PrefillResult | None = None,
                 error: BaseException | None = None) -> None:
        def set_():
            if not req.future.done():
                if error is not None:
                    req.future.set_exception(error)
                else:
                    req.future.set_result(result)
        self._loop.call_soon_threadsafe(set_)

    # --- the step thread ----------------------------------------------------------------

    def _schedule(self) -> SchedulerOutput:
        self._finish_sent()
        aborted = self.scheduler.take_aborted()
        for r in aborted:                          # between chunks: abort frame, release
            self.connector.request_finished(r, None)
        if self.tp_ranks is not None:
            self.tp_ranks.finish([(r, False) for r in aborted])
        out = self.scheduler.schedule()
        if self.activity is not None:
            self.activity.set_busy(bool(out.requests) or self._benching)
        return out

    def _idle(self) -> None:
        if self.tp_ranks is not None:
            self.tp_ranks.poll()
            self._finish_sent()      # blocks the ranks are done with, back before the wait
        # a TP worker's ranks report tier copies, pulls and sends only when polled
        # (engine/tp_tiers.py, kv_transfer/tp_receiver.py, rank.py)
        polling = any(getattr(x, "wants_poll", False)
                      for x in (self.tiers, self.pulls and self.pulls.receiver, self.tp_ranks))
        self._wake.wait(0.005 if polling else 0.05)
        self._wake.clear()

    def _step(self, out: SchedulerOutput) -> None:
        """One prefill step of `out` (the ranks' KV sends ordered around it). Each chunk
        streams every layer's K/V of the blocks it completed (and, with a prompt's first
        chunk, of P's cached blocks D lacks) while the next layer computes; D's cached
        prefix is never sent."""
        self.metrics.batch_size.labels(phase="prefill").observe(len(out.requests))
        ranges = self.scheduler.kv_send_ranges(out)
        if self.tp_ranks is not None:
            self.tp_ranks.sends(ranges)

        def on_layer_done(i: int) -> None:
            for r, lo, hi in ranges:
                self.connector.save_layers(r, i, i + 1, lo, hi)
            self._finish_sent()       # a transfer that ended waits one layer at most

        t0 = time.perf_counter()
        try:
            result = self.runner.execute(out, on_layer_done)
        except Exception as e:  # a model fault fails this step's requests, not the worker
            if isinstance(e, TPGroupBroken):   # ... unless its ranks are out of step
                self._group_broken(e)
            logger.exception("prefill batch of %d failed", len(out.requests))
            result = None
            for r in out.requests:
                fail(r, FinishCause.MODEL_FAULT, f"prefill failed: {type(e).__name__}: {e}")
        step_s = time.perf_counter() - t0
        if tracing.enabled():   # each traced prompt's chunk, with the step it ran in
            spans.chunks(out, step_s)
        self.step_stats += StepStats.of(out.total_num_scheduled_tokens, step_s)
        if self.pulls is not None:
            self.pulls.cost.observe_compute(out.total_num_scheduled_tokens, step_s)
        done = self.scheduler.update_from_output(out, result)
        for r, token in done:
            r.state = RequestState.SENDING_KV
            self.connector.request_finished(r, token)
        if self.tp_ranks is not None:
            self.tp_ranks.finish([(r, token is not None) for r, token in done])

    def _finish_sent(self, ranks_stopped: bool = False) -> None:
        """Release every request whose transfer ended (the connector's poll) once no
        rank 1..N-1 still sends it (PrefillRanks.sending; every one once the ranks
        stopped): until then its blocks stay out of the pool, so no step, tier load or
        pull writes a block a rank reads. A failed one's call raises once its blocks
        are back, or at once while a rank still sends it (a sent one was answered at
        DONE: connector on_done)."""
        finished = self.connector.get_finished()
        self._sent.extend(finished)
        sending = [r for r in self._sent if not ranks_stopped and self.tp_ranks is not None
                   and self.tp_ranks.sending(r.request_id)]
        for req in self._sent:
            if req in sending:
                continue
            if req.finish is None:
                state = RequestState.FINISHED_STOPPED
            elif req.finish.cause is FinishCause.ABORTED:
                state = RequestState.FINISHED_ABORTED
            else:
                state = RequestState.FINISHED_ERROR
            self.scheduler.release(req, state)
        self._sent = sending
        for req in finished:
            if req.finish is not None:
                self._resolve(req, error=req.finish.error())
