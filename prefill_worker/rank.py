"""Ranks 1..N-1 of a tensor-parallel prefill worker: each sends the KV heads its own
cache holds (its slice of kv_transfer/tp_plan.py) to the decode worker, layer by layer
as its forward computes them, then a DONE for those heads; rank 0 (worker.py) sends its
own heads and the first token. The scheduler, block pool and prefix cache are rank 0's
alone, so rank 0 tells its ranks what to send through orders (engine/tp_executor.py
TPLeader.order) in step with the model calls::

    rank 0 (PrefillRanks, worker.py's step loop)  rank i (PrefillRankKV, in follow())
    gather kv_sends(sends)             ──▶    kv_sends: the step's (request, blocks);
                                       ◀──    the requests that left its send thread
    runner.prefill(seqs, on_layer_done) ──▶   prefill; on_layer_done(i) queues layer i
                                              of each send on its connector
    order kv_finish(requests)          ──▶    DONE (no token) or ABORT for each
    gather kv_poll (idle, while some   ──▶    the requests that left its send thread
    request is still on a rank)        ◀──    since (done, or failed: rank 0 aborts
                                              them on the decode worker)

Rank 0 gives a request's blocks back to its pool only once every rank reported the
request off its send thread (PrefillRanks.sending; worker.py _finish_sent), so nothing
that takes blocks from the pool (a step, a tier load, a pull into every rank's cache)
writes a block a rank is still sending.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from ..kv_transfer import KVTransferError
from .connector import PrefillKVConnector
from .requests import Finish, FinishCause, fail

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class RankRequest:
    """What the connector reads of a request (PrefillRequest's fields), on rank i."""

    request_id: str
    epoch: int
    kv_address: tuple[str, int]          # decode rank 0's
    kv_rank_addresses: tuple = ()        # decode ranks 1..M-1
    num_cached_blocks: int = 0
    block_table: list[int] = field(default_factory=list)
    finish: Finish | None = None         # set once it fails or is aborted (requests.fail)
    kv_send_started: float | None = None
    kv_send_done: float | None = None    # the KV connector's, as PrefillRequest's
    kv_bytes_sent: int = 0


class PrefillRankKV:
    """A follower's KV sends (see the module docstring). ``targets(d_size)``: what this
    rank sends a decode worker of d_size ranks (tp_plan.rank_targets; none where its
    heads reach D from another replica). kv_sends and kv_poll answer rank 0 with the
    requests that left this rank since the last answer: (done request ids, failed as
    (request_id, epoch, decode rank 0's address, error))."""

    ORDERS = ("kv_finish",)
    GATHERS = ("kv_sends", "kv_poll", "kv_pair")

    def __init__(self, sender, num_layers: int, targets):
        self.num_layers = num_layers
        # no wake-up: rank 0 asks for news (kv_sends, kv_poll)
        self.connector = PrefillKVConnector(sender, num_layers, lambda: None,
                                            targets=targets)
        self._requests: dict[str, RankRequest] = {}
        self._sends: list[tuple[RankRequest, int, int]] = []
        self._closing: dict[str, bool] = {}   # finished here (ok?), maybe still sending
        self._done: list[str] = []
        self._failed: list[tuple[str, int, tuple, str]] = []

    def kv_sends(self, sends: list[tuple]) -> tuple[list, list]:
        """The next step's sends: (request_id, epoch, decode ranks' KV addresses,
        num_cached_blocks, block_table, block_lo, block_hi) each; answers what left the
        send thread since the last answer."""
        self._collect()
        self._sends = []
        for rid, epoch, addresses, cached, table, lo, hi in sends:
            req = self._request(rid, epoch, addresses, cached)
            req.block_table = list(table)
            self._sends.append((req, lo, hi))
        return self._answer()

    def kv_poll(self) -> tuple[list, list]:
        """What left the send thread since the last answer (rank 0 idle)."""
        self._collect()
        return self._answer()

    def kv_pair(self, addresses: list[tuple[str, int]]) -> list[str]:
        """Connect (handshake) to every decode rank; the errors, as messages."""
        errors = []
        for address in addresses:
            try:
                self.connector.sender.connect(tuple(address))
            except Exception as e:       # KVLayoutMismatch, KVAuthError, KVTransferError
                errors.append(f"{type(e).__name__}: {e}")
        return errors

    def on_layer_done(self, layer: int) -> None:
        for req, lo, hi in self._sends:
            self.connector.save_layers(req, layer, layer + 1, lo, hi)
        if layer == self.num_layers - 1:
            self._sends = []        # a prefill without kv_sends sends nothing

    def kv_finish(self, requests: list[tuple]) -> None:
        """(request_id, epoch, decode ranks' KV addresses, num_cached_blocks, ok) each:
        DONE for this rank's heads when ok, else ABORT."""
        self._sends = []
        for rid, epoch, addresses, cached, ok in requests:
            req = self._request(rid, epoch, addresses, cached)
            del self._requests[rid]
            if not ok:                      # its layers still queued are not sent
                fail(req, FinishCause.ABORTED, f"request {rid} aborted")
            self._closing[rid] = ok
            self.connector.request_finished(req, None, ok=ok)

    def close(self) -> None:
        self.connector.close()

    def _request(self, rid: str, epoch: int, addresses, cached: int) -> RankRequest:
        req = self._requests.get(rid)
        if req is None:
            first, *rest = (tuple(a) for a in addresses)
            req = self._requests[rid] = RankRequest(rid, epoch, first, tuple(rest), cached)
        return req

    def _collect(self) -> None:
        for req in self.connector.get_finished():
            ok = self._closing.pop(req.request_id, False)
            if ok and req.finish is not None:    # a transfer failure, not an abort
                logger.warning("%s: %s", req.request_id, req.finish.message)
                self._failed.append((req.request_id, req.epoch, req.kv_address,
                                     req.finish.message))
            else:
                self._done.append(req.request_id)

    def _answer(self) -> tuple[list, list]:
        out, self._done, self._failed = (self._done, self._failed), [], []
        return out


class PrefillRanks:
    """Rank 0's side of its ranks' KV sends: the orders (see the module docstring) and
    what comes back. A request a rank could not send (its decode rank unreachable, say)
    is aborted on the decode worker from here, so D fails it at once and the router
    retries, rather than D waiting for those heads until the lease ends.

    leader: the TPLeader runner. sender: rank 0's KVSender (its ABORT frames).
    on_broken(error): a rank did not answer (the worker exits; does not return)."""

    def __init__(self, leader, sender, size: int, on_broken: Callable[[Exception], None]):
        self.leader, self.sender, self.size = leader, sender, size
        self._on_broken = on_broken
        self._open: dict[str, int] = {}      # kv_finish sent: ranks yet to report it

    def sends(self, ranges: list[tuple]) -> None:
        """Before a step: its (request, block_lo, block_hi) sends, to every rank."""
        self._answers(self._gather("kv_sends", sends=[
            (r.request_id, r.epoch, (r.kv_address, *r.kv_rank_addresses),
             r.num_cached_blocks, list(r.block_table), lo, hi) for r, lo, hi in ranges]))

    def finish(self, items: list[tuple]) -> None:
        """After a step: (request, ok) of the requests it ended (DONE, or ABORT)."""
        if not items:
            return
        try:
            self.leader.order("kv_finish", requests=[
                (r.request_id, r.epoch, (r.kv_address, *r.kv_rank_addresses),
                 r.num_cached_blocks, ok) for r, ok in items])
        except Exception as e:          # TPGroupBroken
            self._on_broken(e)
        for r, _ in items:
            self._open[r.request_id] = self.size - 1

    def pair(self, addresses: list[tuple[str, int]]) -> list[str]:
        """Every rank connects to every decode rank at `addresses`, as rank 0 does at
        start (PrefillWorker.pair): their errors, each naming its rank."""
        return [f"prefill rank {rank}: {error}"
                for rank, errors in enumerate(self._gather("kv_pair", addresses=addresses),
                                              start=1) for error in errors]

    def poll(self) -> None:
        """Idle: what the ranks finished sending since (only while some are open)."""
        if self._open:
            self._answers(self._gather("kv_poll"))

    def sending(self, request_id: str) -> bool:
        """Whether a rank may still read the request's blocks (finish() ordered it, not
        every rank reported it off its send thread yet)."""
        return request_id in self._open

    @property
    def wants_poll(self) -> bool:
        """A rank still sends: the idle step loop polls soon (ranks cannot wake it)."""
        return bool(self._open)

    def _gather(self, name: str, **kwargs) -> list:
        try:
            return self.leader.gather(name, **kwargs)
        except Exception as e:          # TPGroupBroken
            self._on_broken(e)
            raise

    def _answers(self, answers: list) -> None:
        aborted = set()
        for rank, (done, failed) in enumerate(answers, start=1):
            for rid in done:
                self._close(rid)
            for rid, epoch, address, error in failed:
                self._close(rid)
                if rid in aborted:
                    continue
                aborted.add(rid)
                try:
                    self.sender.send_abort(address, rid, epoch, f"prefill rank {rank}: {error}")
                except KVTransferError as e:
                    logger.warning("abort of %s on the decode worker not sent: %s", rid, e)

    def _close(self, rid: str) -> None:
        left = self._open.get(rid, 1) - 1
        if left > 0:
            self._open[rid] = left
        else:
            self._open.pop(rid, None)
