"""Which workers a router replica places requests on: those it was built with, or, after
Ray restarted it, the live ones by their Ray names (join); after another replica scaled
or drained, the set as Ray names it and the workers' own drain marks (sync_members,
which that replica asks for: notify_replicas); and the drain marks themselves
(mark_draining)."""

from __future__ import annotations

import asyncio
import logging
import re

import ray

from .workers import Worker

logger = logging.getLogger(__name__)

SYNC_READY_TIMEOUT_S = 5.0   # sync_members: a worker slower to answer ready() stays as it was


async def join(placement, handles: tuple[list, list], index: int,
               restarted_timeout_s: float | None = None) -> None:
    """Fill `placement` with the workers of `handles` ((prefill, decode) actor handles)
    once each is ready, and pair every prefill worker with every decode worker (a
    layout mismatch fails `serve` at start with a message naming the field, not the
    first request). With `restarted_timeout_s` (the replica `index` restarted,
    Router.start): the workers are the live named ones instead, each waited for at
    most that many seconds (one that does not answer is left out and probed like a
    dead one), and every request this replica had on them is aborted."""
    restarted = restarted_timeout_s is not None
    if not restarted:
        prefill = await ready_workers(handles[0])
        decode = await ready_workers(handles[1])
    else:
        found = named_workers()
        prefill = await ready_workers([h for _, h in found["prefill"]], restarted_timeout_s)
        decode = await ready_workers([h for _, h in found["decode"]], restarted_timeout_s)
    placement.prefill = [Worker(h, i.worker_id, i.num_blocks, i.epoch, node_ip=i.node_ip,
                                draining=i.draining) for h, i in prefill]
    placement.decode = [Worker(h, i.worker_id, i.num_blocks, i.epoch, free_blocks=i.num_blocks,
                               node_ip=i.node_ip, draining=i.draining) for h, i in decode]
    if restarted:
        aborted = await asyncio.gather(*(w.handle.abort_all.remote(router=index)
                                         for w in placement.prefill + placement.decode),
                                       return_exceptions=True)
        logger.warning("router %d restarted: serving again with %d prefill and %d decode "
                       "workers; %d requests of its dead incarnation aborted on them",
                       index, len(prefill), len(decode),
                       sum(n for n in aborted if isinstance(n, int)))
    addresses = [a for _, i in decode for a in (i.kv_address, *i.kv_rank_addresses)]
    await asyncio.gather(*(p.handle.pair.remote(addresses) for p in placement.prefill))


async def ready_workers(handles: list, timeout_s: float | None = None) -> list[tuple]:
    """(handle, WorkerInfo) of each worker once it is ready. With `timeout_s`, a
    worker that fails or does not answer in time is left out (logged); without, its
    error is raised."""
    if timeout_s is None:
        infos = await asyncio.gather(*(h.ready.remote() for h in handles))
        return list(zip(handles, infos))
    infos = await asyncio.gather(*(asyncio.wait_for(h.ready.remote(), timeout_s)
                                   for h in handles), return_exceptions=True)
    for h, i in zip(handles, infos):
        if isinstance(i, BaseException):
            logger.warning("worker %s left out: not ready within %.0f s (%r)",
                           getattr(h, "_actor_id", h), timeout_s, i)
    return [(h, i) for h, i in zip(handles, infos) if not isinstance(i, BaseException)]


async def sync_members(placement) -> tuple[list[str], list[str]]:
    """Take the worker set as Ray names it (another router replica may have scaled it,
    router/scaling.py) and each worker's drain mark (another replica drained or is
    retiring it): a named worker this replica does not know joins its lists once
    ready (whoever started it paired it first), one no longer named (retired) leaves
    them (`placement`'s). Returns the worker ids (joined, left)."""
    found = await asyncio.to_thread(named_workers)
    joined, left = [], []
    for role in ("prefill", "decode"):
        have = {w.worker_id: w for w in getattr(placement, role)}
        named = dict(found[role])
        infos = await asyncio.gather(*(asyncio.wait_for(named[wid].ready.remote(),
                                                        SYNC_READY_TIMEOUT_S)
                                       for wid in named), return_exceptions=True)
        new = []
        for wid, info in zip(named, infos):
            if isinstance(info, BaseException):     # starting, dead or hung: as it was
                continue
            if wid not in have:
                new.append(Worker(named[wid], wid, info.num_blocks, info.epoch,
                                  node_ip=info.node_ip, draining=info.draining,
                                  free_blocks=info.num_blocks if role == "decode" else 0))
            elif info.draining and info.epoch == have[wid].epoch:
                have[wid].draining = True
        gone = sorted(set(have) - set(named))
        setattr(placement, role, [w for wid, w in have.items() if wid not in gone] + new)
        index = (placement.prefill_router.index if role == "prefill"
                 else placement.decode_index)
        for wid in gone if index is not None else ():
            index.forget(wid)
        joined += [w.worker_id for w in new]
        left += gone
    if joined:
        placement.room.freed()      # a request waiting for KV space may fit there
    if joined or left:
        logger.warning("workers joined %s, left %s (another router replica scaled)",
                       joined, left)
    return joined, left


async def notify_replicas(config, index: int) -> None:
    """Ask the other router replicas to sync_members now (after this one scaled or
    drained; `index` this replica's, of config.num_routers); one that does not answer
    syncs when it restarts (Router.start)."""
    async def one(i: int) -> None:
        try:
            handle = await asyncio.to_thread(ray.get_actor, f"router-{i}" if i else "router")
            await asyncio.wait_for(handle.sync_members.remote(), 30)
        except Exception as e:
            logger.warning("router replica %d not told of the new workers: %r", i, e)

    if config.num_routers > 1:
        await asyncio.gather(*(one(i) for i in range(config.num_routers) if i != index))


async def mark_draining(workers: list[Worker]) -> None:
    """Send `workers` no new request, from this router replica (at once) and from the
    others (the workers' drain(): ready() tells them, sync_members). A worker
    that does not answer is dead or hung: this replica's mark is enough then."""
    for w in workers:
        w.draining = True
    await asyncio.gather(*(asyncio.wait_for(w.handle.drain.remote(), 5) for w in workers),
                         return_exceptions=True)


def named_workers() -> dict[str, list[tuple[str, object]]]:
    """The worker actors of this Ray namespace by role, each named `role-N` (its worker
    id: cluster.start_worker), in N order: {"prefill": [(worker id, handle)...],
    "decode": [...]}. An actor gone between the listing and the lookup is left out."""
    found: dict[str, list[tuple[int, object]]] = {"prefill": [], "decode": []}
    for name in ray.util.list_named_actors():
        if (m := re.fullmatch(r"(prefill|decode)-(\d+)", name)) is None:
            continue
        try:
            found[m.group(1)].append((int(m.group(2)), ray.get_actor(name)))
        except ValueError:      # killed meanwhile (scaled down)
            continue
    return {role: [(f"{role}-{n}", h) for n, h in sorted(hs, key=lambda x: x[0])]
            for role, hs in found.items()}
