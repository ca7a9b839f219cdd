"""Prefill worker: a Ray actor that batches prompts, runs full-attention prefill, and
streams each layer's KV to the decode worker that reserved blocks for it.

Request lifecycle here (see scheduler.py):

    router ── prefill(PrefillOrder) (pdserve/messages.py) ──▶ queue
    step thread:  schedule() (prefix-cache lookup, chunking) → ModelRunner.prefill(
                  batch, on_layer_done), computing each prompt's next uncached chunk
                  on_layer_done(i): layer i of the blocks each chunk completed (that D
                  lacks: D's cached prefix is skipped) → connector.save_layers
                  logits of each finished prompt's last token → sample() → first token
                  → connector.request_finished
    connector:    (connector.py, its send thread) the layers to D (block_start = the
                  position in D's reserved blocks) while layer i+1 or the next chunk
                  computes; then DONE with the first token, upon which the router's
                  call returns that token (TTFT)
    step thread:  connector.get_finished(), polled each step and between layers: the
                  request's blocks are released (a failed one's call raises)

A transfer failure fails that one request (the router sees KVTransferError); the
worker keeps serving.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
import time
import uuid

import ray
import torch

from ..config import WorkerConfig
from ..core_share import CompileActivity, PrefillActivity
from ..engine.block_pool import BlockPool, blocks_needed
from ..engine.engine_thread import EngineThread
from ..engine.kv_prefault import prefault_pool
from ..engine.model_runner import PrefillSeq
from ..engine.request import RequestState
from ..engine.logprobs import capture
from ..engine.structured_output import apply_bitmask
from ..engine.sampler import sample
from ..engine.tp_executor import TPGroupBroken
from ..kv_transfer import KVTransferError, make_sender
from ..kv_transfer.tp_plan import rank_layout, rank_targets
from ..messages import (CacheEvents, PrefillOrder, PrefillResult, StepStats, WorkerInfo,
                        WorkerStatus)
from ..metrics import WorkerMetrics, serve as serve_metrics
from ..request_ids import router_of
from ..tp_group import worker_runner
from .connector import PrefillKVConnector
from .rank import PrefillRanks
from .scheduler import PrefillRequest, PrefillScheduler

logger = logging.getLogger(__name__)


class PrefillAborted(RuntimeError):
    """The request was aborted before its prefill finished."""


class PrefillFailed(RuntimeError):
    """The model step that computed the request's prompt raised (not a transfer
    failure: its KV was never complete)."""


class PrefillWorker:
    """Ray actor (see cluster.py); methods are called by the router."""

    def __init__(self, worker_id: str, config: WorkerConfig):
        logging.basicConfig(level=config.log_level)
        self.worker_id, self.config = worker_id, config
        self.epoch = uuid.uuid4().int & (2**63 - 1)   # this incarnation (new on Ray restart)
        self.draining = False            # drain(): no new requests from any router
        # busy flag a decode worker of this node reads (core_share): published busy before
        # the model loads, so a restarted worker's old "idle" file lends nothing meanwhile
        self.activity = None
        if config.core_share_dir is not None:
            try:
                self.activity = PrefillActivity(config.core_share_dir, worker_id,
                                                config.num_threads)
            except OSError as e:
                logger.warning("idle cores not lent to decode: %s", e)
        self.compile_flag = CompileActivity.on(config.core_share_dir, worker_id)
        # tensor-parallel: ranks 1..N-1 follow, each sending its KV heads (rank.py)
        self._wake = threading.Event()
        # the runner is built, warmed up and stepped on one thread (engine_thread.py)
        self.engine = EngineThread("prefill-step", wake=self._wake.set)
        self.tp, self._ranks, self.runner = self.engine.call(
            worker_runner, worker_id, config, "prefill", self.epoch, self._group_broken,
            compile_model=config.compile and not config.enforce_eager)
        self.num_layers = self.runner.config.num_layers
        self.pool = BlockPool(self.runner.cache_config.num_blocks)
        self.prefault = prefault_pool(self.pool, self.runner.kv_cache)   # kv_prefault.py
        self.scheduler = PrefillScheduler(self.pool, self.runner.block_size,
                                          config.max_num_batched_tokens,
                                          config.enable_prefix_caching,
                                          config.prefill_chunk_size,
                                          config.schedule_policy)
        model = self.runner.config
        layout = rank_layout(self.runner.kv_cache, model.model_id, model.num_kv_heads, self.tp)
        self.sender = make_sender(config.transport, self.runner.kv_cache, layout,
                                  checksum=config.kv_checksum, secret=config.kv_secret,
                                  epoch=self.epoch, host=config.node_host())
        self._loop: asyncio.AbstractEventLoop | None = None
        self.metrics = WorkerMetrics("prefill", self._metric_values)
        self.metrics_address = "%s:%d" % serve_metrics(
            self.metrics.registry, config.node_host(), config.metrics_port)
        self._stop = threading.Event()
        self._benching = False   # bench_prefill computing: busy to the node's decode workers
        self.step_stats = StepStats()   # (prompt tokens, seconds) of every step (the planner)
        self.connector = PrefillKVConnector(
            self.sender, self.num_layers, self._wake.set,
            on_done=lambda req, token: self._resolve(
                req, result=PrefillResult(token, req.logprobs, tuple(req.prompt_logprobs),
                                          self.scheduler.active_tokens(but=req))),
            observe_transfer_s=self.metrics.kv_transfer_seconds.observe,
            targets=functools.partial(rank_targets, model.num_kv_heads, self.tp.size, 0))
        # tensor-parallel: the ranks' KV sends, ordered around each step (rank.py)
        self.tp_ranks = (PrefillRanks(self.runner, self.sender, self.tp.size,
                                      self._group_broken) if self.tp.size > 1 else None)
        self.engine.start(self._step_loop)

    # --- RPCs -------------------------------------------------------------------------

    async def ready(self) -> WorkerInfo:
        self._loop = asyncio.get_running_loop()
        return WorkerInfo(self.worker_id, "prefill", self.epoch, self.pool.num_blocks,
                          self.runner.block_size, ray.util.get_node_ip_address(),
                          draining=self.draining)

    async def drain(self) -> None:
        """Take no new request from any router (ready() says so to the replicas that
        did not drain it: router/admin.py sync_members); until it restarts."""
        self.draining = True

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
                             grammar=grammar)
        self.scheduler.add(req)
        self._wake.set()
        try:
            return await req.future
        except asyncio.CancelledError:
            self._abort(order.request_id)
            raise

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

    async def ranks(self) -> list[dict]:
        """Ranks 1..N-1 of a tensor-parallel worker: pid, node and KV heads each
        (tp_group.TPRank.ready); [] at TP 1."""
        return [await r.ready.remote() for r in self._ranks]

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

    async def cache_events(self, since: int) -> CacheEvents:
        """Prefix-cache changes after event `since` (engine/block_pool.py), or a
        snapshot when `since` is too old; the router polls it (KV-aware routing)."""
        seq, events, snapshot = self.pool.cache_events(since)
        return CacheEvents(self.epoch, seq, events, snapshot)

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
            step_stats=self.step_stats)

    def _metric_values(self) -> dict[str, float]:
        """Current gauges and counters for /metrics (pdserve/metrics.py), at scrape time."""
        running, waiting = self.scheduler.counts()
        return {"num_requests_running": running, "num_requests_waiting": waiting,
                "kv_cache_usage_ratio": self.pool.usage,
                "prefix_cache_queries": self.scheduler.prefix_queries,
                "prefix_cache_hits": self.scheduler.prefix_hits,
                "kv_transfer_bytes": self.connector.kv_bytes_sent,
                "kv_transfer_failures": self.connector.kv_send_failures}

    async def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        self.engine.close(timeout_s=10)
        if self.prefault is not None:
            self.prefault.close()
        if self.tp.size > 1:
            self.runner.stop()       # the ranks' loops end; Ray kills them with this actor
        self.connector.close()
        self._finish_sent()
        if self.activity is not None:
            self.activity.close()
        self.compile_flag.close()

    # --- helpers ------------------------------------------------------------------------

    def _abort(self, request_id: str) -> None:
        queued = self.scheduler.abort(request_id)
        if queued is not None:
            self._resolve(queued, error=PrefillAborted(f"request {request_id} aborted"))

    def _resolve(self, req: PrefillRequest, result: PrefillResult | None = None,
                 error: BaseException | None = None) -> None:
        def set_():
            if not req.future.done():
                if error is not None:
                    req.future.set_exception(error)
                else:
                    req.future.set_result(result)
        self._loop.call_soon_threadsafe(set_)

    # --- threads ------------------------------------------------------------------------

    def _step_loop(self) -> None:
        while not self._stop.is_set():
            self.engine.run_calls()
            self._finish_sent()
            aborted = self.scheduler.take_aborted()
            for r in aborted:                          # between chunks: abort frame, release
                self.connector.request_finished(r, None)
            if self.tp_ranks is not None:
                self.tp_ranks.finish([(r, False) for r in aborted])
            batch = self.scheduler.schedule()
            if self.activity is not None:
                self.activity.set_busy(bool(batch) or self._benching)
            if not batch:
                if self.tp_ranks is not None:
                    self.tp_ranks.poll()
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            tokens = sum(r.chunk_end - r.num_computed_tokens for r in batch)
            t0 = time.perf_counter()
            self._step(batch)
            self.step_stats += StepStats.of(tokens, time.perf_counter() - t0)

    def _step(self, batch: list[PrefillRequest]) -> None:
        """One prefill step of `batch` (the ranks' KV sends ordered around it)."""
        self.metrics.batch_size.labels(phase="prefill").observe(len(batch))
        # Each chunk streams every layer's K/V of the blocks it completed (and, with
        # a prompt's first chunk, of P's cached blocks D lacks) while the next layer
        # computes; D's cached prefix is never sent.
        ranges = [(r, *rng) for r in batch
                  if (rng := self.scheduler.kv_send_range(r))[0] < rng[1]]
        if self.tp_ranks is not None:
            self.tp_ranks.sends(ranges)

        def on_layer_done(i: int) -> None:
            for r, lo, hi in ranges:
                self.connector.save_layers(r, i, i + 1, lo, hi)
            self._finish_sent()       # a transfer that ended waits one layer at most

        try:
            seqs = [PrefillSeq(r.token_ids[:r.chunk_end], r.block_table,
                               r.num_computed_tokens) for r in batch]
            if any(r.params.prompt_logprobs is not None for r in batch):
                logits, entries = self.runner.prefill_with_prompt_logprobs(seqs, [
                    None if r.params.prompt_logprobs is None
                    else (r.token_ids, r.params.prompt_logprobs) for r in batch],
                    on_layer_done)
                for r, e in zip(batch, entries):
                    r.prompt_logprobs += e or []
            else:
                logits = self.runner.prefill(seqs, on_layer_done)
            # sampled before advance(): a failure below leaves no chunked request
            # queued for a next chunk (advance(ok=False) then fails them all)
            rows = [i for i, r in enumerate(batch) if r.chunk_end == len(r.token_ids)]
            done, tokens = [batch[i] for i in rows], []
            if done:
                done_logits, params = logits[rows], [r.params for r in done]
                matchers = [self._matcher(r) for r in done]
                if any(m is not None for m in matchers):   # logprobs see the mask
                    apply_bitmask(done_logits, self.runner.grammars.bitmask(matchers))
                captured = capture(done_logits, params)
                tokens = sample(done_logits, params, [0] * len(done),
                                [r.token_ids if r.params.penalized else None for r in done],
                                self.runner.config.eos_token_ids)
                for r, lp in zip(done, captured.of(tokens)):
                    r.logprobs = lp
            assert self.scheduler.advance(batch) == done, "chunk bookkeeping"
            for r in done:
                self.scheduler.cache_computed(r)
        except Exception as e:  # a model fault fails this batch, not the worker
            if isinstance(e, TPGroupBroken):   # ... unless its ranks are out of step
                self._group_broken(e)
            logger.exception("prefill batch of %d failed", len(batch))
            self.scheduler.advance(batch, ok=False)
            for r in batch:   # model_fault: the send thread may set error meanwhile
                r.model_fault = r.error = f"prefill failed: {type(e).__name__}: {e}"
            done, tokens = batch, [None] * len(batch)
        for r, tok in zip(done, tokens):
            r.state = RequestState.SENDING_KV
            self.connector.request_finished(r, tok)
        if self.tp_ranks is not None:
            self.tp_ranks.finish([(r, tok is not None) for r, tok in zip(done, tokens)])

    def _group_broken(self, e: TPGroupBroken) -> None:
        """A rank is lost (or out of step): exit, so Ray restarts this actor, which
        builds its ranks anew (new epoch; the router retries what was in flight)."""
        logger.critical("%s: %s; exiting so Ray restarts the worker's ranks as a whole",
                        self.worker_id, e)
        logging.shutdown()
        os._exit(1)

    def _matcher(self, req: PrefillRequest):
        """A grammar matcher for the request's first token: it has accepted the tokens
        generated before (on a retry, the prompt's last step_offset); None without
        structured_outputs. Raises ValueError when those break the grammar."""
        so, offset = req.params.structured_outputs, req.params.step_offset
        if so is None:
            return None
        done = req.token_ids[len(req.token_ids) - offset:] if offset else []
        return self.runner.grammars.matcher(so, done, req.grammar)

    def _finish_sent(self) -> None:
        """Release every request whose transfer ended (the connector's poll); a failed
        one's call raises (a sent one was answered at DONE: connector on_done)."""
        for req in self.connector.get_finished():
            self._finish(req)

    def _finish(self, req: PrefillRequest) -> None:
        if req.error is None:
            self.scheduler.release(req, RequestState.FINISHED_STOPPED)
            return
        self.scheduler.release(req, RequestState.FINISHED_ERROR if not req.aborted
                               else RequestState.FINISHED_ABORTED)
        err = (PrefillAborted(req.error) if req.aborted else
               PrefillFailed(req.model_fault) if req.model_fault else KVTransferError(req.error))
        self._resolve(req, error=err)
