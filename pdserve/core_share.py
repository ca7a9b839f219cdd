"""Idle prefill cores lent to decode, among the CPU workers of one node.

On a GPU, SGLang's PD multiplexing splits one device's SMs between prefill and decode as
the load moves between them; pdserve's CPU workers do the same with cores. Each prefill
worker publishes in shared memory whether it is computing, and how many torch threads it
runs: a 2-byte file `<worker_id>.prefill` (byte 0: busy, byte 1: threads) in a directory
under /dev/shm that the cluster names once per start (`WorkerConfig.core_share_dir`).
Before each step, a decode worker of the same node runs on its own threads plus its share
of those of every prefill worker there that is idle (the idle threads split evenly among
the node's decode workers, each of which publishes an empty `<worker_id>.decode` file),
and goes back to its own as soon as one is busy again: a decode step already running on
lent threads when a prefill starts gives them back after its current layer (the decode
worker checks between layers), since two OpenMP teams on one core slow both several-fold
(an 813 ms decode step with a prefill chunk beside a 106 ms prefill step, traced at 4
req/s, docs/performance.md section 15).

A grammar compile (structured outputs: seconds of one core for a large schema) on the
node stops the lending too: every process that compiles or parses one (the prefill and
decode workers; the router replicas, which only parse) publishes a 1-byte `<owner>.compiling` file, nonzero while it
compiles, and while any is nonzero a decode worker runs on its own threads alone. An
OpenMP team sharing a core with the compile thread slowed a running stream's token gaps
from ~35 ms to ~300 ms; its own threads, beside the compile, by a few milliseconds
(`tests/e2e/test_serve_grammar_itl.py`).

Without it, a one-box cluster of 1 prefill + 1 decode worker on 2 cores leaves one core
idle whenever prompts stop arriving (measured in docs/performance.md). Only for workers
not pinned to CPUs (`WorkerConfig.cpus` None): a pinned decode worker could not use the
lent core. A prefill worker's busy byte starts at 1, so a decode worker borrows nothing
before the prefill worker's loop runs; a prefill worker killed while busy keeps its byte
at 1 (nothing is lent), one restarted replaces its file (the reader notices the new inode
within `RESCAN_S`).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import threading
import time
from pathlib import Path

logger = logging.getLogger(__name__)

RESCAN_S = 1.0          # how often a decode worker lists the directory again (seconds)
_SUFFIX = ".prefill"
_DECODE_SUFFIX = ".decode"
_COMPILE_SUFFIX = ".compiling"


class PrefillActivity:
    """A prefill worker's flag in `directory`: `set_busy(True)` while it computes.

    Raises:
        OSError: the directory cannot be created or written (e.g. no /dev/shm).
    """

    def __init__(self, directory: str, worker_id: str, threads: int):
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self.path = d / f"{worker_id}{_SUFFIX}"
        tmp = d / f".{worker_id}.{os.getpid()}.tmp"
        tmp.write_bytes(bytes([1, max(1, min(threads, 255))]))
        os.replace(tmp, self.path)          # a restarted worker: a new inode, seen as such
        with open(self.path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), 2)
        self._busy = True

    def set_busy(self, busy: bool) -> None:
        if busy != self._busy:
            self._map[0] = 1 if busy else 0
            self._busy = busy

    def close(self) -> None:
        """Unpublish: the file goes (no decode worker borrows these threads any more)."""
        self._map[0] = 1
        self._map.close()
        self.path.unlink(missing_ok=True)


class CompileActivity:
    """A process's grammar-compile flag in `directory` (None: no lending on this node,
    nothing published): `compiling()` holds it set. Thread-safe.

    Raises:
        OSError: the directory cannot be created or written.
    """

    def __init__(self, directory: str | None, owner: str):
        self._map: mmap.mmap | None = None
        self._count, self._lock = 0, threading.Lock()
        if directory is None:
            return
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self.path = d / f"{owner}{_COMPILE_SUFFIX}"
        tmp = d / f".{owner}.{os.getpid()}.compiling.tmp"
        tmp.write_bytes(b"\0")
        os.replace(tmp, self.path)
        with open(self.path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), 1)

    @classmethod
    def on(cls, directory: str | None, owner: str) -> "CompileActivity":
        """The flag, or (logged) one that publishes nothing when `directory` cannot
        hold it."""
        try:
            return cls(directory, owner)
        except OSError as e:
            logger.warning("grammar compiles not published to the node's decode workers: "
                           "%s", e)
            return cls(None, owner)

    @contextlib.contextmanager
    def compiling(self):
        self._add(1)
        try:
            yield
        finally:
            self._add(-1)

    def _add(self, n: int) -> None:
        with self._lock:
            self._count += n
            if self._map is not None:
                self._map[0] = min(self._count, 255)

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
            self.path.unlink(missing_ok=True)


class LentThreads:
    """A decode worker's view of `directory`: `threads()` is its own thread count plus
    its share of the idle prefill workers' threads there (split evenly among the decode
    workers that publish themselves in it, the first ones by id taking the remainder),
    at most `max_threads`; its own alone while a process there compiles a grammar.

    Raises:
        OSError: the directory cannot be created or written.
    """

    def __init__(self, directory: str, worker_id: str, own_threads: int, max_threads: int):
        self.directory, self.own, self.max = Path(directory), own_threads, max_threads
        self.directory.mkdir(parents=True, exist_ok=True)
        self.name = f"{worker_id}{_DECODE_SUFFIX}"
        (self.directory / self.name).touch()
        self._maps: dict[str, tuple[int, mmap.mmap]] = {}   # name -> (inode, map)
        self._compiles: dict[str, tuple[int, mmap.mmap]] = {}   # compile flags, likewise
        self._decoders: list[str] = [self.name]             # the node's decode workers
        self._scanned = float("-inf")

    def threads(self) -> int:
        now = time.monotonic()
        if now - self._scanned >= RESCAN_S:
            self._scanned = now
            self._rescan()
        if any(m[0] for _, m in self._compiles.values()):
            return self.own
        lent = sum(m[1] for _, m in self._maps.values() if m[0] == 0)
        n = len(self._decoders)
        rank = self._decoders.index(self.name) if self.name in self._decoders else n - 1
        share = lent // n + (rank < lent % n)
        return min(self.max, self.own + share)

    def close(self) -> None:
        """Unpublish this decode worker and let go of the prefill workers' flags."""
        for _, m in (*self._maps.values(), *self._compiles.values()):
            m.close()
        self._maps.clear()
        self._compiles.clear()
        (self.directory / self.name).unlink(missing_ok=True)

    def _rescan(self) -> None:
        try:
            entries = list(os.scandir(self.directory))
        except FileNotFoundError:
            entries = []
        self._decoders = sorted({e.name for e in entries if e.name.endswith(_DECODE_SUFFIX)}
                                | {self.name})
        self._maps = _remap(self._maps, [e for e in entries if e.name.endswith(_SUFFIX)], 2)
        self._compiles = _remap(self._compiles,
                                [e for e in entries if e.name.endswith(_COMPILE_SUFFIX)], 1)


