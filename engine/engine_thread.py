"""The one thread of a worker process that runs its model.

torch's CPU build runs its parallel ops on libgomp (GNU OpenMP), which keeps a pool of
team threads for every thread that opens a parallel region. Once a process holds more
such threads than the CPUs it may run on, libgomp throttles every team's wait at its
barriers from 300,000 spins to 100 before sleeping on a futex (libgomp's
`gomp_throttled_spin_count_var`; GOMP_SPINCOUNT and OMP_WAIT_POLICY in its manual), and
each of a step's hundreds of short regions then pays a wake-up. A runner built on the
actor's thread and stepped on another leaves two pools. Measured on this 2-core box,
fp32, 2 threads, SmolLM2-135M, median of 30 steps: a decode step of 1 sequence 17 ms
when one thread builds and steps the runner, 22 ms when another built it; 55 -> 63 ms at
32 sequences; a 512-token prefill step 2-4% slower.

So a worker builds its runner, warms it up and steps it on one EngineThread, and any
other call that runs the model (a benchmark forward) is handed to it (`submit`).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class EngineThread:
    """A daemon thread that runs the calls handed to it in order; its loop (`start`) is
    one of them, and runs the others between its iterations (`run_calls`)."""

    def __init__(self, name: str, wake: Callable[[], None] | None = None):
        """wake: called after each `submit`, to rouse the loop from an idle wait."""
        self.wake = wake
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args, **kwargs) -> Future:
        """fn(*args, **kwargs) on the thread; its Future (asyncio.wrap_future awaits it)."""
        fut: Future = Future()
        self._calls.put((fn, args, kwargs, fut))
        if self.wake is not None:
            self.wake()
        return fut

    def call(self, fn: Callable[..., Any], *args, **kwargs) -> Any:
        """fn(*args, **kwargs) on the thread, waited for: its result, or what it raised."""
        if threading.current_thread() is self._thread:
            return fn(*args, **kwargs)
        return self.submit(fn, *args, **kwargs).result()

    def start(self, loop: Callable[[], None]) -> None:
        """Run `loop` on the thread after the calls handed over before it. Calls handed
        over later run when it calls run_calls() (between its iterations) or after it
        returns; what it raises ends the thread (printed, as a thread's uncaught
        exception is)."""
        self._calls.put((loop, (), {}, None))

    def run_calls(self) -> None:
        """Run the calls handed over so far; only from the thread's own loop."""
        assert threading.current_thread() is self._thread, "run_calls off the engine thread"
        while True:
            try:
                item = self._calls.get_nowait()
            except queue.Empty:
                return
            if item is None:              # close(): after the loop returns
                self._calls.put(None)
                return
            self._run(*item)

    def close(self, timeout_s: float | None = None) -> None:
        """End the thread once its loop (stopped by its owner) and the calls before this
        one have run; waits at most timeout_s."""
        self._calls.put(None)
        self._thread.join(timeout_s)

    def _serve(self) -> None:
        while (item := self._calls.get()) is not None:
            self._run(*item)

    @staticmethod
    def _run(fn, args, kwargs, fut: Future | None) -> None:
        if fut is None:                   # the loop: what it raises ends the thread
            fn(*args, **kwargs)
        elif fut.set_running_or_notify_cancel():
            try:
                fut.set_result(fn(*args, **kwargs))
            except BaseException as e:
                fut.set_exception(e)
