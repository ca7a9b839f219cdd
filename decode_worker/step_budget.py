"""A decode worker's step size under a TPOT SLO: how many tokens (decode rows and prompt
tokens of its own prefills together) one step may compute and still keep every running
stream's TPOT within the SLO, so a prompt the decode worker prefills (conditional
disaggregation, a lone prompt on lent cores, a recompute) never stretches its streams
past it. Sarathi-Serve's stall-free batching (Agrawal et al., OSDI 2024) sizes every
step to the SLO; TPOT is a mean (DistServe's SLO: (E2E - TTFT) / (tokens - 1)), so here
a stream that ran faster than the SLO has banked the difference, and a step may spend
it: a stream with k tokens whose k - 1 gaps took itl_s seconds allows the step that
gives its (k+1)-th token target x k - itl_s seconds, and the step takes the least of its
streams' allowances. Every stream's mean TPOT then stays within the target at every
token, at its last included, while prefill chunks grow as large as the slack lets them.

Model: seconds = a + b x tokens, a least-squares line per thread count (a step on lent
threads is faster), each step weighing DECAY times the one after it, so the line
follows the batch's context growing and the machine's load; target = MARGIN x SLO.
Until LEARN_STEPS steps are in a line there is no budget (None): the scheduler runs
prefills at its smallest chunk beside decode rows.
"""

from __future__ import annotations

from ..messages import StepStats

DECAY = 0.98          # a step's weight against the next one's (~50 steps remembered)
MARGIN = 0.9          # the share of the target a step is planned to take
LEARN_STEPS = 8       # steps a thread count's line needs before it sizes a step
MAX_BUDGET_WAITS = 16  # steps in a row a prefill may sit out for want of budget (then a
                       # block runs: its progress, at a bounded cost to the streams' TPOT)


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

    def tokens(self, threads: int, streams: list[tuple[int, float]] = ()) -> int | None:
        """Most tokens a step on `threads` threads may compute and keep the mean TPOT of
        every stream of `streams` (tokens so far, seconds their gaps took) within the
        target; a step with no stream, one target long. At least 1; None while fewer than
        LEARN_STEPS steps ran on that many threads."""
        n, s = self._lines.get(threads, (0, None))
        if n < LEARN_STEPS:
            return None
        allowed = min((self.target_s * k - itl for k, itl in streams), default=self.target_s)
        a, b = s.line()
        return max(int((allowed - a) / b), 1)
