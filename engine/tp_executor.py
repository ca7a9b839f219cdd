"""Step orders within a tensor-parallel worker: rank 0 leads, the other ranks follow
(vLLM's executor broadcasting a SchedulerOutput; here, the ModelRunner call itself).

    rank 0   scheduler, sampling, the router's RPCs; its runner is a TPLeader: every
             model call is first broadcast to the group (method name and arguments,
             pickled: token ids, positions, block tables), then run
    rank i   follow(): receives each call and runs the same ModelRunner method on its
             own shard and KV cache, so every collective inside the forward (the
             all-reduces, the logits' gather) meets the leader's in the same order;
             it samples nothing and drops the logits

So scheduling, the prefix cache and the block pool exist once, on rank 0, and every
rank's KV cache holds the same blocks (its own KV heads of them). A callback such as
`on_layer_done` (a prefill streaming its KV layer by layer) cannot cross processes:
each rank passes its own (`follow(..., on_layer_done=)`), the leader's to its calls.
Work of a follower beside the model (a prefill rank sending its KV heads to the decode
worker) comes as orders of its own (`TPLeader.order`), run by the follower's
handlers in the same sequence as the step calls.

An idle leader sends a heartbeat order every `heartbeat_s`, so followers waiting for
the next order never reach the group's collective timeout while rank 0 is alive; a
rank that dies closes its connections, and the next collective of every other rank
raises at once (tests/e2e/test_tp_group.py).
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from .parallel import TensorParallel

logger = logging.getLogger(__name__)

STEP_CALLS = ("prefill", "prefill_with_prompt_logprobs", "mixed", "decode", "copy_blocks")
_STOP, _PING = "stop", "ping"


class TPGroupBroken(RuntimeError):
    """A step call failed once its order was being broadcast (a fault on rank 0 alone,
    or a lost rank): the ranks' collectives are out of step, so the worker must be
    restarted as a whole (docs/tensor_parallel.md)."""


class TPLeader:
    """Rank 0's runner: the ModelRunner's interface, with each call of STEP_CALLS sent to
    the followers before it runs here (under one lock: calls from several threads stay
    whole); other attributes are the runner's. `stop()` ends the followers' loops.
    `on_broken(error)`: an idle leader's heartbeat found a rank gone (the worker exits).

    Raises (from a step call): TPGroupBroken, once its order went out."""

    def __init__(self, runner, tp: TensorParallel, heartbeat_s: float | None = 10.0,
                 on_broken: Callable[[Exception], None] | None = None):
        assert tp.rank == 0, tp
        self.runner, self.tp = runner, tp
        self._on_broken = on_broken        # a heartbeat found the group broken (idle)
        self.num_calls = 0          # step orders sent (each follower runs as many)
        self._lock = threading.Lock()
        self._last_order = time.monotonic()
        self._stopped = threading.Event()
        if heartbeat_s is not None and tp.size > 1:
            threading.Thread(target=self._heartbeat, args=(heartbeat_s,), daemon=True,
                             name="tp-heartbeat").start()

    def execute(self, out, on_layer_done: Callable[[int], None] | None = None):
        """ModelRunner.execute, its step calls broadcast to the ranks as they run."""
        from .model_runner import execute
        return execute(self, out, on_layer_done)

    def __getattr__(self, name: str) -> Any:
        if name in STEP_CALLS:
            return lambda *args, **kwargs: self._call(name, args, kwargs)
        return getattr(self.runner, name)

    def _call(self, name: str, args: tuple, kwargs: dict):
        fn = getattr(self.runner, name)
        bound = _signature(fn).bind(*args, **kwargs)
        on_layer_done = bound.arguments.pop("on_layer_done", None)   # stays on this rank
        if name == "copy_blocks" and not bound.arguments["pairs"]:
            return None                                              # nothing to order
        with self._lock:
            try:
                self._order([name, bound.arguments])
                self.num_calls += 1
                return _run(fn, bound.arguments, on_layer_done)
            except Exception as e:
                raise TPGroupBroken(f"tensor-parallel {name} failed once ordered (rank 0 "
                                    f"alone, or a lost rank): {type(e).__name__}: {e}") from e

    def order(self, name: str, **kwargs) -> None:
        """Have every follower run ``handler.<name>(**kwargs)`` (follow), between the
        step calls before and after this one; nothing runs here.

        Raises: TPGroupBroken, the order could not be sent."""
        with self._lock:
            try:
                self._order([name, kwargs])
            except Exception as e:
                raise TPGroupBroken(f"tensor-parallel order {name} not sent: "
                                    f"{type(e).__name__}: {e}") from e

    def gather(self, name: str, **kwargs) -> list:
        """Have every follower run ``handler.<name>(**kwargs)`` (a name in its
        ``GATHERS``) and return what ranks 1..N-1 returned, in rank order (a decode
        rank's KV receiver news, polled by rank 0's step loop).

        Raises: TPGroupBroken, a rank did not answer."""
        with self._lock:
            try:
                self._order([name, kwargs])
                out = [None] * self.tp.size
                torch.distributed.gather_object(None, out, dst=0, group=self.tp.group)
                return out[1:]
            except Exception as e:
                raise TPGroupBroken(f"tensor-parallel gather {name} failed: "
                                    f"{type(e).__name__}: {e}") from e

    def stop(self) -> None:
        self._stopped.set()
        with self._lock:
            self._order([_STOP, {}])

    def _heartbeat(self, interval_s: float) -> None:
        while not self._stopped.wait(interval_s / 2):
            with self._lock:
                if self._stopped.is_set():
                    return
                if time.monotonic() - self._last_order >= interval_s:
                    try:
                        self._order([_PING, {}])
                    except Exception as e:    # a lost rank, while idle
                        logger.warning("tensor-parallel heartbeat failed: %r", e)
                        if self._on_broken is not None:
                            self._on_broken(TPGroupBroken(f"heartbeat failed: {e!r}"))
                        return

    def _order(self, order: list) -> None:
        if self.tp.size > 1:
            torch.distributed.broadcast_object_list(order, src=0, group=self.tp.group)
        self._last_order = time.monotonic()


@functools.lru_cache(maxsize=None)
def _signature(fn) -> inspect.Signature:
    """A ModelRunner method's signature (looked up once per method and runner)."""
    return inspect.signature(fn)


