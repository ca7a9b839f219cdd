"""Decode-side scheduler: reservations, KV arrival, the continuous batch, preemption, stops.

Lifecycle of a request on a decode worker (pure state; no model, no sockets):

    reserve()            blocks for the prompt's KV only: its leading full blocks shared
        │                from D's own prefix cache where found, the rest allocated
        │                under a lease (deadline); state WAITING_FOR_REMOTE_KV, the
        │                prefill worker fills only the blocks after the cache's hit and
        │                the next ones a KV tier holds (loaded first: reserved() answers
        │                once they are; export() lends them to a prefill worker that
        │                reads them instead of computing them). Or, when the
        │                uncached part is at most local_prefill_max_tokens, WAITING for
        │                a *local prefill* on D (no transfer, see below)
        ▼
    on_kv_complete()     every block of every layer arrived and the prefill worker's
        │                first token came with the done frame (ok=False ->
        │                FINISHED_ERROR, blocks freed); the prompt's full blocks enter
        │                the prefix cache
        ▼
    schedule()           applies aborts and lease expiry; admits arrived requests into
        │   ▲            RUNNING; grows a block_table by one block when the request's
        │   │            next position enters a new block; returns the SchedulerOutput
        │   │            of one step: per request, the tokens to compute from its
        │   │            num_computed_tokens on
        │   └── PREEMPTED: blocks freed, tokens kept, num_computed_tokens = 0; resumed
        │                  (oldest first, before new arrivals) by computing its tokens
        │                  again, as a prefill
        ▼
    update_from_output() advances num_computed_tokens, appends each sampled token,
                         checks EOS / stop_token_ids / max_tokens / context length,
                         frees finished requests' blocks

Blocks are taken on demand, and a running request that cannot get its next block
preempts the newest (batch.py, the memory policy and why it always makes progress); a
preempted request waits with its tokens and resumes, as if never preempted, by computing
their K/V again as a prefill. With sampling n > 1, the prompt's K/V is forked into its
samples once complete (fork.py). Every case computes tokens from num_computed_tokens to
num_tokens (requests.py DecodeRequest), chunked beside the decode rows under
prefill_chunk_size (vLLM's chunked prefill).

Thread-safety: every public method takes the scheduler's lock. Blocks are only ever
freed, and only taken for running requests, inside schedule(), update_from_output() and
update_from_connector(), on the step thread between model steps, so a step never writes
into a block freed and handed to another request mid-step; aborts from other threads
are recorded and applied there. (reserve() takes free blocks from RPC threads.)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from ..engine.block_pool import BlockPool, NoFreeBlocksError, blocks_needed
from ..engine.kv_tiers import KVTiers
from ..engine.outputs import SchedulerOutput
from ..engine.request import RequestState, TokenEvent
from ..engine.schedule_policy import SchedulePolicy
from ..engine.sampling_params import SamplingParams
from ..engine.stop import stop_state
from ..request_ids import router_of
from .batch import RunningBatch
from .connector import DecodeKVConnector
from .fork import drop_cow_src, fork
from .prompt_cache import PromptCache
from .requests import DecodeRequest, ReservationConflictError, RequestTooLargeError, Reserved
from .step_budget import StepTokens


class DecodeScheduler:
    def __init__(self, pool: BlockPool, block_size: int, max_model_len: int,
                 eos_token_ids: tuple[int, ...], max_batch_size: int = 256,
                 connector: DecodeKVConnector | None = None,
                 enable_prefix_caching: bool = False, local_prefill_max_tokens: int = 0,
                 prefill_chunk_size: int | None = None,
                 schedule_policy: str | SchedulePolicy = SchedulePolicy.FCFS,
                 tiers: KVTiers | None = None, on_loaded: Callable[[], None] | None = None):
        """connector: the KV receiver's side (decode_worker/connector.py) that fills the
        blocks of requests prefilled elsewhere; their blocks go back to the pool only
        once it reports them released (update_from_connector). None (tests, a
        colocated engine): no transfers; blocks are freed at once.

        enable_prefix_caching: share the prompt's leading full blocks from D's prefix
        cache (they are then not transferred). local_prefill_max_tokens: a request whose
        uncached prompt tokens are at most this many is prefilled on D (0: never).
        prefill_chunk_size: most prompt tokens D prefills in one step, all prefill rows
        together, less one per decode row of the step (decode first, as vLLM's chunked
        prefill budgets a step) but at least block_size; None: whole prompts.
        schedule_policy: the order of local prefills (engine/schedule_policy.py).
        tiers (engine/kv_tiers.py; with prefix caching): prompt blocks are stored there
        once cached, and a request loads the tiers' hit past the pool's at reserve: a
        local prefill computes the rest (the hit counts as cached for
        local_prefill_max_tokens), a prefill worker fills the rest (prompt_cache.py).
        on_loaded: called from schedule() (step thread, lock held) when tier loads
        finished: reserve()'s callers waiting on reserved() look again.

        Raises:
            ValueError: an unknown schedule_policy."""
        self.pool, self.block_size, self.max_model_len = pool, block_size, max_model_len
        self.prompt_cache = PromptCache(pool, block_size, enable_prefix_caching, tiers)
        self._on_loaded = on_loaded
        self.local_prefill_max_tokens = local_prefill_max_tokens
        self.step_tokens = StepTokens(block_size, prefill_chunk_size, schedule_policy)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.connector = connector
        self._lock = threading.Lock()
        self._requests: dict[str, DecodeRequest] = {}
        self._arrived: list[str] = []
        self._batch = RunningBatch(pool, block_size, max_batch_size)   # running, preempted
        self._next_seq = 0
        self._release_next: list[int] = []       # refs dropped at the next schedule():
                                                 # last step's cow sources, blocks exported
        self._events: list[TokenEvent] = []      # finishes outside a step (errors, aborts)
        self.num_reclaimed = 0                   # leases expired
        self.num_local_prefills = 0              # requests prefilled on D (no transfer)
        self.computed_tokens = 0                 # prompt tokens computed here (local
                                                 # prefills and resumed preemptions)

    # --- called from RPC / transport threads --------------------------------------

    def reserve(self, request_id: str, prompt_len: int, params: SamplingParams,
                lease_s: float, prompt_token_ids: list[int],
                prefill_locally: bool = False, grammar: Any = None) -> Reserved:
        """Reserve the blocks for the prompt's KV. Idempotent per request_id (the
        router's retry of a prefill reserves again), for the same prompt and params.

        With prefix caching, the prompt's leading full blocks found in D's cache are
        shared (never the block of the last token, so at least one block is always
        prefilled); the rest are allocated. When the prompt's uncached tokens are at most
        local_prefill_max_tokens, or with `prefill_locally` (the router's choice), D
        prefills them itself, from its next step on. The prompt
        (`prompt_token_ids`, len == prompt_len) is kept to recompute the KV if the
        request is preempted; `grammar`, params.structured_outputs compiled, with it. The
        connector expects a request prefilled elsewhere under the lock (once its tier hit
        is loaded: Reserved.loading, then reserved()), so its lease cannot expire before
        the receiver expects it; no lease is applied while a tier loads its blocks.

        Raises:
            ValueError: len(prompt_token_ids) != prompt_len.
            RequestTooLargeError: prompt + max_tokens (capped by the model's context)
                needs more blocks than the whole pool has (nothing taken).
            NoFreeBlocksError: the pool cannot hold the prompt now, counting the blocks
                that preempted requests need to resume as taken (nothing taken).
            ReservationConflictError: request_id is live with another prompt or other
                params (nothing taken).
        """
        if len(prompt_token_ids) != prompt_len:
            raise ValueError(f"prompt_len={prompt_len} but {len(prompt_token_ids)} "
                             "prompt_token_ids were given")
        assert prompt_len < self.max_model_len, (prompt_len, self.max_model_len)  # router checks
        with self._lock:
            req = self._requests.get(request_id)
            if req is None:
                req = self._new_request(request_id, list(prompt_token_ids), params, lease_s,
                                        prefill_locally)
                req.grammar = grammar
            elif req.params != params or req.prompt_token_ids != list(prompt_token_ids):
                raise ReservationConflictError(request_id)
            return self._reserved(req)

    def reserved(self, request_id: str) -> Reserved | None:
        """reserve()'s answer for a request reserved before, once its tier load is done
        (Reserved.loading until then); None once it finished or was aborted."""
        with self._lock:
            req = self._requests.get(request_id)
            return None if req is None or req.abort_reason is not None else self._reserved(req)

    def _reserved(self, req: DecodeRequest) -> Reserved:
        """The reservation of `req` (lock held): a request prefilled elsewhere is
        expected by the connector once its tier hit is loaded."""
        cached = req.num_cached_blocks
        if req.state == RequestState.WAITING:
            return Reserved([], cached, True)
        if self.prompt_cache.loading(req):
            return Reserved([], cached, False, loading=True)
        blocks = req.block_table[cached:blocks_needed(req.prompt_len, self.block_size)]
        if self.connector is not None:
            self.connector.expect(req.request_id, blocks)
        return Reserved(blocks, cached, False)

    def _new_request(self, request_id: str, prompt: list[int], params: SamplingParams,
                     lease_s: float, prefill_locally: bool) -> DecodeRequest:
        """reserve() of a request not seen before (lock held)."""
        bs, n = self.block_size, len(prompt)
        total = blocks_needed(min(n + params.max_tokens, self.max_model_len), bs)
        if total > self.pool.num_blocks:
            raise RequestTooLargeError(n, params.max_tokens, total, self.pool.num_blocks, bs)
        hashes, hit, looked_up, tier_hit = self.prompt_cache.lookup(
            prompt, with_tiers=params.prompt_logprobs is None, salt=params.cache_salt)
        need = blocks_needed(n, bs) - len(hit)
        free = self.pool.num_free - self._batch.resume_blocks()
        if need > free:
            self.pool.free(hit)
            raise NoFreeBlocksError(need, max(free, 0), self.pool.num_blocks)
        req = DecodeRequest(request_id, prompt, params, hit + self.pool.allocate(need),
                            time.monotonic() + lease_s, num_computed_tokens=len(hit) * bs,
                            num_cached_blocks=len(hit), block_hashes=hashes)
        self.prompt_cache.count(looked_up, len(hit))
        if params.prompt_logprobs is None and (  # those need the prefill worker's pass
                prefill_locally
                or n - (len(hit) + tier_hit) * bs <= self.local_prefill_max_tokens):
            req.state, req.remote_kv = RequestState.WAITING, False
            self.num_local_prefills += 1
            if tier_hit:                  # admitted once loaded (schedule)
                self.prompt_cache.load(req, len(hit), tier_hit)
            else:
                self._arrived.append(request_id)
        elif tier_hit:        # the prefill worker fills only the blocks after it
            self.prompt_cache.load(req, len(hit), tier_hit)
        self._requests[request_id] = req
        return req

    def on_kv_complete(self, request_id: str, ok: bool, first_token: int | None,
                       error: str | None = None) -> None:
        """Prefill's KV for the request has all arrived (ok) or failed."""
        with self._lock:
            req = self._requests.get(request_id)
            if req is None or req.state != RequestState.WAITING_FOR_REMOTE_KV:
                return
            if ok:
                req.num_computed_tokens = req.prompt_len
                req.output_ids.append(first_token)
                self._arrived.append(request_id)
                self.prompt_cache.cache(req)
                if req.abort_reason is None:
                    self._fork(req)
            else:
                req.abort_reason = error or "KV transfer failed"
                req.error = req.abort_reason

    def export(self, request_id: str, first: int, count: int) -> list[int] | None:
        """Positions first..first+count-1 of the request's block table, prompt blocks
        whose K/V D holds (cached or loaded from a tier at reserve), for a prefill worker
        to read (send_prompt_kv); each held once more until end_export(). None when the
        request is gone or aborted, or holds fewer."""
        with self._lock:
            req = self._requests.get(request_id)
            end = first + count
            if (req is None or req.abort_reason is not None or self.prompt_cache.loading(req)
                    or not 0 <= first < end <= req.num_cached_blocks
                    or end * self.block_size > req.num_computed_tokens):  # preempted
                return None
            blocks = req.block_table[first:first + count]
            self.pool.incref(blocks)
            return blocks

    def end_export(self, blocks: list[int]) -> None:
        """An export's blocks were sent (or failed): their refs go back at the next
        schedule()."""
        with self._lock:
            self._release_next += blocks

    def update_from_connector(self) -> list:
        """Poll the connector (step thread): apply transfers done or failed
        (on_kv_complete), and free the blocks of finished requests that no write can
        touch any more: the one place blocks of a KV transfer go back. Returns the
        transfers that ended (kv_transfer KVCompletion each)."""
        if self.connector is None:
            return []
        with self._lock:
            completions, freed = self.connector.get_finished()
            self.pool.free(freed)
        for c in completions:
            self.on_kv_complete(c.request_id, c.ok, c.first_token, c.error)
        return completions

    def extend_lease(self, request_id: str, lease_s: float) -> bool:
        """Hold a request still waiting for a prefill worker's KV until `lease_s`
        seconds from now at least (a lease is never shortened). Returns False when it is
        not waiting: unknown, its KV arrived, it is prefilled here, aborted, or already
        reclaimed."""
        with self._lock:
            req = self._requests.get(request_id)
            if (req is None or req.abort_reason is not None
                    or req.state != RequestState.WAITING_FOR_REMOTE_KV):
                return False
            req.lease_deadline = max(req.lease_deadline, time.monotonic() + lease_s)
            return True

    def abort(self, request_id: str, reason: str = "cancelled", error: str | None = None,
              group: bool = False) -> None:
        """Finish the request at the next schedule(): cancelled, or with `error` failed;
        with `group`, every sample forked from it too (fork.py)."""
        with self._lock:
            reqs = [r for r in self._requests.values() if r.group == request_id] if group else []
            for req in (self._requests.get(request_id), *reqs):
                if req is not None and not req.state.finished and req.abort_reason is None:
                    req.abort_reason, req.error = reason, error

    def abort_all(self, reason: str, error: str | None = None, router: int | None = None
                  ) -> int:
        """abort() every unfinished request (router replica `router`'s only, when given:
        pdserve/request_ids.py); returns how many."""
        with self._lock:
            reqs = [r for r in self._requests.values()
                    if not r.state.finished and r.abort_reason is None
                    and (router is None or router_of(r.request_id) == router)]
            for req in reqs:
                req.abort_reason, req.error = reason, error
        return len(reqs)

    # --- called from the step thread ----------------------------------------------

    def schedule(self, now: float | None = None,
                 step_budget: Callable[[list[tuple[int, float, int]]], int | None] | None = None
                 ) -> SchedulerOutput:
        """Admit arrived requests; apply aborts and expired leases; give each request of
        the batch the block its next position needs, preempting the newest running
        requests while the pool is short; then resume preempted requests that fit
        again (oldest first). Returns the next batch. `step_budget` (a TPOT SLO's,
        decode_worker/step_budget.py): given the step's decode rows as (tokens so far,
        DecodeRequest.itl_s, tokens max_tokens leaves after the step's), the most
        tokens the step may compute, rows and prefill chunks together, prefills getting
        at least block_size (so they progress); None from it or without it:
        prefill_chunk_size alone bounds the step."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if self._release_next:
                self.pool.free(self._release_next)
                self._release_next = []
            loaded = self.prompt_cache.loaded()
            self._arrived += [r.request_id for r in loaded if not r.remote_kv]
            if loaded and self._on_loaded is not None:
                self._on_loaded()
            for rid in self._arrived:           # first: an arrived request has no lease
                req = self._requests.get(rid)
                if (req is not None and req.abort_reason is None and req.state in
                        (RequestState.WAITING_FOR_REMOTE_KV, RequestState.WAITING)):
                    self._batch.admit(req, self._next_seq)   # the newest: order kept
                    self._next_seq += 1
                    if req.output_ids:          # P's first token may already finish it
                        self._check_stop(req)
            self._arrived.clear()
            for req in list(self._requests.values()):
                if self.prompt_cache.loading(req):
                    continue                    # a tier writes its blocks: not yet
                if req.abort_reason is not None:
                    state = RequestState.FINISHED_ERROR if req.error else RequestState.FINISHED_ABORTED
                    self._finish(req, state)
                elif req.state == RequestState.WAITING_FOR_REMOTE_KV and now > req.lease_deadline:
                    self.num_reclaimed += 1
                    req.error = "KV reservation lease expired before prefill's KV arrived"
                    self._finish(req, RequestState.FINISHED_ERROR)
            self._batch.grow()
            self._batch.resume()
            copies, self._batch.copies = tuple(self._batch.copies), []
            self._release_next += [src for src, _ in copies]
            batch = self._batch.batch()
            counts = self.step_tokens.counts(batch, now, step_budget)
            rows = [(r, n) for r, n in zip(batch, counts) if n]   # the others sit it out
            return SchedulerOutput(tuple(r for r, _ in rows), tuple(n for _, n in rows), copies)

    def update_from_output(self, output: SchedulerOutput, token_ids: list[int | None],
                           step_s: float = 0.0) -> list[TokenEvent]:
        """Advance each row's num_computed_tokens by what the step computed and append
        its sampled token (None for a row that did not reach num_tokens: a chunk), the
        step's `step_s` seconds counted in the ITL of each row that had a token already;
        returns the step's events (and any finishes recorded since the last call)."""
        with self._lock:
            events, self._events = self._events, []
            for req, n, tok in zip(output.requests, output.num_scheduled_tokens, token_ids,
                                   strict=True):
                if req.state != RequestState.RUNNING or req.abort_reason is not None:
                    continue  # aborted mid-step: schedule() finishes it
                was = req.num_computed_tokens
                req.num_computed_tokens += n
                self.computed_tokens += max(0, min(n, req.prompt_len - was))
                if was < req.prompt_len <= req.num_computed_tokens:
                    self.prompt_cache.cache(req)     # the step completed the prompt's K/V here
                    self._fork(req)
                if tok is None:                 # a chunk, short of num_tokens
                    assert req.num_computed_tokens < req.num_tokens, (req.request_id, n)
                    continue
                assert req.num_computed_tokens == req.num_tokens, (req.request_id, n)
                if req.output_ids:
                    req.itl_s += step_s
                req.output_ids.append(tok)
                stopped = self._check_stop(req, emit=False)
                events.append(TokenEvent(req.request_id, (tok,),
                                         req.state.finish_reason if stopped else None))
            return events

    def drain_events(self) -> list[TokenEvent]:
        with self._lock:
            events, self._events = self._events, []
        return events

    # --- helpers (lock held) ------------------------------------------------------

    def _fork(self, req: DecodeRequest) -> None:
        """With sampling n > 1, the prompt's K/V now complete: its other samples."""
        if req.params.num_samples > 1:
            for child in fork(req, self.pool, self.block_size):
                self._requests[child.request_id] = child
                self._arrived.append(child.request_id)

    def _check_stop(self, req: DecodeRequest, emit: bool = True) -> bool:
        state = stop_state(req.output_ids[-1], len(req.output_ids), req.num_tokens, req.params,
                           self.eos_token_ids, self.max_model_len)
        if state is None:
            return False
        self._finish(req, state, emit=emit)
        return True

    def _finish(self, req: DecodeRequest, state: RequestState, emit: bool = True) -> None:
        self._batch.remove(req)
        drop_cow_src(req, self.pool)
        req.state = state
        del self._requests[req.request_id]
        if self.connector is not None and req.remote_kv:
            self.connector.request_finished(req.request_id, req.block_table)
        else:
            self.pool.free(req.block_table)
        if emit:
            self._events.append(TokenEvent(req.request_id, (), state.finish_reason, req.error))

    # --- introspection --------------------------------------------------------------

    @property
    def num_preemptions(self) -> int:
        return self._batch.num_preemptions

    def counts(self) -> tuple[int, int]:
        """(running, waiting) request counts; waiting = for prefill's KV or preempted."""
        with self._lock:
            running = len(self._batch.running)
            return running, len(self._requests) - running

    def num_waiting_to_resume(self) -> int:
        """Preempted requests now waiting for blocks to resume."""
        with self._lock:
            return len(self._batch.preempted)

    def num_reservations_active(self) -> int:
        """Reservations waiting for prefill's KV."""
        with self._lock:
            return sum(r.state == RequestState.WAITING_FOR_REMOTE_KV
                       for r in self._requests.values())

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._arrived or self._events or self._batch.running
                        or self._batch.preempted or self._release_next
                        or any(r.abort_reason for r in self._requests.values()))
