"""The router's view of one prefill or decode worker, and what a failed call to one
means for the request (router.py retries it on live workers)."""

from __future__ import annotations

import re
from dataclasses import dataclass

import ray


@dataclass(eq=False)
class Worker:
    handle: object          # Ray actor handle
    worker_id: str
    num_blocks: int
    epoch: int = 0          # the incarnation last seen (Ray restarts a dead worker)
    load: int = 0           # prefill: queued prompt tokens; decode: active requests
    local_prefill_load: int = 0  # decode: prompt tokens it prefills itself (conditional
                                 # disaggregation), first token not yet back
    free_blocks: int = 0    # decode: last known
    alive: bool = True      # False from a call that found it dead until a probe answers
    node_ip: str = ""       # the Ray node it runs on
    draining: bool = False  # Drain: takes no new requests (until it restarts elsewhere)

    @property
    def available(self) -> bool:
        return self.alive and not self.draining


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


def named_workers() -> dict[str, list]:
    """The worker actors of this Ray namespace by role, each named `role-N`
    (cluster.start_worker), in N order: {"prefill": [handle...], "decode": [...]}.
    An actor gone between the listing and the lookup is left out."""
    found: dict[str, list[tuple[int, object]]] = {"prefill": [], "decode": []}
    for name in ray.util.list_named_actors():
        if (m := re.fullmatch(r"(prefill|decode)-(\d+)", name)) is None:
            continue
        try:
            found[m.group(1)].append((int(m.group(2)), ray.get_actor(name)))
        except ValueError:      # killed meanwhile (scaled down)
            continue
    return {role: [h for _, h in sorted(hs, key=lambda x: x[0])] for role, hs in found.items()}
