"""Router: a Ray actor hosting the gRPC front end and dispatching each request.

Lifecycle of one Generate call (ARCHITECTURE.md, "Request lifecycle"):

    validate + tokenize (chat template for messages)
    admit: queued requests / prompt tokens over max_queued_* → RESOURCE_EXHAUSTED at once
    pick decode worker D (fewest active requests, then most free blocks) → reserve
        (no room anywhere: retry until reserve_timeout_s, then RESOURCE_EXHAUSTED);
        D says how many leading prompt blocks its own prefix cache holds
    if D prefills locally (its uncached part is short, see local_prefill_max_tokens):
        the first token comes on D's stream; no prefill worker is involved
    else pick prefill worker P (routing.py: kv_aware by default, cached prefix vs
        queue) → prefill into D's blocks, skipping the blocks D holds;
        P returns the first token → stream it (TTFT)
    relay D's token events, detokenized; stop strings end the request here
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
from dataclasses import dataclass

import grpc
import ray

from ..config import ClusterConfig
from ..engine.block_pool import blocks_needed
from ..engine.loader import resolve_model
from ..engine.request import TokenEvent
from ..engine.sampling_params import InvalidRequestError
from ..metrics import RouterMetrics, serve as serve_metrics
from ..proto import pdserve_pb2 as pb
from . import validation
from .admission import Admission
from .detokenizer import Detokenizer
from .errors import RequestError
from .routing import PrefillRouter

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Worker:
    handle: object          # Ray actor handle
    worker_id: str
    num_blocks: int
    load: int = 0           # prefill: queued prompt tokens; decode: active requests
    free_blocks: int = 0    # decode: last known


class Router:
    """Ray actor. `start()` serves gRPC on the actor's event loop until `stop()`."""

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
        self.prefill: list[_Worker] = []
        self.decode: list[_Worker] = []
        self._server: grpc.aio.Server | None = None
        rc = config.router
        self.admission = Admission(rc.max_queued_requests, rc.max_queued_tokens)
        self.prefill_router = PrefillRouter(rc.routing_policy, config.prefill.block_size,
                                            rc.kv_load_weight)
        self._cache_sync: asyncio.Task | None = None
        self.metrics = RouterMetrics(lambda: self.admission.queued_requests,
                                     rc.slo_ttft_ms, rc.slo_tpot_ms)
        self.metrics_address = ""

    async def start(self) -> int:
        """Wait for every worker, then serve. Returns the bound gRPC port."""
        from .service import build_server

        infos = await asyncio.gather(*(h.ready.remote() for h in self._prefill_handles))
        self.prefill = [_Worker(h, i["worker_id"], i["num_blocks"])
                        for h, i in zip(self._prefill_handles, infos)]
        infos = await asyncio.gather(*(h.ready.remote() for h in self._decode_handles))
        self.decode = [_Worker(h, i["worker_id"], i["num_blocks"], free_blocks=i["num_blocks"])
                       for h, i in zip(self._decode_handles, infos)]
        # Pair every P with every D now, so a layout mismatch fails `serve` at start
        # with a message naming the field, not the first request.
        await asyncio.gather(*(p.handle.pair.remote([i["kv_address"] for i in infos])
                               for p in self.prefill))
        rc = self.config.router
        if rc.routing_policy == "kv_aware":
            self._cache_sync = asyncio.get_running_loop().create_task(self._sync_prefix_caches())
        self._server, port = build_server(self, f"{rc.host}:{rc.port}")
        await self._server.start()
        self.metrics_address = "%s:%d" % serve_metrics(self.metrics.registry, rc.host,
                                                       rc.metrics_port)
        logger.info("router serving gRPC on %s:%d, metrics on http://%s/metrics", rc.host, port,
                    self.metrics_address)
        return port

    async def stop(self, grace_s: float = 2.0) -> None:
        if self._cache_sync is not None:
            self._cache_sync.cancel()
            self._cache_sync = None
        if self._server is not None:
            await self._server.stop(grace_s)
            self._server = None

    # --- Generate -------------------------------------------------------------------

    async def generate(self, req: pb.GenerateRequest, deadline_s: float | None
                       ) -> AsyncIterator[pb.GenerateResponse]:
        """Serve one request as a stream of GenerateResponse.

        Raises:
            InvalidRequestError: bad input (→ INVALID_ARGUMENT).
            RequestError: capacity (RESOURCE_EXHAUSTED: the router's queue is full, see
                admission.py, or no decode KV space within reserve_timeout_s), worker or
                transfer failure, with its status.
        """
        cfg = self.model_config
        client_id = validation.request_id(req)
        ids = validation.prompt_token_ids(req, self.tokenizer, cfg.vocab_size, cfg.max_model_len)
        params = validation.sampling_params(req, len(ids), cfg.max_model_len)
        self._check_fits(len(ids), params.max_tokens)
        rid = client_id or uuid.uuid4().hex
        internal_id = f"{rid}#{uuid.uuid4().hex[:8]}"   # unique even if clients reuse ids
        deadline = time.monotonic() + (deadline_s or self.config.router.request_timeout_s)

        # Admitted before any wait (a full queue is refused here, at once). The ticket is
        # released at the first token below, or by the `with` on any earlier exit: reserve
        # timeout, error, client cancel, deadline. release() is idempotent.
        with self.admission.admit(len(ids)) as queued:
            d, res = await self._reserve(internal_id, len(ids), params, deadline, ids)
            p = None if res["local_prefill"] else self.prefill_router.pick(self.prefill, ids)[0]
            d.load += 1
            finished = False
            try:
                events = d.handle.stream.remote(internal_id)
                relay = _Relay(rid, Detokenizer(self.tokenizer, ids, params.stop), len(ids))
                if p is not None:
                    p.load += len(ids)
                    try:
                        first = await asyncio.wait_for(
                            p.handle.prefill.remote(internal_id, ids, params,
                                                    res["kv_address"], res["epoch"],
                                                    res["cached_blocks"]),
                            timeout=max(deadline - time.monotonic(), 0.001))
                    finally:
                        p.load -= len(ids)
                        queued.release()  # first token back (or prefill failed): not queued
                    msg = relay.absorb([TokenEvent(internal_id, (first,))])   # TTFT: at once
                    if msg is not None:
                        yield msg
                if relay.finish_reason is None:
                    async for ref in _with_deadline(events, deadline):
                        queued.release()  # local prefill: its first token came from D
                        msg = relay.absorb(await ref)
                        if msg is not None:
                            yield msg
                        if relay.finish_reason is not None:
                            break
                if relay.finish_reason is not None:
                    finished = not relay.stopped_here   # else D still runs: abort it below
                    if relay.error:
                        raise RequestError(grpc.StatusCode.INTERNAL,
                                           f"decode failed: {relay.error}")
                    return
                raise RequestError(grpc.StatusCode.INTERNAL,
                                   "decode stream ended without finishing")
            except asyncio.TimeoutError:
                raise RequestError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                   "request deadline exceeded") from None
            except RequestError:
                raise
            except Exception as e:  # Ray surfaces worker-side errors (transfer, abort, death) here
                raise RequestError(grpc.StatusCode.UNAVAILABLE, f"{type(e).__name__}: {e}") from e
            finally:
                d.load -= 1
                if not finished:  # cancel, deadline, error, stop string: release P and D now
                    if p is not None:
                        p.handle.abort.remote(internal_id)
                    d.handle.abort.remote(internal_id, "cancelled")

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
                       ids: list[int]):
        """Reserve on the best decode worker with room, waiting for room until a limit."""
        give_up = min(deadline, time.monotonic() + self.config.router.reserve_timeout_s)
        delay = 0.01
        while True:
            failures = []
            for d in sorted(self.decode, key=lambda w: (w.load, -w.free_blocks)):
                try:
                    res = await d.handle.reserve.remote(rid, prompt_len, params, ids)
                except ray.exceptions.RayError as e:   # dead or unreachable: try the next
                    failures.append(f"{d.worker_id}: {type(e).__name__}")
                    continue
                if res is not None:
                    d.free_blocks = res["free_blocks"]
                    return d, res
            if len(failures) == len(self.decode):
                raise RequestError(grpc.StatusCode.UNAVAILABLE,
                                   "no decode worker is reachable (" + "; ".join(failures) + ")")
            if time.monotonic() + delay > give_up:
                raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                   "no decode worker has free KV blocks for this request; "
                                   "retry later or lower max_tokens")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.2)

    # --- Admin ------------------------------------------------------------------------

    async def cluster_status(self) -> pb.ClusterStatusResponse:
        workers = self.prefill + self.decode

        async def one(w: _Worker) -> pb.WorkerStatus:
            try:
                s = await asyncio.wait_for(w.handle.status.remote(), timeout=5)
            except Exception as e:  # dead or hung worker: report it, do not fail the call
                role = "prefill" if w in self.prefill else "decode"
                return pb.WorkerStatus(worker_id=w.worker_id, role=role, state=f"dead: {e}"[:200],
                                       kv_blocks_total=w.num_blocks)
            return pb.WorkerStatus(**{k: v for k, v in s.items() if k in _STATUS_FIELDS})

        return pb.ClusterStatusResponse(model=self.model_name,
                                        workers=await asyncio.gather(*map(one, workers)),
                                        queued_requests=self.admission.queued_requests,
                                        queued_tokens=self.admission.queued_tokens,
                                        metrics_address=self.metrics_address)


