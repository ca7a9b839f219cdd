"""The typed boundary of one engine step, as vLLM v1 draws it: a scheduler's
SchedulerOutput goes into ModelRunner.execute, whose ModelRunnerOutput goes back into
the scheduler's update_from_output. Both workers use them: a prefill worker's rows are
prompt chunks, a decode worker's are decode rows beside local prefill chunks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .logprobs import TokenLogprobs
from .sampling_params import SamplingParams


class StepRequest(Protocol):
    """What ModelRunner.execute reads of a scheduled request (the prefill worker's
    PrefillRequest, the decode worker's DecodeRequest). Its tokens are prompt + output;
    `num_computed_tokens` of them have their K/V in the blocks of `block_table`."""

    request_id: str
    params: SamplingParams
    block_table: list[int]
    num_computed_tokens: int
    grammar: Any            # params.structured_outputs compiled (xgrammar), or None
    matcher: Any            # its grammar matcher once the request first samples, or None

    @property
    def prompt_len(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...           # prompt + output tokens

    @property
    def num_output_tokens(self) -> int: ...    # tokens sampled so far (the step index)

    def token_id(self, i: int) -> int: ...     # token i of prompt + output

    def token_ids(self, end: int) -> list[int]: ...   # the first `end` of them


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """One step's work (vLLM's SchedulerOutput): per row of `requests`, compute the K/V
    of tokens [num_computed_tokens, num_computed_tokens + its `num_scheduled_tokens`
    entry) of prompt + output, and sample the next token when that reaches num_tokens.
    A row of one token runs the paged decode path; a longer one is a prefill (a prompt,
    a chunk of one, a preempted request's recompute) and may stop short of num_tokens
    (nothing sampled for it this step). Before the forward, each (src, dst) block of
    `blocks_to_copy` is copied, every layer's K and V (decode_worker/fork.py: a forked
    sample's own copy of a shared block)."""

    requests: tuple[Any, ...] = ()                      # StepRequest each
    num_scheduled_tokens: tuple[int, ...] = ()
    blocks_to_copy: tuple[tuple[int, int], ...] = ()   # (src, dst) before the forward

    def samples(self, i: int) -> bool:
        """Whether row ``i`` samples a token this step."""
        r = self.requests[i]
        return r.num_computed_tokens + self.num_scheduled_tokens[i] == r.num_tokens

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)


@dataclass(frozen=True, slots=True)
class ModelRunnerOutput:
    """What one ModelRunner.execute computed, per row of its SchedulerOutput.

    sampled_token_ids: the row's next token; None for a row short of num_tokens (a
        chunk) or one that failed.
    logprobs: the sampled token's TokenLogprobs when the row's params ask, else None.
    prompt_logprobs: with params.prompt_logprobs, the entries of the prompt tokens after
        each position the step computed (engine/logprobs.py), else None.
    errors: why the row's request must finish as an error (the tokens it generated
        break its grammar), else None; such a row has no token.
    """

    sampled_token_ids: tuple[int | None, ...]
    logprobs: tuple[TokenLogprobs | None, ...]
    prompt_logprobs: tuple[Sequence[TokenLogprobs] | None, ...]
    errors: tuple[str | None, ...]
