"""The router's Admin RPCs (service.py AdminService): draining a node's workers before
it goes away (what a Kubernetes preStop hook calls), and the cluster's status; and its
background loops: probing dead workers, mirroring prefill workers' prefix caches."""

from __future__ import annotations

import asyncio
import logging
import time

from ..engine.sampling_params import InvalidRequestError
from ..proto import pdserve_pb2 as pb
from .membership import mark_draining
from .placement import Placement
from .workers import Worker

logger = logging.getLogger(__name__)

STATUS_TIMEOUT_S = 5.0    # a worker's status() slower than this is hung (not idle, not dead)


async def drain(placement: Placement, node_ip: str, timeout_s: float, notify_replicas
                ) -> pb.DrainResponse:
    """Stop sending new requests to the workers on `node_ip` (this replica's, and the
    others' once `notify_replicas()` told them), then wait up to `timeout_s` seconds
    for their running and waiting requests to finish. A worker whose status() does not
    answer within STATUS_TIMEOUT_S counts as busy (one request), a dead one as idle. A
    drained worker takes requests again only once Ray restarts it (a new epoch).

    Raises:
        InvalidRequestError: no worker runs on `node_ip`, or timeout_s is not in
            [0, 3600] seconds.
    """
    if not 0 <= timeout_s <= 3600:
        raise InvalidRequestError("timeout_s", f"must be in [0, 3600] seconds, got {timeout_s}")
    every = placement.prefill + placement.decode
    workers = [w for w in every if w.node_ip == node_ip]
    if not workers:
        raise InvalidRequestError("node_ip", f"no worker runs on {node_ip!r}")
    await mark_draining(workers)
    await notify_replicas()
    logger.warning("draining %s on %s", [w.worker_id for w in workers], node_ip)
    deadline = time.monotonic() + timeout_s
    while True:
        busy = 0
        for w in workers:
            try:
                s = await asyncio.wait_for(w.handle.status.remote(), timeout=STATUS_TIMEOUT_S)
                busy += s.running_requests + s.waiting_requests
            except asyncio.TimeoutError:   # hung, not idle: its requests may still run
                busy += 1
            except Exception:    # dead already: nothing of its own to wait for
                continue
        if busy == 0 or time.monotonic() >= deadline:
            return pb.DrainResponse(worker_ids=[w.worker_id for w in workers],
                                    drained=busy == 0, running_requests=busy)
        await asyncio.sleep(min(0.2, max(deadline - time.monotonic(), 0)))


async def worker_statuses(placement: Placement, starting: list[tuple[str, str]]
                          ) -> list[pb.WorkerStatus]:
    """Every worker's status (Admin.ClusterStatus), then those `starting` ((role, worker
    id), Scaler.starting). A dead or hung worker is reported so, not raised."""
    workers = placement.prefill + placement.decode

    async def one(w: Worker) -> pb.WorkerStatus:
        try:
            s = await asyncio.wait_for(w.handle.status.remote(), timeout=STATUS_TIMEOUT_S)
        except Exception as e:  # dead or hung worker: report it, do not fail the call
            role = "prefill" if w in placement.prefill else "decode"
            return pb.WorkerStatus(worker_id=w.worker_id, role=role, state=f"dead: {e}"[:200],
                                   kv_blocks_total=w.num_blocks)
        out = s.to_proto()
        if w.draining:           # Drain, or retiring (Admin.Scale): no new requests
            out.state = "draining"
        return out

    return [*await asyncio.gather(*map(one, workers)),
            *(pb.WorkerStatus(worker_id=worker_id, role=role, state="starting")
              for role, worker_id in starting)]


async def watch_workers(placement: Placement, interval_s: float) -> None:
    """Probe the workers marked dead every `interval_s` (worker_probe_interval_s), so
    one that Ray restarted takes requests again while others of its role are serving."""
    while True:
        await asyncio.sleep(interval_s)
        await asyncio.gather(*(placement.probe(w) for w in placement.prefill + placement.decode
                               if not w.alive))


async def sync_prefix_caches(placement: Placement, interval_s: float) -> None:
    """Mirror the prefix caches and KV tiers (routing.PrefixIndex) of the workers
    Placement.mirrored names by polling their cache events every `interval_s`
    (cache_sync_interval_s); a worker that does not answer in time is skipped this
    round (its mirror just goes stale). A worker of a new epoch (Ray restarted it)
    starts its mirror again: its events restart from 0."""
    epochs: dict[tuple[int, str], int] = {}      # the incarnation each mirror follows
    while True:
        for index, workers in placement.mirrored():
            for w in list(workers):
                try:
                    reply = await asyncio.wait_for(
                        w.handle.cache_events.remote(index.since(w.worker_id),
                                                     index.tier_since(w.worker_id)),
                        timeout=5)
                except Exception as e:  # dead, restarting or slow: try again next round
                    logger.debug("prefix cache of %s not synced: %r", w.worker_id, e)
                    continue
                if epochs.setdefault((id(index), w.worker_id), reply.epoch) != reply.epoch:
                    index.forget(w.worker_id)
                    epochs[id(index), w.worker_id] = reply.epoch
                    continue
                index.apply(w.worker_id, reply)
        await asyncio.sleep(interval_s)