class StepThreads:
    """The torch threads of a decode worker's steps: its own `own_threads`, plus, with
    `lent` (LentThreads), its share of the node's idle prefill threads. Used around each
    step on the step thread::

        with step_threads.step() as give_back:     # the step's OpenMP team sized
            runner.execute(out, give_back)         # give_back(layer): between layers

    `give_back` (None while on its own threads) drops the lent threads from the next
    layer on once a lender is busy again, not at the step's end (two OpenMP teams on
    one core slow both several-fold). `threads`: those of the latest step."""

    def __init__(self, lent: LentThreads | None, own_threads: int):
        self.lent, self.own, self.threads = lent, own_threads, own_threads

    @contextlib.contextmanager
    def step(self):
        if self.lent is not None and (n := self.lent.threads()) != self.threads:
            self._set(n)
        yield self._give_back if self.threads > self.own else None

    def _give_back(self, _layer: int) -> None:
        if self.threads > self.own and self.threads > (n := self.lent.threads()):
            self._set(n)

    def _set(self, n: int) -> None:
        import torch
        torch.set_num_threads(n)        # this thread's OpenMP team: the step's ops
        self.threads = n

    def close(self) -> None:
        if self.lent is not None:
            self.lent.close()


def _remap(old: dict[str, tuple[int, mmap.mmap]], entries: list[os.DirEntry], size: int
           ) -> dict[str, tuple[int, mmap.mmap]]:
    """Read-only maps of the `size`-byte flag files `entries`, by name, reusing those of
    `old` whose inode is the same and closing the others."""
    seen = {}
    for e in entries:
        try:
            inode = e.inode()
            if (kept := old.get(e.name)) is not None and kept[0] == inode:
                seen[e.name] = kept
                continue
            with open(e.path, "rb") as f:
                seen[e.name] = (inode, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ))
        except (OSError, ValueError) as err:    # vanished, or not yet `size` bytes long
            logger.debug("core share: %s skipped: %s", e.name, err)
    for name, (inode, m) in old.items():
        if seen.get(name, (None,))[0] != inode:
            m.close()
    return seen
