"""The decode worker's token events on their way to the routers: one list per router
replica (the one pdserve/request_ids.py names in each request's id), each streamed by
that replica's events() call. A newer call for one replica ends its older one (a
restarted replica's stream takes over from its dead incarnation's). Runs on the
worker's event loop; the step thread hands events over with call_soon_threadsafe."""

from __future__ import annotations

import asyncio
import collections
import threading

from ..engine.request import TokenEvent
from ..request_ids import router_of


class EventOutbox:
    def __init__(self):
        self._events: dict[int, list[TokenEvent]] = collections.defaultdict(list)
        self._ready: dict[int, asyncio.Event] = {}
        self._generation: dict[int, int] = collections.defaultdict(int)

    def deliver(self, events: list[TokenEvent]) -> None:
        """Queue `events` for their routers' streams (on the event loop)."""
        touched = set()
        for ev in events:
            router = router_of(ev.request_id)
            self._events[router].append(ev)
            touched.add(router)
        for router in touched:
            if router in self._ready:
                self._ready[router].set()

    async def stream(self, router: int, stopped: threading.Event, poll_s: float):
        """Yield lists of router `router`'s events as they come (what piled up meanwhile
        in one list), until a newer stream of that router or end(router) takes over,
        or `stopped` is set (checked at least every `poll_s` seconds)."""
        self._generation[router] += 1
        me = self._generation[router]
        ready = self._ready.setdefault(router, asyncio.Event())
        while me == self._generation[router] and not stopped.is_set():
            try:
                await asyncio.wait_for(ready.wait(), poll_s)
            except asyncio.TimeoutError:
                continue
            if me != self._generation[router]:   # a newer stream took over while this
                break                            # waited: the events are its
            ready.clear()
            events, self._events[router] = self._events[router], []
            if events:
                yield events

    def end(self, router: int) -> None:
        """End router `router`'s current stream and drop what waits for it (its
        requests were aborted: a restarted replica's)."""
        self._generation[router] += 1
        self._events.pop(router, None)
        if router in self._ready:
            self._ready[router].set()
