"""Block pool: ref-counted allocation of paged-KV block ids.

A request's KV lives in a block table (list of block ids). Blocks are handed out from a
free list; `ref_count` lets a block be shared (prefix caching, next issue) and returns
it to the free list only when the last holder frees it. The pool holds ids only; the
tensors live in engine/kv_cache.py.

Thread-safety: workers allocate from their step loop and free from transport and RPC
threads, so every public method takes the pool's lock.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Iterable


class NoFreeBlocksError(RuntimeError):
    """Asked for more blocks than are free. `requested` and `free` are block counts."""

    def __init__(self, requested: int, free: int, total: int):
        super().__init__(f"KV block pool exhausted: requested {requested} blocks, "
                         f"{free} of {total} free")
        self.requested, self.free = requested, free


class BlockPool:
    """Free list + ref counts over block ids ``0 .. num_blocks-1``."""

    def __init__(self, num_blocks: int):
        assert num_blocks > 0, f"num_blocks={num_blocks}"
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_count = [0] * num_blocks
        self._lock = threading.Lock()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0.0 .. 1.0."""
        return 1.0 - len(self._free) / self.num_blocks

    def allocate(self, n: int) -> list[int]:
        """Take `n` free blocks (ref count 1 each), all or none.

        Raises:
            NoFreeBlocksError: fewer than `n` blocks are free; nothing is taken.
        """
        assert n >= 0, n
        with self._lock:
            if n > len(self._free):
                raise NoFreeBlocksError(n, len(self._free), self.num_blocks)
            ids = [self._free.popleft() for _ in range(n)]
            for i in ids:
                self._ref_count[i] = 1
            return ids

    def incref(self, block_ids: Iterable[int]) -> None:
        """Add a holder to blocks already in use."""
        with self._lock:
            for i in block_ids:
                assert self._ref_count[i] > 0, f"incref of free block {i}"
                self._ref_count[i] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one holder of each block; blocks whose count reaches 0 become free."""
        with self._lock:
            for i in block_ids:
                assert self._ref_count[i] > 0, f"double free of block {i}"
                self._ref_count[i] -= 1
                if self._ref_count[i] == 0:
                    self._free.append(i)

    def ref_count(self, block_id: int) -> int:
        return self._ref_count[block_id]

    def all_free(self) -> bool:
        """True when every block is back in the pool (the leak check after each test)."""
        with self._lock:
            return len(self._free) == self.num_blocks and not any(self._ref_count)


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks to hold `num_tokens` tokens (ceil division)."""
    return -(-num_tokens // block_size)
