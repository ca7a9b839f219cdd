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
                 ModelRunner.execute() (the forward; grammar masks, logprobs and
                 sampling of the rows that reach num_tokens) → update_from_output()
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
import time

import ray

from .. import tracing
from ..config import WorkerConfig
from ..core_share import LentThreads, StepThreads
from ..engine.block_pool import NoFreeBlocksError
from ..engine.outputs import ModelRunnerOutput, SchedulerOutput
from ..engine.request import TokenEvent
from ..engine.sampling_params import SamplingParams
from ..engine.tp_executor import TPGroupBroken
from ..engine_actor import EngineActor
from ..kv_transfer import make_receiver
from ..kv_transfer.tp_receiver import TPReceiver
from ..messages import DecodeReservation, KVPullOrder, StepStats, WorkerStatus
from ..prefill_worker.kv_pull import pull_expiry
from ..tp_group import rank_addresses
from .connector import DecodeKVConnector
from .outbox import EventOutbox
from .scheduler import DecodeScheduler, RequestTooLargeError
from .spans import DecodeSpans
from .step_budget import StepBudget

logger = logging.getLogger(__name__)


class StaleEpochError(RuntimeError):
    """An events() call named an earlier incarnation of this decode worker."""


_IDLE_WAIT_S = 0.05   # step thread's wake-up period when idle (lease checks, shutdown)
_RANK_POLL_S = 0.005  # ... while a tensor-parallel rank's KV may be arriving
_LOAD_RECHECK_S = 0.05  # reserve(): looks again this often while a tier loads, woken
                       # at once when loads finish (an abort meanwhile is seen by then)


