"""Prefill-side scheduler: a queue ordered by the schedule policy (engine/schedule_policy.py:
arrival order by default, shortest prompt first with `sjf`) → varlen batches under a token
budget.

Lifecycle of a request on a prefill worker:

    add()        WAITING in the queue
    schedule()   PREFILLING: its prompt's leading full blocks are looked up in the
                 prefix cache (engine/block_pool.py) and shared where found, the rest
                 allocated; joins a batch while the batch's tokens to compute fit
                 max_num_batched_tokens (one over-budget prompt runs alone) and the pool
                 has blocks
    (worker)     computes the uncached tokens, a chunk per step; after each layer, the
                 layer's K/V of the blocks this chunk completed (and, with the first
                 chunk, of cached blocks D lacks) is queued for sending (kv_send_range);
                 once every chunk is computed (SENDING_KV), cache_computed() registers
                 its full blocks in the prefix cache
    release()    the done frame went out (or the request failed / was aborted):
                 blocks return to the pool (cached ones stay cached, evictable)

The block holding a prompt's last token is never taken from the cache, so at least that
token is computed (its logits give the first token) and shared blocks are only read.

No model and no sockets here: the worker (worker.py) drives it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ..engine.block_pool import BlockHash, BlockPool, block_hashes, blocks_needed
from ..engine.logprobs import TokenLogprobs
from ..engine.request import RequestState
from ..engine.schedule_policy import prefill_order
from ..engine.sampling_params import SamplingParams


@dataclass(slots=True, eq=False)
class PrefillRequest:
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    kv_address: tuple[str, int]          # decode worker's KV receiver
    epoch: int                           # decode worker's epoch, echoed in every frame
    future: Any = None                   # asyncio.Future on the actor loop: first token
    num_cached_blocks: int = 0           # leading prompt blocks D holds already: not sent
    kv_sent_blocks: int = 0              # block-table positions before this are queued to send
    kv_send_started: float | None = None  # perf_counter() of its first KV frame (metrics)
    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0                  # leading prompt tokens found in P's prefix cache
    num_computed_tokens: int = 0         # tokens whose K/V is in the blocks (cached included)
    chunk_end: int = 0                   # this step computes [num_computed_tokens, chunk_end)
    block_hashes: list[BlockHash] | None = None  # of its full blocks, computed once
    state: RequestState = RequestState.WAITING
    aborted: bool = False
    error: str | None = None
    model_fault: str | None = None       # the model step's error: it outranks the transfer's
    kv_rank_addresses: tuple = ()        # a tensor-parallel D's ranks 1..M-1 (messages.py)
    logprobs: TokenLogprobs | None = None  # of the first token, when params.logprobs
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # grows per chunk
    arrived: float = field(default_factory=time.monotonic)   # schedule policy's clock
    grammar: Any = None                  # params.structured_outputs compiled (xgrammar)


class PrefillScheduler:
    """Prefill batches in `schedule_policy` order; see the module docstring. With `enable_prefix_caching`
    False, nothing is looked up or registered. Counters (tokens unless named blocks):
    `computed_tokens`, `cached_tokens` (reused from the cache), and
    `prefix_queries` / `prefix_hits` (blocks looked up / found)."""

    def __init__(self, pool: BlockPool, block_size: int, max_num_batched_tokens: int,
                 enable_prefix_caching: bool = True, prefill_chunk_size: int | None = None,
                 schedule_policy: str = "fcfs"):
        if prefill_chunk_size is not None and (
                prefill_chunk_size < block_size or prefill_chunk_size % block_size
                or prefill_chunk_size > max_num_batched_tokens):
            raise ValueError(f"prefill_chunk_size={prefill_chunk_size} must be a multiple of "
                             f"block_size={block_size} and <= max_num_batched_tokens="
                             f"{max_num_batched_tokens}")
        self.pool, self.block_size = pool, block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_prefix_caching = enable_prefix_caching
        self.prefill_chunk_size = prefill_chunk_size
        prefill_order([], len, float, schedule_policy, 0.0)       # ValueError: unknown policy
        self.schedule_policy = schedule_policy
        self._partial: deque[PrefillRequest] = deque()   # between chunks, oldest first
        self._dropped: list[PrefillRequest] = []          # aborted between chunks
        self.computed_tokens = self.cached_tokens = 0
        self.prefix_queries = self.prefix_hits = 0
        self._lock = threading.Lock()
        self._waiting: deque[PrefillRequest] = deque()
        self._active: dict[str, PrefillRequest] = {}

    def add(self, req: PrefillRequest) -> None:
        """Queue a request.

        Raises:
            ValueError: its prompt needs more blocks than this worker's whole pool.
        """
        need = blocks_needed(len(req.token_ids), self.block_size)
        if need > self.pool.num_blocks:
            raise ValueError(f"prompt of {len(req.token_ids)} tokens needs {need} KV blocks; "
                             f"this prefill worker has {self.pool.num_blocks}")
        with self._lock:
            self._waiting.append(req)
            self._active[req.request_id] = req

    def schedule(self) -> list[PrefillRequest]:
        """Next batch (possibly empty); each member computes tokens
        ``[num_computed_tokens, chunk_end)`` this step. Partly prefilled prompts continue first
        (oldest first), then waiting ones join in the schedule policy's order (FIFO, or
        shortest prompt first), each taking blocks for its
        whole prompt (cached prefix blocks shared, `num_cached` set) when it first runs.
        With prefill_chunk_size, a prompt computes at most that many tokens a step, and
        a partly prefilled one at most half the step's budget while other prompts wait,
        so short prompts behind a long one share the next steps instead of waiting for
        all of it (the budget may be no larger than one chunk); chunks end on block
        boundaries (the last one at the prompt's end)."""
        batch, budget = [], self.max_num_batched_tokens
        bs = self.block_size
        with self._lock:
            for req in list(self._partial):
                self._partial.remove(req)
                if req.aborted:
                    self._dropped.append(req)
                    continue
                share = budget
                if self._waiting and self.prefill_chunk_size is not None:
                    share = max(bs, self.max_num_batched_tokens // 2 // bs * bs)
                take = self._chunk(req, min(budget, share), alone=not batch)
                if take == 0:
                    self._partial.appendleft(req)  # keeps its turn for the next step
                    break
                budget -= take
                self.computed_tokens += take
                batch.append(req)
            if len(self._waiting) > 1 and budget > 0:
                self._waiting = deque(prefill_order(
                    self._waiting, lambda r: len(r.token_ids), lambda r: r.arrived,
                    self.schedule_policy, time.monotonic()))
            while self._waiting and budget > 0:
                req = self._waiting[0]
                n = len(req.token_ids)
                hit: list[int] = []
                lookup: list[BlockHash] = []
                if self.enable_prefix_caching and req.params.prompt_logprobs is None:
                    if req.block_hashes is None:
                        req.block_hashes = block_hashes(req.token_ids, bs)
                    lookup = req.block_hashes[: (n - 1) // bs]  # not the last token's block
                    hit = self.pool.match_prefix(lookup)
                req.num_computed_tokens = len(hit) * bs
                take = self._chunk(req, budget, alone=not batch)
                need = blocks_needed(n, bs) - len(hit)
                if take == 0 or need > self.pool.num_free:
                    # in order: wait (for room or blocks) rather than let later prompts overtake
                    self.pool.free(hit)
                    req.num_computed_tokens = 0
                    break
                req.block_table = hit + self.pool.allocate(need)
                req.num_cached = req.num_computed_tokens
                req.state = RequestState.PREFILLING
                self._waiting.popleft()
                batch.append(req)
                budget -= take
                self.computed_tokens += take
                self.cached_tokens += req.num_cached
                self.prefix_queries += len(lookup)
                self.prefix_hits += len(hit)
        return batch

    def _chunk(self, req: PrefillRequest, budget: int, alone: bool) -> int:
        """Tokens `req` computes this step within `budget` (0: none fit); sets chunk_end.
        Without chunking, a prompt over the budget runs whole, alone."""
        remaining = len(req.token_ids) - req.num_computed_tokens
        take = min(remaining, self.prefill_chunk_size or remaining)
        if take > budget:
            if self.prefill_chunk_size is None:
                take = remaining if alone else 0    # whole prompts only
            else:
                take = budget
        end = req.num_computed_tokens + take
        if end < len(req.token_ids):
            end -= end % self.block_size          # later chunks start on a block boundary
        take = max(end - req.num_computed_tokens, 0)
        req.chunk_end = req.num_computed_tokens + take
        return take

    def advance(self, batch: list[PrefillRequest], ok: bool = True) -> list[PrefillRequest]:
        """After a step: each member's computed tokens now reach chunk_end. Returns the
        members whose prompt is complete (sample their first token); the rest wait for
        their next chunk (with ok False, a failed step: none of them does)."""
        done = []
        with self._lock:
            for req in batch:
                req.num_computed_tokens = req.chunk_end
                if req.num_computed_tokens == len(req.token_ids):
                    done.append(req)
                elif ok:
                    self._partial.append(req)
        return done

    def kv_send_range(self, req: PrefillRequest) -> tuple[int, int]:
        """Block-table positions ``[lo, hi)`` whose K/V this step's chunk makes final and
        D still lacks: from where earlier chunks stopped (at first, after D's
        num_cached_blocks; P's own cached blocks included) to the chunk's last block; then
        marks them sent. Call once per scheduled step; ``lo == hi`` when D holds them all."""
        lo = max(req.num_cached_blocks, req.kv_sent_blocks)
        hi = max(lo, blocks_needed(req.chunk_end, self.block_size))
        req.kv_sent_blocks = hi
        return lo, hi

    def take_aborted(self) -> list[PrefillRequest]:
        """Requests aborted between chunks (their blocks still held): the worker ends
        them like failed ones."""
        with self._lock:
            dropped, self._dropped = self._dropped, []
        return dropped

    def cache_computed(self, req: PrefillRequest) -> None:
        """Register the request's full blocks in the prefix cache once its K/V is
        computed (every layer); later prompts with the same prefix share them."""
        if not self.enable_prefix_caching or not req.block_hashes:
            return
        with self._lock:
            if req.block_table:   # not released meanwhile
                full = len(req.block_hashes)
                self.pool.cache_blocks(req.block_table[:full], req.block_hashes)

    def abort(self, request_id: str) -> PrefillRequest | None:
        """Mark a request aborted; returns it if it was still queued (never computed)."""
        with self._lock:
            req = self._active.get(request_id)
            if req is None:
                return None
            req.aborted = True
            if req.state == RequestState.WAITING:
                self._active.pop(request_id)
                self._waiting.remove(req)       # O(queue); keeps counts() exact
                return req
            return None

    def request_ids(self) -> list[str]:
        """Every request queued or computing on this worker."""
        with self._lock:
            return list(self._active)

    def release(self, req: PrefillRequest, state: RequestState) -> None:
        """The request is done on this worker: free its blocks."""
        with self._lock:
            req.state = state
            self._active.pop(req.request_id, None)
            if req.block_table:
                self.pool.free(req.block_table)
                req.block_table = []

    def counts(self) -> tuple[int, int]:
        """(requests computing or sending, requests queued)."""
        with self._lock:
            return len(self._active) - len(self._waiting), len(self._waiting)

    def queued_tokens(self) -> int:
        with self._lock:
            return sum(len(r.token_ids) for r in self._waiting)

    def active_tokens(self, but: PrefillRequest | None = None) -> int:
        """Prompt tokens of every request queued, computing or sending, `but` aside."""
        with self._lock:
            return sum(len(r.token_ids) for r in self._active.values() if r is not but)
