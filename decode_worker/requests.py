"""Decode-side request types: one request's state (DecodeRequest), what reserve()
returns (Reserved), and the refusal of a request the pool could never hold. The state
machine that moves them is scheduler.py; one step's work is engine/outputs.py's
SchedulerOutput."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

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


class ReservationConflictError(ValueError):
    """reserve() of a request id that is live with another prompt or other sampling
    parameters: a second request under one id (reserve is idempotent per id, for a
    retried prefill), which must not share the first's reservation and KV."""

    def __init__(self, request_id: str):
        super().__init__(f"request {request_id!r} is reserved already, for another prompt "
                         "or other sampling parameters")


@dataclass(slots=True, eq=False)
class DecodeRequest:
    """One request on the decode worker (engine/outputs.py StepRequest). Compared by
    identity (it is mutable state).

    Progress is one counter, as in vLLM: ``num_computed_tokens``, the leading tokens of
    prompt + output (``token_ids``) whose K/V is in ``block_table``. Every step
    computes tokens from there towards ``num_tokens`` and samples a token once it gets
    there, whatever brought the request here::

        remote KV arrived     num_computed_tokens = prompt_len, output = [P's token]
        local prefill         num_computed_tokens = prefix-cache hit, output = []
        resumed (preempted)   num_computed_tokens = 0, output kept
        running               num_computed_tokens = num_tokens - 1 (one token a step)
    """

    request_id: str
    prompt_token_ids: list[int]          # kept to recompute the KV after preemption
    params: SamplingParams
    block_table: list[int]               # block ids; [] while PREEMPTED
    lease_deadline: float                # time.monotonic() seconds; WAITING_FOR_REMOTE_KV only
    state: RequestState = RequestState.WAITING_FOR_REMOTE_KV
    output_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0         # leading tokens whose K/V is in block_table
    num_cached_blocks: int = 0           # leading prompt blocks D's prefix cache had (reserve)
    remote_kv: bool = True               # a KV receiver fills its prompt blocks (not local)
    abort_reason: str | None = None      # set by abort(); applied by schedule()
    error: str | None = None
    admitted_seq: int = -1               # order of first admission into RUNNING (resume order)
    block_hashes: list[BlockHash] = field(default_factory=list)  # prompt's full blocks
    arrived: float = field(default_factory=time.monotonic)   # reserved at; schedule policy
    grammar: Any = None                  # params.structured_outputs compiled (xgrammar)
    matcher: Any = None                  # of its grammar: the tokens so far (sampling)
    group: str | None = None             # sample i > 0 of n: the request it was forked from
    cow_src: int | None = None           # a block to copy before its first write (fork.py)
    itl_s: float = 0.0                   # seconds of the steps that gave its tokens after
                                         # the first (a TPOT SLO's accounting, step_budget.py)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far (the sampler's step index: unchanged by preemption,
        so seeded draws repeat)."""
        return len(self.output_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt + generated tokens; the step that computes the last one samples."""
        return self.prompt_len + len(self.output_ids)

    def token_id(self, i: int) -> int:
        """Token ``i`` of prompt + output."""
        n = self.prompt_len
        return self.prompt_token_ids[i] if i < n else self.output_ids[i - n]

    def token_ids(self, end: int) -> list[int]:
        """The first ``end`` tokens of prompt + output."""
        return (self.prompt_token_ids + self.output_ids)[:end]


@dataclass(frozen=True, slots=True)
class Reserved:
    """Outcome of DecodeScheduler.reserve.

    block_ids: where the prefill worker's KV goes, in prompt order: the prompt's blocks
        after the first `num_cached_blocks` (which D already holds); [] for a local prefill.
    num_cached_blocks: leading full prompt blocks found in D's prefix cache, or loaded
        from its KV tier (not sent).
    local_prefill: D computes the prompt itself; no prefill worker is involved.
    loading: a tier is loading the blocks after the cache's hit (nothing is expected
        yet); ask again (DecodeScheduler.reserved) once it is done.
    """

    block_ids: list[int]
    num_cached_blocks: int
    local_prefill: bool
    loading: bool = False
