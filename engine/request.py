"""Request states shared by the workers, and the token events decode streams to the router."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .logprobs import TokenLogprobs


class RequestState(enum.IntEnum):
    """Where a request is on one worker. Finished states come last: `state.finished`."""

    WAITING = 0                 # prefill: queued for a prefill batch
    WAITING_FOR_REMOTE_KV = 1   # decode: blocks reserved under a lease, KV arriving
    PREFILLING = 2              # prefill: in the batch being computed
    SENDING_KV = 3              # prefill: computed, KV frames still in flight
    RUNNING = 4                 # decode: in the continuous batch
    PREEMPTED = 5               # decode: blocks freed for older requests; resumes by recompute
    FINISHED_STOPPED = 6        # EOS or a stop token
    FINISHED_LENGTH = 7         # max_tokens or the model's context
    FINISHED_ABORTED = 8        # client cancel / router abort
    FINISHED_ERROR = 9          # transfer failure, lease expiry, worker fault

    @property
    def finished(self) -> bool:
        return self >= RequestState.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        """The API's finish_reason: stop | length | cancelled | error (None while live)."""
        return _FINISH_REASON.get(self)


_FINISH_REASON = {
    RequestState.FINISHED_STOPPED: "stop",
    RequestState.FINISHED_LENGTH: "length",
    RequestState.FINISHED_ABORTED: "cancelled",
    RequestState.FINISHED_ERROR: "error",
}


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """New tokens of one request, from a decode worker to the router.

    `finish_reason` is set on the request's last event; `error` says why when it is
    "error". `logprobs` is empty, or one entry per token (engine/logprobs.py). Events of
    one request arrive in order and are never repeated.
    """

    request_id: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    error: str | None = None
    logprobs: tuple[TokenLogprobs | None, ...] = ()   # per token, when params.logprobs
