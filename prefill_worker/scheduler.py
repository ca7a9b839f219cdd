"""Prefill-side scheduler: a queue ordered by the schedule policy (engine/schedule_policy.py:
arrival order by default, shortest prompt first with `sjf`) → varlen batches under a token
budget.

Lifecycle of a request on a prefill worker:

    add()        WAITING in the queue
    schedule()   PREFILLING: its prompt's leading full blocks are looked up in the
                 prefix cache (engine/block_pool.py match_prompt_prefix) and shared where
                 found, the rest allocated; joins the step's SchedulerOutput while the
                 step's tokens fit max_num_batched_tokens (one over-budget prompt runs
                 alone) and the pool has blocks
    (worker)     ModelRunner.execute computes its uncached tokens, a chunk per step;
                 after each layer, the layer's K/V of the blocks this chunk completed
                 (and, with the first chunk, of cached blocks D lacks) is queued for
                 sending (kv_send_ranges)
    update_from_output()  the chunk counted; once the prompt is complete (SENDING_KV),
                 its full blocks enter the prefix cache
    release()    the done frame went out (or the request failed / was aborted):
                 blocks return to the pool (cached ones stay cached, evictable)

The block holding a prompt's last token is never taken from the cache, so at least that
token is computed (its logits give the first token) and shared blocks are only read.

No model and no sockets here: the worker (worker.py) drives it.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass

from ..engine.block_pool import (BlockHash, BlockPool, block_hashes, blocks_needed,
                                 match_prompt_prefix)
from ..engine.kv_tiers import KVTiers
from ..engine.outputs import ModelRunnerOutput, SchedulerOutput
from ..engine.request import RequestState
from ..engine.schedule_policy import SchedulePolicy, chunk_tokens, prefill_order
from ..engine.tier_loads import TierLoads
from .kv_pull import KVPulls
from .requests import FinishCause, PrefillRequest, fail


@dataclass(slots=True)
class _Export:
    """Blocks another prefill worker reads (export): `block_hashes`' blocks, the tail of
    `block_table` being loaded from the tiers (TierLoads takes it as a request)."""

    request_id: str
    block_table: list[int]
    block_hashes: list[BlockHash]
    blocks: Future


class PrefillScheduler:
    """Prefill batches in `schedule_policy` order; see the module docstring. With `enable_prefix_caching`
    False, nothing is looked up or registered. Counters (tokens unless named blocks):
    `computed_tokens`, `cached_tokens` (reused from the cache), and
    `prefix_queries` / `prefix_hits` (blocks looked up / found). With `tiers`
    (engine/kv_tiers.py), the blocks the pool's cache lacks are looked up in the host and
    disk tiers too: a prompt with a tier hit takes its blocks, waits while the tiers
    thread loads the hit into them, then computes the rest; its computed blocks are
    stored to the tiers once cached (engine/tier_loads.py). With `pulls` (kv_pull.py), the
    leading blocks the request's decode worker holds past the pool's hit are read from
    there instead, when they are more than the tiers' and the cost model says so."""

    def __init__(self, pool: BlockPool, block_size: int, max_num_batched_tokens: int,
                 enable_prefix_caching: bool = True, prefill_chunk_size: int | None = None,
                 schedule_policy: str | SchedulePolicy = SchedulePolicy.FCFS,
                 tiers: KVTiers | None = None, pulls: KVPulls | None = None):
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
        self.schedule_policy = SchedulePolicy.of(schedule_policy)   # ValueError: unknown
        self.loads = None if tiers is None else TierLoads(tiers, pool, block_size)
        self.pulls = pulls
        self._partial: deque[PrefillRequest] = deque()   # between chunks, oldest first
        self._dropped: list[PrefillRequest] = []          # aborted between chunks
        self.computed_tokens = self.cached_tokens = 0
        self.prefix_queries = self.prefix_hits = 0
        self._lock = threading.Lock()
        self._waiting: deque[PrefillRequest] = deque()
        self._active: dict[str, PrefillRequest] = {}
        self._export_ids = itertools.count()

    def add(self, req: PrefillRequest) -> None:
        """Queue a request.

        Raises:
            ValueError: its prompt needs more blocks than this worker's whole pool.
        """
        need = blocks_needed(req.prompt_len, self.block_size)
        if need > self.pool.num_blocks:
            raise ValueError(f"prompt of {req.prompt_len} tokens needs {need} KV blocks; "
                             f"this prefill worker has {self.pool.num_blocks}")
        with self._lock:
            self._waiting.append(req)
            self._active[req.request_id] = req

    def schedule(self) -> SchedulerOutput:
        """Next step's SchedulerOutput (engine/outputs.py; no rows: nothing to do), each
        row a prompt computing its next num_scheduled_tokens from num_computed_tokens.
        Partly prefilled prompts continue first (oldest first), then waiting ones join in
        the schedule policy's order (FIFO, or shortest prompt first), each taking blocks
        for its whole prompt (cached prefix blocks shared, `num_cached` set) when it
        first runs. With prefill_chunk_size, a prompt computes at most that many tokens
        a step, and a partly prefilled one at most half the step's budget while other
        prompts wait, so short prompts behind a long one share the next steps instead
        of waiting for all of it (the budget may be no larger than one chunk); chunks
        end on block boundaries (schedule_policy.chunk_tokens)."""
        rows: list[tuple[PrefillRequest, int]] = []
        with self._lock:
            self._loads_done()
            budget = self._schedule_partial(rows)
            if len(self._waiting) > 1 and budget > 0:
                self._waiting = deque(prefill_order(
                    self._waiting, lambda r: r.prompt_len, lambda r: r.arrived,
                    self.schedule_policy, time.monotonic()))
            while self._waiting and budget > 0:
                take = self._admit(self._waiting[0], budget, alone=not rows)
                if take == 0:
                    break   # in order: wait (for room or blocks), no later prompt overtakes
                req = self._waiting.popleft()
                if take > 0:        # else its tier hit is loading: it runs once loaded
                    rows.append((req, take))
                    budget -= take
        return SchedulerOutput(tuple(r for r, _ in rows), tuple(n for _, n in rows))

    def _schedule_partial(self, rows: list[tuple[PrefillRequest, int]]) -> int:
        """The next chunks of partly prefilled prompts into `rows` (lock held); returns
        the step's budget left."""
        budget, bs = self.max_num_batched_tokens, self.block_size
        for req in list(self._partial):
            self._partial.remove(req)
            if req.finish is not None:
                self._dropped.append(req)
                continue
            share = budget
            if self._waiting and self.prefill_chunk_size is not None:
                share = max(bs, self.max_num_batched_tokens // 2 // bs * bs)
            take = self._chunk(req, min(budget, share), alone=not rows)
            if take == 0:
                self._partial.appendleft(req)  # keeps its turn for the next step
                break
            budget -= take
            self.computed_tokens += take
            rows.append((req, take))
        return budget

    def _admit(self, req: PrefillRequest, budget: int, alone: bool) -> int:
        """A waiting prompt's first step (lock held): its prefix-cache hit shared, blocks
        for the rest allocated, PREFILLING. Returns the tokens it computes this step; 0
        (nothing taken) when they do not fit `budget` or the pool lacks blocks; -1 when
        its blocks are taken and a tier hit or a pull loads into them (it computes once
        loaded)."""
        bs, n = self.block_size, req.prompt_len
        hit, looked_up, tier_hit, pull = [], 0, 0, 0
        if self.enable_prefix_caching and req.params.prompt_logprobs is None:
            if req.block_hashes is None:
                req.block_hashes = block_hashes(req.prompt_token_ids, bs,
                                                req.params.cache_salt)
            hit, looked_up = match_prompt_prefix(self.pool, req.block_hashes, n, bs)
            if self.loads is not None:   # the rest of the lookup, never the last block
                tier_hit = self.loads.lookup(req.block_hashes, len(hit), n)
            if self.pulls is not None:
                pull = self.pulls.count(req, len(hit), tier_hit)
                tier_hit = 0 if pull else tier_hit
        req.num_computed_tokens = len(hit) * bs
        take = -1 if tier_hit or pull else self._chunk(req, budget, alone)
        need = blocks_needed(n, bs) - len(hit)
        if take == 0 or need > self.pool.num_free:
            self.pool.free(hit)
            req.num_computed_tokens = 0
            return 0
        req.block_table = hit + self.pool.allocate(need)
        if tier_hit:
            self.loads.start(req, len(hit), tier_hit)
        elif pull:
            self.pulls.start(req, len(hit), pull)
        req.num_cached = req.num_computed_tokens
        req.state = RequestState.PREFILLING
        req.scheduled = time.monotonic()
        self.computed_tokens += max(take, 0)
        self.cached_tokens += req.num_cached
        self.prefix_queries += looked_up
        self.prefix_hits += len(hit)
        return take

    def _loads_done(self) -> None:
        """Prompts whose tier load or pull finished (lock held): the blocks loaded enter
        the pool's prefix cache and count as computed; the prompt computes the rest from
        its next chunk on (an aborted one is handed back by take_aborted)."""
        done = [*(self.loads.finished() if self.loads is not None else ()),
                *(self.pulls.finished() if self.pulls is not None else ())]
        for req, num_blocks in done:
            if isinstance(req, _Export):
                self._exported(req, num_blocks)
                continue
            self.cached_tokens += num_blocks * self.block_size - req.num_cached
            req.num_computed_tokens = req.num_cached = num_blocks * self.block_size
            (self._dropped if req.finish is not None else self._partial).append(req)

    def export(self, hashes: list[BlockHash]) -> Future:
        """The blocks holding `hashes` (chained block hashes of a prompt's full blocks),
        for another prefill worker to read (kv_pull.py): a Future of the block ids, each
        held once more until end_export(), or of None (nothing held) when this worker
        lacks any of them. Resolved at once when the prefix cache holds them all. When
        it holds a leading run and the KV tiers hold the rest, blocks are taken for the
        rest and the tiers thread loads them (engine/tier_loads.py); the step thread's
        next schedule() after the load resolves it, the loaded blocks then in the prefix
        cache (None when an entry was missing or damaged by then). Under the lock, so a
        schedule() counting free blocks is not raced."""
        out: Future = Future()
        with self._lock:
            blocks = self.pool.match_prefix(hashes)
            rest = len(hashes) - len(blocks)
            if not rest:
                out.set_result(blocks)
            elif (self.loads is not None and self.loads.tiers.lookup(hashes[len(blocks):])
                  == rest and self.pool.num_free >= rest):
                export = _Export(f"export-{next(self._export_ids)}",
                                 blocks + self.pool.allocate(rest), list(hashes), out)
                self.loads.start(export, len(blocks), rest)
            else:
                self.pool.free(blocks)
                out.set_result(None)
        return out

    def _exported(self, export: _Export, num_blocks: int) -> None:
        """An export's tier load finished (lock held) with `num_blocks` leading blocks
        holding K/V: the blocks go to the reader, or back when any is missing."""
        if num_blocks == len(export.block_hashes):
            export.blocks.set_result(export.block_table)
        else:
            self.pool.free(export.block_table)
            export.blocks.set_result(None)

    def end_export(self, blocks: list[int]) -> None:
        """An export's blocks were sent (or failed): their holds go back."""
        with self._lock:
            self.pool.free(blocks)

    def loading(self) -> bool:
        """Whether a tier load or a pull is in flight."""
        with self._lock:
            return any(x is not None and x.loading() for x in (self.loads, self.pulls))

    def _chunk(self, req: PrefillRequest, budget: int, alone: bool) -> int:
        """Tokens `req` computes this step within `budget` (0: none fit). Without
        chunking, a prompt over the budget runs whole, alone."""
        remaining = req.prompt_len - req.num_computed_tokens
        if self.prefill_chunk_size is None:
            return remaining if remaining <= budget or alone else 0
        return chunk_tokens(req.num_computed_tokens, remaining,
                            min(budget, self.prefill_chunk_size), self.block_size)

    def update_from_output(self, out: SchedulerOutput, result: ModelRunnerOutput | None
                           ) -> list[tuple[PrefillRequest, int | None]]:
        """After a step: each row's num_computed_tokens advanced by what it computed; a
        row's error (result.errors) fails it. Returns the rows done on this worker with
        their first token: those whose prompt is complete (token None for one that
        failed), and with `result` None (the step raised; the caller set each row's
        finish) every row; the others wait for their next chunk. Complete prompts' full
        blocks enter the prefix cache."""
        done = []
        with self._lock:
            for i, (req, n) in enumerate(zip(out.requests, out.num_scheduled_tokens)):
                req.num_computed_tokens += n
                if result is None:
                    done.append((req, None))
                    continue
                if result.errors[i] is not None:
                    fail(req, FinishCause.MODEL_FAULT, result.errors[i])
                if result.prompt_logprobs[i]:
                    req.prompt_logprobs += result.prompt_logprobs[i]
                if req.num_computed_tokens < req.prompt_len:
                    self._partial.append(req)
                    continue
                req.logprobs = result.logprobs[i]
                done.append((req, result.sampled_token_ids[i]))
                if req.finish is None:
                    self._cache_computed(req)
        return done

    def kv_send_ranges(self, out: SchedulerOutput) -> list[tuple[PrefillRequest, int, int]]:
        """(request, lo, hi) for each row of `out` with blocks to send: kv_send_range of
        the chunk it computes this step."""
        ranges = [(r, *self.kv_send_range(r, r.num_computed_tokens + n))
                  for r, n in zip(out.requests, out.num_scheduled_tokens)]
        return [(r, lo, hi) for r, lo, hi in ranges if lo < hi]

    def kv_send_range(self, req: PrefillRequest, chunk_end: int) -> tuple[int, int]:
        """Block-table positions ``[lo, hi)`` whose K/V this step's chunk makes final and
        D still lacks: from where earlier chunks stopped (at first, after D's
        num_cached_blocks; P's own cached blocks included) to the chunk's last block; then
        marks them sent. Call once per scheduled step; ``lo == hi`` when D holds them all."""
        lo = max(req.num_cached_blocks, req.kv_sent_blocks)
        hi = max(lo, blocks_needed(chunk_end, self.block_size))
        req.kv_sent_blocks = hi
        return lo, hi

    def take_aborted(self) -> list[PrefillRequest]:
        """Requests aborted between chunks (their blocks still held): the worker ends
        them like failed ones."""
        with self._lock:
            dropped, self._dropped = self._dropped, []
        return dropped

    def _cache_computed(self, req: PrefillRequest) -> None:
        """Register the request's full blocks in the prefix cache once its K/V is
        computed (every layer; lock held); later prompts with the same prefix share them."""
        if self.enable_prefix_caching and req.block_hashes and req.block_table:
            full = req.block_table[:len(req.block_hashes)]
            self.pool.cache_blocks(full, req.block_hashes)
            if self.loads is not None:
                self.loads.store(full, req.block_hashes)

    def abort(self, request_id: str) -> PrefillRequest | None:
        """Mark a request aborted; returns it if it was still queued (never computed)."""
        with self._lock:
            req = self._active.get(request_id)
            if req is None:
                return None
            fail(req, FinishCause.ABORTED, f"request {request_id} aborted")
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
            return sum(r.prompt_len for r in self._waiting)

    def active_tokens(self, but: PrefillRequest | None = None) -> int:
        """Prompt tokens of every request queued, computing or sending, `but` aside."""
        with self._lock:
            return sum(r.prompt_len for r in self._active.values() if r is not but)
