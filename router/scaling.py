"""Workers added and retired at runtime (Admin.Scale, `pdserve scale`).

    scale(P, D)
      up:    start_worker (cluster.py) for each missing worker, state "starting";
             once ready(), every new prefill worker pairs with every decode worker and
             every prefill worker with every new decode worker (a layout mismatch fails
             the call and stops the new workers), then they join the placement's lists
             and take requests; new decode workers also take the streams the others
             have above the mean (`rebalance`, router.rebalance_on_scale_up)
      down:  the newest workers beyond P and D are marked draining (placement.available
             skips them: no new request, no new reservation); each is stopped (shutdown,
             then killed) once neither it nor the router has a request of its own on it,
             or at timeout_s: then what it still had moves on as from a dead worker
             (the router's retry: a prefill is retried elsewhere, a decode stream
             resumes on another decode worker after the tokens it already sent)

Nothing is refused or lost: a request that reached a retiring worker before it was
marked finishes there (or moves on), and the others go to the workers that serve. Ray owns the
workers the router starts, so they also end with the router.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from typing import TYPE_CHECKING

import ray

from ..engine.sampling_params import InvalidRequestError
from ..proto import pdserve_pb2 as pb
from .membership import mark_draining
from .workers import Worker

if TYPE_CHECKING:
    from ..config import ClusterConfig
    from .placement import Placement
    from .streams import DecodeStreams

logger = logging.getLogger(__name__)

MAX_WORKERS = 256          # per role, a bound on what one call may ask for


class Scaler:
    """The router's scaling state: what is starting, and one scale call at a time."""

    def __init__(self, config: ClusterConfig | None, placement: Placement | None,
                 streams: DecodeStreams | None, notify_replicas=None):
        """`notify_replicas`: an async callable telling the other router replicas the
        worker set changed (membership.notify_replicas)."""
        self.config, self.placement, self.streams = config, placement, streams
        self._notify = notify_replicas
        self.starting: list[tuple[str, str]] = []      # (role, worker id)
        self._placement_groups: dict[str, object] = {}  # worker id -> its ranks' group
        self._last: dict[str, int] = {}     # role -> the highest N of a `role-N` id issued
        self._lock = asyncio.Lock()

    async def scale(self, num_prefill: int, num_decode: int, timeout_s: float
                    ) -> pb.ScaleResponse:
        """Admin.Scale; see the module docstring.

        Raises:
            InvalidRequestError: a count outside [1, MAX_WORKERS], both together over
                router.max_workers, or timeout_s outside [0, 3600] seconds (named).
        """
        for field, n in (("num_prefill_workers", num_prefill),
                         ("num_decode_workers", num_decode)):
            if not 1 <= n <= MAX_WORKERS:
                raise InvalidRequestError(field, f"must be in [1, {MAX_WORKERS}], got {n}")
        if not 0 <= timeout_s <= 3600:
            raise InvalidRequestError("timeout_s", f"must be in [0, 3600] seconds, got {timeout_s}")
        if num_prefill + num_decode > (limit := self.config.router.max_workers):
            raise InvalidRequestError(
                "num_prefill_workers", f"{num_prefill} prefill + {num_decode} decode workers "
                f"exceed the cluster's max_workers={limit} (serve --max-workers)")
        async with self._lock:
            placement = self.placement
            started = await self._start(num_prefill - len(placement.prefill),
                                        num_decode - len(placement.decode))
            retiring = ([("prefill", w) for w in placement.prefill[num_prefill:]] +
                        [("decode", w) for w in placement.decode[num_decode:]])
            await mark_draining([w for _, w in retiring])
            if retiring:
                logger.warning("retiring %s", [w.worker_id for _, w in retiring])
            if started or retiring:       # the other replicas take or spare them too
                await self._notify()
            done = await asyncio.gather(*(self._retire(role, w, timeout_s)
                                          for role, w in retiring))
            if retiring:
                await self._notify()
            return pb.ScaleResponse(
                started=started,
                retired=[w.worker_id for (_, w), idle in zip(retiring, done) if idle],
                migrated=[w.worker_id for (_, w), idle in zip(retiring, done) if not idle],
                num_prefill_workers=len(placement.prefill),
                num_decode_workers=len(placement.decode))

    async def _start(self, more_prefill: int, more_decode: int) -> list[str]:
        """Start the workers, pair them, then let them take requests; their ids."""
        from ..cluster import STARTUP_TIMEOUT_S, start_worker

        placement = self.placement
        new: list[tuple[str, str, object]] = []
        for role, n, have in (("prefill", more_prefill, placement.prefill),
                              ("decode", more_decode, placement.decode)):
            for _ in range(max(n, 0)):
                worker_id, handle, pg = self._start_named(start_worker, role, have, new)
                if pg is not None:
                    self._placement_groups[worker_id] = pg
                new.append((role, worker_id, handle))
                self.starting.append((role, worker_id))
        if not new:
            return []
        t0 = time.monotonic()
        try:
            # a worker Ray cannot place (no node has its resources) fails the call here
            infos = await asyncio.wait_for(asyncio.gather(*(h.ready.remote() for _, _, h in new)),
                                           STARTUP_TIMEOUT_S)
            workers = [(role, Worker(h, i.worker_id, i.num_blocks, i.epoch, node_ip=i.node_ip,
                                     free_blocks=i.num_blocks if role == "decode" else 0), i)
                       for (role, _, h), i in zip(new, infos)]
            new_p = [w for role, w, _ in workers if role == "prefill"]
            new_d = [(w, i) for role, w, i in workers if role == "decode"]
            d_infos = await asyncio.gather(*(d.handle.ready.remote() for d in placement.decode))
            every_d = [(i.kv_address, *i.kv_rank_addresses) for i in d_infos] + [
                (i.kv_address, *i.kv_rank_addresses) for _, i in new_d]
            await asyncio.gather(
                *(p.handle.pair.remote([a for ranks in every_d for a in ranks]) for p in new_p),
                *(p.handle.pair.remote([a for _, i in new_d
                                        for a in (i.kv_address, *i.kv_rank_addresses)])
                  for p in placement.prefill if new_d))
        except BaseException:
            for _, worker_id, handle in new:
                self._stop(worker_id, handle)
            raise
        finally:
            self.starting = [s for s in self.starting if s not in
                             {(role, worker_id) for role, worker_id, _ in new}]
        placement.prefill = placement.prefill + new_p
        placement.decode = placement.decode + [w for w, _ in new_d]
        placement.room.freed()          # a request waiting for KV space may fit there
        logger.warning("started %s in %.1f s", [worker_id for _, worker_id, _ in new],
                       time.monotonic() - t0)
        if new_d and self.config.router.rebalance_on_scale_up:
            self.rebalance()
        return [worker_id for _, worker_id, _ in new]

    def rebalance(self) -> int:
        """Move the streams each decode worker has above the pool's mean (rounded up)
        off it: each such attempt fails with streams.Moved and is retried like a death,
        its prompt and the tokens it streamed prefilled again and decoded on the least
        loaded worker, the one that just joined (token-identical: greedy outputs do not
        depend on the batch). Llumnix balances instances the same way, by migrating
        requests (Sun et al., OSDI 2024, section 4); it copies their KV live, here it is
        recomputed: a prefill of the prompt and every token streamed so far, queued on
        the prefill workers with new prompts (why it is off by default). Returns how
        many moved."""
        decode = [d for d in self.placement.decode if d.available]
        if len(decode) < 2:
            return 0
        share = math.ceil(sum(d.streams for d in decode) / len(decode))
        moved = 0
        for d in decode:
            excess = d.streams - share
            for rid in self.streams.decoding_on(d.worker_id):
                if excess <= 0:
                    break
                if self.streams.move(rid):
                    excess -= 1
                    moved += 1
        if moved:
            logger.warning("moved %d streams onto the decode workers that joined", moved)
        return moved

    async def _retire(self, role: str, w: Worker, timeout_s: float) -> bool:
        """Wait until `w` has nothing of its own (True), or timeout_s (False: what it
        still has moves on when it stops), then stop it."""
        deadline = time.monotonic() + timeout_s
        self._issued(role, [w.worker_id])           # its name is never issued again
        while True:
            try:
                s = await asyncio.wait_for(w.handle.status.remote(), timeout=5)
                busy = (s.running_requests + s.waiting_requests + s.kv_reservations_leased
                        + w.queued_tokens + w.streams)
            except Exception:        # dead: nothing of its own left to wait for
                busy = 0
            if busy == 0 or time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.05)
        if busy:
            logger.warning("%s still has %d requests after %g s: they move on", w.worker_id,
                           busy, timeout_s)
        placement = self.placement
        if role == "prefill":
            placement.prefill = [p for p in placement.prefill if p is not w]
            placement.prefill_router.index.forget(w.worker_id)
        else:
            placement.decode = [d for d in placement.decode if d is not w]
        try:
            await asyncio.wait_for(w.handle.shutdown.remote(), timeout=15)
        except Exception as e:       # already dead, or hung: the kill below ends it
            logger.warning("shutdown of %s: %r", w.worker_id, e)
        self._stop(w.worker_id, w.handle)
        logger.warning("retired %s", w.worker_id)
        return not busy

    def _stop(self, worker_id: str, handle) -> None:
        ray.kill(handle)
        pg = self._placement_groups.pop(worker_id, None)
        if pg is not None:
            ray.util.remove_placement_group(pg)

    def stop(self) -> None:
        """The router stops: the placement groups of the workers it started."""
        for pg in self._placement_groups.values():
            try:
                ray.util.remove_placement_group(pg)
            except Exception as e:   # Ray going away
                logger.debug("placement group not removed: %s", e)
        self._placement_groups = {}

    NAME_TRIES = 8

    def _start_named(self, start_worker, role: str, have: list[Worker], new: list
                     ) -> tuple[str, object, object]:
        """Start a `role` worker under the next free `role-N` name: another router
        replica scaling at the same moment may have taken the one this replica
        issued (Ray refuses a second actor of one name), so the next is tried, at most
        NAME_TRIES times. Returns (worker id, handle, placement group or None).

        Raises:
            ray.exceptions.ActorAlreadyExistsError: NAME_TRIES names in a row were taken.
        """
        for _ in range(self.NAME_TRIES - 1):
            worker_id = self._next_id(role, have, new)
            try:
                return (worker_id, *start_worker(self.config, role, worker_id))
            except ray.exceptions.ActorAlreadyExistsError:
                logger.warning("%s is taken (another router replica scaled): trying the "
                               "next name", worker_id)
        worker_id = self._next_id(role, have, new)      # the last try: its error goes up
        return (worker_id, *start_worker(self.config, role, worker_id))

    def _next_id(self, role: str, have: list[Worker], new: list) -> str:
        """`role-N`, N past every id of the role this router has had (a retired one's
        name may still be Ray's for a moment)."""
        self._issued(role, [w.worker_id for w in have] +
                     [worker_id for r, worker_id, _ in new if r == role])
        self._last[role] += 1
        return f"{role}-{self._last[role]}"

    def _issued(self, role: str, worker_ids: list[str]) -> None:
        """Note `role-N` ids as had (a worker the cluster started, then retired, too)."""
        used = [int(m.group(1)) for wid in worker_ids
                if (m := re.fullmatch(rf"{role}-(\d+)", wid))]
        self._last[role] = max([self._last.get(role, -1), *used])
