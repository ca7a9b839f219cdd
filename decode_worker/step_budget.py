"""A decode worker's step size under a TPOT SLO: how many tokens (decode rows and prompt
tokens of its own prefills together) one step may compute and still keep every running
stream's TPOT within the SLO, so a prompt the decode worker prefills (conditional
disaggregation, a lone prompt on lent cores, a recompute) never stretches its streams
past it. Sarathi-Serve's stall-free batching (Agrawal et al., OSDI 2024) sizes every
step to the SLO; TPOT is a mean (DistServe's SLO: (E2E - TTFT) / (tokens - 1)), so here
a stream that ran faster than the SLO has banked the difference, and a step may spend
it: a stream with k tokens whose k - 1 gaps took itl_s seconds allows the step that
gives its (k+1)-th token target x k - itl_s seconds, and the step takes the least of its
streams' allowances. A stream also lends what its next h tokens will leave: each of
their steps, a decode step of the batch (d seconds, the line's), leaves target - d, so
it allows h x (target - d) more, h being the tokens it still has to make after this
one (max_tokens) but at most BORROW_TOKENS (a stream may stop sooner, at a stop token).
A stream's mean TPOT then stays within the target at its last token whenever it makes
the tokens it lent from, and at every token with h = 0, while prefill chunks grow as
large as the slack lets them: on a loose TPOT SLO a prompt on the decode worker is
computed at nearly the speed of a step of its own.

Model: seconds = a + b x tokens, a least-squares line per thread count (a step on lent
threads is faster), each step weighing DECAY times the one after it, so the line
follows the batch's context growing and the machine's load; target = MARGIN x SLO.
Until LEARN_STEPS steps are in a line there is no budget (None): the scheduler runs
prefills at its smallest chunk beside decode rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..engine.schedule_policy import SchedulePolicy, step_tokens
from ..messages import StepStats

DECAY = 0.98          # a step's weight against the next one's (~50 steps remembered)
MARGIN = 0.9          # the share of the target a step is planned to take
LEARN_STEPS = 8       # steps a thread count's line needs before it sizes a step
MAX_BUDGET_WAITS = 16  # steps in a row a prefill may sit out for want of budget (then a
                       # block runs: its progress, at a bounded cost to the streams' TPOT)
BORROW_TOKENS = 32    # a stream's next tokens whose steps' slack a step may spend now


class StepBudget:
    """Step sizes within `slo_tpot_s` (seconds) from the steps observed so far."""

    def __init__(self, slo_tpot_s: float):
        if not slo_tpot_s > 0:
            raise ValueError(f"slo_tpot_s={slo_tpot_s}: must be > 0 seconds")
        self.target_s = MARGIN * slo_tpot_s
        self._lines: dict[int, tuple[int, StepStats]] = {}   # threads -> (steps, sums)

    def observe(self, threads: int, tokens: int, seconds: float) -> None:
        """A step of `tokens` tokens took `seconds` on `threads` threads."""
        n, s = self._lines.get(threads, (0, StepStats()))
        decayed = StepStats(*(v * DECAY for v in s.astuple()))
        self._lines[threads] = n + 1, decayed + StepStats.of(tokens, seconds)

    def tokens(self, threads: int, streams: list[tuple[int, float, int]] = ()) -> int | None:
        """Most tokens a step on `threads` threads may compute and keep the mean TPOT of
        every stream of `streams` (tokens so far, seconds their gaps took, tokens it may
        still make after this step's) within the target (the module docstring); a step
        with no stream, one target long. At least 1; None while fewer than LEARN_STEPS
        steps ran on that many threads."""
        n, s = self._lines.get(threads, (0, None))
        if n < LEARN_STEPS:
            return None
        a, b = s.line()
        spare = max(self.target_s - (a + b * len(streams)), 0.0)  # a decode step's slack
        allowed = min((self.target_s * k - itl + min(left, BORROW_TOKENS) * spare
                       for k, itl, left in streams), default=self.target_s)
        return max(int((allowed - a) / b), 1)


class StepTokens:
    """Tokens each row of a decode worker's batch computes in one step: a decode row its
    next token; a prefill (a local prefill, a resumed preemption) a chunk of at most
    `prefill_chunk_size` tokens (None: no bound), ending on a block boundary, in
    `schedule_policy`'s order (engine/schedule_policy.py step_tokens), under a TPOT
    budget (StepBudget.tokens) when the step has one. A budget that leaves the prefills
    less than a block beside the decode rows has them sit the step out while the
    streams bank time (steps faster than the SLO), at most MAX_BUDGET_WAITS steps in a
    row; then a block runs anyway, so a prefill always progresses.

    Raises:
        ValueError: an unknown schedule_policy."""

    def __init__(self, block_size: int, prefill_chunk_size: int | None,
                 schedule_policy: str | SchedulePolicy):
        self.block_size, self.prefill_chunk_size = block_size, prefill_chunk_size
        self.schedule_policy = SchedulePolicy.of(schedule_policy)
        self._budget_waits = 0      # steps in a row a TPOT budget left the prefills out

    def counts(self, batch: Sequence, now: float,
               step_budget: Callable[[list[tuple[int, float, int]]], int | None] | None = None
               ) -> list[int]:
        """Per row of `batch` (DecodeRequests, oldest first), the tokens it computes this
        step; 0: it sits the step out (keeps its blocks). `step_budget` as
        DecodeScheduler.schedule's."""
        chunk, least = self.prefill_chunk_size, self.block_size
        streams = [(len(r.output_ids), r.itl_s,
                    max(r.params.max_tokens - len(r.output_ids) - 1, 0)) for r in batch
                   if r.num_tokens - r.num_computed_tokens == 1]
        if step_budget is not None and streams and any(   # prefills beside streams
                r.num_tokens - r.num_computed_tokens > 1 for r in batch):
            cap = step_budget(streams)
            if cap is not None:
                if cap - len(streams) < self.block_size and self._budget_waits < MAX_BUDGET_WAITS:
                    self._budget_waits += 1
                    cap, least = len(streams), 0         # decode rows only this step
                else:
                    self._budget_waits = 0
                chunk = cap if chunk is None else min(chunk, cap)
        return step_tokens(batch, lambda r: r.num_tokens - r.num_computed_tokens,
                           lambda r: r.arrived, self.schedule_policy, now,
                           chunk, least, lambda r: r.num_computed_tokens, self.block_size)
