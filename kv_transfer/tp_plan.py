"""Which prefill rank sends which KV heads to which decode rank, when the prefill and
decode workers are tensor-parallel over different numbers of ranks (engine/parallel.py:
a rank's KV cache holds its KV heads only, `kv_head_range`).

Every decode rank must receive each KV head it holds exactly once, from a prefill rank
that holds it. With the cache layout `[num_blocks, num_kv_heads, block_size, head_dim]`
per layer, a run of consecutive heads of one block is one contiguous region on both
sides, so each (prefill rank, decode rank) pair moves, per block and layer, one region:

    P TP 2, D TP 1, 4 KV heads    P0 -> D0 heads 0-1, P1 -> D0 heads 2-3
    P TP 1, D TP 2                P0 -> D0 heads 0-1 (P's 0-1), P0 -> D1 heads 2-3
    P TP 4, D TP 2, 2 KV heads    P holds head 0 on ranks 0, 1 and head 1 on ranks 2, 3
                                  (replicated): D0 (head 0) from P0, D1 (head 1) from P3
    P TP 1, D TP 4, 2 KV heads    D0, D1 (head 0) and D2, D3 (head 1) all from P0

Where a head is replicated on several prefill ranks, the decode ranks that need it are
spread over those replicas (decode rank j takes replica j mod count), so no prefill
rank sends more than its share. vLLM's NIXL connector refuses prefill TP > decode TP
for GQA models; this plan covers every pair of sizes the model's KV heads allow.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..engine.parallel import kv_head_range

if TYPE_CHECKING:
    from .base import KVLayout


@dataclass(frozen=True)
class HeadSlice:
    """Prefill rank `p_rank` sends KV heads `heads` (the model's numbering) to decode rank
    `d_rank`; they start at local head `p_offset` in the prefill rank's cache and
    `d_offset` in the decode rank's."""

    p_rank: int
    d_rank: int
    heads: range
    p_offset: int
    d_offset: int


def partition_mismatch(num_kv_heads: int, p_size: int, d_size: int,
                       d_num_kv_heads: int | None = None) -> str | None:
    """None if a prefill worker of `p_size` ranks and a decode worker of `d_size` ranks
    can pair over a model with `num_kv_heads` KV heads (`d_num_kv_heads`: the decode
    side's, when it reports its own), else a message naming the mismatch."""
    if d_num_kv_heads is not None and d_num_kv_heads != num_kv_heads:
        return (f"num_kv_heads: prefill has {num_kv_heads}, decode has {d_num_kv_heads} "
                "(not the same model)")
    for role, size in (("prefill", p_size), ("decode", d_size)):
        if size < 1 or ((num_kv_heads % size) if num_kv_heads >= size else (size % num_kv_heads)):
            return (f"{role} tensor-parallel size {size} cannot hold {num_kv_heads} KV heads: "
                    "one must divide the other")
    return None


def transfer_plan(num_kv_heads: int, p_size: int, d_size: int) -> list[HeadSlice]:
    """The slices that move every decode rank's KV heads, ordered by (decode rank,
    head); consecutive heads from one prefill rank are one slice.

    Raises:
        ValueError: the partitions cannot pair (partition_mismatch's message).
    """
    bad = partition_mismatch(num_kv_heads, p_size, d_size)
    if bad is not None:
        raise ValueError(bad)
    holders: dict[int, list[int]] = {}
    for p in range(p_size):
        for h in kv_head_range(num_kv_heads, p_size, p):
            holders.setdefault(h, []).append(p)
    plan: list[HeadSlice] = []
    for d in range(d_size):
        mine = kv_head_range(num_kv_heads, d_size, d)
        for h in mine:
            replicas = holders[h]
            p = replicas[d % len(replicas)]
            last = plan[-1] if plan else None
            if last is not None and (last.p_rank, last.d_rank) == (p, d) and last.heads.stop == h:
                plan[-1] = HeadSlice(p, d, range(last.heads.start, h + 1), last.p_offset,
                                     last.d_offset)
                continue
            p_first = kv_head_range(num_kv_heads, p_size, p).start
            plan.append(HeadSlice(p, d, range(h, h + 1), h - p_first, h - mine.start))
    return plan


def rank_layout(kv, model_id: str, num_kv_heads: int, tp) -> KVLayout:
    """The KVLayout of a tensor-parallel rank's cache `kv` (engine/parallel.py
    TensorParallel `tp`; its share of the model's `num_kv_heads`)."""
    from .base import KVLayout

    heads = kv_head_range(num_kv_heads, tp.size, tp.rank)
    return KVLayout.for_cache(kv, model_id, kv_head_start=heads.start,
                              model_kv_heads=num_kv_heads if tp.size > 1 else 0,
                              tp_size=tp.size)


@functools.lru_cache(maxsize=64)
def rank_targets(num_kv_heads: int, p_size: int, p_rank: int, d_size: int
                 ) -> tuple[tuple[int, range | None], ...]:
    """What prefill rank `p_rank` of `p_size` sends a decode worker of `d_size` ranks:
    (decode rank, KV heads) pairs, heads None meaning every head (both workers one
    rank each); () when every head it holds reaches D from another replica.

    Raises:
        ValueError: the partitions cannot pair (partition_mismatch's message).
    """
    if p_size == d_size == 1:
        return ((0, None),)
    return tuple((s.d_rank, s.heads) for s in transfer_plan(num_kv_heads, p_size, d_size)
                 if s.p_rank == p_rank)
