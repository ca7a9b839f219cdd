"""Streams whose client stopped taking responses.

A front end (gRPC, HTTP) pulls the router's next response only once it has handed the
previous one to the connection; a client that stops reading fills its socket's buffers
and then parks the stream at that response. Parked, the request would still hold its
KV blocks on P and D, and D would go on decoding into the router's queue for it.
`StallWatch` closes a stream parked longer than `stream_stall_timeout_s`, or past its
deadline: the router's generator ends (its `finally` aborts the request on P and D, so
every block is freed at once) and the front end, when the connection lets it, ends the
call with an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Callable

import grpc

from .errors import RequestError


class Held:
    """One stream under watch: when it was parked (time.monotonic() seconds, None while
    the front end is pulling), its deadline, and the task closing it once it stalled."""

    __slots__ = ("stream", "deadline", "since", "closing", "error")

    def __init__(self, stream: AsyncGenerator, deadline: float):
        self.stream, self.deadline = stream, deadline
        self.since: float | None = None
        self.closing: asyncio.Task | None = None
        self.error: RequestError | None = None


class StallWatch:
    """Closes the streams parked at a response for `timeout_s` seconds, or past their
    deadline, every `timeout_s` / 4 (at most 1 s). `on_stall` is called for each stream
    closed for the stall (a metric)."""

    def __init__(self, timeout_s: float, on_stall: Callable[[], None] = lambda: None):
        self.timeout_s = timeout_s
        self._on_stall = on_stall
        self._held: set[Held] = set()

    def hold(self, stream: AsyncGenerator, deadline: float) -> Held:
        held = Held(stream, deadline)
        self._held.add(held)
        return held

    def release(self, held: Held) -> None:
        self._held.discard(held)

    def sweep(self, now: float | None = None) -> None:
        """Close every stream parked too long or past its deadline."""
        now = time.monotonic() if now is None else now
        for h in list(self._held):
            if h.since is None or h.closing is not None:
                continue
            if now >= h.deadline:
                h.error = RequestError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                       "request deadline exceeded while the client was not "
                                       "reading the response")
            elif now - h.since >= self.timeout_s:
                h.error = RequestError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"the client read nothing for {self.timeout_s:g} s "
                    "(stream_stall_timeout_s): the stream is aborted")
                self._on_stall()
            else:
                continue
            self._held.discard(h)
            h.closing = asyncio.get_running_loop().create_task(h.stream.aclose())

    async def run(self) -> None:
        """sweep() until cancelled."""
        while True:
            await asyncio.sleep(min(1.0, self.timeout_s / 4))
            self.sweep()


async def watched(watch: StallWatch | None, stream: AsyncGenerator, deadline: float
                  ) -> AsyncGenerator:
    """The items of `stream`, closed by `watch` when its consumer leaves it parked at
    one too long (then RequestError once the consumer comes back for the next). Closing
    this closes `stream`.

    Raises:
        RequestError: the stream stalled (RESOURCE_EXHAUSTED) or its deadline passed
            while parked (DEADLINE_EXCEEDED).
    """
    held = watch.hold(stream, deadline) if watch is not None else None
    try:
        while True:
            if held is not None and held.closing is not None:
                await held.closing
                raise held.error
            try:
                item = await anext(stream)
            except StopAsyncIteration:
                return
            if held is not None:
                held.since = time.monotonic()
            try:
                yield item
            finally:
                if held is not None:
                    held.since = None
    finally:
        if held is None or held.closing is None:
            if held is not None:
                watch.release(held)
            await stream.aclose()
        else:
            with contextlib.suppress(Exception):
                await held.closing
