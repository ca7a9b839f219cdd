"""Router: a Ray actor hosting the gRPC front end and dispatching each request.

Lifecycle of one Generate call (ARCHITECTURE.md, "Request lifecycle"):

    validate + tokenize (chat template for messages)
    admit: queued requests / prompt tokens over max_queued_* → RESOURCE_EXHAUSTED at once
    pick decode worker D (fewest active requests, then most free blocks) → reserve
        (no room anywhere: retry until reserve_timeout_s, then RESOURCE_EXHAUSTED);
        D says how many leading prompt blocks its own prefix cache holds
    if D prefills locally (its uncached part is short, see local_prefill_max_tokens; or
        the prefill workers on D's node are idle and lend D their cores, or every
        prefill worker's queue is long: see _prefill_on_decode):
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import grpc
import ray

from ..config import ClusterConfig
from ..engine.block_pool import blocks_needed
from ..engine.loader import resolve_model
from ..engine.request import TokenEvent
from ..engine.sampling_params import InvalidRequestError
from ..messages import PrefillOrder
from ..metrics import RouterMetrics, serve as serve_metrics
from ..proto import pdserve_pb2 as pb
from . import validation
from .admission import Admission
from .detokenizer import Detokenizer
from .errors import RequestError
from .relay import Relay
from .routing import PrefillRouter
from .streams import DecodeStreams
from .workers import AttemptFailed, Worker, attempt_failed

logger = logging.getLogger(__name__)

_TOKENIZE = ThreadPoolExecutor(1, thread_name_prefix="tokenize")


class Router:
    """Ray actor. `start()` serves gRPC (and, with router.http_port, the OpenAI-compatible
    HTTP API of http_api.py) on the actor's event loop until `stop()`."""

    def __init__(self, config: ClusterConfig, prefill: list, decode: list):
        from transformers import AutoConfig, AutoTokenizer

        from ..engine.config import ModelConfig

        logging.basicConfig(level=config.prefill.log_level)
        self.config = config
        model_dir = resolve_model(config.prefill.model)
        self.model_config = ModelConfig.from_hf(AutoConfig.from_pretrained(model_dir))
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model_name = str(config.prefill.model)
        self._prefill_handles, self._decode_handles = prefill, decode
        self.prefill: list[Worker] = []
        self.decode: list[Worker] = []
        self._server: grpc.aio.Server | None = None
        rc = config.router
        self.admission = Admission(rc.max_queued_requests, rc.max_queued_tokens)
        self.prefill_router = PrefillRouter(rc.routing_policy, config.prefill.block_size,
                                            rc.kv_load_weight)
        self._cache_sync: asyncio.Task | None = None
        self._watch: asyncio.Task | None = None
        self._pending: set[asyncio.Task] = set()    # fire-and-forget calls in flight
        self.streams = DecodeStreams()              # decode workers' token events
        self.metrics = RouterMetrics(lambda: self.admission.queued_requests,
                                     rc.slo_ttft_ms, rc.slo_tpot_ms)
        self.metrics_address = ""
        self._http = None               # http_api.HTTPServer when router.http_port is set
        self.http_address = ""

    async def start(self) -> int:
        """Wait for every worker, then serve gRPC (and the OpenAI-compatible HTTP API
        when router.http_port is set). Returns the bound gRPC port.

        Raises:
            SecurityConfigError: a tls_* file cannot be read or is not PEM.
            RuntimeError: an address could not be bound.
        """
        from .service import build_server

        infos = await asyncio.gather(*(h.ready.remote() for h in self._prefill_handles))
        self.prefill = [Worker(h, i.worker_id, i.num_blocks, i.epoch, node_ip=i.node_ip)
                        for h, i in zip(self._prefill_handles, infos)]
        infos = await asyncio.gather(*(h.ready.remote() for h in self._decode_handles))
        self.decode = [Worker(h, i.worker_id, i.num_blocks, i.epoch, free_blocks=i.num_blocks,
                              node_ip=i.node_ip)
                       for h, i in zip(self._decode_handles, infos)]
        # Pair every P with every D now, so a layout mismatch fails `serve` at start
        # with a message naming the field, not the first request.
        await asyncio.gather(*(p.handle.pair.remote([i.kv_address for i in infos])
                               for p in self.prefill))
        rc = self.config.router
        if rc.routing_policy == "kv_aware":
            self._cache_sync = asyncio.get_running_loop().create_task(self._sync_prefix_caches())
        self._watch = asyncio.get_running_loop().create_task(self._watch_workers())
        self._server, port = build_server(self, f"{rc.host}:{rc.port}")
        await self._server.start()
        self.metrics_address = "%s:%d" % serve_metrics(self.metrics.registry, rc.host,
                                                       rc.metrics_port)
        logger.info("router serving gRPC on %s:%d, metrics on http://%s/metrics", rc.host, port,
                    self.metrics_address)
        if rc.http_port is not None:
            from .http_api import serve_http   # FastAPI + uvicorn only when asked for
            self._http = await serve_http(self, rc.host, rc.http_port)
            self.http_address = "%s:%d" % (rc.host, self._http.port)
            logger.info("router serving the OpenAI-compatible HTTP API on http%s://%s",
                        "s" if rc.tls_cert_file else "", self.http_address)
        return port

    def http_port(self) -> int | None:
        """The bound port of the HTTP API, or None when it is off."""
        return self._http.port if self._http is not None else None

    async def stop(self, grace_s: float = 2.0) -> None:
        for task in (self._cache_sync, self._watch):
            if task is not None:
                task.cancel()
        self._cache_sync = self._watch = None
        if self._http is not None:
            await self._http.stop(grace_s)
            self._http = None
        if self._server is not None:
            await self._server.stop(grace_s)
            self._server = None
        await self.streams.stop()

    # --- Generate -------------------------------------------------------------------

    async def generate(self, req: pb.GenerateRequest, deadline_s: float | None
                       ) -> AsyncIterator[pb.GenerateResponse]:
        """Serve one request as a stream of GenerateResponse.

        A failed attempt (a worker died, a KV transfer failed) is retried on live
        workers as `prompt + tokens already streamed`, for the rest of max_tokens and
        with the sampler's step continuing (so greedy and seeded outputs equal an
        uninterrupted run's); at most `router.max_migrations` times.

        Raises:
            InvalidRequestError: bad input (→ INVALID_ARGUMENT).
            RequestError: capacity (RESOURCE_EXHAUSTED: the router's queue is full, see
                admission.py, or no decode KV space within reserve_timeout_s); the
                deadline (DEADLINE_EXCEEDED); UNAVAILABLE when no worker of a role is up
                within the deadline or the request failed more than max_migrations times.
        """
        cfg = self.model_config
        client_id = validation.request_id(req)
        # Off the event loop (a long prompt must not stall other streams), on one thread:
        # HF tokenizers raise "Already borrowed" when one is used from two threads at once.
        ids = await asyncio.get_running_loop().run_in_executor(
            _TOKENIZE, validation.prompt_token_ids, req, self.tokenizer, cfg.vocab_size,
            cfg.max_model_len)
        params = validation.sampling_params(req, len(ids), cfg.max_model_len)
        self._check_fits(len(ids), params.max_tokens)
        rid = client_id or uuid.uuid4().hex
        deadline = time.monotonic() + (deadline_s or self.config.router.request_timeout_s)
        relay = Relay(rid, Detokenizer(self.tokenizer, ids, params.stop), len(ids), params,
                      frozenset(cfg.eos_token_ids), cfg.max_model_len)
        failures: list[str] = []
        # Admitted before any wait (a full queue is refused here, at once). The ticket is
        # released at the first token, or by the `with` on any earlier exit: reserve
        # timeout, error, client cancel, deadline. release() is idempotent.
        with self.admission.admit(len(ids)) as queued:
            while True:
                # The relay applies D's stop rule to every token it streams, so a stream
                # that had ended (even if D died before its finish event) is finished
                # there and no attempt fails after it: a retry always resumes a live one.
                assert relay.finish_reason is None, (rid, relay.finish_reason)
                sent = len(relay.token_ids)
                attempt = replace(params, max_tokens=params.max_tokens - sent,
                                  step_offset=params.step_offset + sent)
                try:
                    async for msg in self._attempt(rid, ids + relay.token_ids, attempt,
                                                   deadline, relay, queued):
                        yield msg
                    return
                except AttemptFailed as e:
                    failures.append(str(e))
                    self.metrics.retries.labels(reason=e.reason).inc()
                    limit = self.config.router.max_migrations
                    if len(failures) > limit:
                        raise RequestError(
                            grpc.StatusCode.UNAVAILABLE,
                            f"request failed {len(failures)} times (router.max_migrations="
                            f"{limit}): " + "; ".join(failures[-3:])) from None
                    logger.warning("request %s: %s; retrying on live workers after the %d "
                                   "tokens streamed (%d/%d)", rid, e, len(relay.token_ids),
                                   len(failures), limit)

    async def _attempt(self, rid: str, ids: list[int], params, deadline: float,
                       relay: Relay, queued) -> AsyncIterator[pb.GenerateResponse]:
        """One try at serving `ids` (the prompt, plus the tokens streamed by earlier
        attempts) on one decode worker D, prefilled by one prefill worker P or by D.

        Raises:
            AttemptFailed: P or D died, or the KV transfer or D failed (retryable).
            RequestError: deadline, capacity, no worker available (final).
        """
        internal_id = f"{rid}#{uuid.uuid4().hex[:8]}"   # unique per attempt and client id
        self.streams.open(internal_id)   # before D may produce a token (a local prefill)
        try:
            d, res, p = await self._reserve(internal_id, len(ids), params, deadline, ids)
        except BaseException:
            self.streams.close(internal_id)
            raise
        d.load += 1
        # prompt tokens charged by _reserve to P's queue or to D's own, until the first token
        local_tokens, p_tokens = (0, len(ids)) if p is not None else (len(ids), 0)
        finished = False
        try:
            self.streams.bind(internal_id, d, res.epoch)
            if p is not None:
                try:
                    first = await asyncio.wait_for(
                        p.handle.prefill.remote(PrefillOrder(
                            internal_id, ids, params, res.kv_address, res.epoch,
                            res.num_cached_blocks)),
                        timeout=max(deadline - time.monotonic(), 0.001))
                except ray.exceptions.RayError as e:
                    raise attempt_failed("prefill", p, e) from e
                finally:
                    p.load -= p_tokens
                    p_tokens = 0
                    queued.release()  # first token back (or prefill failed): not queued
                msg = relay.absorb([TokenEvent(internal_id, (first,))])   # TTFT: at once
                if msg is not None:
                    yield msg
            if relay.finish_reason is None:
                try:
                    async for events in self.streams.batches(internal_id, deadline):
                        queued.release()  # local prefill: its first token came from D
                        d.local_prefill_load -= local_tokens
                        local_tokens = 0
                        msg = relay.absorb(events)
                        if msg is not None:
                            yield msg
                        if relay.finish_reason is not None or relay.error is not None:
                            break
                except ray.exceptions.RayError as e:
                    raise attempt_failed("decode", d, e) from e
            if relay.error is not None:
                error, relay.error = relay.error, None
                raise AttemptFailed("decode", f"decode on {d.worker_id} failed: {error}")
            if relay.finish_reason is None:
                raise AttemptFailed("decode", f"decode stream of {d.worker_id} ended "
                                               "without finishing")
            finished = not relay.stopped_here   # else D still runs: abort it below
        except asyncio.TimeoutError:
            raise RequestError(grpc.StatusCode.DEADLINE_EXCEEDED,
                               "request deadline exceeded") from None
        finally:
            self.streams.close(internal_id)
            d.load -= 1
            d.local_prefill_load -= local_tokens
            if p is not None:
                p.load -= p_tokens
            if not finished:  # cancel, deadline, error, stop string: release P and D now
                # (sent to a worker found dead too: it may only have been unreachable)
                if p is not None:
                    self._send(p.handle.abort.remote(internal_id))
                self._send(d.handle.abort.remote(internal_id, "cancelled"))

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

    async def _available(self, workers: list[Worker], role: str, deadline: float
                         ) -> list[Worker]:
        """The workers of a role not known to be dead nor draining. When none is, wait
        for Ray to restart one (probing them with ready()) until `deadline`.

        Raises:
            RequestError: UNAVAILABLE, none came back before the deadline.
        """
        delay = 0.05
        while True:
            live = [w for w in workers if w.available]
            if live:
                return live
            await asyncio.gather(*(self._probe(w) for w in workers if not w.alive))
            if any(w.available for w in workers):
                continue
            if time.monotonic() + delay >= deadline:
                raise RequestError(grpc.StatusCode.UNAVAILABLE,
                                   f"no {role} worker is available: all {len(workers)} are "
                                   "down and none restarted within the request's deadline")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)

    async def _probe(self, w: Worker, timeout_s: float = 1.0) -> None:
        """Mark `w` alive again once it answers ready(); a new epoch (Ray restarted it)
        resets the router's mirror of its prefix cache."""
        try:
            info = await asyncio.wait_for(w.handle.ready.remote(), timeout=timeout_s)
        except Exception:  # still down or restarting
            return
        if info.epoch != w.epoch:
            logger.warning("%s restarted on %s (epoch %x -> %x)", w.worker_id, info.node_ip,
                           w.epoch, info.epoch)
            w.epoch, w.node_ip, w.draining = info.epoch, info.node_ip, False
            self.prefill_router.index.forget(w.worker_id)
        w.alive = True

    async def _watch_workers(self) -> None:
        """Probe the workers marked dead every worker_probe_interval_s, so one that Ray
        restarted takes requests again while others of its role are serving."""
        while True:
            await asyncio.sleep(self.config.router.worker_probe_interval_s)
            await asyncio.gather(*(self._probe(w) for w in self.prefill + self.decode
                                   if not w.alive))

    async def _sync_prefix_caches(self) -> None:
        """Mirror every prefill worker's prefix cache (routing.PrefixIndex) by polling its
        cache events every cache_sync_interval_s; a worker that does not answer in time
        is skipped this round (its mirror just goes stale)."""
        interval = self.config.router.cache_sync_interval_s
        index = self.prefill_router.index
        while True:
            for w in self.prefill:
                try:
                    reply = await asyncio.wait_for(
                        w.handle.cache_events.remote(index.since(w.worker_id)), timeout=5)
                except Exception as e:  # dead, restarting or slow: try again next round
                    logger.debug("prefix cache of %s not synced: %r", w.worker_id, e)
                    continue
                if reply.epoch != w.epoch:   # restarted: its events restart from 0
                    index.forget(w.worker_id)
                    w.epoch = reply.epoch
                    continue
                index.apply(w.worker_id, reply)
            await asyncio.sleep(interval)

    def _check_fits(self, prompt_len: int, max_tokens: int) -> None:
        bs = self.config.decode.block_size
        need = blocks_needed(prompt_len + max_tokens, bs)
        most = max(w.num_blocks for w in self.decode)
        if need > most:
            raise InvalidRequestError(
                "sampling.max_tokens", f"prompt ({prompt_len}) + max_tokens ({max_tokens}) needs "
                                       f"{need} KV blocks; the largest decode worker has {most}")
        if blocks_needed(prompt_len, bs) > max(w.num_blocks for w in self.prefill):
            raise InvalidRequestError("prompt", f"{prompt_len} tokens exceed every prefill "
                                                "worker's KV pool")

    async def _reserve(self, rid: str, prompt_len: int, params, deadline: float,
                       ids: list[int]) -> tuple[Worker, dict, Worker | None]:
        """Reserve on the best live decode worker with room, waiting for room (or for
        Ray to restart a dead one) until reserve_timeout_s, and choose who prefills:
        returns (D, D's reservation, P), P None when D prefills the prompt itself. The
        prompt's tokens are charged to P's queue (P.load) or D's own
        (D.local_prefill_load) when the choice is made, before the reserve call is
        awaited: the requests of a burst, whose choices are made while the first
        reservations are in flight, see each other's load. The caller releases the
        charge. The reservation's lease ends with the request's deadline at the
        latest, so D reclaims it even if this router goes away."""
        give_up = min(deadline, time.monotonic() + self.config.router.reserve_timeout_s)
        delay = 0.01
        while True:
            live = await self._available(self.decode, "decode", give_up)
            live_p = await self._available(self.prefill, "prefill", deadline)
            lease_s = min(self.config.decode.lease_s, max(deadline - time.monotonic(), 0.001))
            for d in sorted(live, key=lambda w: (w.load, -w.free_blocks)):
                # choose and charge with no await in between
                local = self._prefill_on_decode(d, prompt_len)
                p = None if local else self.prefill_router.pick(
                    [w for w in live_p if w.available] or live_p, ids)[0]
                self._charge(d, p, prompt_len, 1)
                try:
                    res = await d.handle.reserve.remote(rid, prompt_len, params, ids, lease_s,
                                                        local)
                except ray.exceptions.RayActorError:   # dead or restarting: try the next
                    self._charge(d, p, prompt_len, -1)
                    d.alive = False
                    continue
                except BaseException:
                    self._charge(d, p, prompt_len, -1)
                    raise
                if res is None:
                    self._charge(d, p, prompt_len, -1)
                    continue
                d.free_blocks = res.free_blocks
                if res.local_prefill and p is not None:   # D's own threshold chose it
                    self._charge(d, p, prompt_len, -1)
                    self._charge(d, None, prompt_len, 1)
                    p = None
                return d, res, p
            if not any(d.available for d in live):
                continue          # every one died meanwhile: wait for a restart above
            if time.monotonic() + delay > give_up:
                raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                   "no decode worker has free KV blocks for this request; "
                                   "retry later or lower max_tokens")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.2)

    @staticmethod
    def _charge(d: Worker, p: Worker | None, tokens: int, sign: int) -> None:
        """Add (sign 1) or take back (-1) a prompt's tokens on the queue of whoever
        prefills it: P, or D itself when p is None."""
        if p is not None:
            p.load += sign * tokens
        else:
            d.local_prefill_load += sign * tokens

    def _prefill_on_decode(self, d: Worker, prompt_len: int) -> bool:
        """Conditional disaggregation: whether D prefills the prompt itself.

        - D has no prefill of its own queued and prefill workers on D's node, at least
          as many as its decode workers, have none either
          (router.local_prefill_when_prefill_idle, with core lending on): the idle
          workers lend D their threads (pdserve/core_share.py), so D computes the
          prompt on its cores and theirs, where a prefill worker would use its own
          alone. The next prompt, while D is at it, goes to a prefill worker.
        - Every live prefill worker has more than router.max_prefill_queue_tokens prompt
          tokens queued, and more than D would have queued for its own prefills with
          this prompt (Dynamo's disaggregated router decides the same way, by its
          max_prefill_queue_size). A burst is then split between P and D instead of
          waiting for P alone. The limit defaults to one prefill step's budget (prefill
          workers' max_num_batched_tokens)."""
        rc = self.config.router
        if (rc.local_prefill_when_prefill_idle and self.config.decode.core_share_dir
                and d.local_prefill_load == 0):
            # each decode worker of the node gets a share of the idle workers' threads
            # (core_share), so D gets at least one when they are at least as many
            idle = sum(p.available and p.load == 0 and p.node_ip == d.node_ip
                       for p in self.prefill)
            if idle and idle >= sum(w.node_ip == d.node_ip for w in self.decode):
                return True
        limit = rc.max_prefill_queue_tokens
        if limit is None:
            limit = self.config.prefill.max_num_batched_tokens
        queued = [p.load for p in self.prefill if p.available]
        if not limit or not queued:
            return False
        shortest = min(queued)
        return shortest > limit and shortest > d.local_prefill_load + prompt_len

    # --- Admin ------------------------------------------------------------------------

    async def drain(self, node_ip: str, timeout_s: float) -> pb.DrainResponse:
        """Stop sending new requests to the workers on `node_ip`, then wait up to
        `timeout_s` seconds for their running and waiting requests to finish. A drained
        worker takes requests again only once Ray restarts it (a new epoch).

        Raises:
            InvalidRequestError: no worker runs on `node_ip`, or timeout_s is not in
                [0, 3600] seconds.
        """
        if not 0 <= timeout_s <= 3600:
            raise InvalidRequestError("timeout_s", f"must be in [0, 3600] seconds, got {timeout_s}")
        workers = [w for w in self.prefill + self.decode if w.node_ip == node_ip]
        if not workers:
            known = sorted({w.node_ip for w in self.prefill + self.decode})
            raise InvalidRequestError("node_ip", f"no worker runs on {node_ip!r} (nodes: "
                                                 f"{', '.join(known)})")
        for w in workers:
            w.draining = True
        logger.warning("draining %s on %s", [w.worker_id for w in workers], node_ip)
        deadline = time.monotonic() + timeout_s
        while True:
            busy = 0
            for w in workers:
                try:
                    s = await asyncio.wait_for(w.handle.status.remote(), timeout=5)
                    busy += s.running_requests + s.waiting_requests
                except Exception:    # dead already: nothing of its own to wait for
                    continue
            if busy == 0 or time.monotonic() >= deadline:
                return pb.DrainResponse(worker_ids=[w.worker_id for w in workers],
                                        drained=busy == 0, running_requests=busy)
            await asyncio.sleep(min(0.2, max(deadline - time.monotonic(), 0)))

    async def cluster_status(self) -> pb.ClusterStatusResponse:
        workers = self.prefill + self.decode

        async def one(w: Worker) -> pb.WorkerStatus:
            try:
                s = await asyncio.wait_for(w.handle.status.remote(), timeout=5)
            except Exception as e:  # dead or hung worker: report it, do not fail the call
                role = "prefill" if w in self.prefill else "decode"
                return pb.WorkerStatus(worker_id=w.worker_id, role=role, state=f"dead: {e}"[:200],
                                       kv_blocks_total=w.num_blocks)
            return s.to_proto()

        return pb.ClusterStatusResponse(model=self.model_name,
                                        workers=await asyncio.gather(*map(one, workers)),
                                        queued_requests=self.admission.queued_requests,
                                        queued_tokens=self.admission.queued_tokens,
                                        metrics_address=self.metrics_address,
                                        http_address=self.http_address)

