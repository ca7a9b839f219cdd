"""One attempt at a request: its samples on one decode worker D, prefilled by one
prefill worker P or by D itself (router/samples.py SampleGroup makes the attempts and
retries a failed one).

    reserve on D (Placement.reserve: D, who prefills, the load charged; a Reservation)
    P prefills into D's blocks → its first token (TTFT)  │  D prefills: its first token
                                                        │  comes on D's stream
    relay D's token events into the samples' relays (router/streams.py); a stop
        string ends a sample here, and it is aborted on D
    end: the Reservation's charge back (its `with`); not finished on D (cancel,
        deadline, error, stop string): abort on P and D, so every block is released
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

import grpc
import ray

from .. import tracing
from ..decode_worker.fork import sample_id
from ..engine.request import TokenEvent
from ..messages import PrefillOrder, PrefillResult
from ..proto import pdserve_pb2 as pb
from ..request_ids import attempt_id
from .errors import RequestError
from .relay import Relay
from .reservation import Reservation
from .samples import by_request
from .workers import AttemptFailed, Worker, attempt_failed

logger = logging.getLogger(__name__)


class Attempts:
    """What attempts run on: this router replica's placement, its decode workers' event
    streams and its metrics (the router's). Runs on the router's event loop."""

    def __init__(self, placement, streams, metrics, index: int = 0, num_routers: int = 1):
        """`index`: this replica's, of `num_routers` (pdserve/request_ids.py)."""
        self.placement, self.streams, self.metrics = placement, streams, metrics
        self.index, self.num_routers = index, num_routers
        self._pending: set[asyncio.Task] = set()    # fire-and-forget calls in flight

    def run(self, rid: str, ids: list[int], params, deadline: float, relays: list[Relay],
            queued, trace=None) -> AsyncIterator[pb.GenerateResponse]:
        """Serve `ids` (the prompt, plus the tokens streamed by earlier attempts) to
        `relays` (relays[k] takes sample k of params.num_samples; one relay: params is
        its own) until `deadline` (time.monotonic()). `queued`: the request's admission
        ticket, released at its first token. `trace` (pdserve/tracing.py RequestTrace;
        None: not traced): the attempt's span, with its reservation, prefill and decode.

        Raises:
            AttemptFailed: P or D died, or the KV transfer or D failed (retryable).
            RequestError: deadline, capacity, no worker available (final).
        """
        return Attempt(self, attempt_id(rid, self.index), ids, params, deadline, relays,
                       queued, trace).run()

    def send(self, ref) -> None:
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


class Attempt:
    """One try (Attempts.run). Its id is unique per attempt and names this replica;
    sample k's id on D is decode_worker/fork.py sample_id(id, k)."""

    def __init__(self, on: Attempts, internal_id: str, ids: list[int], params,
                 deadline: float, relays: list[Relay], queued, trace=None):
        self.on, self.id, self.ids, self.params = on, internal_id, ids, params
        self.deadline, self.relays, self.queued = deadline, relays, queued
        self.trace, self.span = trace, None     # the attempt's span, when traced
        self.on_d = {sample_id(internal_id, k): r for k, r in enumerate(relays)}
        # sample 0 ended at P's token by a stop string (n > 1): aborted on D only once a
        # sibling's event shows D forked the prompt (an abort before the fork would
        # leave the siblings unborn)
        self._abort0 = False

    def run(self) -> AsyncIterator[pb.GenerateResponse]:
        """The attempt's messages (see Attempts.run); in an `attempt` span when traced
        (no extra generator in between when not)."""
        return self._run() if self.trace is None else self._traced_run()

    async def _traced_run(self) -> AsyncIterator[pb.GenerateResponse]:
        trace = self.trace
        self.span = trace.start("attempt", attributes={
            "pdserve.attempt_id": self.id, "pdserve.prompt_tokens": len(self.ids)})
        try:
            async with aclosing(self._run()) as stream:    # closed with this one, at once
                async for msg in stream:
                    yield msg
        except GeneratorExit:
            raise
        except BaseException as e:
            tracing.end(self.span, error=e)
            self.span = None
            raise
        finally:
            if self.span is not None:
                tracing.end(self.span)

    async def _run(self) -> AsyncIterator[pb.GenerateResponse]:
        on, trace = self.on, self.trace
        on.streams.open(self.id, tuple(self.on_d)[1:])  # before D may produce a token
        span = trace.start("reserve", self.span) if trace is not None else None
        try:
            held = await on.placement.reserve(
                self.id, len(self.ids), self.params, self.deadline, self.ids,
                len(self.relays), None if span is None else {
                    "trace_context": trace.carrier(span),
                    "decode_context": trace.carrier(self.span)})
        except BaseException as e:
            on.streams.close(self.id)
            if span is not None:
                tracing.end(span, error=e)
            raise
        if span is not None:
            tracing.end(span, {"pdserve.decode_worker": held.d.worker_id,
                             "pdserve.prefill_worker": "" if held.p is None
                             else held.p.worker_id,
                             "pdserve.local_prefill": held.p is None,
                             "pdserve.cached_blocks": held.res.num_cached_blocks,
                             **(held.why.attributes() if held.why is not None else {})})
        on.metrics.prefills.labels(on="decode_worker" if held.p is None
                                   else "prefill_worker").inc()
        on.metrics.decode_placements.labels(by="cache" if held.by_cache else "load").inc()
        on.metrics.decode_refusals.inc(held.refusals)
        finished = False
        with held:
            try:
                on.streams.bind(self.id, held.d, held.res.epoch)
                if held.p is not None:
                    if (msg := self._first_message(await self._traced_prefill(held))
                            ) is not None:
                        yield msg                   # TTFT
                self._abort0 = len(self.relays) > 1 and self.relays[0].stopped_here
                if trace is None:
                    async for msg in self._decode(held):
                        yield msg
                else:
                    async for msg in self._traced_decode(held):
                        yield msg
                finished = not any(r.stopped_here for r in self.relays)  # else D may run
            except asyncio.TimeoutError:
                raise RequestError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                   "request deadline exceeded") from None
            finally:
                on.streams.close(self.id)
                if not finished:  # cancel, deadline, error, stop string: release P and D
                    # now (sent to a worker found dead too: it may only have been
                    # unreachable)
                    if held.p is not None:
                        on.send(held.p.handle.abort.remote(self.id))
                    on.send(held.d.handle.abort.remote(self.id, "cancelled",
                                                       group=len(self.relays) > 1))

    async def _traced_prefill(self, held: Reservation) -> PrefillResult:
        """_prefill, in a span of the attempt's when traced."""
        if self.trace is None:
            return await self._prefill(held)
        span = self.trace.start("prefill", self.span,
                                {"pdserve.prefill_worker": held.p.worker_id})
        try:
            first = await self._prefill(held, self.trace.carrier(span))
        except BaseException as e:
            tracing.end(span, error=e)
            raise
        tracing.end(span)
        return first

    async def _prefill(self, held: Reservation, trace_context: dict | None = None
                       ) -> PrefillResult:
        """P's prefill into D's reservation: its first token, once the KV is sent. Its
        time feeds placement.first_token; with replicas, its reported queue P's share
        of the others. `trace_context`: the router's prefill span, P's goes under it.

        Raises:
            AttemptFailed: P died or failed (retryable). asyncio.TimeoutError: deadline.
        """
        p, res = held.p, held.res
        sent, queued_on_p = time.monotonic(), p.total_queued_tokens   # this prompt's too
        # P may read cached blocks from D, or from another prefill worker holding more
        # (prefill_worker/kv_pull.py)
        placement, source, peer, peer_blocks = self.on.placement, None, None, 0
        if placement.config.prefill.kv_pull:
            source = held.d.handle
            peer, peer_blocks = placement.prefill_router.pull_peer(
                [w for w in placement.prefill if w.alive], p, self.ids, self.params.cache_salt)
        lease = asyncio.create_task(self._hold_lease(held.d))
        try:
            first: PrefillResult = await asyncio.wait_for(
                p.handle.prefill.remote(PrefillOrder(
                    self.id, self.ids, self.params, res.kv_address, res.epoch,
                    res.num_cached_blocks, res.kv_rank_addresses, source,
                    None if peer is None else peer.handle, peer_blocks, trace_context)),
                timeout=max(self.deadline - time.monotonic(), 0.001))
        except ray.exceptions.RayError as e:
            raise attempt_failed("prefill", p, e) from e
        finally:
            lease.cancel()
            held.first_token()
            self.queued.release()  # first token back (or prefill failed): not queued
        self.on.placement.first_token.observe(p.worker_id, queued_on_p,
                                              time.monotonic() - sent)
        if self.on.num_routers > 1:   # the others' share, as P counts it
            p.reported_queue(first.queued_tokens)
        return first

    async def _hold_lease(self, d: Worker) -> None:
        """While P has the prompt (queued or prefilling), renew D's lease on this
        attempt's reservation every half lease (decode.lease_s, capped by the deadline),
        so a long queue on P does not cost the reservation and the prefill done; ends
        once D says the request no longer waits for KV, or D cannot be reached (the
        attempt fails on its own then). A router gone renews nothing: the lease ends."""
        lease_s = self.on.placement.config.decode.lease_s
        while True:
            await asyncio.sleep(lease_s / 2)
            left = self.deadline - time.monotonic()
            if left <= 0:
                return
            try:
                if not await d.handle.extend_lease.remote(self.id, min(lease_s, left)):
                    return
            except ray.exceptions.RayError:
                return

    def _first_message(self, first: PrefillResult) -> pb.GenerateResponse | None:
        """P's first token into sample 0's relay (D samples the others after the fork),
        and the prompt logprobs into every sample's first message."""
        if self.params.prompt_logprobs is not None:
            for r in self.relays:
                r.set_prompt_logprobs(first.prompt_logprobs)
        return self.relays[0].absorb([TokenEvent(
            self.id, (first.first_token,), logprobs=(first.logprobs,) if first.logprobs else ())])

    async def _decode(self, held: Reservation) -> AsyncIterator[pb.GenerateResponse]:
        """D's token events relayed until every sample finished.

        Raises:
            AttemptFailed: D died, failed a sample, or its stream ended early.
        """
        relays, d = self.relays, held.d
        sent, queued_on_d = time.monotonic(), d.queued_tokens   # D's own prefill
        error = None
        if any(r.finish_reason is None for r in relays):
            try:
                async for events in self.on.streams.batches(self.id, self.deadline):
                    self.queued.release()  # local prefill: its first token came from D
                    if held.p is None and not held.first_token_seen:
                        self.on.placement.first_token.observe(
                            self.on.placement.first_token.line(d, held.lent), queued_on_d,
                            time.monotonic() - sent)
                    held.first_token()
                    msgs, error = self._absorb(events, held)
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

    async def _traced_decode(self, held: Reservation) -> AsyncIterator[pb.GenerateResponse]:
        """_decode in a `decode` span of the attempt's: D's stream, with the tokens it
        brought, the seconds to its first one (D's first step) and the mean gap between
        them after that (TPOT)."""
        span, error = self.trace.start("decode", self.span), None
        started = time.monotonic()
        samples: dict[int, list] = {}    # sample index -> [first token's time, last's, tokens]
        try:
            async with aclosing(self._decode(held)) as stream:  # closed with this one
                async for msg in stream:
                    if msg.token_ids:
                        now = time.monotonic()
                        s = samples.setdefault(msg.index, [now, now, 0])
                        s[1], s[2] = now, s[2] + len(msg.token_ids)
                    yield msg
        except GeneratorExit:
            raise
        except BaseException as e:
            error = e
            raise
        finally:
            attributes = {"pdserve.decode_worker": held.d.worker_id,
                          "pdserve.output_tokens": sum(s[2] for s in samples.values())}
            if samples:
                attributes["pdserve.first_token_s"] = min(s[0] for s in samples.values()) - started
            gaps = [(last - first) / (n - 1) for first, last, n in samples.values() if n > 1]
            if gaps:      # each sample's mean gap between tokens after its first, averaged
                attributes["pdserve.tpot_s"] = sum(gaps) / len(gaps)
            tracing.end(span, attributes, error)

    def _absorb(self, events: list[TokenEvent], held: Reservation
                ) -> tuple[list[pb.GenerateResponse], str | None]:
        """One batch of D's events into the relays of the attempt's samples: the
        messages they make, and the first sample error (taken off its relay: the retry
        starts clean). A sample a stop string ended is aborted on D; sample 0 ended at
        P's token once a sibling's event shows D forked the prompt."""
        out, error, send, d = [], None, self.on.send, held.d
        for sid, evs in by_request(events).items():
            r = self.on_d[sid]
            if r.finish_reason is None:
                msg = r.absorb(evs)
                if msg is not None:
                    out.append(msg)
                if r.stopped_here and len(self.on_d) > 1:
                    send(d.handle.abort.remote(sid, "cancelled"))
            elif any(e.finish_reason == "error" for e in evs):
                r.error = evs[-1].error or "unknown error"  # before the fork
            error, r.error = error or r.error, None
            if self._abort0 and sid != self.id:
                self._abort0 = False
                send(d.handle.abort.remote(self.id, "cancelled"))
        return out, error
