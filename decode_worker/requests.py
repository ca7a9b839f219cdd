"""Decode-side request types: one request's state (DecodeRequest), what reserve()
returns (Reserved), one step's batch (DecodeBatch), and the refusal of a request the
pool could never hold. The state machine that moves them is scheduler.py."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..engine.block_pool import BlockHash
from ..engine.request import RequestState
from ..engine.sampling_params import SamplingParams


class RequestTooLargeError(ValueError):
    """prompt + max_tokens needs more KV blocks than the whole pool has: the request could
    never run on this worker, even alone (`needed`, `total` are block counts)."""

    def __init__(self, prompt_len: int, max_tokens: int, needed: int, total: int,
                 block_size: int):
        super().__init__(
            f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) needs {needed} KV "
            f"blocks of {block_size} tokens; this decode worker has {total} in all")
        self.needed, self.total = needed, total


@dataclass(slots=True, eq=False)
class DecodeRequest:
    """One request on the decode worker. Compared by identity (it is mutable state)."""

    request_id: str
    prompt_token_ids: list[int]          # kept to recompute the KV after preemption
    params: SamplingParams
    block_table: list[int]               # block ids; [] while PREEMPTED
    lease_deadline: float                # time.monotonic() seconds; WAITING_FOR_REMOTE_KV only
    state: RequestState = RequestState.WAITING_FOR_REMOTE_KV
    output_ids: list[int] = field(default_factory=list)
    abort_reason: str | None = None      # set by abort(); applied by schedule()
    error: str | None = None
    admitted_seq: int = -1               # order of first admission into RUNNING (resume order)
    recompute: bool = False              # KV to compute before its next token (see DecodeBatch)
    num_cached: int = 0                  # leading tokens whose KV is in block_table already
    block_hashes: list[BlockHash] = field(default_factory=list)  # prompt's full blocks
    arrived: float = field(default_factory=time.monotonic)   # reserved at; schedule policy

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt + generated tokens; the next decode step writes position num_tokens - 1."""
        return self.prompt_len + len(self.output_ids)

    @property
    def recompute_token_ids(self) -> list[int]:
        """Tokens whose KV a request resumed after preemption recomputes: all but the
        newest, which the next decode step feeds (its KV is written by that step, as for
        any running request)."""
        return self.prompt_token_ids + self.output_ids[:-1]


@dataclass(frozen=True, slots=True)
class Reserved:
    """Outcome of DecodeScheduler.reserve.

    block_ids: where the prefill worker's KV goes, in prompt order: the prompt's blocks
        after the first `num_cached_blocks` (which D already holds); [] for a local prefill.
    num_cached_blocks: leading full prompt blocks found in D's prefix cache (not sent).
    local_prefill: D computes the prompt itself; no prefill worker is involved.
    """

    block_ids: list[int]
    num_cached_blocks: int
    local_prefill: bool


@dataclass(frozen=True, slots=True)
class DecodeBatch:
    """One step; one sampled token per row of `requests`, in order. Rows in `prefill`
    have no output yet (local prefill, or preempted before their first token): prefill
    prompt_token_ids[num_cached:] into the block_table and sample from the last prompt
    token's logits. Every other row decodes: rows in `recompute` (resumed after
    preemption) first prefill recompute_token_ids into the new block_table; then each
    feeds output_ids[-1] at position num_tokens - 1. `prefill` and `recompute` are
    subsets of `requests`.

    Chunked prefill: a `prefill` row computes only prompt tokens [num_cached, its
    `prefill_ends` entry) this step (vLLM's chunked prefill, so one long prompt cannot
    stall the running rows for its whole length); a row whose end is short of its prompt
    samples nothing (the worker passes None for it to update_from_output)."""

    requests: tuple[DecodeRequest, ...]
    recompute: tuple[DecodeRequest, ...] = ()
    prefill: tuple[DecodeRequest, ...] = ()
    prefill_ends: tuple[int, ...] = ()   # per `prefill` row: prompt tokens computed after the step