class DecodeWorker(EngineActor):
    """Ray actor (see ``DecodeWorker.remote_class``); methods are called by the router."""

    role = "decode"

    def __init__(self, worker_id: str, config: WorkerConfig):
        super().__init__(worker_id, config,
                         enforce_eager=config.enforce_eager or not config.cuda_graphs,
                         compile_model=config.compile and not config.enforce_eager,
                         max_graph_batch_size=min(config.max_batch_size, 512))
        self.receiver = make_receiver(config.transport, self.runner.kv_cache, self.kv_layout,
                                      self.epoch, notify=self._wake.set,
                                      host=config.node_host(), secret=config.kv_secret)
        self.kv_address = self.receiver.start()
        self._spans = DecodeSpans()            # traced requests' spans (tracing on)
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
            schedule_policy=config.schedule_policy, tiers=self.tiers,
            on_loaded=self._tier_loads_done)
        self._loaded = asyncio.Event()   # set (then replaced) when tier loads finished
        self._outbox = EventOutbox()                 # events not yet streamed, per router
        # threads of idle prefill workers on this node, borrowed step by step (core_share)
        lent = None
        if config.core_share_dir is not None:
            try:
                lent = LentThreads(config.core_share_dir, worker_id, config.num_threads,
                                   len(os.sched_getaffinity(0)))
            except OSError as e:
                logger.warning("idle prefill cores not borrowed: %s", e)
        self.step_threads = StepThreads(lent, config.num_threads)
        self.peak_batch_size = 0      # largest decode batch so far (tests prove batching)
        # steps sized to the TPOT SLO when one is set (step_budget.py)
        self.step_budget = (StepBudget(config.slo_tpot_ms / 1e3) if config.slo_tpot_ms
                            else None)
        self.step_stats = StepStats()  # (rows, seconds) of its decode-only steps
        self._serve_metrics()
        self.engine.start(self._step_loop)

    # --- RPCs -------------------------------------------------------------------------

    async def reserve(self, request_id: str, prompt_len: int, params: SamplingParams,
                      prompt_token_ids: list[int], lease_s: float | None = None,
                      prefill_locally: bool = False, trace_context: dict | None = None,
                      decode_context: dict | None = None) -> DecodeReservation | None:
        """Reserve blocks for a request's prompt KV; None when the pool cannot hold it
        now, or ever (prompt + max_tokens beyond the whole pool; the router refuses
        those against the largest decode worker first). `prompt_token_ids` (prompt_len
        of them) are kept to recompute the KV should the request be preempted.

        Returns the DecodeReservation (pdserve/messages.py): where P sends the KV, the
        blocks it fills, the leading prompt blocks D holds already (num_cached_blocks: P
        skips them; with KV tiers, the blocks of a tier hit are loaded before the answer
        and counted there), local_prefill when D prefills the prompt itself (then no prefill
        worker is called: the first token comes on the stream), D's free blocks. The
        reservation is held under a lease of `lease_s` seconds
        (default config.lease_s; the router passes the request's remaining deadline):
        KV not arrived by then, the blocks are reclaimed and the request fails.
        Idempotent per request_id (a repeated call returns the same reservation).
        `prefill_locally`: the router asks D to prefill the prompt itself whatever its
        length (its prefill workers' queues are long: conditional disaggregation).
        `trace_context`: the router's reserve span of a traced request; this worker's
        span of the reservation goes under it (pdserve/tracing.py). `decode_context`:
        the router's attempt span; this worker's span of the request, from its
        reservation to its last sample's end, goes under it (DecodeSpans).
        Raises:
            ValueError: len(prompt_token_ids) != prompt_len, or the structured output's
                grammar does not compile (compiled here, before the reservation, off the
                step thread).
        """
        tracing.set_log_request(request_id, None)
        if trace_context is None:
            return await self._reserve(request_id, prompt_len, params, prompt_token_ids,
                                       lease_s, prefill_locally)
        span = tracing.worker_span("decode_worker.reserve", trace_context,
                                   {"pdserve.worker_id": self.worker_id})
        tracing.set_log_request(request_id, span)
        if decode_context is not None:       # before the step thread may run it
            self._spans.start(request_id, params.num_samples, decode_context)
        try:
            res = await self._reserve(request_id, prompt_len, params, prompt_token_ids,
                                      lease_s, prefill_locally)
        except BaseException as e:
            self._spans.cancel(request_id)
            if span is not None:
                tracing.end(span, error=e)
            raise
        if res is None:
            self._spans.cancel(request_id)
        if span is not None:
            tracing.end(span, {"pdserve.reserved": False} if res is None else {
                "pdserve.reserved": True, "pdserve.blocks": res.num_blocks,
                "pdserve.cached_blocks": res.num_cached_blocks,
                "pdserve.local_prefill": res.local_prefill,
                "pdserve.free_blocks": res.free_blocks})
        return res

    async def _reserve(self, request_id: str, prompt_len: int, params: SamplingParams,
                       prompt_token_ids: list[int], lease_s: float | None,
                       prefill_locally: bool) -> DecodeReservation | None:
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
        while r is not None and r.loading:   # a tier loads blocks P then need not send
            loaded = self._loaded                # replaced once set: no wake is missed
            try:
                await asyncio.wait_for(loaded.wait(), _LOAD_RECHECK_S)
            except TimeoutError:
                pass
            r = self.scheduler.reserved(request_id)
        if r is None:                         # aborted meanwhile
            return None
        if r.local_prefill:
            self._wake.set()
        elif self.tp.size > 1:      # every rank expects it before any prefill rank sends
            await self.receiver.expect_ranks(request_id)
        return DecodeReservation(tuple(self.kv_address), self.epoch, len(r.block_ids),
                                 r.num_cached_blocks, r.local_prefill, self.pool.num_free,
                                 self.kv_rank_addresses, sum(self.scheduler.counts()))

    def _tier_loads_done(self) -> None:
        """Step thread (DecodeScheduler.schedule): tier loads finished; reserve() calls
        waiting on them look again, on the event loop."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._wake_reserves)

    def _wake_reserves(self) -> None:
        self._loaded.set()
        self._loaded = asyncio.Event()

    async def send_prompt_kv(self, order: KVPullOrder) -> int:
        """Send a prefill worker the K/V of prompt blocks D holds for request
        `order.request_id` (DecodeScheduler.export), every layer, into its pull
        receiver, then DONE with no token (prefill_worker/kv_pull.py). Returns the
        payload bytes sent; 0 when D holds no such blocks or the send failed (P is sent
        ABORT where it can be reached; P gives up on a 0 either way and computes
        them)."""
        expires = pull_expiry(order)
        blocks = self.scheduler.export(order.request_id, order.first_block, order.num_blocks)
        return await self._send_held_kv(order, blocks, self._end_export, expires)

    def _end_export(self, blocks: list[int]) -> None:
        self.scheduler.end_export(blocks)
        self._wake.set()            # their refs go back at the next schedule()

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

    async def extend_lease(self, request_id: str, lease_s: float) -> bool:
        """Hold the reservation of a request whose prefill worker has not sent its KV
        yet for `lease_s` more seconds (the router renews it while the prompt is queued
        or prefilled there; a router gone renews nothing, and the lease ends). False
        when the request no longer waits for KV (Scheduler.extend_lease)."""
        return self.scheduler.extend_lease(request_id, lease_s)

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
            prefill_tokens_computed=self.scheduler.computed_tokens,
            prefix_cache_hit_tokens=self.scheduler.prompt_cache.cached_tokens,
            prefix_cache_blocks=self.pool.num_cached,
            kv_transport=self.config.transport,
            # KV that arrived by one-sided writes (NIXL), not over the socket
            kv_one_sided_writes=getattr(self.receiver, "num_writes", 0),
            peak_batch_size=self.peak_batch_size, step_threads=self.step_threads.threads,
            step_stats=self.step_stats,
            num_preemptions=self.scheduler.num_preemptions,
            kv_reservations_leased=self.scheduler.num_reservations_active(),
            kv_reservations_reclaimed=self.scheduler.num_reclaimed,
            preempted_requests=self.scheduler.num_waiting_to_resume(),
            local_prefills=self.scheduler.num_local_prefills,
            tensor_parallel_size=self.tp.size, **self._tier_values(status=True))

    def _metric_values(self) -> dict[str, float]:
        """Current gauges and counters for /metrics (pdserve/metrics.py), at scrape time."""
        sched = self.scheduler
        running, waiting = sched.counts()
        return {"num_requests_running": running, "num_requests_waiting": waiting,
                "kv_cache_usage_ratio": self.pool.usage,
                "kv_reservations_active": sched.num_reservations_active(),
                "kv_reservations_reclaimed": sched.num_reclaimed,
                "num_preemptions": sched.num_preemptions,
                "prefix_cache_queries": sched.prompt_cache.prefix_queries,
                "prefix_cache_hits": sched.prompt_cache.prefix_hits,
                "kv_transfer_failures": sched.connector.num_failed, **self._tier_values()}

    def _kv_endpoints(self) -> tuple:
        return tuple(self.kv_address), self.kv_rank_addresses

    def _close(self) -> None:
        self.receiver.close()
        self._close_pull_sender()
        self.step_threads.close()
        if self.tiers is not None:
            self.tiers.close()

    # --- the step thread ----------------------------------------------------------------

    def _publish(self, events: list[TokenEvent]) -> None:
        if events and self._spans:
            self._spans.finished(events)
        if events and self._loop is not None:
            self._loop.call_soon_threadsafe(self._outbox.deliver, events)

    def _schedule(self) -> SchedulerOutput:
        arrived = self.scheduler.update_from_connector()
        if self._spans and arrived:
            self._spans.kv_arrived(arrived)
        budget = self.step_budget
        return self.scheduler.schedule(step_budget=None if budget is None else
                                       functools.partial(budget.tokens,
                                                         self.step_threads.threads))

    def _idle(self) -> None:
        self._publish(self.scheduler.drain_events())
        # a TP worker's ranks report arrivals only when polled (rank.py)
        self._wake.wait(_RANK_POLL_S if getattr(self.receiver, "wants_poll", False)
                        or self.tiers is not None and self.tiers.wants_poll else _IDLE_WAIT_S)
        self._wake.clear()

    def _step(self, out: SchedulerOutput) -> None:
        """One step of `out`: ModelRunner.execute on the step's threads, then the
        scheduler's update_from_output, whose events go to the routers."""
        self.peak_batch_size = max(self.peak_batch_size, len(out.requests))
        self.metrics.batch_size.labels(phase="decode").observe(len(out.requests))
        with self.step_threads.step() as give_back:
            t0 = time.perf_counter()
            try:
                result = self.runner.execute(out, give_back)
            except Exception as e:   # a model or sampler fault fails the step, not the worker
                return self._step_failed(out, e)
            step_s = time.perf_counter() - t0
        self._observe(out, step_s)
        if self._spans:
            self._spans.step(out, step_s)
        self._publish(self._update(out, result, step_s))

    def _update(self, out: SchedulerOutput, result: ModelRunnerOutput,
                step_s: float) -> list[TokenEvent]:
        """The scheduler's update_from_output of the step, each event given its token's
        logprobs where asked; rows whose grammar broke fail first."""
        for req, error in zip(out.requests, result.errors):
            if error is not None:
                self.scheduler.abort(req.request_id, error=error)
        events = self.scheduler.update_from_output(out, list(result.sampled_token_ids), step_s)
        logprobs = {r.request_id: lp for r, lp in zip(out.requests, result.logprobs)
                    if lp is not None}
        return [e if not (e.token_ids and e.request_id in logprobs)
                else TokenEvent(e.request_id, e.token_ids, e.finish_reason, e.error,
                                (logprobs[e.request_id],)) for e in events]

    def _observe(self, out: SchedulerOutput, step_s: float) -> None:
        """A step's seconds: for the planner (decode rows only) and the TPOT budget."""
        if max(out.num_scheduled_tokens) == 1:
            self.step_stats += StepStats.of(len(out.requests), step_s)
        if self.step_budget is not None:
            self.step_budget.observe(self.step_threads.threads,
                                     out.total_num_scheduled_tokens, step_s)

    def _step_failed(self, out: SchedulerOutput, e: Exception) -> None:
        """The step's rows finish as errors (the router may retry them); a broken
        tensor-parallel group restarts the worker."""
        if isinstance(e, TPGroupBroken):
            self._group_broken(e)
        logger.exception("decode step of %d rows failed", len(out.requests))
        for r in out.requests:
            self.scheduler.abort(r.request_id, error=f"decode step failed: "
                                                    f"{type(e).__name__}: {e}")
