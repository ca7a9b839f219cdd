"""Decode worker: a Ray actor that reserves KV blocks, receives prefill's KV, and runs
the continuous-batching decode loop.

Request lifecycle here (see scheduler.py for the state machine):

    router ── reserve(request_id, prompt_len, params, prompt_token_ids)
          ──▶ DecodeReservation (pdserve/messages.py): KV address + epoch + how many
              leading prompt blocks D holds already (its prefix cache), or
              local_prefill: D computes the prompt itself
    prefill ══ KV frames of the blocks D lacks, per chunk and layer, then
               done(first token) ══▶ KV receiver
    step thread: schedule() → SchedulerOutput: per request, the tokens to compute
                 from its num_computed_tokens (one: decode; more: a local prefill, a
                 chunk of one, or a preempted request's recompute) →
                 ModelRunner.mixed() / prefill() + decode() → sample() the rows that
                 reach num_tokens → update_from_output()
    router ◀── events(epoch, router): one stream per worker and router replica, each
               item the TokenEvents of every request of that replica since the last (a
               step's worth, one Ray message, where a stream per request costs one per
               request and step); a request's events end with the one carrying
               finish_reason

The step thread owns the model; the actor's event loop serves RPCs; the KV receiver
has its own threads, and the step loop polls it through the scheduler's connector
(decode_worker/connector.py: transfers done or failed, finished requests' blocks
released; the receiver only wakes the loop). Events
cross to the event loop through the outbox (`call_soon_threadsafe`, outbox.py), so a
slow client never blocks the step loop.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import replace

import ray
import torch

from ..engine.block_pool import BlockPool, NoFreeBlocksError
from ..engine.model_runner import DecodeSeq, PrefillSeq
from ..engine.request import TokenEvent
from ..engine.logprobs import TokenLogprobs, capture
from ..engine.sampler import sample
from ..engine.structured_output import apply_bitmask
from ..engine.sampling_params import SamplingParams
from ..engine.tp_executor import TPGroupBroken
from ..kv_transfer import make_receiver
from ..kv_transfer.tp_plan import rank_layout
from ..messages import DecodeReservation, StepStats, WorkerInfo, WorkerStatus
from ..metrics import WorkerMetrics, serve as serve_metrics
from ..config import WorkerConfig
from ..core_share import CompileActivity, LentThreads
from ..engine.engine_thread import EngineThread
from ..engine.kv_prefault import prefault_pool
from ..tp_group import worker_runner
from .connector import DecodeKVConnector
from .outbox import EventOutbox
from .rank import TPReceiver, rank_addresses
from .requests import DecodeRequest, SchedulerOutput
from .scheduler import DecodeScheduler, RequestTooLargeError
from .step_budget import StepBudget

logger = logging.getLogger(__name__)


class StaleEpochError(RuntimeError):
    """An events() call named an earlier incarnation of this decode worker."""


_IDLE_WAIT_S = 0.05   # step thread's wake-up period when idle (lease checks, shutdown)
_RANK_POLL_S = 0.005  # ... while a tensor-parallel rank's KV may be arriving


class DecodeWorker:
    """Ray actor (see ``DecodeWorker.remote_class``); methods are called by the router."""

    def __init__(self, worker_id: str, config: WorkerConfig):
        logging.basicConfig(level=config.log_level)
        self.worker_id, self.config = worker_id, config
        self.epoch = uuid.uuid4().int & (2**63 - 1)   # this incarnation of the process
        self.draining = False                        # drain(): no new requests from any router
        # tensor-parallel: ranks 1..M-1 follow, each with its KV receiver (rank.py)
        self._wake = threading.Event()   # the step loop's: new work, or the receiver has news
        # the runner is built, warmed up and stepped on one thread (engine_thread.py)
        self.engine = EngineThread("decode-step", wake=self._wake.set)
        self.tp, self._ranks, self.runner = self.engine.call(
            worker_runner, worker_id, config, "decode", self.epoch, self._group_broken,
            enforce_eager=config.enforce_eager or not config.cuda_graphs,
            compile_model=config.compile and not config.enforce_eager,
            max_graph_batch_size=min(config.max_batch_size, 512))
        self.pool = BlockPool(self.runner.cache_config.num_blocks)
        self.prefault = prefault_pool(self.pool, self.runner.kv_cache)   # kv_prefault.py
        model = self.runner.config
        layout = rank_layout(self.runner.kv_cache, model.model_id, model.num_kv_heads, self.tp)
        self.receiver = make_receiver(config.transport, self.runner.kv_cache, layout, self.epoch,
                                      notify=self._wake.set, host=config.node_host(),
                                      secret=config.kv_secret)
        self.kv_address = self.receiver.start()
        self.kv_rank_addresses: tuple[tuple[str, int], ...] = ()
        if self.tp.size > 1:        # every rank's receiver, news polled by the step loop
            self.kv_rank_addresses = rank_addresses(self._ranks)
            self.receiver = TPReceiver(self.receiver, self.runner, self._ranks,
                                       on_broken=self._group_broken)
        self.scheduler = DecodeScheduler(
            self.pool, self.runner.block_size, self.runner.config.max_model_len,
            self.runner.config.eos_token_ids, config.max_batch_size,
            connector=DecodeKVConnector(self.receiver),
            enable_prefix_caching=config.enable_prefix_caching,
            local_prefill_max_tokens=config.local_prefill_max_tokens,
            prefill_chunk_size=config.prefill_chunk_size,
            schedule_policy=config.schedule_policy)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outbox = EventOutbox()                 # events not yet streamed, per router
        self._stop = threading.Event()
        # threads of idle prefill workers on this node, borrowed step by step (core_share)
        self.lent = None
        if config.core_share_dir is not None:
            try:
                self.lent = LentThreads(config.core_share_dir, worker_id, config.num_threads,
                                        len(os.sched_getaffinity(0)))
            except OSError as e:
                logger.warning("idle prefill cores not borrowed: %s", e)
        self.compile_flag = CompileActivity.on(config.core_share_dir, worker_id)
        self.peak_batch_size = 0      # largest decode batch so far (tests prove batching)
        # steps sized to the TPOT SLO when one is set (step_budget.py)
        self.step_budget = (StepBudget(config.slo_tpot_ms / 1e3) if config.slo_tpot_ms
                            else None)
        self.step_stats = StepStats()  # (rows, seconds) of its decode-only steps
        self.step_threads = config.num_threads   # torch threads the latest step started on
        self.metrics = WorkerMetrics("decode", self._metric_values)
        self.metrics_address = "%s:%d" % serve_metrics(
            self.metrics.registry, config.node_host(), config.metrics_port)
        self.engine.start(self._step_loop)

    # --- RPCs -------------------------------------------------------------------------

    async def ready(self) -> WorkerInfo:
        self._loop = asyncio.get_running_loop()
        return WorkerInfo(self.worker_id, "decode", self.epoch, self.pool.num_blocks,
                          self.runner.block_size, ray.util.get_node_ip_address(),
                          tuple(self.kv_address), self.kv_rank_addresses, self.draining)

    async def drain(self) -> None:
        """Take no new request from any router (ready() says so to the replicas that
        did not drain it: router/admin.py sync_members); until it restarts."""
        self.draining = True

    async def reserve(self, request_id: str, prompt_len: int, params: SamplingParams,
                      prompt_token_ids: list[int], lease_s: float | None = None,
                      prefill_locally: bool = False) -> DecodeReservation | None:
        """Reserve blocks for a request's prompt KV; None when the pool cannot hold it
        now, or ever (prompt + max_tokens beyond the whole pool; the router refuses
        those against the largest decode worker first). `prompt_token_ids` (prompt_len
        of them) are kept to recompute the KV should the request be preempted.

        Returns the DecodeReservation (pdserve/messages.py): where P sends the KV, the
        blocks it fills, the leading prompt blocks D holds already (num_cached_blocks: P
        skips them), local_prefill when D prefills the prompt itself (then no prefill
        worker is called: the first token comes on the stream), D's free blocks. The
        reservation is held under a lease of `lease_s` seconds
        (default config.lease_s; the router passes the request's remaining deadline):
        KV not arrived by then, the blocks are reclaimed and the request fails.
        Idempotent per request_id (a repeated call returns the same reservation).
        `prefill_locally`: the router asks D to prefill the prompt itself whatever its
        length (its prefill workers' queues are long: conditional disaggregation).
        Raises:
            ValueError: len(prompt_token_ids) != prompt_len, or the structured output's
                grammar does not compile (compiled here, before the reservation, off the
                step thread).
        """
        self._loop = self._loop or asyncio.get_running_loop()
        grammar = None
        if params.structured_outputs is not None:
            with self.compile_flag.compiling():      # core_share: no lent threads meanwhile
                grammar = await self.runner.compile_grammar(params.structured_outputs)
        try:
            r = self.scheduler.reserve(request_id, prompt_len, params,
                                       lease_s or self.config.lease_s, prompt_token_ids,
                                       prefill_locally, grammar)
        except (NoFreeBlocksError, RequestTooLargeError) as e:
            logger.debug("reserve %s refused: %s", request_id, e)
            return None
        if r.local_prefill:
            self._wake.set()
        elif self.tp.size > 1:      # every rank expects it before any prefill rank sends
            await self.receiver.expect_ranks(request_id)
        return DecodeReservation(tuple(self.kv_address), self.epoch, len(r.block_ids),
                                 r.num_cached_blocks, r.local_prefill, self.pool.num_free,
                                 self.kv_rank_addresses, sum(self.scheduler.counts()))

    async def events(self, epoch: int, router: int = 0):
        """Yield lists of TokenEvents, those of every request router replica `router`
        has on this worker (pdserve/request_ids.py), as the step thread publishes them
        (what piled up while the consumer was slow comes in one list). One consumer
        per replica at a time: a newer call ends an older one's stream (decode_worker/
        outbox.py). A request's events end with the one carrying its finish_reason.

        Raises:
            StaleEpochError: `epoch` is not this incarnation's (the worker restarted
                since the caller reserved: those requests are gone).
        """
        if epoch != self.epoch:
            raise StaleEpochError(f"decode worker {self.worker_id} is at epoch {self.epoch}, "
                                  f"not {epoch}: it restarted and lost those requests")
        self._loop = self._loop or asyncio.get_running_loop()
        async for events in self._outbox.stream(router, self._stop, _IDLE_WAIT_S * 20):
            yield events

    async def abort(self, request_id: str, reason: str = "cancelled", group: bool = False) -> None:
        """Finish the request (at the next step); with `group`, every sample forked from
        it too (sampling n > 1: decode_worker/fork.py)."""
        self.scheduler.abort(request_id, reason, group=group)
        self._wake.set()

    async def abort_all(self, reason: str = "router restarted", router: int = 0) -> int:
        """Finish every request router replica `router` has on this worker at the next
        step, their KV freed, and end that replica's event stream (a restarted
        replica's: their callers, and that stream's reader, died with it; Ray does not
        end the stream itself). Returns how many."""
        n = self.scheduler.abort_all(reason, router=router)
        self._outbox.end(router)        # before the new incarnation's requests come
        self._wake.set()
        return n

    async def status(self) -> WorkerStatus:
        running, waiting = self.scheduler.counts()
        host, port = self.kv_address
        return WorkerStatus(
            worker_id=self.worker_id, role="decode", pid=os.getpid(),
            node_ip=ray.util.get_node_ip_address(), state="ready", epoch=self.epoch,
            kv_blocks_total=self.pool.num_blocks, kv_blocks_free=self.pool.num_free,
            running_requests=running, waiting_requests=waiting,
            metrics_address=self.metrics_address, kv_address=f"{host}:{port}",
            prefix_cache_hit_tokens=self.scheduler.cached_tokens,
            prefix_cache_blocks=self.pool.num_cached,
            kv_transport=self.config.transport,
            # KV that arrived by one-sided writes (NIXL), not over the socket
            kv_one_sided_writes=getattr(self.receiver, "num_writes", 0),
            peak_batch_size=self.peak_batch_size, step_threads=self.step_threads,
            step_stats=self.step_stats,
            num_preemptions=self.scheduler.num_preemptions,
            kv_reservations_leased=self.scheduler.num_reservations_active(),
            kv_reservations_reclaimed=self.scheduler.num_reclaimed,
            preempted_requests=self.scheduler.num_waiting_to_resume(),
            local_prefills=self.scheduler.num_local_prefills,
            tensor_parallel_size=self.tp.size)

    async def ranks(self) -> list[dict]:
        """Ranks 1..M-1 of a tensor-parallel worker: pid, node, KV heads, KV receiver and
        its open reservations each (tp_group.TPRank.ready); [] at TP 1."""
        return [await r.ready.remote() for r in self._ranks]

    def _metric_values(self) -> dict[str, float]:
        """Current gauges and counters for /metrics (pdserve/metrics.py), at scrape time."""
        sched = self.scheduler
        running, waiting = sched.counts()
        return {"num_requests_running": running, "num_requests_waiting": waiting,
                "kv_cache_usage_ratio": self.pool.usage,
                "kv_reservations_active": sched.num_reservations_active(),
                "kv_reservations_reclaimed": sched.num_reclaimed,
                "num_preemptions": sched.num_preemptions,
                "prefix_cache_queries": sched.prefix_queries,
                "prefix_cache_hits": sched.prefix_hits,
                "kv_transfer_failures": sched.connector.num_failed}

    async def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        self.engine.close(timeout_s=10)
        if self.prefault is not None:
            self.prefault.close()
        if self.tp.size > 1:
            self.runner.stop()       # the ranks' loops end; Ray kills them with this actor
        self.receiver.close()
        if self.lent is not None:
            self.lent.close()
        self.compile_flag.close()

    # --- threads ------------------------------------------------------------------------

    def _publish(self, events: list[TokenEvent]) -> None:
        if events and self._loop is not None:
            self._loop.call_soon_threadsafe(self._outbox.deliver, events)

    def _step_loop(self) -> None:
        sched = self.scheduler
        threads = self.config.num_threads
        while not self._stop.is_set():
            self.engine.run_calls()
            sched.update_from_connector()
            out = sched.schedule(step_budget=None if self.step_budget is None else
                                 functools.partial(self.step_budget.tokens, threads))
            if not out.requests:
                self._publish(sched.drain_events())
                # a TP worker's ranks report arrivals only when polled (rank.py)
                self._wake.wait(_RANK_POLL_S if getattr(self.receiver, "wants_poll", False)
                                else _IDLE_WAIT_S)
                self._wake.clear()
                continue
            if self.lent is not None and (n := self.lent.threads()) != threads:
                torch.set_num_threads(n)    # this thread's OpenMP team: the step's ops
                threads = n
            self.step_threads = threads
            give_back = None
            if threads > self.config.num_threads:
                def give_back(_layer: int) -> None:
                    # a prefill worker whose threads this step borrowed is busy again:
                    # its threads go back from the next layer on, not at the step's end
                    # (two OpenMP teams on one core slow both several-fold)
                    nonlocal threads
                    if threads > self.config.num_threads and threads > (n := self.lent.threads()):
                        torch.set_num_threads(n)
                        threads = n
            self.peak_batch_size = max(self.peak_batch_size, len(out.requests))
            self.metrics.batch_size.labels(phase="decode").observe(len(out.requests))
            t0 = time.perf_counter()
            try:
                # a forked sample's block (fork.py); its row is in this step: one token
                # left, and a decode row always gets its token (schedule_policy.step_tokens)
                self.runner.copy_blocks(out.blocks_to_copy)
                tokens, logprobs = self._step(out, give_back)
                step_s = time.perf_counter() - t0
                if max(out.num_scheduled_tokens) == 1:   # decode rows only (the planner)
                    self.step_stats += StepStats.of(len(out.requests), step_s)
                if self.step_budget is not None:
                    self.step_budget.observe(threads, sum(out.num_scheduled_tokens), step_s)
            except Exception as e:  # a model or sampler fault fails the step, not the worker
                if isinstance(e, TPGroupBroken):   # ... unless its ranks are out of step
                    self._group_broken(e)
                logger.exception("decode step of %d rows failed", len(out.requests))
                for r in out.requests:      # they finish as errors (the router may retry)
                    sched.abort(r.request_id, error=f"decode step failed: "
                                                    f"{type(e).__name__}: {e}")
                continue
            events = sched.update_from_output(out, tokens, step_s)
            if logprobs:                    # the rows that asked: their token's entry
                events = [replace(e, logprobs=(logprobs[e.request_id],))
                          if e.token_ids and e.request_id in logprobs else e for e in events]
            self._publish(events)

    def _group_broken(self, e: Exception) -> None:
        """A rank is lost (or out of step): exit, so Ray restarts this actor and its
        ranks as a whole (new epoch; the router retries the streams on live workers)."""
        logger.critical("%s: %s; exiting so Ray restarts the worker's ranks as a whole",
                        self.worker_id, e)
        logging.shutdown()
        os._exit(1)

    def _matcher(self, req: DecodeRequest):
        """The request's grammar matcher, built at its first sampling on D and fed the
        tokens generated so far (P's first token; on a retry, the prompt's tail too);
        None without structured_outputs, or when those tokens break the grammar (then
        the request fails)."""
        so = req.params.structured_outputs
        if so is None or req.matcher is not None:
            return req.matcher
        offset = req.params.step_offset
        done = req.prompt_token_ids[len(req.prompt_token_ids) - offset:] if offset else []
        try:
            req.matcher = self.runner.grammars.matcher(so, done + req.output_ids, req.grammar)
        except ValueError as e:
            self.scheduler.abort(req.request_id, error=str(e))
        return req.matcher

    def _step(self, out: SchedulerOutput,
              give_back: Callable[[int], None] | None
              ) -> tuple[list[int | None], dict[str, TokenLogprobs]]:
        """One model step of ``out`` (a SchedulerOutput): the forward of its rows, then a
        token for each row that reaches num_tokens (None for the others), and the
        logprobs of those whose params ask (by request id)."""
        runner = self.runner
        reqs, counts = out.requests, out.num_scheduled_tokens
        t0 = time.perf_counter()
        # a row of one token decodes (the paged decode path); longer rows prefill
        # tokens [num_computed_tokens, + count) of prompt + output
        drows = [i for i, n in enumerate(counts) if n == 1]
        prows = [i for i, n in enumerate(counts) if n > 1]
        dseqs = [DecodeSeq(reqs[i].token_id(reqs[i].num_computed_tokens),
                           reqs[i].num_computed_tokens, reqs[i].block_table) for i in drows]
        pseqs = [PrefillSeq(reqs[i].token_ids(reqs[i].num_computed_tokens + counts[i]),
                            reqs[i].block_table, reqs[i].num_computed_tokens) for i in prows]
        plogits = dlogits = None
        # one forward for both where the C++ paged kernel takes one-token rows beside
        # chunks (measured there); CUDA keeps its decode path (graphs, paged decode)
        if pseqs and dseqs and runner.attention_kernel:
            plogits, dlogits = runner.mixed(pseqs, dseqs, give_back)
        else:
            plogits = runner.prefill(pseqs, give_back) if pseqs else None
            dlogits = runner.decode(dseqs, give_back) if dseqs else None
        tokens: list[int | None] = [None] * len(reqs)
        logprobs: dict[str, TokenLogprobs] = {}
        for rows, logits in ((drows, dlogits), (prows, plogits)):
            # rows that reach num_tokens sample; the step index is the tokens
            # generated so far, unchanged by preemption: seeded draws repeat
            hit = [k for k, i in enumerate(rows) if out.samples(i)]
            if hit:
                if len(hit) < len(rows):
                    logits = logits[hit]
                rq = [reqs[rows[k]] for k in hit]
                params = [r.params for r in rq]
                matchers = [self._matcher(r) for r in rq]
                if any(m is not None for m in matchers):   # first: logprobs see the mask
                    apply_bitmask(logits, runner.grammars.bitmask(matchers))
                captured = capture(logits, params)
                drawn = sample(logits, params, [len(r.output_ids) for r in rq],
                               [r.token_ids(r.num_tokens) if r.params.penalized else None
                                for r in rq], runner.config.eos_token_ids)
                for k, t, lp, m in zip(hit, drawn, captured.of(drawn), matchers):
                    tokens[rows[k]] = t
                    if lp is not None:
                        logprobs[reqs[rows[k]].request_id] = lp
                    if m is not None and not m.is_terminated():   # ignore_eos: goes on
                        m.accept_token(t)
        logger.debug("decode step: %d rows (%d prefill, %d tokens), %.1f ms", len(reqs),
                     len(prows), sum(counts), 1e3 * (time.perf_counter() - t0))
        return tokens, logprobs
