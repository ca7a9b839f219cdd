"""Prompts waiting while a KV tier loads their prefix hit into their blocks.

Both schedulers (prefill_worker/scheduler.py for every prompt, decode_worker/scheduler.py
for every prompt it reserves) use one of these under their own lock (P on its step
thread; D looks up and starts in reserve(), on RPC threads), around a worker's KVTiers
(engine/kv_tiers.py):

    lookup(hashes, num_hit, n)   after the pool's prefix match of `num_hit` blocks, how
                                 many of the next full blocks a tier holds (never the
                                 block of the prompt's last token, which is computed)
    start(req, num_hit, count)   the request holds its blocks; the tiers thread copies the
                                 hit into block_table[num_hit:num_hit + count] while the
                                 step thread runs other steps
    finished()                   each request whose load is done, its loaded blocks
                                 registered in the pool's prefix cache, with how many
                                 leading blocks of its block_table hold K/V now (a
                                 missing or damaged entry ends the run early: the rest
                                 is computed)
    store(blocks, hashes)        write-through of blocks just registered in the cache

A request is in `self` (``request_id in loads``) from start() until finished() hands it
back: its blocks are being written and must not be freed meanwhile.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from .block_pool import BlockHash, BlockPool
from .kv_tiers import KVTiers


class _Request(Protocol):
    request_id: str
    block_table: list[int]
    block_hashes: list[BlockHash] | None


class TierLoads:
    """The tier loads in flight of one scheduler; see the module docstring.
    `loaded_tokens`: tokens loaded from the tiers so far (whole blocks)."""

    def __init__(self, tiers: KVTiers, pool: BlockPool, block_size: int):
        self.tiers, self.pool, self.block_size = tiers, pool, block_size
        self._loading: dict[str, tuple[_Request, int]] = {}   # request_id -> (req, num_hit)
        self.loaded_tokens = 0

    def lookup(self, hashes: Sequence[BlockHash], num_hit: int, prompt_len: int) -> int:
        """Blocks after the first `num_hit` of a prompt of `prompt_len` tokens (block
        hashes `hashes`) that a tier holds, never its last token's block."""
        return self.tiers.lookup(hashes[num_hit:(prompt_len - 1) // self.block_size])

    def start(self, req: _Request, num_hit: int, count: int) -> None:
        """Load the tiers' `count` blocks after `num_hit` into req.block_table's."""
        self._loading[req.request_id] = (req, num_hit)
        end = num_hit + count
        self.tiers.load(req.request_id, req.block_hashes[num_hit:end],
                        req.block_table[num_hit:end])

    def finished(self) -> list[tuple[_Request, int]]:
        """(request, leading blocks holding K/V) of each load done since the last call;
        also gives the pool back the blocks whose store finished (KVTiers.poll), so call
        it every step."""
        out = []
        for done in self.tiers.poll():
            req, start = self._loading.pop(done.key)
            loaded = slice(start, start + done.num_loaded)
            self.pool.cache_blocks(req.block_table[loaded], req.block_hashes[loaded])
            self.loaded_tokens += done.num_loaded * self.block_size
            out.append((req, loaded.stop))
        return out

    def store(self, block_ids: Sequence[int], hashes: Sequence[BlockHash]) -> None:
        self.tiers.store(block_ids, hashes)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._loading

    def loading(self) -> bool:
        """Whether a load is in flight."""
        return bool(self._loading)
