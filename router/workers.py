"""The router's view of one prefill or decode worker, and what a failed call to one
means for the request (router.py retries it on live workers)."""

from __future__ import annotations

from dataclasses import dataclass

import ray


@dataclass(eq=False)
class Worker:
    handle: object          # Ray actor handle
    worker_id: str
    num_blocks: int
    epoch: int = 0          # the incarnation last seen (Ray restarts a dead worker)
    queued_tokens: int = 0  # prompt tokens this router sent it to prefill whose first
                            # token is not back: a prefill worker's queue, or a decode
                            # worker's own prefills (conditional disaggregation)
    streams: int = 0        # decode: this router's unfinished streams on it
    others_queued_tokens: int = 0  # router replicas: the same two counts of the other
    others_streams: int = 0        # replicas, as the worker last reported its own
    free_blocks: int = 0    # decode: last known
    alive: bool = True      # False from a call that found it dead until a probe answers
    node_ip: str = ""       # the Ray node it runs on
    draining: bool = False  # Drain: takes no new requests (until it restarts elsewhere)

    @property
    def available(self) -> bool:
        return self.alive and not self.draining

    @property
    def total_queued_tokens(self) -> int:
        """queued_tokens with the other router replicas' (theirs are 0 with one router)."""
        return self.queued_tokens + self.others_queued_tokens

    @property
    def total_streams(self) -> int:
        """streams with the other router replicas'."""
        return self.streams + self.others_streams

    def reported_queue(self, tokens: int) -> None:
        """A prefill worker's own count of its queued prompt tokens (PrefillResult.
        queued_tokens): the other replicas' share is what this one did not send."""
        self.others_queued_tokens = max(tokens - self.queued_tokens, 0)

    def reported_streams(self, count: int) -> None:
        """A decode worker's own count of its unfinished requests (DecodeReservation.
        num_requests): the other replicas' share is what this one does not have there."""
        self.others_streams = max(count - self.streams, 0)


class Moved(ray.exceptions.RayError):
    """The router moved an attempt off its decode worker (streams.move: a decode worker
    joined); retried like a death, after the tokens it streamed."""


class AttemptFailed(Exception):
    """One attempt at a request failed in a way a retry on live workers can mend."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason    # "prefill" | "decode": the phase that failed;
                                # "rebalance": moved to another decode worker


def attempt_failed(phase: str, w: Worker, e: Exception) -> AttemptFailed:
    """The retryable failure of a call to `w` in `phase` that raised Ray's `e`; a dead
    (or restarting) worker is marked so until a probe finds it back."""
    if isinstance(e, ray.exceptions.RayActorError):
        w.alive = False
        return AttemptFailed(phase, f"{phase} worker {w.worker_id} died: {type(e).__name__}")
    if isinstance(e, Moved):
        return AttemptFailed("rebalance", str(e))
    cause = getattr(e, "cause", None) or e     # the worker-side exception
    return AttemptFailed(phase, f"{phase} on {w.worker_id} failed: "
                                 f"{type(cause).__name__}: {cause}")
