"""The KV receivers of a tensor-parallel worker: every rank has its own (its cache holds
its KV heads of every block, engine/parallel.py), and the sending ranks send each one its
heads (kv_transfer/tp_plan.py). A decode worker receives a prefill's KV this way, and a
prefill worker with kv_pull the blocks it reads from the worker holding them
(prefill_worker/kv_pull.py). Rank 0 owns the scheduler and the block pool, so a
transfer's KV is there only once every rank's share is, and its blocks are free only
once no rank can still write into them::

    rank 0 (TPReceiver)                        rank i (RankReceiver, in its TPRank actor)
    expect locally (the scheduler's lock), then
      await rank.<p>_expect(rid, blocks) ──▶   expect: its receiver takes rid's frames
      (before any sender is told of the transfer: D's reserve answering the router,
      P's pull asking the holder)
    step loop: TPReceiver.get_finished()
      own receiver's news, and (while a
      rank may have news: wants_poll)
      TPLeader.gather("<p>_poll")        ──▶   <p>_poll: its receiver's KVFinished
      a completion once every rank's is ok (or at the first failure), a release once
      every rank released
    forget locally,
      rank.<p>_forget(rid, seq)          ──▶   forget (the release comes back by the poll)

<p> is the receiver's prefix: ``kv`` for a decode rank's receiver, ``pull`` for a
prefill rank's pull receiver (beside its KV sends, whose own poll is ``kv_poll``).
Expects and forgets are actor calls (rank 0's RPC thread must not wait for a step to
reach its ranks); the news come back through the step loop's own collectives. A forget
may overtake its expect (a request aborted as it is reserved): each expect carries a
sequence number, and a rank ignores an expect older than a forget it has seen.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence

from .base import KVCompletion, KVFinished, KVReceiver, TransferState

logger = logging.getLogger(__name__)

_FORGOTTEN_KEPT = 4096     # forgets a rank remembers, to ignore an expect they overtook


class RankReceiver:
    """Rank i's receiver with prefix ``kv`` (see the module docstring); `receiver`
    started here."""

    ORDERS = ()
    GATHERS = ("kv_poll",)

    def __init__(self, receiver: KVReceiver):
        self.receiver = receiver
        self.address = receiver.start()
        self._forgotten: OrderedDict[str, int] = OrderedDict()   # rid -> seq of its forget

    def kv_expect(self, request_id: str, block_ids: list[int], seq: int) -> None:
        if self._forgotten.get(request_id, -1) >= seq:
            return                                  # its forget came first
        self.receiver.expect(request_id, block_ids)

    def kv_forget(self, request_id: str, seq: int, lease_timeout_s: float | None = None) -> None:
        self._forgotten[request_id] = seq
        self._forgotten.move_to_end(request_id)
        while len(self._forgotten) > _FORGOTTEN_KEPT:
            self._forgotten.popitem(last=False)
        self.receiver.forget(request_id, lease_timeout_s)

    def kv_poll(self) -> KVFinished:
        return self.receiver.get_finished()

    def close(self) -> None:
        self.receiver.close()


class RankPullReceiver(RankReceiver):
    """A prefill rank's pull receiver: RankReceiver with prefix ``pull``."""

    GATHERS = ("pull_poll",)

    def pull_poll(self) -> KVFinished:
        return self.kv_poll()


