"""Router: a Ray actor hosting the gRPC front end and dispatching each request.

Lifecycle of one Generate call (ARCHITECTURE.md, "Request lifecycle"):

    validate + tokenize (chat template for messages)
    admit: queued requests / prompt tokens over max_queued_* → RESOURCE_EXHAUSTED at once
    pick decode worker D (fewest active requests, then most free blocks) → reserve
        (no room anywhere: wait in arrival order until the deadline, placement.py);
        D says how many leading prompt blocks its own prefix cache holds
    if D prefills locally (its uncached part is short, see local_prefill_max_tokens; or
        the prefill workers on D's node are idle and lend D their cores, or every
        prefill worker's queue is long: see placement.py):
        the first token comes on D's stream; no prefill worker is involved
    else pick prefill worker P (routing.py: kv_aware by default, cached prefix vs
        queue) → prefill into D's blocks, skipping the blocks D holds;
        P returns the first token → stream it (TTFT)
    relay D's token events (one stream per D, router/streams.py), detokenized; stop
        strings end the request here
    finish / cancel / error: abort on P and D, so every block is released

Nothing waits without a deadline: the gRPC deadline (or request_timeout_s) bounds the
whole call.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import grpc
import ray

from ..config import ClusterConfig
from ..decode_worker.fork import sample_id
from ..engine.loader import resolve_model
from ..engine.request import TokenEvent
from ..engine.structured_output import Grammars
from ..messages import PrefillOrder, PrefillResult
from ..metrics import RouterMetrics, serve as serve_metrics
from ..proto import pdserve_pb2 as pb
from ..request_ids import attempt_id
from . import admin, membership, validation
from .admission import Admission
from .errors import RequestError
from .relay import Relay
from .samples import best_of, by_request, merge, retry_groups, sample_relays
from .placement import Placement
from .planner import Planner
from .scaling import Scaler
from .stalls import StallWatch
from .routing import PrefillRouter
from .streams import DecodeStreams
from .tokenize_queue import TokenizeQueue
from .workers import AttemptFailed, Worker, attempt_failed

logger = logging.getLogger(__name__)

# structured outputs' grammars compile here (validation), apart from the tokenizer's thread
_GRAMMAR = ThreadPoolExecutor(1, thread_name_prefix="grammar")


class Router:
    """Ray actor. `start()` serves gRPC (and, with router.http_port, the OpenAI-compatible
    HTTP API of http_api.py) on the actor's event loop until `stop()`."""

    def __init__(self, config: ClusterConfig, prefill: list, decode: list, index: int = 0):
        """`index`: this replica's, of config.num_routers (pdserve/request_ids.py)."""
        from transformers import AutoConfig, AutoTokenizer

        from ..engine.config import ModelConfig

        logging.basicConfig(level=config.prefill.log_level)
        self.config = config
        self.index = index
        model_dir = resolve_model(config.prefill.model)
        self.model_config = ModelConfig.from_hf(AutoConfig.from_pretrained(model_dir))
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.grammars = Grammars(self.tokenizer, self.model_config.vocab_size,  # refuses a bad
                                 self.model_config.eos_token_ids)            # grammar first
        self.model_name = str(config.prefill.model)
        self._prefill_handles, self._decode_handles = prefill, decode
        self._server: grpc.aio.Server | None = None
        self._server_port = 0
        rc = config.router
        self.admission = Admission(rc.max_queued_requests, rc.max_queued_tokens)
        self.tokenize = TokenizeQueue(rc.max_tokenize_queue_chars)
        self.prefill_router = PrefillRouter(rc.routing_policy, config.prefill.block_size,
                                            rc.kv_load_weight)
        self.placement = Placement(config, self.prefill_router)   # workers from start() on
        self.scaler = Scaler(self)                                  # Admin.Scale
        self._cache_sync: asyncio.Task | None = None
        self._watch: asyncio.Task | None = None
        self._pending: set[asyncio.Task] = set()    # fire-and-forget calls in flight
        self.streams = DecodeStreams(index)         # decode workers' token events
        self.metrics = RouterMetrics(lambda: self.admission.queued_requests,
                                     rc.slo_ttft_ms, rc.slo_tpot_ms)
        self.stalls = StallWatch(rc.stream_stall_timeout_s, self.metrics.stalled.inc)
        self._stall_sweep: asyncio.Task | None = None
        self.planner = None if config.planner is None else Planner(self, config.planner)
        self._plan: asyncio.Task | None = None      # serve --planner slo (planner.py)
        self.metrics_address = ""
        self._http = None               # http_server.HTTPServer when router.http_port is set
        self.http_address = ""

    @property
    def prefill(self) -> list[Worker]:
        return self.placement.prefill

    @property
    def decode(self) -> list[Worker]:
        return self.placement.decode

    async def start(self, ports: dict[str, int] | None = None, restarted: bool = False) -> int:
        """Wait for every worker, then serve gRPC (and the OpenAI-compatible HTTP API
        when router.http_port is set). Returns the bound gRPC port.

        `ports` ({"grpc", "http", "metrics"}, each optional): where to serve instead of
        the configured ports: a replica's (num_routers > 1) are the first replica's,
        shared, and its /metrics on the configured port + its index (0: a free one).
        `restarted`: this actor was restarted after its process died (Cluster's watch;
        `ports` its previous incarnation's). Its workers are then the live named ones
        (scaling may have changed them since it was built), waited for each at most
        worker_ready_timeout_s (one that does not answer is left out and probed like
        a dead one), and every request this replica had on them is aborted: their
        callers' connections died with the process, so their KV is freed at once
        rather than kept decoding for nobody.

        Raises:
            SecurityConfigError: a tls_* file cannot be read or is not PEM.
            RuntimeError: an address could not be bound.
        """
        from .service import build_server

        rc = self.config.router
        await membership.join(self, restarted)
        if rc.routing_policy == "kv_aware":
            self._cache_sync = asyncio.get_running_loop().create_task(admin.sync_prefix_caches(self))
        self._watch = asyncio.get_running_loop().create_task(admin.watch_workers(self))
        self._stall_sweep = asyncio.get_running_loop().create_task(self.stalls.run())
        if self.planner is not None and self.index == 0:     # one planner sizes the pools
            self._plan = asyncio.get_running_loop().create_task(self.planner.run())
        ports = ports or {}
        self._server, port = build_server(self, f"{rc.host}:{ports.get('grpc', rc.port)}")
        await self._server.start()
        self._server_port = port
        metrics_port = rc.metrics_port + self.index if rc.metrics_port else 0
        self.metrics_address = "%s:%d" % serve_metrics(self.metrics.registry, rc.host,
                                                       ports.get("metrics", metrics_port))
        logger.info("router serving gRPC on %s:%d, metrics on http://%s/metrics", rc.host, port,
                    self.metrics_address)
        if rc.http_port is not None:
            from .http_server import serve_http   # FastAPI + uvicorn only when asked for
            self._http = await serve_http(self, rc.host, ports.get("http", rc.http_port))
            self.http_address = "%s:%d" % (rc.host, self._http.port)
            logger.info("router serving the OpenAI-compatible HTTP API on http%s://%s",
                        "s" if rc.tls_cert_file else "", self.http_address)
        return port

    def serving(self) -> dict[str, int] | None:
        """The bound ports ({"grpc", "http", "metrics"}), or None when this incarnation
        does not serve (Ray restarted it and start() was not called yet, or stop())."""
        if self._server is None:
            return None
        ports = {"grpc": self._server_port,
                 "metrics": int(self.metrics_address.rsplit(":", 1)[1])}
        if self._http is not None:
            ports["http"] = self._http.port
        return ports

    def http_port(self) -> int | None:
        """The bound port of the HTTP API, or None when it is off."""
        return self._http.port if self._http is not None else None

    async def stop(self, grace_s: float = 2.0) -> None:
        for task in (self._cache_sync, self._watch, self._plan, self._stall_sweep):
            if task is not None:
                task.cancel()
        self._cache_sync = self._watch = self._plan = self._stall_sweep = None
        if self._http is not None:
            await self._http.stop(grace_s)
            self._http = None
        if self._server is not None:
            await self._server.stop(grace_s)
            self._server = None
        await self.streams.stop()
        self.scaler.stop()

    # --- Generate -------------------------------------------------------------------

    async def generate(self, req: pb.GenerateRequest, deadline_s: float | None
                       ) -> AsyncIterator[pb.GenerateResponse]:
        """Serve one request as a stream of GenerateResponse. With sampling.n > 1 the
        messages of its samples interleave, each naming its sample (`index`); they share
        one reservation and one prefill, forked on D (decode_worker/fork.py). With
        best_of, its samples are ranked by cumulative logprob (vLLM's rule) and the n
        best sent at the end, renumbered in that order (router/samples.py).

        A failed attempt (a worker died, a KV transfer failed) is retried on live
        workers as `prompt + tokens already streamed`, for the rest of max_tokens and
        with the sampler's step continuing (so greedy and seeded outputs equal an
        uninterrupted run's); at most `router.max_migrations` times per sample.

        Raises:
            InvalidRequestError: bad input (→ INVALID_ARGUMENT).
            RequestError: capacity (RESOURCE_EXHAUSTED: the router's queue is full, see
                admission.py, or no decode KV space within reserve_timeout_s when set);
                the deadline (DEADLINE_EXCEEDED, waiting for KV space included); UNAVAILABLE when no worker of a role is up
                within the deadline or the request failed more than max_migrations times.
        """
        cfg = self.model_config
        client_id = validation.request_id(req)
        # Off the event loop (a long prompt must not stall other streams), shortest first,
        # refused at once when the tokenizer's queue is full (tokenize_queue.py).
        self.admission.check_room()            # a full router refuses before any work
        ids = await self.tokenize.run(
            validation.prompt_chars(req), validation.prompt_token_ids, req, self.tokenizer,
            cfg.vocab_size, cfg.max_model_len)
        args = (req, len(ids), cfg.max_model_len, cfg.vocab_size, self.grammars)
        params = (await asyncio.get_running_loop().run_in_executor(
            _GRAMMAR, validation.sampling_params, *args)  # off the loop: a grammar compiles
                  if req.sampling.HasField("structured_outputs")
                  else validation.sampling_params(*args))
        self.placement.check_fits(len(ids), params.max_tokens)
        rid = client_id or uuid.uuid4().hex
        deadline = time.monotonic() + (deadline_s or self.config.router.request_timeout_s)
        ranked = params.num_samples > params.n
        params, relays = sample_relays(rid, self.tokenizer, ids, params, cfg.eos_token_ids,
                                       cfg.max_model_len)
        resumed = validation.resume_token_ids(req, params, len(ids), cfg.vocab_size,
                                              cfg.max_model_len)
        if resumed:     # goes on as the router's own retry does, after those tokens
            relays[0].resume(resumed)
        # Admitted before any wait (a full queue is refused here, at once). The ticket is
        # released at the first token, or by the `with` on any earlier exit: reserve
        # timeout, error, client cancel, deadline. release() is idempotent.
        with self.admission.admit(len(ids), params.max_tokens * len(relays)) as queued:
            async with aclosing(self._serve(rid, ids, params, deadline, relays, queued,
                                            [])) as stream:
                if ranked:
                    for msg in await best_of(stream, relays, params.n):
                        yield msg
                else:
                    async for msg in stream:
                        yield msg
        self.metrics.totals.complete(sum(len(r.token_ids) for r in relays),
                                     params.max_tokens * len(relays))

    async def _serve(self, rid: str, ids: list[int], params, deadline: float,
                     relays: list[Relay], queued, failures: list[str]
                     ) -> AsyncIterator[pb.GenerateResponse]:
        """Attempts until every sample of `relays` has finished: all together while none
        has streamed a token (one reservation and prefill, forked on D), else those
        with tokens each on its own (their prompts differ by the tokens streamed) and
        the others in runs forked again (samples.retry_groups), merged. `params`'
        sample 0 is relays[0]'s."""
        while True:
            # The relay applies D's stop rule to every token it streams, so a stream
            # that had ended (even if D died before its finish event) is finished
            # there and no attempt fails after it: a retry always resumes a live one.
            live = [r for r in relays if r.finish_reason is None]
            if not live:
                return
            if len(live) > 1 and (len(live) < len(relays) or any(r.token_ids for r in live)):
                base = relays[0].index
                each = merge([self._serve(rid, ids, replace(params.sample(g[0].index - base),
                                                            n=len(g)),
                                          deadline, g, queued, list(failures))
                              for g in retry_groups(live)])
                async with aclosing(each):
                    async for msg in each:
                        yield msg
                return
            one = live[0] if len(live) == 1 else None
            sent = one.token_ids if one is not None else []
            attempt = params if one is None else params.sample(one.index - relays[0].index)
            attempt = replace(attempt, max_tokens=attempt.max_tokens - len(sent),
                              step_offset=attempt.step_offset + len(sent),   # a retry's
                              prompt_logprobs=None if live[0].prompt_logprobs is not None
                              else attempt.prompt_logprobs)
            try:
                async with aclosing(self._attempt(rid, ids + sent, attempt, deadline, live,
                                                  queued)) as tried:
                    async for msg in tried:
                        yield msg
            except AttemptFailed as e:
                failures += [str(e)] if e.reason != "rebalance" else []   # not a fault
                self.metrics.retries.labels(reason=e.reason).inc()
                limit = self.config.router.max_migrations
                if len(failures) > limit:
                    raise RequestError(
                        grpc.StatusCode.UNAVAILABLE,
                        f"request failed {len(failures)} times (router.max_migrations="
                        f"{limit}): " + "; ".join(failures[-3:])) from None
                logger.warning("request %s: %s; retrying on live workers after the %s "
                               "tokens streamed (%d/%d)", rid, e,
                               "+".join(str(len(r.token_ids)) for r in live),
                               len(failures), limit)

    async def _attempt(self, rid: str, ids: list[int], params, deadline: float,
                       relays: list[Relay], queued) -> AsyncIterator[pb.GenerateResponse]:
        """One try at serving `ids` (the prompt, plus the tokens streamed by earlier
        attempts) on one decode worker D, prefilled by one prefill worker P or by D;
        relays[k] takes sample k of params.num_samples (one relay: params is its own).

        Raises:
            AttemptFailed: P or D died, or the KV transfer or D failed (retryable).
            RequestError: deadline, capacity, no worker available (final).
        """
        internal_id = attempt_id(rid, self.index)   # unique per attempt; names this replica
        on_d = {sample_id(internal_id, k): r for k, r in enumerate(relays)}
        self.streams.open(internal_id, tuple(on_d)[1:])  # before D may produce a token
        try:
            d, res, p = await self.placement.reserve(   # charges D.load with the relays
                internal_id, len(ids), params, deadline, ids, len(relays))
        except BaseException:
            self.streams.close(internal_id)
            raise
        self.metrics.prefills.labels(on="decode_worker" if p is None else "prefill_worker").inc()
        # prompt tokens charged by _reserve to P's queue or to D's own, until the first token
        local_tokens, p_tokens = (0, len(ids)) if p is not None else (len(ids), 0)
        sent, queued_on_d = time.monotonic(), d.local_prefill_load    # D's own prefill
        finished = False
        try:
            self.streams.bind(internal_id, d, res.epoch)
            if p is not None:
                try:
                    first = await self._prefill(p, internal_id, ids, params, res, deadline)
                finally:
                    p.load -= p_tokens
                    p_tokens = 0
                    queued.release()  # first token back (or prefill failed): not queued
                if (msg := self._first_message(first, internal_id, params, relays)) is not None:
                    yield msg                   # TTFT
            error = None
            # A sample a stop string ended is aborted on D at once, the others go on; one
            # ended at P's token only once a sibling's event shows D forked the prompt
            # (an abort before the fork would leave the siblings unborn).
            stop0 = [len(relays) > 1 and relays[0].stopped_here]
            if any(r.finish_reason is None for r in relays):
                try:
                    async for events in self.streams.batches(internal_id, deadline):
                        queued.release()  # local prefill: its first token came from D
                        if local_tokens:
                            self.placement.first_token.observe(d.worker_id, queued_on_d,
                                                               time.monotonic() - sent)
                        d.local_prefill_load -= local_tokens
                        local_tokens = 0
                        msgs, error = self._absorb(events, on_d, d, internal_id, stop0)
                        for msg in msgs:
                            yield msg
                        if error is not None or all(r.finish_reason is not None for r in relays):
                            break
                except ray.exceptions.RayError as e:
                    raise attempt_failed("decode", d, e) from e
            if error is not None:
                raise AttemptFailed("decode", f"decode on {d.worker_id} failed: {error}")
            if any(r.finish_reason is None for r in relays):
                raise AttemptFailed("decode", f"decode stream of {d.worker_id} ended "
                                               "without finishing")
            finished = not any(r.stopped_here for r in relays)   # else D may still run
        except asyncio.TimeoutError:
            raise RequestError(grpc.StatusCode.DEADLINE_EXCEEDED,
                               "request deadline exceeded") from None
        finally:
            self.streams.close(internal_id)
            self.placement.charge(d, p, p_tokens, -1, len(relays))
            d.local_prefill_load -= local_tokens
            self.placement.room.freed()     # its blocks come back: a waiting request asks
            if not finished:  # cancel, deadline, error, stop string: release P and D now
                # (sent to a worker found dead too: it may only have been unreachable)
                if p is not None:
                    self._send(p.handle.abort.remote(internal_id))
                self._send(d.handle.abort.remote(internal_id, "cancelled", group=len(relays) > 1))

    async def _prefill(self, p: Worker, internal_id: str, ids: list[int], params, res,
                       deadline: float) -> PrefillResult:
        """P's prefill of attempt `internal_id` into D's reservation `res`: its first
        token, once the KV is sent. Its time feeds placement.first_token; with
        replicas, its reported queue P's share of the others.

        Raises:
            AttemptFailed: P died or failed (retryable). asyncio.TimeoutError: deadline.
        """
        sent, queued_on_p = time.monotonic(), p.total_load   # this prompt included
        try:
            first: PrefillResult = await asyncio.wait_for(
                p.handle.prefill.remote(PrefillOrder(
                    internal_id, ids, params, res.kv_address, res.epoch,
                    res.num_cached_blocks, res.kv_rank_addresses)),
                timeout=max(deadline - time.monotonic(), 0.001))
        except ray.exceptions.RayError as e:
            raise attempt_failed("prefill", p, e) from e
        self.placement.first_token.observe(p.worker_id, queued_on_p, time.monotonic() - sent)
        if self.config.num_routers > 1:   # the others' share, as P counts it
            p.reported(first.queued_tokens)
        return first

    @staticmethod
    def _first_message(first: PrefillResult, internal_id: str, params, relays: list[Relay]
                       ) -> pb.GenerateResponse | None:
        """P's first token into sample 0's relay (D samples the others after the fork),
        and the prompt logprobs into every sample's first message."""
        if params.prompt_logprobs is not None:
            for r in relays:
                r.set_prompt_logprobs(first.prompt_logprobs)
        return relays[0].absorb([TokenEvent(internal_id, (first.first_token,),
                                            logprobs=(first.logprobs,) if first.logprobs else ())])

    def _absorb(self, events: list[TokenEvent], on_d: dict[str, Relay], d: Worker,
                internal_id: str, stop0: list[bool]
                ) -> tuple[list[pb.GenerateResponse], str | None]:
        """One batch of D's events into the relays of the attempt's samples (`on_d`, by
        their ids on D): the messages they make, and the first sample error (taken off
        its relay: the retry starts clean). A sample a stop string ended is aborted on
        D; sample 0 ended at P's token (`stop0[0]`) once a sibling's event shows D
        forked the prompt."""
        out, error = [], None
        for sid, evs in by_request(events).items():
            r = on_d[sid]
            if r.finish_reason is None:
                msg = r.absorb(evs)
                if msg is not None:
                    out.append(msg)
                if r.stopped_here and len(on_d) > 1:
                    self._send(d.handle.abort.remote(sid, "cancelled"))
            elif any(e.finish_reason == "error" for e in evs):
                r.error = evs[-1].error or "unknown error"  # before the fork
            error, r.error = error or r.error, None
            if stop0[0] and sid != internal_id:
                stop0[0] = False
                self._send(d.handle.abort.remote(internal_id, "cancelled"))
        return out, error

    def _send(self, ref) -> None:
        """Fire a call whose result does not matter; its error (the worker is dead or
        restarting) is dropped here rather than logged by Ray as unhandled."""
        if not inspect.isawaitable(ref):   # a test's fake handle
            return

        async def wait() -> None:
            try:
                await ref
            except Exception as e:
                logger.debug("abort not delivered: %r", e)

        task = asyncio.get_running_loop().create_task(wait())
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    # --- Admin (admin.py) ------------------------------------------------------------

    async def drain(self, node_ip: str, timeout_s: float) -> pb.DrainResponse:
        return await admin.drain(self, node_ip, timeout_s)

    async def cluster_status(self) -> pb.ClusterStatusResponse:
        return await admin.cluster_status(self)

    async def sync_members(self) -> tuple[list[str], list[str]]:
        """Another replica scaled or drained: membership.sync_members."""
        return await membership.sync_members(self)

    async def scale(self, num_prefill: int, num_decode: int, timeout_s: float
                    ) -> pb.ScaleResponse:
        if self.planner is not None:    # it would undo the call at its next interval
            raise RuntimeError("the SLO planner sizes the pools (serve --planner slo); "
                               "Admin.Scale is off while it runs")
        return await self.scaler.scale(num_prefill, num_decode, timeout_s)
