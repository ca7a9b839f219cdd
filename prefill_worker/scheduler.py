"""Prefill-side scheduler: FIFO queue → varlen batches under a token budget.

Lifecycle of a request on a prefill worker:

    add()        WAITING in the FIFO queue
    schedule()   PREFILLING: blocks allocated for its prompt; joins a batch while the
                 batch's prompt tokens fit max_num_batched_tokens (one over-budget prompt
                 runs alone) and the pool has blocks
    (worker)     after each layer, the layer's K/V is queued for sending (SENDING_KV)
    release()    the done frame went out (or the request failed / was aborted):
                 blocks return to the pool

No model and no sockets here: the worker (worker.py) drives it.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ..engine.block_pool import BlockPool, blocks_needed
from ..engine.request import RequestState
from ..engine.sampling_params import SamplingParams


@dataclass(slots=True, eq=False)
class PrefillRequest:
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    kv_address: tuple[str, int]          # decode worker's KV receiver
    epoch: int                           # decode worker's epoch, echoed in every frame
    future: Any = None                   # asyncio.Future on the actor loop: first token
    block_table: list[int] = field(default_factory=list)
    state: RequestState = RequestState.WAITING
    aborted: bool = False
    error: str | None = None


class PrefillScheduler:
    def __init__(self, pool: BlockPool, block_size: int, max_num_batched_tokens: int):
        self.pool, self.block_size = pool, block_size
        self.max_num_batched_tokens = max_num_batched_tokens
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
        """Next batch (possibly empty), FIFO; blocks allocated for each member."""
        batch, tokens = [], 0
        with self._lock:
            while self._waiting:
                req = self._waiting[0]
                n = len(req.token_ids)
                if batch and tokens + n > self.max_num_batched_tokens:
                    break
                need = blocks_needed(n, self.block_size)
                if need > self.pool.num_free:
                    break  # FIFO: wait for blocks rather than let later prompts overtake
                req.block_table = self.pool.allocate(need)
                req.state = RequestState.PREFILLING
                self._waiting.popleft()
                batch.append(req)
                tokens += n
        return batch

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
