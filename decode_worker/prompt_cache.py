"""A decode worker's prefix cache over its block pool, and the KV tiers below it.

Every prompt's K/V ends on a decode worker, transferred from a prefill worker or computed
there, so D's cache holds the histories of the conversations it serves. DecodeScheduler
(scheduler.py) uses one of these under its lock:

    lookup(prompt)     the prompt's block hashes, its leading full blocks D's pool caches
                       (shared, held; never the last token's block) and how many of the
                       next full blocks a tier holds (engine/kv_tiers.py)
    load(req, ...)     a request's tier hit copied into its blocks by the tiers thread at
                       reserve; once loaded() returns it, a local prefill is admitted
                       and a request prefilled elsewhere expects the blocks after it
    cache(req)         the prompt's full blocks registered once their K/V is in place,
                       and stored to the tiers (write-through)

Counters: `cached_tokens` (prompt tokens taken from the pool or a tier instead of being
computed or transferred), `prefix_queries` / `prefix_hits` (pool blocks looked up /
found).
"""

from __future__ import annotations

from ..engine.block_pool import BlockHash, BlockPool, block_hashes, match_prompt_prefix
from ..engine.kv_tiers import KVTiers
from ..engine.tier_loads import TierLoads
from .requests import DecodeRequest


class PromptCache:
    """See the module docstring. `enabled` False (no prefix caching): nothing is looked
    up, registered or stored."""

    def __init__(self, pool: BlockPool, block_size: int, enabled: bool,
                 tiers: KVTiers | None = None):
        self.pool, self.block_size, self.enabled = pool, block_size, enabled
        self.loads = TierLoads(tiers, pool, block_size) if tiers is not None and enabled else None
        self.cached_tokens = 0
        self.prefix_queries = self.prefix_hits = 0

    def lookup(self, prompt: list[int], with_tiers: bool, salt: str = ""
               ) -> tuple[list[BlockHash], list[int], int, int]:
        """(block hashes (salted by the request's cache_salt), pool blocks hit (each held
        once more), blocks looked up in the pool, blocks a tier holds after the hit; 0
        unless `with_tiers`)."""
        if not self.enabled:
            return [], [], 0, 0
        hashes = block_hashes(prompt, self.block_size, salt)
        hit, looked_up = match_prompt_prefix(self.pool, hashes, len(prompt), self.block_size)
        tier_hit = (self.loads.lookup(hashes, len(hit), len(prompt))
                    if with_tiers and self.loads is not None else 0)
        return hashes, hit, looked_up, tier_hit

    def count(self, looked_up: int, num_hit: int) -> None:
        """A lookup's pool blocks looked up and hit, once the request holds them."""
        self.cached_tokens += num_hit * self.block_size
        self.prefix_queries += looked_up
        self.prefix_hits += num_hit

    def load(self, req: DecodeRequest, num_hit: int, count: int) -> None:
        """The tiers' `count` blocks after the pool's `num_hit` into req's blocks."""
        self.loads.start(req, num_hit, count)

    def loading(self, req: DecodeRequest) -> bool:
        """Whether a tier is writing req's blocks (they must stay held)."""
        return self.loads is not None and req.request_id in self.loads

    def loaded(self) -> list[DecodeRequest]:
        """The requests whose load finished since the last call, their loaded blocks
        cached and counted as computed; call every step (it also gives the pool back the
        blocks whose store finished)."""
        out = []
        for req, num_blocks in self.loads.finished() if self.loads is not None else ():
            self.cached_tokens += (num_blocks - req.num_cached_blocks) * self.block_size
            req.num_cached_blocks = num_blocks
            req.num_computed_tokens = num_blocks * self.block_size
            out.append(req)
        return out

    def cache(self, req: DecodeRequest) -> None:
        """Register the prompt's full blocks once their K/V is in place (transferred or
        computed here; decode never writes into them), and store them to the tiers."""
        if req.block_hashes:
            full = req.block_table[:len(req.block_hashes)]
            self.pool.cache_blocks(full, req.block_hashes)
            if self.loads is not None:
                self.loads.store(full, req.block_hashes)
