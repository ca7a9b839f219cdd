"""The router's end of the decode workers' token events: one Ray stream per decode
worker incarnation (DecodeWorker.events, carrying this router replica's requests),
fanned out to one queue per request attempt.

    attempt:  open(rid, sample_ids) ─ before the reservation: D may produce events at
              once (a local prefill), and none may be dropped; the events of every id
              of `sample_ids` (the samples D forks the request into, sampling.n) go to
              the attempt's one queue
              bind(rid, d, epoch) ─ after it: the stream of (d, epoch) is started if it
              is not running; if it fails (D died, or restarted since the reservation),
              every attempt bound to it gets the error
              batches(rid, deadline) ─ the attempt's events, as lists
              close(rid) ─ always, in a finally
    scaling:  move(rid) ─ a decoding attempt fails with `Moved` (retried like a death,
              on the least loaded decode worker: router/scaling.py's rebalance)

One stream per worker carries a step's tokens for all its requests as one Ray message;
a stream per request cost one message (and one object-store report on each side) per
request and step, which on a 2-core box took as much CPU as a fifth of the decode step
(docs/performance.md).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import grpc
import ray

from ..engine.request import TokenEvent
from .errors import RequestError
from .workers import Moved, Worker

logger = logging.getLogger(__name__)


class StreamEnded(ray.exceptions.RayError):
    """A decode worker's event stream ended (a newer subscriber took it, or the worker
    shut down) while requests were still bound to it: they are retried like a death."""


class _Failed:
    """Queued for an attempt whose worker's stream failed: `error` is raised there."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException):
        self.error = error


class DecodeStreams:
    """Per attempt, at most MAX_QUEUED_EVENTS events wait for its reader: past them the
    attempt fails with RESOURCE_EXHAUSTED (after the events queued before) and D's
    further events for it are dropped, so a client that reads nothing costs the router
    a bounded buffer even before StallWatch (router/stalls.py) ends its stream."""

    MAX_QUEUED_EVENTS = 1 << 14     # ~16k decode steps of one stream's tokens: minutes

    def __init__(self, router: int = 0):
        self.router = router        # this replica's index: the events it asks D for
        self._queues: dict[str, asyncio.Queue] = {}          # request id on D -> its events
        self._samples: dict[str, tuple[str, ...]] = {}       # attempt id -> its ids on D
        self._bound: dict[tuple[str, int], set[str]] = {}    # (worker id, epoch) -> attempts
        self._pumps: dict[tuple[str, int], asyncio.Task] = {}
        self._decoding: set[str] = set()    # attempts of one sample that got events
        self._moved: set[str] = set()       # attempts move() failed (never moved twice)
        self._overflowed: set[asyncio.Queue] = set()   # attempts' queues past the bound

    def open(self, rid: str, sample_ids: tuple[str, ...] = ()) -> None:
        """Start collecting the events of attempt `rid` (before its reservation), and of
        its samples' `sample_ids` on D (sampling n > 1) into the same queue."""
        queue = asyncio.Queue()
        self._samples[rid] = (rid, *sample_ids)
        for i in self._samples[rid]:
            self._queues[i] = queue

    def bind(self, rid: str, d: Worker, epoch: int) -> None:
        """Attempt `rid` holds a reservation on `d` at incarnation `epoch`: its events come
        on (d, epoch)'s stream, started here when it is not running."""
        key = (d.worker_id, epoch)
        self._bound.setdefault(key, set()).add(rid)
        if key not in self._pumps:
            self._pumps[key] = asyncio.get_running_loop().create_task(self._pump(d, epoch))

    def close(self, rid: str) -> None:
        for i in self._samples.pop(rid, ()):
            self._overflowed.discard(self._queues.pop(i, None))
        for key, rids in list(self._bound.items()):
            rids.discard(rid)
        self._decoding.discard(rid)
        self._moved.discard(rid)

    def decoding_on(self, worker_id: str) -> list[str]:
        """The attempts of one sample each (n = 1) bound to `worker_id` that are decoding
        there (D has streamed them tokens)."""
        return [rid for (w, _), rids in self._bound.items() if w == worker_id
                for rid in rids if rid in self._decoding]

    def move(self, rid: str) -> bool:
        """Fail decoding attempt `rid` with `Moved` at its next wait for events; False
        when it is not decoding (finished meanwhile)."""
        if rid not in self._decoding:
            return False
        self._decoding.discard(rid)
        self._moved.add(rid)
        self._queues[rid].put_nowait(_Failed(Moved(f"attempt {rid} moved to balance the "
                                                   "decode workers")))
        return True

    async def batches(self, rid: str, deadline: float) -> AsyncIterator[list[TokenEvent]]:
        """The events of attempt `rid`, every one that piled up in each list, each wait
        bounded by `deadline` (time.monotonic()).

        Raises:
            asyncio.TimeoutError: nothing came before the deadline.
            ray.exceptions.RayError: the worker's stream failed (it died or restarted).
        """
        queue = self._queues[rid]
        while True:
            # asyncio.wait, not wait_for: 3.11's wait_for can swallow a cancellation (the
            # client went away) that races the queue's get, and the attempt runs on
            get = asyncio.ensure_future(queue.get())
            try:
                await asyncio.wait({get}, timeout=max(deadline - time.monotonic(), 0.001))
            finally:
                if not get.done():
                    get.cancel()
            if get.cancelled() or not get.done():
                raise asyncio.TimeoutError
            item = get.result()
            if (len(self._samples.get(rid, ())) == 1 and not isinstance(item, _Failed)
                    and rid not in self._moved):
                self._decoding.add(rid)
            batch = []
            while True:
                if isinstance(item, _Failed):
                    if batch:        # what came before the failure first
                        queue.put_nowait(item)
                        break
                    raise item.error
                batch.append(item)
                if queue.empty():
                    break
                item = queue.get_nowait()
            yield batch

    async def stop(self) -> None:
        for task in self._pumps.values():
            task.cancel()
        await asyncio.gather(*self._pumps.values(), return_exceptions=True)

    async def _pump(self, d: Worker, epoch: int) -> None:
        key = (d.worker_id, epoch)
        error: BaseException = StreamEnded(f"decode worker {d.worker_id}'s event stream ended")
        try:
            async for ref in d.handle.events.remote(epoch, self.router):
                for ev in await ref:
                    queue = self._queues.get(ev.request_id)
                    if queue is None or queue in self._overflowed:
                        continue
                    if queue.qsize() < self.MAX_QUEUED_EVENTS:
                        queue.put_nowait(ev)
                        continue
                    self._overflowed.add(queue)
                    queue.put_nowait(_Failed(RequestError(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"the response was not read: {self.MAX_QUEUED_EVENTS} token events "
                        "waited for the client")))
        except ray.exceptions.RayError as e:
            error = e
        except asyncio.CancelledError:
            raise
        except Exception as e:   # the stream cannot go on: its attempts are retried
            logger.warning("event stream of %s failed: %r", d.worker_id, e)
            error = StreamEnded(f"event stream of {d.worker_id} failed: {e!r}")
        finally:
            del self._pumps[key]
            for rid in self._bound.pop(key, ()):
                queue = self._queues.get(rid)
                if queue is not None:
                    queue.put_nowait(_Failed(error))
