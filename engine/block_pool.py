"""Block pool: ref-counted allocation of paged-KV block ids, with a prefix cache.

A request's KV lives in a block table (list of block ids). Blocks are handed out from a
free list; `ref_count` lets a block be shared, and a block goes back to the pool only
when its last holder frees it. The pool holds ids only; the tensors live in the
ModelRunner's KV cache.

Prefix cache (docs/architecture.md, "KV cache layout"; the scheme of vLLM's automatic prefix
caching): a *full* block whose K/V has been computed can be registered under its
**block hash**, a digest of its tokens chained with the hash of the block before it
(``block_hashes``), so equal hashes mean equal token prefixes. A later prompt looks its
leading block hashes up (``match_prefix``) and shares the blocks found instead of
computing them again. A cached block whose last holder frees it stays cached but
*evictable*, in LRU order; ``allocate`` takes never-cached free blocks first, then evicts
the least recently used cached ones (dropping their hashes). Evictable blocks count as
free (``num_free``, ``all_free``): they are reclaimable at once.

Cache events: every hash registered or evicted is logged with a sequence number, so a
router can mirror which prefixes a worker holds by polling ``cache_events(since)`` now
and then, instead of asking every worker on every request (KV-aware routing).

Thread-safety: workers allocate from their step loop and free from transport and RPC
threads, so every public method takes the pool's lock.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence

import numpy as np

BlockHash = bytes  # 16-byte digest; see block_hashes


class NoFreeBlocksError(RuntimeError):
    """Asked for more blocks than are free. `requested` and `free` are block counts."""

    def __init__(self, requested: int, free: int, total: int):
        super().__init__(f"KV block pool exhausted: requested {requested} blocks, "
                         f"{free} of {total} free")
        self.requested, self.free = requested, free


def block_hashes(token_ids: Sequence[int], block_size: int, salt: str = "") -> list[BlockHash]:
    """Chained hashes of the *full* blocks of `token_ids` (a trailing partial block has
    none): ``h[i] = blake2b(h[i-1] || tokens of block i as int64)``, 16 bytes, with
    ``h[-1]`` empty, or with a `salt` (a request's cache_salt, vLLM's) a hash of it: a
    salted prompt's blocks match only those of the same salt, from its first block on.
    Equal lists of leading hashes mean equal token prefixes and salts (up to a 2^-128
    collision). Deterministic across processes, so workers and the router agree.
    """
    tokens = np.asarray(token_ids, dtype=np.int64)
    out = []
    prev = (hashlib.blake2b(b"pdserve cache salt\0" + salt.encode(), digest_size=16).digest()
            if salt else b"")
    for start in range(0, len(tokens) - block_size + 1, block_size):
        prev = hashlib.blake2b(prev + tokens[start:start + block_size].tobytes(),
                               digest_size=16).digest()
        out.append(prev)
    return out


class BlockPool:
    """Free list + ref counts over block ids ``0 .. num_blocks-1``, plus the prefix cache
    (see the module docstring)."""

    def __init__(self, num_blocks: int):
        assert num_blocks > 0, f"num_blocks={num_blocks}"
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))   # holders 0, not cached
        self._ref_count = [0] * num_blocks
        self._hash_of: dict[int, BlockHash] = {}              # cached block -> its hash
        self._block_of: dict[BlockHash, int] = {}             # and back
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, holders 0; LRU first
        self._lock = threading.Lock()
        # (stored?, hash) per change to the cache; a reader further behind than the log
        # gets a snapshot instead (cache_events)
        self._events = EventLog(4 * num_blocks)
        self.fresh_from = 0   # blocks from here on were never handed out (_free's order)
        self.on_fresh: Callable[[int], None] | None = None   # fresh_from moved (kv_prefault)

    @property
    def num_free(self) -> int:
        """Blocks allocatable now: never-cached free ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Blocks registered in the prefix cache (held or evictable)."""
        return len(self._hash_of)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, 0.0 .. 1.0 (evictable ones are free)."""
        return 1.0 - self.num_free / self.num_blocks

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks (ref count 1 each, not cached), all or none: free ones first,
        then the least recently used evictable cached blocks, whose hashes are dropped.

        Raises:
            NoFreeBlocksError: fewer than `n` blocks are free; nothing is taken.
        """
        assert n >= 0, n
        with self._lock:
            if n > self.num_free:
                raise NoFreeBlocksError(n, self.num_free, self.num_blocks)
            ids = []
            for _ in range(n):
                if self._free:
                    ids.append(self._free.popleft())
                else:
                    block, _ = self._evictable.popitem(last=False)
                    h = self._hash_of.pop(block)
                    del self._block_of[h]
                    self._events.append((False, h))
                    ids.append(block)
            for i in ids:
                self._ref_count[i] = 1
            if ids and (top := max(ids)) >= self.fresh_from:
                self.fresh_from = top + 1
                if self.on_fresh is not None:
                    self.on_fresh(self.fresh_from)
            return ids

    def match_prefix(self, hashes: Sequence[BlockHash]) -> list[int]:
        """The cached blocks of the longest run of leading `hashes` found, each now held
        once more by the caller (free them like allocated blocks)."""
        with self._lock:
            found = []
            for h in hashes:
                block = self._block_of.get(h)
                if block is None:
                    break
                found.append(block)
            for block in found:
                if self._ref_count[block] == 0:
                    del self._evictable[block]
                self._ref_count[block] += 1
            return found

    def cache_blocks(self, block_ids: Sequence[int], hashes: Sequence[BlockHash]) -> None:
        """Register held, fully computed blocks under their hashes (pairwise). A hash
        already cached under another block keeps that one (two prompts computed the same
        prefix at once); a block already cached keeps its hash."""
        with self._lock:
            for block, h in zip(block_ids, hashes):
                assert self._ref_count[block] > 0, f"cache_blocks of free block {block}"
                if h in self._block_of or block in self._hash_of:
                    continue
                self._block_of[h] = block
                self._hash_of[block] = h
                self._events.append((True, h))

    def cache_events(self, since: int) -> tuple[int, list[tuple[bool, BlockHash]] | None,
                                                 list[BlockHash] | None]:
        """What changed in the prefix cache after event number `since` (0: from the
        start): ``(seq, events, None)`` with events ``(stored, hash)`` oldest first
        (stored False: evicted), or ``(seq, None, snapshot)`` with every cached hash when
        the reader is too far behind for the bounded log (or ahead of it: a restarted
        pool). Pass the returned `seq` as the next `since`."""
        with self._lock:
            events = self._events.since(since)
            return self._events.seq, events, None if events is not None else list(self._block_of)

    def incref(self, block_ids: Iterable[int]) -> None:
        """Add a holder to blocks already in use."""
        with self._lock:
            for i in block_ids:
                assert self._ref_count[i] > 0, f"incref of free block {i}"
                self._ref_count[i] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one holder of each block; a block whose count reaches 0 becomes free, or
        evictable (most recently used) if it is cached."""
        with self._lock:
            for i in block_ids:
                assert self._ref_count[i] > 0, f"double free of block {i}"
                self._ref_count[i] -= 1
                if self._ref_count[i] == 0:
                    if i in self._hash_of:
                        self._evictable[i] = None
                    else:
                        self._free.append(i)

    def ref_count(self, block_id: int) -> int:
        return self._ref_count[block_id]

    def all_free(self) -> bool:
        """True when no block has a holder (the leak check after each test); cached
        blocks may remain, evictable."""
        with self._lock:
            return self.num_free == self.num_blocks and not any(self._ref_count)