def _run(fn, kwargs: dict, on_layer_done: Callable[[int], None] | None):
    """`fn(**kwargs)`, with this rank's `on_layer_done` where `fn` takes one."""
    if "on_layer_done" in _signature(fn).parameters:
        return fn(**kwargs, on_layer_done=on_layer_done)
    return fn(**kwargs)


def follow(runner, tp: TensorParallel,
           on_layer_done: Callable[[int], None] | None = None, handlers: tuple = ()) -> int:
    """Run rank 0's calls on this rank's `runner` until its stop(); returns the number of
    step calls run. An order that is not a step call (TPLeader.order) runs as
    ``handler.<name>(**kwargs)`` of the one of `handlers` (None entries skipped) whose
    ``ORDERS`` name it; one of its ``GATHERS`` (TPLeader.gather) also sends what it
    returns to rank 0. Raises what a call or the group raises (a rank gone), which ends
    this rank: its worker is restarted as a whole."""
    assert tp.rank > 0, tp
    orders, gathers = {}, {}
    for handler in (h for h in handlers if h is not None):
        orders |= {name: getattr(handler, name) for name in handler.ORDERS}
        gathers |= {name: getattr(handler, name) for name in handler.GATHERS}
    calls = 0
    while True:
        order: list = [None, None]
        torch.distributed.broadcast_object_list(order, src=0, group=tp.group)
        name, kwargs = order
        if name == _STOP:
            return calls
        if name == _PING:
            continue
        if name in orders:
            orders[name](**kwargs)
            continue
        if name in gathers:
            torch.distributed.gather_object(gathers[name](**kwargs), None, dst=0,
                                            group=tp.group)
            continue
        if name not in STEP_CALLS:
            raise ValueError(f"rank {tp.rank}: unknown step order {name!r}")
        _run(getattr(runner, name), kwargs, on_layer_done)
        calls += 1
