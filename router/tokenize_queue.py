"""The router's tokenizer work: one thread (HF tokenizers raise "Already borrowed" when
one is used from two threads at once), fed shortest input first, with a bound on the
characters that would run before a new call (the one in progress and every waiting
one no longer than it), checked before any work. A flood of maximum-size prompts then
costs a short request at most the one tokenization in progress, and the flood's excess
is refused before any work (RESOURCE_EXHAUSTED) instead of queueing; a short request is
never refused for the long ones waiting. A refusal is answered once the work ahead of
it would have run (learned seconds per character, at most MAX_REFUSAL_DELAY_S): a client
that loops on refusals goes at the tokenizer's pace, not at the router's, so its
requests do not take the event loop from everyone else's. vLLM's API server tokenizes
on a thread pool too (AsyncMicrobatchTokenizer); the order and the bound are pdserve's.

Long inputs (over `long_chars`: for the router, more characters than
validation.PREFIX_CHARS_PER_TOKEN per token of the context, prompts that are nearly
always over it) share at most LONG_SHARE of the thread's time, a token bucket of
seconds (LONG_BURST_S deep, refilled at LONG_SHARE a second): one arriving while the
bucket is empty is refused (RESOURCE_EXHAUSTED) once it would have refilled, at most
MAX_REFUSAL_DELAY_S later. Clients looping on such prompts, however many, then keep
the thread busy a quarter of the time, not all of it: where the router shares a box's
cores with workers, the rest is theirs (on this 2-core box, 16 clients looping refused
maximum-size prompts cost a short request ~1.8x its unloaded time to first token
without the share, 0.8-1.4x with it: tests/e2e/test_serve_refused_flood.py).

Runs on the router's event loop (no locks: the queue is only touched there).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NoReturn

import grpc

from .errors import RequestError


MAX_REFUSAL_DELAY_S = 1.0
LONG_SHARE = 0.25       # of the tokenizer thread's time, for long inputs together
LONG_BURST_S = 1.0      # seconds of long inputs' tokenizing let in at once
_DECAY = 0.9            # a tokenization's weight in the seconds-per-character estimate


class TokenizeQueue:
    """Calls run on one thread, shortest (by `chars`) first, arrival order among equals.

    Args:
        max_queued_chars: most characters of input a call may find ahead of it, its own
            included (RouterConfig.max_tokenize_queue_chars); a call with nothing ahead
            is always let in.
        long_chars: a call of more characters is long: long calls share LONG_SHARE of
            the thread's time (the module docstring); None: no share.
    """

    def __init__(self, max_queued_chars: int, long_chars: int | None = None):
        assert max_queued_chars >= 1, max_queued_chars
        self.max_queued_chars = max_queued_chars
        self.long_chars = long_chars
        self._long_credit_s = LONG_BURST_S   # the long calls' bucket (may go below 0)
        self._long_refilled = time.monotonic()
        self.queued_chars = 0             # waiting or in progress
        self.refused = 0
        self._running_chars = 0
        self._started = 0.0
        self.seconds_per_char = 0.0       # of the tokenizations so far (decayed mean)
        self._heap: list[tuple[int, int, asyncio.Future, Callable, tuple]] = []
        self._seq = itertools.count()
        self._busy = False
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tokenize")

    async def run(self, chars: int, fn: Callable[..., Any], *args) -> Any:
        """fn(*args) on the tokenizer thread, after every waiting call with fewer
        `chars` (the input's size, in characters).

        Raises:
            RequestError: RESOURCE_EXHAUSTED (nothing ran; raised after the refusal
                delay), when the calls that would run first hold more than
                max_queued_chars with this one, or when this call is long and the long
                calls' share is spent. What fn raises.
        """
        if self.long_chars is not None and chars > self.long_chars:
            now = time.monotonic()
            self._long_credit_s = min(LONG_BURST_S, self._long_credit_s
                                      + LONG_SHARE * (now - self._long_refilled))
            self._long_refilled = now
            if self._long_credit_s <= 0:     # refused once the share has refilled
                await self._refuse(-self._long_credit_s / LONG_SHARE + 1e-3,
                                   f"prompts of over {self.long_chars} characters (this one "
                                   f"has {chars}) have used their share ({LONG_SHARE:.0%}) "
                                   "of the router's tokenizer")
        ahead = self._running_chars + sum(c for c, _, fut, _, _ in self._heap
                                          if c <= chars and not fut.done())
        if ahead and ahead + chars > self.max_queued_chars:
            await self._refuse(ahead * self.seconds_per_char,
                               f"{ahead} characters wait for the router's tokenizer ahead "
                               f"of this request's {chars}, over max_tokenize_queue_chars="
                               f"{self.max_queued_chars} with it")
        fut = asyncio.get_running_loop().create_future()
        heapq.heappush(self._heap, (chars, next(self._seq), fut, fn, args))
        self.queued_chars += chars
        try:
            self._start_next()
            return await fut
        finally:          # done, failed, or cancelled while waiting (then skipped)
            self.queued_chars -= chars

    async def _refuse(self, delay_s: float, why: str) -> NoReturn:
        """RESOURCE_EXHAUSTED "server overloaded: `why`; retry later", raised after
        `delay_s` seconds (at most MAX_REFUSAL_DELAY_S)."""
        self.refused += 1
        await asyncio.sleep(min(delay_s, MAX_REFUSAL_DELAY_S))
        raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"server overloaded: {why}; retry later")

    def _start_next(self) -> None:
        while self._heap and not self._busy:
            chars, _, fut, fn, args = heapq.heappop(self._heap)
            if fut.done():                        # its caller went away while it waited
                continue
            self._busy, self._running_chars, self._started = True, chars, time.perf_counter()
            job = asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
            job.add_done_callback(lambda j, fut=fut: self._finished(j, fut))

    def _finished(self, job: asyncio.Future, fut: asyncio.Future) -> None:
        if self.long_chars is not None and self._running_chars > self.long_chars:
            self._long_credit_s -= time.perf_counter() - self._started
        if self._running_chars:
            took = (time.perf_counter() - self._started) / self._running_chars
            self.seconds_per_char = (took if not self.seconds_per_char else
                                     _DECAY * self.seconds_per_char + (1 - _DECAY) * took)
        self._busy, self._running_chars = False, 0
        if job.cancelled():                       # the loop is shutting down
            fut.cancel()
        elif not fut.done():
            if job.exception() is not None:
                fut.set_exception(job.exception())
            else:
                fut.set_result(job.result())
        self._start_next()
