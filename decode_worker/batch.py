"""The decode worker's running requests and the preempted ones waiting to resume: block
growth, preemption and resumption (the scheduler's memory policy; scheduler.py holds
the lock and calls these between model steps).

Blocks are taken on demand (vLLM's policy): the prompt's blocks at reserve(), then one
block whenever a running request's next token position enters a new block. Priority is
the order of first admission into RUNNING (kept across preemption). When the pool cannot
give a running request its next block, the newest running request (perhaps the
requester itself) is **preempted**: its blocks go back to the pool, and it waits with
its prompt_token_ids and output_ids until enough blocks are free to hold them again.
It then rejoins the batch with num_computed_tokens = 0: the step computes the K/V of
prompt + output as a prefill and samples the next token from the last one's logits,
as if never preempted. The sampler's step index is len(output_ids), unchanged by
preemption, so greedy and seeded outputs are too.

Why this always makes progress: the oldest running request is preempted only when it is
alone and reservations still waiting for KV hold the rest; a request that could not fit
the whole pool even alone is refused at reserve(); and reserve() never takes the blocks
that preempted requests need to resume (`resume_blocks`), so resumed requests go before
newly arrived ones and a stream of new requests cannot starve them.
"""

from __future__ import annotations

import bisect
import logging
import operator

from ..engine.block_pool import BlockPool, blocks_needed
from ..engine.request import RequestState
from .fork import drop_cow_src, take_copy
from .requests import DecodeRequest

logger = logging.getLogger(__name__)

_by_admission = operator.attrgetter("admitted_seq")   # priority: first admission into RUNNING


class RunningBatch:
    """`running` and `preempted`, each sorted by admitted_seq, oldest first; the newest
    running one is preempted first. Not thread-safe: the scheduler's lock is held."""

    def __init__(self, pool: BlockPool, block_size: int, max_batch_size: int):
        self.pool, self.block_size, self.max_batch_size = pool, block_size, max_batch_size
        self.running: list[DecodeRequest] = []
        self.preempted: list[DecodeRequest] = []
        self.copies: list[tuple[int, int]] = []   # (src, dst) block copies of this schedule
        self.num_preemptions = 0                  # preemptions (a request: perhaps many)

    def admit(self, req: DecodeRequest, seq: int) -> None:
        """A request's first admission into RUNNING, as the newest (`seq`)."""
        req.state, req.admitted_seq = RequestState.RUNNING, seq
        self.running.append(req)

    def remove(self, req: DecodeRequest) -> None:
        """Take a finishing request out (its blocks are the caller's to free); a
        preempted one holds none."""
        if req.state == RequestState.RUNNING:
            self.running.remove(req)
        elif req.state == RequestState.PREEMPTED:
            self.preempted.remove(req)

    def batch(self) -> list[DecodeRequest]:
        return self.running[:self.max_batch_size]

    def grow(self) -> None:
        """Give each request of the next batch, oldest first, the blocks its next position
        needs; while the pool is short, preempt the newest running request (the
        requester itself when it is the newest; perhaps one beyond the batch). A forked
        sample's first new block is a copy of its cow_src (`copies`)."""
        for req in self.batch():
            if req.state != RequestState.RUNNING:
                break                           # preempted below: so is every newer one
            need = blocks_needed(req.num_tokens, self.block_size) - len(req.block_table)
            while need > self.pool.num_free:
                victim = self.running[-1]
                self.preempt(victim)
                if victim is req:
                    break
            if req.state == RequestState.RUNNING and need > 0:
                new = self.pool.allocate(need)
                if (pair := take_copy(req, new)) is not None:
                    self.copies.append(pair)
                req.block_table.extend(new)

    def preempt(self, req: DecodeRequest) -> None:
        """Free a running request's blocks and queue it to resume by recompute. Its KV
        transfer is DONE: no write can land in them, so they go straight to the pool."""
        self.running.remove(req)
        self.pool.free(req.block_table)
        drop_cow_src(req, self.pool)
        logger.debug("preempted request %s at %d tokens (%d blocks freed)",
                     req.request_id, req.num_tokens, len(req.block_table))
        req.block_table = []
        req.state, req.num_computed_tokens = RequestState.PREEMPTED, 0
        bisect.insort(self.preempted, req, key=_by_admission)
        self.num_preemptions += 1

    def resume(self) -> None:
        """Resume preempted requests, oldest first, while the head fits (blocks for every
        token so far, the next position included) and the batch has room; a head that
        does not fit blocks the rest, so smaller ones cannot starve it. A resumed request
        regains its place by admitted_seq, so it goes before newer arrivals."""
        while self.preempted and len(self.running) < self.max_batch_size:
            req = self.preempted[0]
            need = blocks_needed(req.num_tokens, self.block_size)
            if need > self.pool.num_free:
                return
            self.preempted.pop(0)
            req.block_table = self.pool.allocate(need)
            req.state = RequestState.RUNNING
            bisect.insort(self.running, req, key=_by_admission)

    def resume_blocks(self) -> int:
        """Blocks the preempted requests need to resume, all together."""
        return sum(blocks_needed(r.num_tokens, self.block_size) for r in self.preempted)