_STATUS_FIELDS = set(pb.WorkerStatus.DESCRIPTOR.fields_by_name)


class _Relay:
    """Turns decode TokenEvents into GenerateResponses: detokenizes, applies stop
    strings, counts usage; `finish_reason` is set once the request is over."""

    def __init__(self, request_id: str, detok: Detokenizer, prompt_len: int):
        self.request_id, self.detok, self.prompt_len = request_id, detok, prompt_len
        self.num_generated = 0
        self.finish_reason: str | None = None
        self.stopped_here = False    # a stop string matched on the router: D still runs
        self.error: str | None = None

    def absorb(self, events: list[TokenEvent]) -> pb.GenerateResponse | None:
        tokens, text = [], []
        for ev in events:
            for t in ev.token_ids:
                tokens.append(t)
                delta = self.detok.step(t)
                text.append(delta.text)
                if delta.stopped:
                    self.finish_reason, self.stopped_here = "stop", True
                    break
            if self.finish_reason is None and ev.finish_reason is not None:
                self.finish_reason, self.error = ev.finish_reason, ev.error
                text.append(self.detok.flush())
            if self.finish_reason is not None:
                break
        self.num_generated += len(tokens)
        if self.finish_reason == "error":
            return None
        if self.finish_reason is not None:
            return pb.GenerateResponse(
                request_id=self.request_id, token_ids=tokens, text="".join(text),
                finish_reason=self.finish_reason,
                usage=pb.Usage(prompt_tokens=self.prompt_len, completion_tokens=self.num_generated))
        if not tokens:
            return None
        return pb.GenerateResponse(request_id=self.request_id, token_ids=tokens, text="".join(text))


async def _with_deadline(gen, deadline: float):
    """Iterate a Ray ObjectRefGenerator, each wait bounded by the request deadline."""
    it = gen.__aiter__()
    while True:
        try:
            ref = await asyncio.wait_for(it.__anext__(), timeout=max(deadline - time.monotonic(), 0.001))
        except StopAsyncIteration:
            return
        yield ref
