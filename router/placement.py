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
import logging
import math
import time

import grpc
import ray

from ..config import ClusterConfig
from ..engine.block_pool import blocks_needed
from ..engine.sampling_params import InvalidRequestError
from ..messages import StepStats
from .errors import RequestError
from .reservation import PlacementWhy, Reservation, RoomQueue
from .routing import PrefillRouter, PrefixIndex, decode_order
from .workers import Worker

logger = logging.getLogger(__name__)


class FirstTokenTimes:
    """Per worker that prefills (a prefill worker, or a decode worker for its own
    prefills), the seconds from sending it a prompt to its first token, modelled as a
    least-squares line against the prompt tokens it had to compute for it (those
    queued ahead on it, this prompt's included): `seconds = a + b * tokens`, each
    observation weighing DECAY times the next one's, so the line follows the worker's
    load and the machine's. The router's own clock: the queue wait, the prefill steps,
    the KV transfer and the hops are all in it."""

    DECAY = 0.95          # ~20 first tokens remembered
    LEARN = 4             # observations a worker's line needs before it predicts

    def __init__(self):
        self._lines: dict[str, tuple[int, StepStats]] = {}

    def observe(self, worker_id: str, tokens: int, seconds: float) -> None:
        """A prompt sent to `worker_id` with `tokens` prompt tokens queued there (its
        own included) had its first token back after `seconds`."""
        n, s = self._lines.get(worker_id, (0, StepStats()))
        decayed = StepStats(*(v * self.DECAY for v in s.astuple()))
        self._lines[worker_id] = n + 1, decayed + StepStats.of(tokens, seconds)

    def predict(self, worker_id: str, tokens: int) -> float | None:
        """Seconds to the first token of a prompt sent now to `worker_id` with `tokens`
        prompt tokens then queued there; None before LEARN observations."""
        n, s = self._lines.get(worker_id, (0, None))
        if n < self.LEARN or (line := s.line()) is None:
            return None
        return line[0] + line[1] * tokens

    def forget(self, worker_id: str) -> None:
        """Drop the worker's lines (its own, and line(w, lent=True)'s)."""
        for key in [k for k in self._lines if k.split("+")[0] == worker_id]:
            del self._lines[key]

    @staticmethod
    def line(w: Worker, lent: bool = False) -> str:
        """The key of `w`'s line: a decode worker's prefills on the idle prefill
        workers' lent cores (`lent`) run faster than on its own and have their own."""
        return f"{w.worker_id}+lent" if lent else w.worker_id


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
        self.first_token = FirstTokenTimes()    # of the prefill workers (SLO placement)

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
                # choose and charge with no await in between
                # prompt logprobs come from a prefill worker's pass over the whole prompt
                local = params.prompt_logprobs is None and self.prefill_on_decode(d, prompt_len)
                p, p_cached = (None, 0) if local else self.prefill_router.pick(
                    [w for w in live_p if w.available] or live_p, ids, params.cache_salt)
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
                return held
            if any(d.available for d in live):
                return None
            # every one died meanwhile: wait for a restart (available, above)

    SLO_MARGIN = 0.9      # share of the TTFT SLO a prefill worker's predicted time may take
    COLOCATE_SHARE = 1 / 3  # a prompt a prefill worker alone computes in more than this
    #                         share of the TTFT SLO is colocated: the decode worker prefills
    #                         it (chosen on prompt samples 4-5, docs/goodput.md)

    def prefill_ttft(self, prompt_len: int, queued: bool = True) -> float:
        """Seconds to the first token of a `prompt_len`-token prompt sent now to the
        live prefill worker that would answer first (FirstTokenTimes; one with no
        prediction yet counts as 0), with the prompts queued on it (`queued`) or as if
        it had none; inf when none is live."""
        return min((self.first_token.predict(
            p.worker_id, (p.total_queued_tokens if queued else 0) + prompt_len) or 0.0
            for p in self.prefill if p.available), default=math.inf)

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

    def slo_choice(self, d: Worker, prompt_len: int, lent: bool) -> bool | None:
        """Under a TPOT SLO, whether the prompt goes to D (True) or a prefill worker
        (False), or None to leave it to prefill_on_decode's rules. `lent`: lends_to(d).

        With both SLOs (router.slo_tpot_ms, router.slo_ttft_ms):

        - a prompt that the fastest prefill worker, idle, would answer in more than
          COLOCATE_SHARE of the TTFT SLO goes to D. A prefill worker computes a prompt
          on its own cores, D on its and the idle prefill workers' lent ones, so where
          the TTFT SLO leaves one core no room for a queue, the colocated shape (every
          prompt on D, the prefill workers idle and lending) meets it more often; D's
          step budget holds its streams to the TPOT SLO meanwhile;
        - any other goes to a prefill worker whenever the first-token time predicted
          there (FirstTokenTimes, with its queue) is within SLO_MARGIN of the TTFT SLO,
          or D's own predicted time for it is later still (its line for the prompts it
          prefilled under its step budget, kept apart for those on lent cores). D's
          prefills cost its streams TPOT: the budget holds them within the SLO by
          computing the prompt in smaller chunks the tighter it is, and a prefill begun
          on lent cores goes on on D's own once the prefill worker takes a prompt;
        - the rest (None) follow prefill_on_decode's rules.

        Without a TTFT SLO every prompt goes to a prefill worker (any first token is in
        time). DistServe's placement for the two SLOs; TaiChi (arXiv 2508.01989)
        switches between the disaggregated and the colocated shape by them the same
        way."""
        rc = self.config.router
        if rc.slo_ttft_ms is None:
            return False
        slo_s = rc.slo_ttft_ms / 1e3
        if self.prefill_ttft(prompt_len, queued=False) > self.COLOCATE_SHARE * slo_s:
            return True          # a prefill worker alone is too slow for it: colocated
        on_p = self.prefill_ttft(prompt_len)
        if on_p <= self.SLO_MARGIN * slo_s:
            return False
        on_d = self.first_token.predict(FirstTokenTimes.line(d, lent),
                                        d.queued_tokens + prompt_len)
        return False if on_d is not None and on_d >= on_p else None

    def prefill_on_decode(self, d: Worker, prompt_len: int) -> bool:
        """Conditional disaggregation: whether the router asks D to prefill the prompt
        itself. D decides (DecodeWorker.reserve: asked, or its uncached part is at most
        local_prefill_max_tokens), and Reservation.settle follows its decision.

        - No prefill worker's KV pool holds the prompt: a retry's prompt (the original
          plus the tokens streamed, check_fits having bounded only the original) that
          outgrew them; D's pool holds it (prompt + max_tokens fit it).

        With a TPOT SLO, slo_choice decides first.

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
                p.num_blocks for p in self.prefill):
            return True      # no prefill worker's pool holds it: a retry's prompt + tokens
        rc = self.config.router
        lent = self.lends_to(d)
        if rc.slo_tpot_ms is not None and (choice := self.slo_choice(d, prompt_len, lent)
                                           ) is not None:
            return choice
        if lent:
            return True
        limit = rc.max_prefill_queue_tokens
        if limit is None:
            limit = self.config.prefill.max_num_batched_tokens
        queued = [p.total_queued_tokens for p in self.prefill if p.available]
        if not limit or not queued:
            return False
        shortest = min(queued)
        return shortest > limit and shortest > d.queued_tokens + prompt_len
