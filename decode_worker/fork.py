"""n > 1 on the decode worker: one prompt, prefilled and its KV moved once, forked into
its samples (vLLM's parallel sampling, with the copy-on-write fork of vLLM v0's block
manager).

    parent               the reservation (sampling.n or best_of samples): the prefill
        │                worker's first token, or D's local prefill's, is sample 0's
        ▼
    fork()               once the prompt's K/V is complete (KV arrived, or D's prefill
        │                step computed its last token): samples 1..n-1 as requests
        │                "<parent id>/<i>" that hold, by reference (BlockPool counts),
        │                the prompt's blocks before the one of its last token, and that
        │                block as `cow_src`
        ▼
    schedule()           a sample's first step gives it a block of its own and copies
        │                cow_src into it (SchedulerOutput.blocks_to_copy, done before the
        │                step's forward); cow_src is let go after that step
        ▼
    the step             the sample computes the last prompt token again, as one decode
                         row at position prompt_len - 1 (the prefill's logits of that
                         position reached D for sample 0 only), and samples its first
                         token from it with its own params (seed + i)

Why a copy: every sample writes its own K/V from position prompt_len - 1 on, into the
block of the last prompt token when that block is partial (and rewrites that position
when it is full), so it cannot write into the block the others read. The blocks before
it are never written again and stay shared until each holder frees them. A sample that
is preempted before its first step lets cow_src go and recomputes its prompt like any
preempted request.
"""

from __future__ import annotations

import math

from ..engine.block_pool import BlockPool
from ..engine.request import RequestState
from .requests import DecodeRequest


def sample_id(group: str, index: int) -> str:
    """The request id of sample `index` of request `group` on D (sample 0 keeps it)."""
    return group if index == 0 else f"{group}/{index}"


def fork(parent: DecodeRequest, pool: BlockPool, block_size: int) -> list[DecodeRequest]:
    """Samples 1..num_samples-1 of `parent`, whose prompt K/V is complete in its
    block_table; each holds a reference to the blocks it shares. `parent` becomes
    sample 0 (its params those of one sample, so it never forks again). The children
    wait (RequestState.WAITING) for schedule() to admit them."""
    params = parent.params
    last = (parent.prompt_len - 1) // block_size      # the block of the last prompt token
    shared, src = parent.block_table[:last], parent.block_table[last]
    children = []
    for i in range(1, params.num_samples):
        pool.incref([*shared, src])
        children.append(DecodeRequest(
            sample_id(parent.request_id, i), parent.prompt_token_ids, params.sample(i),
            list(shared), math.inf, state=RequestState.WAITING,
            num_computed_tokens=parent.prompt_len - 1, remote_kv=False,
            group=parent.request_id, cow_src=src, arrived=parent.arrived,
            grammar=parent.grammar))
    parent.params = params.sample(0)
    return children


def take_copy(req: DecodeRequest, new_blocks: list[int]) -> tuple[int, int] | None:
    """The (source, destination) block copy `req` needs as it gets `new_blocks`, the
    first of which takes the place of its cow_src; None when it has no cow_src. The
    caller frees the source once the copy ran (after the step)."""
    if req.cow_src is None:
        return None
    pair = (req.cow_src, new_blocks[0])
    req.cow_src = None
    return pair


def drop_cow_src(req: DecodeRequest, pool: BlockPool) -> None:
    """Let go of the block a sample had not copied yet (preempted or finished first)."""
    if req.cow_src is not None:
        pool.free([req.cow_src])
        req.cow_src = None
