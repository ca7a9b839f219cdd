"""One expected request on a receiver (``Reservation``): its blocks, which of its (KV
head, layer, block) triples have arrived, and which heads' senders said DONE.

A KV frame fills a box of the reservation: KV heads [head_start, head_start +
num_heads) x layers [layer_start, layer_end) x block-table positions [block_start,
block_start + num_blocks) (frames.py). Arrival is one byte per (head, layer, position),
head-major, so each (head, layer) of a frame is one contiguous run; a frame whose box
overlaps one that arrived fails the request::

                        position 0  1  2  3  4
    arrived  head 0 layer 0     [1  1  1  0  0]     frame (head 0, layers [0, 2),
                    layer 1     [1  1  1  0  0]     blocks [0, 3)) is in
             head 1 layer 0     [0  0  0  0  0]     head 1 comes from another
             ...                                    prefill rank (tp_plan.py)

A DONE names the heads its sender sent (all of them when P and D are one rank each):
it fails the request unless every (layer, position) of those heads arrived, and the
request is complete once DONEs covered every head this receiver holds; the first token
comes with the DONE of the prefill rank that sampled it (rank 0).
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field

import torch

from . import host_io
from .base import TransferState
from .frames import FrameHeader


@dataclass(eq=False)
class Reservation:
    """One expected request. Mutable; guarded by ``lock`` (internal, never crosses a
    module boundary except as an opaque handle to the transport)."""

    request_id: str
    block_ids: list[int]  # [num_blocks] D's blocks, in block-table order (expect())
    dst_idx: torch.Tensor  # [num_blocks] int64, on kv.device: block_ids as a tensor
    heads: range  # the model's KV heads this receiver holds (KVLayout.heads)
    num_layers: int
    # [num_heads * num_layers * num_blocks] 1 once (head, layer, position) arrived
    arrived: bytearray = field(init=False)
    done_heads: bytearray = field(init=False)  # [num_heads] 1 once a DONE covered it
    first_token: int | None = None  # from the DONE of the rank that sampled it
    state: TransferState = TransferState.WAITING
    conn_ids: set[int] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Two-phase forget: set by forget(); whoever releases `lock` next with no write in
    # flight reports the request released (guarded by `meta`), so the blocks go back to
    # D's pool only once nothing writes into them, and forget() itself never blocks.
    forgotten: bool = False
    meta: threading.Lock = field(default_factory=threading.Lock)
    # Writers that may put bytes into the blocks unseen (begin_writer: a one-sided
    # write's lease); the release waits for them too. Guarded by `lock`.
    writes_in_flight: int = 0
    # the connections whose BEGIN leased the blocks (nixl.py; a tensor-parallel prefill
    # worker's ranks each write their heads), and the notifications of one-sided writes
    # seen from each (nixl_receiver.py's poll thread)
    writer_conns: set[int] = field(default_factory=set)
    writes_by_conn: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.arrived = bytearray(len(self.heads) * self.num_layers * self.num_blocks)
        self.done_heads = bytearray(len(self.heads))

    @functools.cached_property
    def runs(self) -> list[tuple[int, int]]:
        """dst blocks as runs of consecutive ids (host_io.block_runs)."""
        return host_io.block_runs(self.block_ids)

    def runs_in(self, first: int, n: int) -> list[tuple[int, int]]:
        """Runs of the blocks at table positions ``first .. first + n - 1``: equal to
        ``host_io.block_runs(block_ids[first:first + n])``, cut from the cached runs."""
        if first == 0 and n == self.num_blocks:
            return self.runs
        out, pos, end = [], 0, first + n
        for start, count in self.runs:
            lo, hi = max(pos, first), min(pos + count, end)
            if lo < hi:
                out.append((start + lo - pos, hi - lo))
            pos += count
            if pos >= end:
                break
        return out

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    def _rows(self, heads: range, layer_start: int, layer_end: int) -> list[int]:
        """Where each (head, layer) row of ``arrived`` starts, for the model's ``heads``."""
        nb, nl, first = self.num_blocks, self.num_layers, self.heads.start
        return [((h - first) * nl + layer) * nb for h in heads
                for layer in range(layer_start, layer_end)]

    def claim(self, h: FrameHeader, heads: range) -> str | None:
        """Mark the frame's (head, layer, position) box arrived; if part of it arrived
        before, mark nothing and say which triple. Caller holds ``lock``; admit_kv and
        frame validation checked that the box lies inside the reservation."""
        a, b = h.block_start, h.block_start + h.num_blocks
        rows = self._rows(heads, h.layer_start, h.layer_end)
        for row in rows:
            i = self.arrived.find(1, row + a, row + b)
            if i >= 0:
                where, head = self._name(i)
                return f"{where} received twice (KV head {head})"
        ones = b"\x01" * h.num_blocks
        for row in rows:
            self.arrived[row + a : row + b] = ones
        return None

    def missing(self, heads: range | None = None) -> str | None:
        """None once every (layer, position) of ``heads`` (default: all this receiver
        holds) arrived, else how many did and the first that did not. Caller holds
        ``lock``."""
        heads = self.heads if heads is None else heads
        span = self.num_layers * self.num_blocks
        lo = (heads.start - self.heads.start) * span
        hi = lo + len(heads) * span
        first = self.arrived.find(0, lo, hi)
        if first < 0:
            return None
        total = hi - lo
        where, head = self._name(first)
        return (f"{total - self.arrived.count(0, lo, hi)} of {total} (KV head, layer, block) "
                f"triples received; first missing: {where} (KV head {head})")

    def done(self, heads: range, first_token: int | None) -> tuple[bool, str | None]:
        """A DONE for ``heads``: (every head of this receiver is done, error); the error
        names a head whose DONE came twice (marks nothing then). Caller holds ``lock``."""
        lo = heads.start - self.heads.start
        again = self.done_heads.find(1, lo, lo + len(heads))
        if again >= 0:
            return False, f"DONE twice for KV head {self.heads.start + again}"
        self.done_heads[lo:lo + len(heads)] = b"\x01" * len(heads)
        if first_token is not None:
            self.first_token = first_token
        return self.done_heads.find(0) < 0, None

    def _name(self, i: int) -> tuple[str, int]:
        """The (layer, block) and the KV head at index ``i`` of ``arrived``."""
        nb, nl = self.num_blocks, self.num_layers
        head, rest = divmod(i, nl * nb)
        return f"layer {rest // nb} block {rest % nb}", self.heads.start + head
