"""Commit a CPU KV cache's pages ahead of the block pool's first use of them.

allocate_kv_cache (engine/attention.py) maps the cache without writing it, so its pages
are committed as blocks are first written: by the step that prefills into them, or the
KV receiver that lands a transfer in them. The block pool hands out never-used blocks
before any evictable cached one (block_pool.py), so a server walks its whole pool once
before it reuses a page, and until then every step into new blocks pays the kernel's
page faults. Measured on this 2-core box (fp32, SmolLM2-135M, 2 threads, a 4 GiB pool,
lone 1,370-token prompts in 512-token chunks): the first chunk into fresh blocks 0.50 s
against 0.31 s into used ones, in one process; through `pdserve serve`, the prompt's
three chunks 1.01-1.09 s (median of 8 prompts, three runs) with this module and
1.06-1.14 s without, in alternating runs. vLLM writes its whole cache at start
(torch.zeros) and pays this once there.

KVPrefault keeps the next WINDOW_BYTES of never-used blocks committed on a thread of
its own at SCHED_IDLE (it runs when a core would otherwise idle), with
madvise(MADV_POPULATE_WRITE) (Linux 5.14), which faults the pages in writable without
writing them: a block the step writes meanwhile keeps its bytes. A pool that is never
walked still commits only what it used plus the window, not its whole budget.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading

import torch

logger = logging.getLogger(__name__)

WINDOW_BYTES = 256 << 20   # KV bytes kept committed past the newest block handed out
MADV_POPULATE_WRITE = 23   # linux/mman.h (Linux 5.14); Python's mmap lacks the name
_PAGE = os.sysconf("SC_PAGESIZE") if hasattr(os, "sysconf") else 4096


class KVPrefault:
    """A thread that commits blocks [0, newest handed out + window) of `kv_cache`.

    kv_cache: the runner's cache, [num_layers, 2, num_blocks(+1), kv_heads, block_size,
    head_dim] on CPU (ModelRunner.kv_cache): one region per layer and K/V, blocks
    contiguous in each. `advance(fresh_from)` is BlockPool.on_fresh: the pool has handed
    out blocks below fresh_from."""

    def __init__(self, kv_cache: torch.Tensor, num_blocks: int,
                 window_bytes: int = WINDOW_BYTES):
        assert kv_cache.device.type == "cpu" and kv_cache.is_contiguous()
        self.num_blocks = num_blocks
        elem = kv_cache.element_size()
        self._block_bytes = kv_cache[0, 0, 0].numel() * elem
        self._region_bytes = kv_cache[0, 0].numel() * elem
        self._regions = kv_cache.shape[0] * kv_cache.shape[1]
        self._base = kv_cache.data_ptr()
        self._keep = kv_cache           # the mapping stays while this thread reads it
        self._window = max(1, window_bytes // (self._block_bytes * self._regions))
        self.committed = 0              # blocks [0, committed) are committed
        self._target = min(num_blocks, self._window)
        self._closed = False
        self._cond = threading.Condition()
        self._madvise = ctypes.CDLL(None, use_errno=True).madvise
        self._madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        self._thread = threading.Thread(target=self._run, name="kv-prefault", daemon=True)
        self._thread.start()

    def advance(self, fresh_from: int) -> None:
        """Blocks below `fresh_from` have been handed out: commit up to a window past."""
        with self._cond:
            target = min(self.num_blocks, fresh_from + self._window)
            if target > self._target:
                self._target = target
                self._cond.notify()

    def wait(self, timeout_s: float) -> bool:
        """Whether everything asked for is committed within timeout_s (tests)."""
        with self._cond:
            return self._cond.wait_for(lambda: self.committed >= self._target or self._closed,
                                       timeout_s) and self.committed >= self._target

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(5)

    def _run(self) -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))   # this thread only
        except (AttributeError, OSError) as e:
            logger.debug("KV prefault at normal priority: %s", e)
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or self._target > self.committed)
                if self._closed:
                    return
                lo, hi = self.committed, self._target
            if not self._populate(lo, hi):
                return
            with self._cond:
                self.committed = hi
                self._cond.notify_all()

    def _populate(self, lo: int, hi: int) -> bool:
        for r in range(self._regions):
            start = self._base + r * self._region_bytes + lo * self._block_bytes
            end = self._base + r * self._region_bytes + hi * self._block_bytes
            start -= start % _PAGE
            end += -end % _PAGE
            if self._madvise(start, end - start, MADV_POPULATE_WRITE) != 0:
                err = ctypes.get_errno()
                logger.info("KV cache pages not committed ahead (madvise: %s); blocks "
                            "fault in as they are first written", os.strerror(err))
                with self._cond:
                    self._closed = True
                    self._cond.notify_all()
                return False
        return True


def prefault_pool(pool, kv_cache: torch.Tensor) -> KVPrefault | None:
    """A KVPrefault of `kv_cache` fed by `pool` (BlockPool.on_fresh); None for a device
    cache (allocated written: torch.zeros)."""
    if kv_cache.device.type != "cpu":
        return None
    prefault = KVPrefault(kv_cache, pool.num_blocks)
    pool.on_fresh = prefault.advance
    return prefault
