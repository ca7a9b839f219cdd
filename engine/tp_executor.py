"""Step orders within a tensor-parallel worker: rank 0 leads, the other ranks follow
(vLLM's executor broadcasting a SchedulerOutput; here, the ModelRunner call itself).

    rank 0   scheduler, sampling, the router's RPCs; its runner is a TPLeader: every
             model call is first broadcast to the group (method name and arguments,
             pickled: token ids, positions, block tables), then run
    rank i   follow(): receives each call and runs the same ModelRunner method on its
             own shard and KV cache, so every collective inside the forward (the
             all-reduces, the logits' all-gather) meets the leader's in the same order;
             it samples nothing and drops the logits

So scheduling, the prefix cache and the block pool exist once, on rank 0, and every
rank's KV cache holds the same blocks (its own KV heads of them). A callback such as
`on_layer_done` (a prefill streaming its KV layer by layer) cannot cross processes:
each rank passes its own (`follow(..., on_layer_done=)`), the leader's to its calls.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from .parallel import TensorParallel

logger = logging.getLogger(__name__)

STEP_CALLS = ("prefill", "prefill_with_prompt_logprobs", "mixed", "decode", "copy_blocks")
_STOP = "stop"


class TPLeader:
    """Rank 0's runner: the ModelRunner's interface, with each call of STEP_CALLS sent to
    the followers before it runs here; other attributes are the runner's. `stop()`
    ends the followers' loops."""

    def __init__(self, runner, tp: TensorParallel):
        assert tp.rank == 0, tp
        self.runner, self.tp = runner, tp
        self.num_calls = 0          # step orders sent (each follower runs as many)

    def __getattr__(self, name: str) -> Any:
        if name in STEP_CALLS:
            return lambda *args, on_layer_done=None: self._call(name, args, on_layer_done)
        return getattr(self.runner, name)

    def _call(self, name: str, args: tuple, on_layer_done: Callable[[int], None] | None):
        self._order([name, args])
        self.num_calls += 1
        fn = getattr(self.runner, name)
        return fn(*args) if name == "copy_blocks" else fn(*args, on_layer_done=on_layer_done)

    def stop(self) -> None:
        self._order([_STOP, ()])

    def _order(self, order: list) -> None:
        if self.tp.size > 1:
            torch.distributed.broadcast_object_list(order, src=0, group=self.tp.group)


def follow(runner, tp: TensorParallel,
           on_layer_done: Callable[[int], None] | None = None) -> int:
    """Run rank 0's calls on this rank's `runner` until its stop(); returns the number of
    calls run. Raises what a call or the group raises (a rank gone: the group's
    timeout), which ends this rank: its worker is restarted as a whole."""
    assert tp.rank > 0, tp
    calls = 0
    while True:
        order: list = [None, None]
        torch.distributed.broadcast_object_list(order, src=0, group=tp.group)
        name, args = order
        if name == _STOP:
            return calls
        if name not in STEP_CALLS:
            raise ValueError(f"rank {tp.rank}: unknown step order {name!r}")
        fn = getattr(runner, name)
        if name == "copy_blocks":
            fn(*args)
        else:
            fn(*args, on_layer_done=on_layer_done)
        calls += 1
