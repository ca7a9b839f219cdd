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
    load: int = 0           # prefill: queued prompt tokens; decode: active requests
    others_load: int = 0    # router replicas: the same, of the other replicas, as the
                            # worker last reported it (its own count less this one's)
    local_prefill_load: int = 0  # decode: prompt tokens it prefills itself (conditional
                                 # disaggregation), first token not yet back
    free_blocks: int = 0    # decode: last known
    alive: bool = True      # False from a call that found it dead until a probe answers
    node_ip: str = ""       # the Ray node it runs on
    draining: bool = False  # Drain: takes no new requests (until it restarts elsewhere)

    @property
    def available(self) -> bool:
        return self.alive and not self.draining

    @property
    def total_load(self) -> int:
        """load with the other router replicas' (0 with one router)."""
        return self.load + self.others_load

    def reported(self, count: int) -> None:
        """The worker's own count of what `load` counts (replicas: the other replicas'
        share is what this one does not account for)."""
        self.others_load = max(count - self.load, 0)


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