class EventLog:
    """The last `maxlen` changes to a cache, numbered from 1 (`seq`: the newest's), for a
    reader that polls what changed after the number it last saw. Not thread-safe: the
    cache's lock guards it."""

    def __init__(self, maxlen: int):
        self._events: deque = deque(maxlen=maxlen)
        self.seq = 0

    def append(self, event: object) -> None:
        self._events.append(event)
        self.seq += 1

    def since(self, seq: int) -> list | None:
        """The events after number `seq`, oldest first; None when some of them have left
        the log, or `seq` is ahead of it (a restarted cache): the reader then needs a
        snapshot of the whole cache."""
        behind = self.seq - seq
        if not 0 <= behind <= len(self._events):
            return None
        return list(self._events)[len(self._events) - behind:] if behind else []


def match_prompt_prefix(pool: BlockPool, hashes: Sequence[BlockHash], num_tokens: int,
                        block_size: int) -> tuple[list[int], int]:
    """A prompt's prefix-cache lookup: of its full blocks' `hashes` (block_hashes of its
    `num_tokens` tokens), the leading ones found cached in `pool`, never the block that
    holds its last token, so that token is always computed (its logits give the next
    token) and shared blocks are only read. Returns (the blocks found, each held once
    more by the caller as BlockPool.match_prefix does; blocks looked up)."""
    lookup = hashes[:(num_tokens - 1) // block_size]
    return pool.match_prefix(lookup), len(lookup)


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks to hold `num_tokens` tokens (ceil division)."""
    return -(-num_tokens // block_size)
