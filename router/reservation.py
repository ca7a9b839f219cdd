"""A decode worker's reservation for one attempt, as the router holds it: the load it
charges on the router's view of the workers (Reservation), and the queue of requests
waiting for decode KV space (RoomQueue).

    placement.reserve() ─ charge: prompt tokens on P's queue (or D's own), streams on D
        │                 (before D's reserve call is awaited: a burst's choices see
        │                 each other), then D's reply: refused → refused(), the charge
        │                 back; reserved → settle(): D's own choice of who prefills
        ▼
    first token ─────── first_token(): the prompt's tokens off the queue
    attempt ends ────── release() (the `with` block's exit): the rest, and the
                        RoomQueue's oldest waiter asks again
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from dataclasses import dataclass

from ..messages import DecodeReservation
from .workers import Worker


@dataclass(frozen=True, slots=True)
class PlacementWhy:
    """Why placement chose an attempt's workers, for its reserve span (traced requests
    only): the prefill routing policy, the decode worker's load when chosen (streams,
    free KV blocks), whether it prefills the prompt itself, and, when a prefill worker
    does, the prompt tokens that worker was expected to find cached (prefix cache, tiers
    or a peer's cache) and its queued prompt tokens (this prompt's included). With
    cache_aware decode routing, `decode_cached_blocks`: the run of the prompt's blocks
    the decode worker held when it came first for holding them (routing.DecodeOrder)."""

    routing_policy: str
    decode_streams: int
    decode_free_blocks: int
    prefill_on_decode: bool
    prefix_hit_tokens: int | None = None
    prefill_queued_tokens: int | None = None
    decode_cached_blocks: int | None = None

    def attributes(self) -> dict[str, str | int | bool]:
        """As span attributes, `pdserve.placement.<field>` (fields that are None left
        out)."""
        return {f"pdserve.placement.{name}": v for name in self.__slots__
                if (v := getattr(self, name)) is not None}


class Reservation:
    """One attempt's decode worker `d`, its DecodeReservation `res` (set by settle), who
    prefills the prompt (`p`, None when D does), and the load the attempt charges on
    them, each part released once: `prompt_tokens` on the prefilling worker's
    queued_tokens until first_token(), `num_streams` on D's streams until release().
    A context manager: its exit is release(). Runs on the router's event loop.
    `lent`: D would prefill on the idle prefill workers' lent cores (placement's
    first-token line for D's own prefills is kept apart for them)."""

    def __init__(self, d: Worker, p: Worker | None, prompt_tokens: int, num_streams: int,
                 room: "RoomQueue | None" = None, lent: bool = False):
        self.d, self.p, self.lent = d, p, lent
        self.res: DecodeReservation | None = None
        self._queued, self._streams, self._room = prompt_tokens, num_streams, room
        self.first_token_seen = False
        self.why: PlacementWhy | None = None      # set when the request is traced
        self.by_cache = False      # D came first for holding the prompt's blocks (cache_aware)
        self.refusals = 0          # decode workers that refused it before D took it
        self.prefiller.queued_tokens += prompt_tokens
        d.streams += num_streams

    @property
    def prefiller(self) -> Worker:
        """The worker that computes the prompt: P, or D itself."""
        return self.d if self.p is None else self.p

    def settle(self, res: DecodeReservation) -> None:
        """D reserved: `res.local_prefill` is D's own choice (the router's placement
        only asks it, DecodeWorker.reserve), so a prompt charged to P that D prefills
        after all moves to D's queue."""
        self.res = res
        if res.local_prefill and self.p is not None:
            self.p.queued_tokens -= self._queued
            self.p = None
            self.d.queued_tokens += self._queued

    def first_token(self) -> None:
        """The prompt's first token came back (or its prefill failed): its tokens are
        no longer queued. Idempotent."""
        self.prefiller.queued_tokens -= self._queued
        self._queued, self.first_token_seen = 0, True

    def refused(self) -> None:
        """D refused (no room) or could not be reached: the whole charge back."""
        self.first_token()
        self.d.streams -= self._streams
        self._streams = 0

    def release(self) -> None:
        """The attempt ended: the charge back, and the oldest request waiting for KV
        space asks again (its blocks come back). Idempotent."""
        ended = self._streams > 0
        self.refused()
        if ended and self._room is not None:
            self._room.freed()

    def __enter__(self) -> "Reservation":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class RoomQueue:
    """Requests waiting for decode KV space, first come first served (vLLM's waiting
    queue, FCFS): only the oldest asks the decode workers for room, again whenever a
    request ends on one (`freed`: its blocks come back) and every POLL_S at least (a
    lease that ran out, a worker restarted); the next asks once it got room or left.
    A newcomer asks at once only while none waits, so it never overtakes a waiting
    request. Runs on the router's event loop."""

    POLL_S = 0.25

    def __init__(self):
        self._turns: collections.deque[asyncio.Future] = collections.deque()
        self._freed = asyncio.Event()

    def __len__(self) -> int:
        return len(self._turns)

    @contextlib.asynccontextmanager
    async def turn(self, give_up: float):
        """Wait for this request's turn to ask (at once when none waits); the next
        request's turn starts when the block exits.

        Raises:
            TimeoutError: `give_up` (time.monotonic()) passed first.
        """
        me = asyncio.get_running_loop().create_future()
        self._turns.append(me)
        if len(self._turns) == 1:
            me.set_result(None)
        try:
            if not me.done():
                # asyncio.timeout, not wait_for: wait_for swallows a cancel that lands as
                # the future completes (a client gone as its turn came)
                async with asyncio.timeout(max(give_up - time.monotonic(), 0)):
                    await asyncio.shield(me)
            yield
        finally:
            head = self._turns[0] is me
            self._turns.remove(me)
            if head and self._turns:
                self._turns[0].set_result(None)

    def freed(self) -> None:
        """A request ended on a decode worker: the oldest waiting one asks again."""
        self._freed.set()

    def clear(self) -> None:
        """Called before asking: a free after this wakes the next wait()."""
        self._freed.clear()

    async def wait(self, give_up: float) -> None:
        """Until something was freed since clear(), POLL_S, or `give_up`."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(min(self.POLL_S, give_up - time.monotonic()), 0)):
                await self._freed.wait()
