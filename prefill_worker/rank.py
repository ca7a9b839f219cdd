"""Ranks 1..N-1 of a tensor-parallel prefill worker: each sends the KV heads its own
cache holds (its slice of kv_transfer/tp_plan.py) to the decode worker, layer by layer
as its forward computes them, then a DONE for those heads; rank 0 (worker.py) sends its
own heads and the first token. The scheduler, block pool and prefix cache are rank 0's
alone, so rank 0 tells its ranks what to send through orders (engine/tp_executor.py
TPLeader.order) in step with the model calls::

    rank 0 (PrefillWorker step loop)          rank i (this handler, in follow())
    order kv_sends(sends)              ──▶    kv_sends: the step's (request, blocks)
    runner.prefill(seqs, on_layer_done) ──▶   prefill; on_layer_done(i) queues layer i
                                              of each send on its connector
    order kv_finish(requests)          ──▶    DONE (no token) or ABORT for each

Blocks rank 0 frees are reused by a later step: before a step's sends are taken, a rank
waits until every request it finished has left its send thread, so no forward writes
a block this rank is still sending (a wait on the tail of the transfer only: the
layers go out while the forward runs).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from .connector import PrefillKVConnector

logger = logging.getLogger(__name__)

DRAIN_TIMEOUT_S = 120.0   # a send thread stuck longer than this breaks the rank


@dataclass(eq=False)
class RankRequest:
    """What the connector reads of a request (PrefillRequest's fields), on rank i."""

    request_id: str
    epoch: int
    kv_address: tuple[str, int]          # decode rank 0's
    kv_rank_addresses: tuple = ()        # decode ranks 1..M-1
    num_cached_blocks: int = 0
    block_table: list[int] = field(default_factory=list)
    aborted: bool = False
    error: str | None = None
    kv_send_started: float | None = None


class PrefillRankKV:
    """A follower's KV sends (see the module docstring). ``targets(d_size)``: what this
    rank sends a decode worker of d_size ranks (tp_plan.rank_targets; none where its
    heads reach D from another replica)."""

    ORDERS = ("kv_sends", "kv_finish")
    GATHERS = ()

    def __init__(self, sender, num_layers: int, targets):
        self.num_layers = num_layers
        self._news = threading.Event()
        self.connector = PrefillKVConnector(sender, num_layers, self._news.set,
                                            targets=targets)
        self._requests: dict[str, RankRequest] = {}
        self._sends: list[tuple[RankRequest, int, int]] = []
        self._closing: set[str] = set()     # finished here, maybe still on the send thread

    def kv_sends(self, sends: list[tuple]) -> None:
        """The next step's sends: (request_id, epoch, decode ranks' KV addresses,
        num_cached_blocks, block_table, block_lo, block_hi) each."""
        self._drain()
        self._sends = []
        for rid, epoch, addresses, cached, table, lo, hi in sends:
            req = self._request(rid, epoch, addresses, cached)
            req.block_table = list(table)
            self._sends.append((req, lo, hi))

    def on_layer_done(self, layer: int) -> None:
        for req, lo, hi in self._sends:
            self.connector.save_layers(req, layer, layer + 1, lo, hi)
        if layer == self.num_layers - 1:
            self._sends = []        # a prefill without kv_sends (a bench) sends nothing

    def kv_finish(self, requests: list[tuple]) -> None:
        """(request_id, epoch, decode ranks' KV addresses, num_cached_blocks, ok) each:
        DONE for this rank's heads when ok, else ABORT."""
        self._sends = []
        for rid, epoch, addresses, cached, ok in requests:
            req = self._requests.pop(rid, None) or self._request(rid, epoch, addresses, cached)
            self._requests.pop(rid, None)
            self._closing.add(rid)
            self.connector.request_finished(req, None, ok=ok)

    def close(self) -> None:
        self.connector.close()

    def _request(self, rid: str, epoch: int, addresses, cached: int) -> RankRequest:
        req = self._requests.get(rid)
        if req is None:
            first, *rest = (tuple(a) for a in addresses)
            req = self._requests[rid] = RankRequest(rid, epoch, first, tuple(rest), cached)
        return req

    def _drain(self) -> None:
        """Wait until every request finished here has left the send thread."""
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while True:
            for req in self.connector.get_finished():
                self._closing.discard(req.request_id)
                if req.error is not None:
                    logger.warning("%s: %s", req.request_id, req.error)
            if not self._closing:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"KV sends of {sorted(self._closing)[:3]} still running "
                                   f"after {DRAIN_TIMEOUT_S} s")
            self._news.wait(0.05)
            self._news.clear()
