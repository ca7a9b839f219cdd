"""Router: a Ray actor hosting the gRPC front end and dispatching each request.

Lifecycle of one Generate call (docs/architecture.md, "Request lifecycle"):

    validate + tokenize (chat template for messages; tokenize_queue.py, validation.py)
    admit: queued requests / prompt tokens over max_queued_* → RESOURCE_EXHAUSTED at once
    a SampleGroup (samples.py) of the request's samples, served by attempts until each
        has finished, a failed one retried on live workers (max_migrations)
    an attempt (attempt.py): reserve on a decode worker D (placement.py: fewest active
        streams, then most free blocks; no room anywhere: wait in arrival order until
        the deadline); D or a prefill worker P prefills (conditional disaggregation,
        placement.prefill_on_decode; P chosen by routing.py); P's first token → stream
        it (TTFT); relay D's token events (streams.py), detokenized; stop strings end
        a sample here
    finish / cancel / error: abort on P and D, so every block is released

Nothing waits without a deadline: the gRPC deadline (or request_timeout_s) bounds the
whole call.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing

import grpc
import ray

from ..config import ClusterConfig
from ..core_share import CompileActivity
from ..engine.loader import resolve_model
from ..engine.sampling_params import SamplingParams
from ..engine.structured_output import compile_executor
from ..metrics import RouterMetrics, serve as serve_metrics
from ..proto import pdserve_pb2 as pb
from .. import tracing
from . import admin, membership, validation
from .admission import Admission
from .attempt import Attempts
from .heap import HeapTrim
from .samples import SampleGroup
from .placement import Placement
from .planner import Planner
from .scaling import Scaler
from .stalls import StallWatch
from .routing import PrefillRouter
from .streams import DecodeStreams
from .tokenize_queue import TokenizeQueue
from .workers import Worker

logger = logging.getLogger(__name__)



class Router:
    """Ray actor. `start()` serves gRPC (and, with router.http_port, the OpenAI-compatible
    HTTP API of http_api.py) on the actor's event loop until `stop()`."""

    def __init__(self, config: ClusterConfig, prefill: list, decode: list, index: int = 0):
        """`index`: this replica's, of config.num_routers (pdserve/request_ids.py)."""
        from ..engine.config import ModelConfig
        from ..engine.loader import load_tokenizer

        tracing.configure_logging(config.prefill.log_level)
        self.config = config
        self.index = index
        tracing.configure(config.router.otlp_traces_endpoint, "pdserve-router",
                          config.router.otlp_traces_sample_ratio,
                          {"pdserve.router.index": index},
                          config.router.otlp_traces_client_sample_ratio)
        model_dir = resolve_model(config.prefill.model)
        self.model_config = ModelConfig.of(model_dir)
        self.tokenizer = load_tokenizer(model_dir)
        self.model_name = str(config.prefill.model)
        self.compile_flag = CompileActivity.on(config.decode.core_share_dir,
                                               f"router-{index}")
        self._prefill_handles, self._decode_handles = prefill, decode
        self._server: grpc.aio.Server | None = None
        self._server_port = 0
        rc = config.router
        self.admission = Admission(rc.max_queued_requests, rc.max_queued_tokens)
        self.tokenize = TokenizeQueue(
            rc.max_tokenize_queue_chars,
            validation.PREFIX_CHARS_PER_TOKEN * self.model_config.max_model_len)
        self.prefill_router = PrefillRouter.of(config)
        self.placement = Placement(config, self.prefill_router)   # workers from start() on
        self._cache_sync: asyncio.Task | None = None
        self._watch: asyncio.Task | None = None
        self.streams = DecodeStreams(index)         # decode workers' token events
        self.metrics = RouterMetrics(lambda: self.admission.queued_requests,
                                     rc.slo_ttft_ms, rc.slo_tpot_ms)
        self.attempts = Attempts(self.placement, self.streams, self.metrics, index,
                                 config.num_routers)
        self.scaler = Scaler(config, self.placement, self.streams,  # Admin.Scale
                             self._notify_replicas)
        self.stalls = StallWatch(rc.stream_stall_timeout_s, self.metrics.stalled.inc)
        self._stall_sweep: asyncio.Task | None = None
        self.heap_trim = HeapTrim()     # large requests' freed buffers back to the OS
        self._trim: asyncio.Task | None = None
        self.planner = None if config.planner is None else Planner(
            config.planner, self.placement, self.admission, self.metrics, self.scaler.scale)
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
        await membership.join(self.placement, (self._prefill_handles, self._decode_handles),
                              self.index, rc.worker_ready_timeout_s if restarted else None)
        loop = asyncio.get_running_loop()
        if (rc.routing_policy == "kv_aware" or self.config.prefill.kv_pull
                or rc.decode_routing_policy == "cache_aware"):
            self._cache_sync = loop.create_task(admin.sync_prefix_caches(
                self.placement, rc.cache_sync_interval_s))
        self._watch = loop.create_task(admin.watch_workers(self.placement,
                                                           rc.worker_probe_interval_s))
        self._stall_sweep = loop.create_task(self.stalls.run())
        self._trim = loop.create_task(self.heap_trim.run())
        if self.planner is not None and self.index == 0:     # one planner sizes the pools
            self._plan = loop.create_task(self.planner.run())
        ports = ports or {}
        self._server, port = build_server(self, f"{rc.host}:{ports.get('grpc', rc.port)}")
        await self._server.start()
        self._server_port = port
        metrics_port = rc.metrics_port + self.index if rc.metrics_port else 0
        metrics_host = rc.metrics_host or (rc.host if rc.host not in ("0.0.0.0", "::", "")
                                           else ray.util.get_node_ip_address())
        self.metrics_address = "%s:%d" % serve_metrics(self.metrics.registry, metrics_host,
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
        for task in (self._cache_sync, self._watch, self._plan, self._stall_sweep, self._trim):
            if task is not None:
                task.cancel()
        self._cache_sync = self._watch = self._plan = self._stall_sweep = self._trim = None
        if self._http is not None:
            await self._http.stop(grace_s)
            self._http = None
        if self._server is not None:
            await self._server.stop(grace_s)
            self._server = None
        await self.streams.stop()
        self.scaler.stop()
        self.compile_flag.close()

    # --- Generate -------------------------------------------------------------------

    async def generate(self, req: pb.GenerateRequest, deadline_s: float | None,
                       trace: tracing.RequestTrace | None = None
                       ) -> AsyncIterator[pb.GenerateResponse]:
        """Serve one request as a stream of GenerateResponse. With sampling.n > 1 the
        messages of its samples interleave, each naming its sample (`index`); they share
        one reservation and one prefill, forked on D (decode_worker/fork.py). With
        best_of, its samples are ranked by cumulative logprob (vLLM's rule) and the n
        best sent at the end, renumbered in that order (router/samples.py).

        A failed attempt (a worker died, a KV transfer failed) is retried on live
        workers as `prompt + tokens already streamed`, for the rest of max_tokens and
        with the sampler's step continuing (so greedy and seeded outputs equal an
        uninterrupted run's); at most `router.max_migrations` times per request
        (samples.SampleGroup). `trace`: the request's spans (pdserve/tracing.py; None:
        not traced), under which tokenization and each attempt get theirs.

        Raises:
            InvalidRequestError: bad input (→ INVALID_ARGUMENT).
            RequestError: capacity (RESOURCE_EXHAUSTED: the router's queue is full, see
                admission.py, or no decode KV space within reserve_timeout_s when set);
                the deadline (DEADLINE_EXCEEDED, waiting for KV space included);
                UNAVAILABLE when no worker of a role is up within the deadline or the
                request failed more than max_migrations times.
        """
        cfg, rc = self.model_config, self.config.router
        rid = validation.request_id(req) or uuid.uuid4().hex   # the first field checked
        tracing.set_log_request(rid, None if trace is None else trace.root)
        ids, params = await self._validate(req, trace)
        deadline = rc.deadline(deadline_s)
        group = SampleGroup(rid, self.tokenizer, ids, params, cfg.eos_token_ids,
                            cfg.max_model_len)
        resumed = validation.resume_token_ids(req, group.params, len(ids), cfg.vocab_size,
                                              cfg.max_model_len)
        if resumed:     # goes on as the router's own retry does, after those tokens
            group.resume(resumed)
        max_output = params.max_tokens * len(group.relays)
        # Admitted before any wait (a full queue is refused here, at once). The ticket is
        # released at the first token, or by the `with` on any earlier exit: reserve
        # timeout, error, client cancel, deadline. release() is idempotent.
        with self.admission.admit(len(ids), max_output) as queued:
            def attempt(ids, params, relays):
                return self.attempts.run(rid, ids, params, deadline, relays, queued, trace)

            async with aclosing(group.serve(attempt, rc.max_migrations, lambda reason:
                                            self.metrics.retries.labels(reason=reason).inc())
                                ) as stream:
                async for msg in stream:
                    yield msg
        self.metrics.totals.complete(group.num_tokens, max_output)

    async def _validate(self, req: pb.GenerateRequest, trace: tracing.RequestTrace | None = None
                        ) -> tuple[list[int], SamplingParams]:
        """The prompt's token ids and the request's SamplingParams: tokenized off the
        event loop (a long prompt must not stall other streams), shortest first,
        refused at once when the tokenizer's queue is full (tokenize_queue.py); a
        structured output's grammar parsed (not compiled: the workers do) on the
        grammar thread.

        Raises:
            InvalidRequestError, RequestError: as generate().
        """
        cfg = self.model_config
        self.admission.check_room()            # a full router refuses before any work
        span = trace.start("tokenize") if trace is not None else None
        try:
            ids = await self.tokenize.run(
                validation.prompt_chars(req), validation.prompt_token_ids, req,
                self.tokenizer, cfg.vocab_size, cfg.max_model_len)
        except BaseException as e:
            if span is not None:
                tracing.end(span, error=e)
            raise
        if span is not None:
            tracing.end(span, {"pdserve.prompt_tokens": len(ids)})
        args = (req, len(ids), cfg.max_model_len, cfg.vocab_size, True)
        if not req.sampling.HasField("structured_outputs"):
            params = validation.sampling_params(*args)
        else:     # off the loop (a 60 KB schema: ~20 ms); published (core_share: no
                  # lent threads meanwhile)
            with self.compile_flag.compiling():
                params = await asyncio.get_running_loop().run_in_executor(
                    compile_executor(), validation.sampling_params, *args)
        self.placement.check_fits(len(ids), params.max_tokens)
        return ids, params

    # --- Admin (admin.py) ------------------------------------------------------------

    async def drain(self, node_ip: str, timeout_s: float) -> pb.DrainResponse:
        return await admin.drain(self.placement, node_ip, timeout_s, self._notify_replicas)

    async def cluster_status(self) -> pb.ClusterStatusResponse:
        return pb.ClusterStatusResponse(
            model=self.model_name,
            workers=await admin.worker_statuses(self.placement, self.scaler.starting),
            queued_requests=self.admission.queued_requests,
            queued_tokens=self.admission.queued_tokens,
            metrics_address=self.metrics_address, http_address=self.http_address)

    async def sync_members(self) -> tuple[list[str], list[str]]:
        """Another replica scaled or drained: membership.sync_members."""
        return await membership.sync_members(self.placement)

    async def _notify_replicas(self) -> None:
        await membership.notify_replicas(self.config, self.index)

    async def scale(self, num_prefill: int, num_decode: int, timeout_s: float
                    ) -> pb.ScaleResponse:
        if self.planner is not None:    # it would undo the call at its next interval
            raise RuntimeError("the SLO planner sizes the pools (serve --planner slo); "
                               "Admin.Scale is off while it runs")
        return await self.scaler.scale(num_prefill, num_decode, timeout_s)