class TPReceiver:
    """Rank 0's view of every rank's receiver, with KVReceiver's interface (for the
    decode connector, decode_worker/connector.py, and the pulls of a prefill worker,
    prefill_worker/kv_pull.py); see the module docstring.

    receiver: rank 0's own (started). leader: the TPLeader runner (its gather). ranks:
    the TPRank handles of ranks 1..M-1. on_broken(error): a rank did not answer a
    poll (the group must restart; it does not return). prefix: the ranks' methods
    (``kv``: kv_expect, kv_forget, kv_poll; ``pull``: pull_expect, ...). role: the
    worker's, naming a failed rank ("decode rank 1: ...")."""

    def __init__(self, receiver: KVReceiver, leader, ranks: Sequence,
                 on_broken: Callable[[Exception], None], prefix: str = "kv",
                 role: str = "decode"):
        self.receiver, self.leader, self.ranks = receiver, leader, list(ranks)
        self.prefix, self.role = prefix, role
        self.size = len(self.ranks) + 1
        self._on_broken = on_broken
        self._seq = 0
        self._expects: dict[str, tuple[list[int], int]] = {}   # not yet sent to the ranks
        self._seqs: dict[str, int] = {}                         # rid -> its expect's seq
        self._done: dict[str, dict[int, KVCompletion]] = {}     # rid -> rank -> completion
        self._reported: set[str] = set()        # completion reported; later ones dropped
        self._released: dict[str, set[int]] = {}                # rid -> ranks released
        # what the ranks may still report: expected and not yet complete, forgotten and
        # not yet released (get_finished polls them only then: no collective when idle)
        self._waiting: set[str] = set()
        self._releasing: set[str] = set()

    def expect(self, request_id: str, dst_block_ids: Sequence[int]) -> None:
        """Rank 0's expect (the scheduler's lock held); the ranks' is expect_ranks.
        Idempotent, as the receiver's: a repeated reserve keeps what the ranks said."""
        self.receiver.expect(request_id, dst_block_ids)
        if request_id in self._seqs:
            return
        self._seq += 1
        self._seqs[request_id] = self._seq
        self._expects[request_id] = (list(dst_block_ids), self._seq)
        self._reported.discard(request_id)
        self._done.pop(request_id, None)
        self._waiting.add(request_id)

    @property
    def wants_poll(self) -> bool:
        """Whether some rank may have news (then the step loop polls soon, not at its
        idle period: a rank's news does not wake it)."""
        return bool(self._waiting or self._releasing)

    async def expect_ranks(self, request_id: str) -> bool:
        """Have ranks 1..M-1 expect the request (awaited before any sender hears of it:
        DecodeWorker.reserve, PrefillWorker's pull). Returns whether it is still
        expected (False: forgotten meanwhile, nothing to send). Raises RayActorError: a
        rank is gone."""
        pending = self._expects.pop(request_id, None)
        if pending is not None:
            await asyncio.gather(*(getattr(r, f"{self.prefix}_expect").remote(request_id, *pending)
                                   for r in self.ranks))
        return request_id in self._seqs

    def forget(self, request_id: str, lease_timeout_s: float | None = None) -> None:
        self._expects.pop(request_id, None)
        seq = self._seqs.pop(request_id, self._seq)
        self._waiting.discard(request_id)
        self._releasing.add(request_id)
        self.receiver.forget(request_id, lease_timeout_s)
        for r in self.ranks:      # its release comes back by the poll
            getattr(r, f"{self.prefix}_forget").remote(request_id, seq, lease_timeout_s)

    def get_finished(self) -> KVFinished:
        news = [self.receiver.get_finished()]
        if self.wants_poll:
            try:
                news += self.leader.gather(f"{self.prefix}_poll")
            except Exception as e:          # TPGroupBroken: a rank is gone
                self._on_broken(e)
                raise
        completions, released = [], []
        for rank, finished in enumerate(news):
            for c in finished.completions:
                if (out := self._complete(rank, c)) is not None:
                    completions.append(out)
            for rid in finished.released:
                ranks = self._released.setdefault(rid, set())
                ranks.add(rank)
                if len(ranks) == self.size:
                    del self._released[rid]
                    self._releasing.discard(rid)
                    self._reported.discard(rid)
                    self._done.pop(rid, None)       # aborted before every rank's arrived
                    released.append(rid)
        return KVFinished(completions, released)

    def _complete(self, rank: int, c: KVCompletion) -> KVCompletion | None:
        """The request's completion once all ranks' are in (or at a rank's failure)."""
        rid = c.request_id
        if rid in self._reported:
            return None
        if not c.ok:
            self._reported.add(rid)
            self._waiting.discard(rid)
            self._done.pop(rid, None)
            return KVCompletion(rid, False, None, f"{self.role} rank {rank}: {c.error}")
        done = self._done.setdefault(rid, {})
        done[rank] = c
        if len(done) < self.size:
            return None
        self._reported.add(rid)
        self._waiting.discard(rid)
        del self._done[rid]
        return done[0]          # the first token came to rank 0 (with prefill rank 0's DONE)

    def state(self, request_id: str) -> TransferState:
        return self.receiver.state(request_id)

    def close(self) -> None:
        self.receiver.close()

