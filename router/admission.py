"""Admission control: the router bounds its queued work and refuses the excess at once.

"Queued" is a request the router admitted that has not yet got its first token back from
prefill: waiting for a decode reservation, in a prefill worker's queue, or being
prefilled. Beyond either bound a Generate call fails fast with RESOURCE_EXHAUSTED and a
message naming the bound, so clients back off instead of piling up behind a full
cluster (and a prompt larger than the token bound is refused rather than never fitting).

    admit(num_tokens) → Ticket ── first token / error / cancel / deadline ──→ release()

Single-threaded: the router calls it from its one asyncio event loop.
"""

from __future__ import annotations

import grpc

from .errors import RequestError


class Admission:
    """Counts queued requests and their prompt tokens against two bounds.

    Args:
        max_requests: most requests queued at once (RouterConfig.max_queued_requests).
        max_tokens: most prompt tokens queued at once (RouterConfig.max_queued_tokens).
    """

    def __init__(self, max_requests: int, max_tokens: int):
        assert max_requests >= 1 and max_tokens >= 1, (max_requests, max_tokens)
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self.queued_requests = 0
        self.queued_tokens = 0      # prompt tokens of the queued requests
        # since start, with their prompt tokens: the SLO planner's arrivals (planner.py)
        self.admitted_requests = self.admitted_tokens = 0
        self.refused_requests = self.refused_tokens = 0   # over a bound (not too long)
        self.arrived_max_output = 0     # max_tokens x samples of every arrival (both)

    def admit(self, num_tokens: int, max_output_tokens: int = 0) -> Ticket:
        """Queue a request of `num_tokens` prompt tokens (and at most `max_output_tokens`
        output tokens, every sample it decodes: the planner's output estimate); release the ticket once its first
        token is back or it fails (a `with` block releases it on every path).

        Raises:
            RequestError: RESOURCE_EXHAUSTED when admitting it would exceed either bound;
                the message names the bound (max_queued_requests / max_queued_tokens).
        """
        assert num_tokens >= 1, num_tokens
        if num_tokens > self.max_tokens:
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"prompt of {num_tokens} tokens exceeds max_queued_tokens="
                               f"{self.max_tokens}: it can never be queued; shorten the prompt")
        self.arrived_max_output += max_output_tokens
        over_requests = self.queued_requests + 1 > self.max_requests
        over_tokens = self.queued_tokens + num_tokens > self.max_tokens
        if over_requests or over_tokens:
            self.refused_requests += 1
            self.refused_tokens += num_tokens
        if over_requests:
            raise self._full()
        if over_tokens:
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"server overloaded: {self.queued_tokens} prompt tokens queued + "
                               f"{num_tokens} in this request > max_queued_tokens="
                               f"{self.max_tokens}; retry later")
        self.queued_requests += 1
        self.queued_tokens += num_tokens
        self.admitted_requests += 1
        self.admitted_tokens += num_tokens
        return Ticket(self, num_tokens)


    def check_room(self) -> None:
        """Refuse a request before any work on it (tokenizing) when the request bound is
        reached already: admit() would refuse it whatever its prompt.

        Raises:
            RequestError: RESOURCE_EXHAUSTED naming max_queued_requests.
        """
        if self.queued_requests >= self.max_requests:
            self.refused_requests += 1
            raise self._full()

    def _full(self) -> RequestError:
        return RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"server overloaded: {self.queued_requests} requests already "
                            f"queued for prefill (max_queued_requests={self.max_requests}); "
                            "retry later")


class Ticket:
    """One admitted request's share of the queue; `release()` returns it exactly once
    (later calls do nothing), and leaving a `with` block releases it."""

    __slots__ = ("_admission", "num_tokens", "released")

    def __init__(self, admission: Admission, num_tokens: int):
        self._admission = admission
        self.num_tokens = num_tokens    # prompt tokens counted against max_queued_tokens
        self.released = False

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        a = self._admission
        a.queued_requests -= 1
        a.queued_tokens -= self.num_tokens
        assert a.queued_requests >= 0 and a.queued_tokens >= 0, (a.queued_requests, a.queued_tokens)

    def __enter__(self) -> Ticket:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
