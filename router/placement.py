"""Placement: where one request runs. The decode worker D that reserves its KV (fewest
active requests, then most free blocks), and who prefills it: a prefill worker P
(routing.py's policy), or D itself (conditional disaggregation, prefill_on_decode).
The load each choice puts on the workers is charged from the choice on (reservation.py).
Requests no decode worker has KV room for wait in arrival order (RoomQueue), as a
colocated engine's waiting queue holds them, within their deadline and the admission
bounds. Workers found dead are probed back (Ray restarts them) within a request's
deadline.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import grpc
import ray

from ..config import ClusterConfig
from ..engine.block_pool import blocks_needed
from ..engine.sampling_params import InvalidRequestError
from .errors import RequestError
from .first_token import Eta, FirstTokenTimes
from .reservation import PlacementWhy, Reservation, RoomQueue
from .routing import PrefillRouter, PrefixIndex, decode_order
from .workers import Worker

logger = logging.getLogger(__name__)


class Placement:
    """The router's workers of both roles and the choice of D and P for each request.
    Runs on the router's event loop (no locks: a choice and its charge happen with no
    await in between)."""

    def __init__(self, config: ClusterConfig, prefill_router: PrefillRouter,
                 prefill: list[Worker] | None = None, decode: list[Worker] | None = None):
        self.config = config
        self.prefill_router = prefill_router
        self.prefill: list[Worker] = prefill or []
        self.decode: list[Worker] = decode or []
        rc = config.router
        # the decode workers' prefix caches and tiers, mirrored (routing.decode_order)
        self.decode_index = (PrefixIndex() if rc.decode_routing_policy == "cache_aware"
                             else None)
        self.room = RoomQueue()
        self.first_token = FirstTokenTimes()    # of every worker that prefills (SLO placement)

    def mirrored(self) -> list[tuple[PrefixIndex, list[Worker]]]:
        """(index, workers) per role whose prefix caches the router mirrors
        (admin.sync_prefix_caches): the prefill workers' for kv_aware or kv_pull, the
        decode workers' for cache_aware when there is more than one to choose from."""
        rc, out = self.config.router, []
        if rc.routing_policy == "kv_aware" or self.config.prefill.kv_pull:
            out.append((self.prefill_router.index, self.prefill))
        if self.decode_index is not None and len(self.decode) > 1:
            out.append((self.decode_index, self.decode))
        return out

    async def available(self, workers: list[Worker], role: str, deadline: float
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
            await asyncio.gather(*(self.probe(w) for w in workers if not w.alive))
            if any(w.available for w in workers):
                continue
            if time.monotonic() + delay >= deadline:
                raise RequestError(grpc.StatusCode.UNAVAILABLE,
                                   f"no {role} worker is available: all {len(workers)} are "
                                   "down and none restarted within the request's deadline")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)

    async def probe(self, w: Worker, timeout_s: float = 1.0) -> None:
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
            for index in (self.prefill_router.index, self.decode_index):
                if index is not None:
                    index.forget(w.worker_id)
            self.first_token.forget(w.worker_id)
        w.alive = True

    def check_fits(self, prompt_len: int, max_tokens: int) -> None:
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

    async def reserve(self, rid: str, prompt_len: int, params, deadline: float,
                      ids: list[int], num_samples: int = 1,
                      trace: dict | None = None) -> Reservation:
        """Reserve on the best live decode worker with room, waiting for room in arrival
        order (RoomQueue) or for Ray to restart a dead one, until the request's
        deadline (or router.reserve_timeout_s when set), and choose who prefills
        (prefill_on_decode asks D; D decides, Reservation.settle). The returned
        Reservation charges the prompt's tokens to P's queue (or D's own) and its
        `num_samples` streams to D from the choice on, before the reserve call is
        awaited: the requests of a burst, whose choices are made while the first
        reservations are in flight, see each other's load (they spread over the
        decode workers). The caller releases it (`with`). Its lease on D ends with the
        request's deadline at the latest, so D reclaims it even if this router goes
        away. `trace`: a traced request's W3C contexts for D's spans
        (DecodeWorker.reserve's trace_context and decode_context; pdserve/tracing.py).

        Raises:
            RequestError: DEADLINE_EXCEEDED, no room before the deadline;
                RESOURCE_EXHAUSTED, none within reserve_timeout_s; UNAVAILABLE, no
                worker of a role came back (Placement.available).
        """
        timeout_s = self.config.router.reserve_timeout_s
        give_up = deadline if timeout_s is None else min(deadline, time.monotonic() + timeout_s)
        args = (rid, prompt_len, params, deadline, ids, num_samples, give_up, trace)
        if not len(self.room):       # none waiting: ask at once (a burst's asks overlap)
            held = await self._try_reserve(*args)
            if held is not None:
                return held
        try:
            async with self.room.turn(give_up):
                while True:
                    self.room.clear()
                    held = await self._try_reserve(*args)
                    if held is not None:
                        return held
                    if time.monotonic() >= give_up:
                        break
                    await self.room.wait(give_up)
        except TimeoutError:
            pass
        if give_up < deadline:
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"no decode worker had free KV blocks for this request within "
                               f"router.reserve_timeout_s={timeout_s}; retry later or lower "
                               "max_tokens")
        raise RequestError(grpc.StatusCode.DEADLINE_EXCEEDED, "request deadline exceeded while "
                           "waiting for decode KV space")

    async def _try_reserve(self, rid: str, prompt_len: int, params, deadline: float,
                           ids: list[int], num_samples: int, give_up: float,
                           trace: dict | None = None) -> Reservation | None:
        """One pass over the live decode workers, best first (waiting for a dead role
        to restart until `give_up`); None when none had room."""
        while True:
            live = await self.available(self.decode, "decode", give_up)
            live_p = await self.available(self.prefill, "prefill", deadline)
            lease_s = min(self.config.decode.lease_s, max(deadline - time.monotonic(), 0.001))
            rc = self.config.router
            order = decode_order(live, self.decode_index, ids, self.config.decode.block_size,
                                 rc.cache_threshold, rc.balance_abs_threshold,
                                 rc.balance_rel_threshold, params.cache_salt)
            refusals = 0
            for d in order.workers:
                # choose and charge with no await in between; the prefill worker the
                # routing policy picks is the one SLO placement judges; prompt logprobs
                # come from a prefill worker's pass over the whole prompt
                p, p_cached = self.prefill_router.pick(
                    [w for w in live_p if w.available] or live_p, ids, params.cache_salt)
                local = params.prompt_logprobs is None and self.prefill_on_decode(
                    d, prompt_len, p)
                if local:
                    p, p_cached = None, 0
                held = Reservation(d, p, prompt_len, num_samples, self.room,
                                   lent=self.lends_to(d))
                held.by_cache = order.cached_blocks is not None and d is order.workers[0]
                if trace:      # why these workers, for the attempt's reserve span
                    held.why = PlacementWhy(
                        self.prefill_router.policy, d.total_streams, d.free_blocks, local,
                        *((None, None) if p is None else (p_cached, p.total_queued_tokens)),
                        decode_cached_blocks=order.cached_blocks if held.by_cache else None)
                try:
                    res = await d.handle.reserve.remote(
                        rid, prompt_len, params, ids, lease_s, local,
                        **(trace or {}))
                except ray.exceptions.RayActorError:   # dead or restarting: try the next
                    held.refused()
                    d.alive = False
                    refusals += 1
                    continue
                except BaseException:
                    held.refused()
                    raise
                if res is None:
                    held.refused()
                    refusals += 1
                    continue
                held.refusals = refusals
                d.free_blocks = res.free_blocks
                if self.config.num_routers > 1:    # the others' share, as D counts it
                    d.reported_streams(res.num_requests)
                held.settle(res)
                self.first_token.sent(held.prefiller.worker_id, prompt_len)
                return held
            if any(d.available for d in live):
                return None
            # every one died meanwhile: wait for a restart (available, above)

    SLO_MARGIN = 0.9      # share of the TTFT SLO a predicted first token may take

    def prefill_eta(self, prompt_len: int, p: Worker | None = None) -> Eta | None:
        """The first token of a `prompt_len`-token prompt on prefill worker `p`, or
        without one on the live prefill worker predicted to answer it first
        (FirstTokenTimes.eta: the queue it has, and the one its arrival rate builds);
        None when none is live or one judged has not learned its line yet."""
        judged = [p] if p is not None else [w for w in self.prefill if w.available]
        etas = [self.first_token.eta(w.worker_id, w.worker_id, w.total_queued_tokens,
                                     prompt_len) for w in judged]
        if not etas or any(e is None for e in etas):
            return None
        return min(etas, key=lambda e: e.seconds)

    def lends_to(self, d: Worker) -> bool:
        """Whether the prefill workers on D's node are idle and would lend D their
        threads (pdserve/core_share.py) for a prefill of its own: core lending on
        (router.local_prefill_when_prefill_idle, decode.core_share_dir), D has no prefill
        queued, and the idle prefill workers on its node are at least as many as its
        decode workers (each decode worker gets a share of their threads)."""
        rc = self.config.router
        if not (rc.local_prefill_when_prefill_idle and self.config.decode.core_share_dir
                and d.queued_tokens == 0):
            return False
        idle = sum(p.available and p.total_queued_tokens == 0 and p.node_ip == d.node_ip
                   for p in self.prefill)
        return bool(idle) and idle >= sum(w.node_ip == d.node_ip for w in self.decode)

    def slo_choice(self, d: Worker, prompt_len: int, lent: bool, p: Worker | None = None
                   ) -> bool | None:
        """Under a TPOT SLO, whether the prompt goes to D (True) or a prefill worker
        (False: `p`, the one the routing policy picked; None: the first to answer of the
        live ones), or None to leave it to prefill_on_decode's rules. `lent`:
        lends_to(d).

        With both SLOs (router.slo_tpot_ms, router.slo_ttft_ms), by the first token
        predicted on each (Eta.seconds: the later of the worker's queue now and the
        queue its arrival rate builds; prefill_eta, and D's line for its own prefills,
        kept apart for those on lent cores):

        - D has no streams: the one predicted to answer first (a prefill on D then costs
          no stream's TPOT; an idle prefill worker lends D its cores);
        - otherwise a prefill worker when it answers within SLO_MARGIN of the TTFT SLO
          (D's streams keep their TPOT); else D when D does; else whichever answers
          this prompt first with the queues there now. A prefill worker whose prompts
          arrive faster than it computes them (rho >= 1) is never in time, however
          short its queue is at this moment, so its share of the prompts falls until
          its queue stops growing;
        - a line not learned yet (FirstTokenTimes.LEARN first tokens): None, the rules
          the server follows untold.

        Without a TTFT SLO every prompt goes to a prefill worker (any first token is in
        time). DistServe places by the same two SLOs; the queue is Pollaczek-Khinchine's
        M/G/1 mean wait (FirstTokenTimes.eta)."""
        rc = self.config.router
        if rc.slo_ttft_ms is None:
            return False
        on_p = self.prefill_eta(prompt_len, p)
        on_d = self.first_token.eta(FirstTokenTimes.line(d, lent), d.worker_id,
                                    d.queued_tokens, prompt_len)
        choice = self._slo_rule(on_p, on_d, d.total_streams, rc.slo_ttft_ms / 1e3)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("slo placement %s", json.dumps(
                self.slo_state(d, prompt_len, lent, p) | {"choice": choice}))
        return choice

    def _slo_rule(self, on_p: Eta | None, on_d: Eta | None, d_streams: int,
                  slo_ttft_s: float) -> bool | None:
        if on_p is None or on_d is None:
            return None
        if d_streams == 0:
            return on_d.seconds < on_p.seconds
        in_time = self.SLO_MARGIN * slo_ttft_s
        if on_p.seconds <= in_time:
            return False
        if on_d.seconds <= in_time:
            return True
        return on_d.now < on_p.now

    def slo_state(self, d: Worker, prompt_len: int, lent: bool, p: Worker | None = None
                  ) -> dict:
        """What slo_choice reads, as plain data (the debug log line `slo placement`, one
        per choice; tests replay such lines): the prompt, the TTFT SLO, D's streams and
        queue, and per prefill worker judged (`p`, or every live one) FirstTokenTimes.state
        with its queued tokens."""
        line = FirstTokenTimes.line(d, lent)
        return {"prompt_len": prompt_len, "slo_ttft_ms": self.config.router.slo_ttft_ms,
                "lent": lent, "d_streams": d.total_streams,
                "d": {"worker_id": d.worker_id, "line_key": line, "queued": d.queued_tokens,
                      **self.first_token.state(line, d.worker_id)},
                "p": [{"worker_id": w.worker_id, "queued": w.total_queued_tokens,
                       **self.first_token.state(w.worker_id, w.worker_id)}
                      for w in ([p] if p is not None else self.prefill) if w.available]}

    def prefill_on_decode(self, d: Worker, prompt_len: int, p: Worker | None = None) -> bool:
        """Conditional disaggregation: whether the router asks D to prefill the prompt
        itself. D decides (DecodeWorker.reserve: asked, or its uncached part is at most
        local_prefill_max_tokens), and Reservation.settle follows its decision.

        - No prefill worker's KV pool holds the prompt: a retry's prompt (the original
          plus the tokens streamed, check_fits having bounded only the original) that
          outgrew them; D's pool holds it (prompt + max_tokens fit it).

        With a TPOT SLO, slo_choice decides first, judging `p` (the prefill worker the
        routing policy picked; None: the first to answer of the live ones).

        - D has no prefill of its own queued and prefill workers on D's node, at least
          as many as its decode workers, have none either (lends_to): the idle workers
          lend D their threads, so D computes the prompt on its cores and theirs, where
          a prefill worker would use its own alone. The next prompt, while D is at it,
          goes to a prefill worker.
        - Every live prefill worker has more than router.max_prefill_queue_tokens prompt
          tokens queued, and more than D would have queued for its own prefills with
          this prompt (Dynamo's disaggregated router decides the same way, by its
          max_prefill_queue_size). A burst is then split between P and D instead of
          waiting for P alone. The limit defaults to one prefill step's budget (prefill
          workers' max_num_batched_tokens)."""
        if self.prefill and blocks_needed(prompt_len, self.config.prefill.block_size) > max(
                w.num_blocks for w in self.prefill):
            return True      # no prefill worker's pool holds it: a retry's prompt + tokens
        rc = self.config.router
        lent = self.lends_to(d)
        if rc.slo_tpot_ms is not None and (choice := self.slo_choice(d, prompt_len, lent, p)
                                           ) is not None:
            return choice
        if lent:
            return True
        limit = rc.max_prefill_queue_tokens
        if limit is None:
            limit = self.config.prefill.max_num_batched_tokens
        queued = [w.total_queued_tokens for w in self.prefill if w.available]
        if not limit or not queued:
            return False
        shortest = min(queued)
        return shortest > limit and shortest > d.queued_tokens + prompt_len
