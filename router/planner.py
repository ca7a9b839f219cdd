"""The SLO planner (`serve --planner slo`): every adjustment_interval_s the
router sizes its prefill and decode pools to a TTFT and an ITL target, through the same
Scaler.scale as Admin.Scale (router/scaling.py: new workers pair before they serve,
retired ones drain or move their requests on, so nothing is lost).

    observe   the interval's arrivals (admitted requests, their prompt tokens and
              max_tokens, admission.py), the requests still waiting for their first
              token at its end, finished requests' output tokens and
              max_tokens, tokens streamed, mean TTFT and ITL (metrics.RouterTotals),
              each worker's model steps (WorkerStatus.step_stats) and the decode
              workers' KV blocks in use
    predict   the next interval's load = this one's (Dynamo's constant predictor)
    size      the workers each pool needs at its target: `size()`, below
    decide    bounds, the budget of both pools together, hysteresis: `Hysteresis`

Model: Dynamo's throughput-based planner (docs.nvidia.com/dynamo, "Planner Design":
replicas = predicted load / one replica's throughput at the SLO, corrected by
observed / expected latency), with one worker's throughput measured online from the
workers' own steps rather than a pre-deployment profile. Load, latencies and steps are
all taken over the last `HISTORY` intervals:

- prefill: a worker computes `mu` prompt tokens per busy second (tokens / seconds of its
  steps); a prompt of ISL tokens takes s = ISL / mu. A worker is an M/D/1 queue, as
  DistServe models prefill (Zhong et al., OSDI 2024, section 3.1: mean TTFT = D +
  R D^2 / (2 (1 - R D)) at arrival rate R and service time D), so it meets the TTFT
  target up to utilization rho* = 2 (x - 1) / (2 x - 1), x = target / s; the pool needs
  (prompt tokens/s) / (mu rho*) workers. The prompt tokens waiting for prefill at the
  interval's end count as its load when they are more than its arrivals': clients that
  wait on a long queue (a closed loop, a client's own concurrency limit) send nothing
  while they wait, and a window without arrivals would shrink the pool they wait on.
- decode: a step of B tokens (one per decoding row) takes t(B) = a + b B (least
  squares over the steps); one worker holds B* = (ITL target - a) / b tokens per step
  within the target, generating B* / target tokens/s; the pool needs (arrivals/s x
  expected output tokens, or the tokens streamed per second if more) / that, and no
  fewer than the KV blocks in use / (KV_HEADROOM x one worker's). Expected output: the
  arrivals' mean max_tokens x the share of their max_tokens the completed requests
  used; the arrivals' own max_tokens follow a shift to longer answers at once (when
  clients' max_tokens track their answers), where the finished requests' mean lags it
  by the length of an answer. A rise of max_tokens alone (the same answers) overshoots
  until the completed requests show the lower share, an answer's length later.
- correction (Dynamo's): the window's mean TTFT (ITL) over what the model expects for
  it (M/D/1 at the pool's utilization; t(mean tokens per step)) measures what the
  model leaves out (queueing outside the steps, transfers, cores shared with the other
  pool); the target the model is held to is divided by that factor (within
  MAX_CORRECTION either way). A pool with little load needs few workers however large
  the factor.

Every decision is logged with its inputs and exported (metrics.PlannerMetrics).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from dataclasses import dataclass

from ..config import PlannerConfig
from ..messages import StepStats

logger = logging.getLogger(__name__)

HISTORY = 3              # intervals the load, the latencies and the capacities are
                         # measured over (each decision looks at this many)
KV_HEADROOM = 0.8        # decode: KV use per worker the pool is sized to at most
MAX_CORRECTION = 4.0     # largest observed / target scale of a pool's need
MAX_RHO = 0.95           # prefill: utilization never planned above this
MIN_X = 1.5              # prefill: the corrected TTFT target over one prompt's time,
                         # at least (rho* 0.5), unless the target itself is below it


@dataclass(frozen=True)
class Interval:
    """One adjustment interval as the planner saw it."""

    seconds: float
    num_prefill: int                  # workers serving at its end
    num_decode: int
    requests: int                     # admitted in it
    prompt_tokens: int                # of those requests
    queued_requests: int              # admitted, still waiting for a first token, at its end
    queued_tokens: int                # their prompt tokens
    output_len: float | None          # mean output tokens of the requests finished in it
                                      # (None: none yet, ever)
    output_share: float | None        # tokens / max_tokens of the requests completed in it
    max_output_len: float             # mean max_tokens (x samples) of its arrivals
    ttft_s: float | None              # mean TTFT of its first tokens (None: none)
    itl_s: float | None               # mean ITL of its tokens after the first
    tokens_after_first: int           # streamed in it after the first, running requests'
                                      # too (sample 0's: n > 1 undercounts)
    kv_blocks_used: int               # decode pools, at its end
    kv_blocks_per_decode: int         # one decode worker's pool
    prefill_steps: StepStats          # every prefill worker's steps, last HISTORY intervals
    decode_steps: StepStats           # every decode worker's steps, the same


@dataclass(frozen=True)
class Plan:
    """What `size()` asks for, and why."""

    prefill_needed: float             # fractional workers at the TTFT target
    decode_needed: float              # fractional workers at the ITL target
    num_prefill: int                  # within bounds and budget
    num_decode: int
    why: str                          # the model's inputs, for the log


def size(iv: Interval, cfg: PlannerConfig) -> Plan:
    """The workers each pool needs for load like `iv`'s at cfg's targets (module
    docstring), then fitted into the bounds and the budget: when both needs together
    exceed `cfg.budget`, the budget is shared in proportion to them."""
    why = [f"{iv.requests} req in {iv.seconds:.1f}s"]
    p_need = d_need = 0.0
    if iv.queued_requests:
        why.append(f"queued {iv.queued_requests} ({iv.queued_tokens} tok)")
    if iv.requests or iv.queued_requests:
        p_need = _prefill_need(iv, cfg.slo_ttft_ms / 1e3, why)
    if iv.requests or iv.tokens_after_first:      # streams still running count
        d_need = _decode_need(iv, cfg.slo_itl_ms / 1e3, why)
    if iv.kv_blocks_per_decode:
        d_need = max(d_need, iv.kv_blocks_used / (KV_HEADROOM * iv.kv_blocks_per_decode))
    p, d = (min(max(math.ceil(n), lo), hi) if math.isfinite(n) else hi
            for n, lo, hi in ((p_need, cfg.min_prefill_workers, cfg.max_prefill_workers),
                              (d_need, cfg.min_decode_workers, cfg.max_decode_workers)))
    if p + d > cfg.budget:
        if math.isinf(p_need) and math.isfinite(d_need):      # the finite need first
            d = min(d, cfg.budget - cfg.min_prefill_workers)
            p = min(cfg.budget - d, cfg.max_prefill_workers)
        elif math.isinf(d_need) and math.isfinite(p_need):
            p = min(p, cfg.budget - cfg.min_decode_workers)
            d = min(cfg.budget - p, cfg.max_decode_workers)
        else:
            share = (p_need / (p_need + d_need) if math.isfinite(p_need + d_need)
                     and p_need + d_need > 0 else 0.5)
            p = min(max(round(cfg.budget * share), cfg.min_prefill_workers),
                    cfg.max_prefill_workers, cfg.budget - cfg.min_decode_workers)
            d = min(max(cfg.budget - p, cfg.min_decode_workers), cfg.max_decode_workers)
    return Plan(p_need, d_need, p, d, ", ".join(why))


def _prefill_need(iv: Interval, target: float, why: list[str]) -> float:
    """Prefill workers for iv's prompt tokens/s (its arrivals', or the queue's at its
    end if more) at a mean TTFT of `target` seconds: M/D/1 per worker, the target
    corrected by observed / expected TTFT."""
    tokens = max(iv.prompt_tokens, iv.queued_tokens)
    if tokens == 0:                           # no prompt tokens to prefill
        return 0.0
    if iv.prefill_steps.line() is None:       # no prefill measured yet: hold the pool
        return float(iv.num_prefill)
    isl = (iv.prompt_tokens / iv.requests if iv.requests
           else iv.queued_tokens / iv.queued_requests)
    mu = iv.prefill_steps.x / iv.prefill_steps.seconds     # tokens per busy second
    service = isl / mu                                     # s: one prompt alone
    load = tokens / iv.seconds                             # tokens/s
    rho_now = load / (mu * iv.num_prefill)
    expected = service * (1 + rho_now / (2 * (1 - rho_now))) if rho_now < 1 else None
    corrected = _correct(target, iv.ttft_s, expected, "TTFT", why)
    # more workers shorten the queue, not a prompt's own time: the correction never
    # asks a worker to run below half utilization (x = 1.5: rho* = 0.5)
    x = max(corrected, min(target, MIN_X * service)) / service
    rho = min(MAX_RHO, 2 * (x - 1) / (2 * x - 1)) if x > 1 else 0.0
    why.append(f"ISL {isl:.0f} mu {mu:.0f} tok/s rho {rho_now:.2f} rho* {rho:.2f}")
    return load / (mu * rho) if rho > 0 else math.inf


def _decode_need(iv: Interval, target: float, why: list[str]) -> float:
    """Decode workers for iv's output tokens/s at a mean ITL of `target` seconds: tokens
    per step of a worker from the step line, the target corrected by observed / expected ITL."""
    line = iv.decode_steps.line()
    osl = (iv.output_share * iv.max_output_len if iv.output_share is not None
           else iv.output_len)
    if line is None or (osl is None and not iv.tokens_after_first):
        return float(iv.num_decode)
    a, b = line
    # a token's mean step time: steps weighted by their tokens, as ITL counts them
    per_token = a + b * iv.decode_steps.xx / iv.decode_steps.x
    target = _correct(target, iv.itl_s, per_token, "ITL", why)
    rows = max((target - a) / b, 1.0)                      # B*: tokens within the target
    # demand: arrivals x their expected output (their max_tokens x the share of it the
    # finished requests used: the arrivals' own max_tokens follow a change of output
    # length at once, where the finished requests' output lags it by an answer), or the
    # tokens the pool streamed, whichever is more
    tokens_s = max(iv.requests * (osl or 0), iv.tokens_after_first) / iv.seconds
    why.append(f"OSL {osl or 0:.0f} (max {iv.max_output_len:.0f}) streamed "
               f"{iv.tokens_after_first} step {a * 1e3:.1f}+{b * 1e3:.2f}/tok ms B* {rows:.1f}")
    return tokens_s / (rows / max(target, a + b * rows))


def _correct(target: float, observed: float | None, expected: float | None, name: str,
             why: list[str]) -> float:
    """Dynamo's correction: the target the model is held to, target / (observed /
    expected), the factor clamped to [1 / MAX_CORRECTION, MAX_CORRECTION]; unchanged
    without an observation or an expectation (an overloaded pool's is unbounded)."""
    if observed is None:
        return target
    why.append(f"{name} {observed * 1e3:.0f}ms/{target * 1e3:.0f}ms")
    if not expected:
        return target
    factor = min(max(observed / expected, 1 / MAX_CORRECTION), MAX_CORRECTION)
    why.append(f"x{factor:.2f}")
    return target / factor


class Hysteresis:
    """More workers at once; fewer only after `down_after` intervals in a row asked for
    fewer (each role down by one per action). A plan that raises one pool carries the
    other's decrease with it as far as the budget needs (a budget-bound swap is one
    decision)."""

    def __init__(self, down_after: int):
        self.down_after = down_after
        self.lower_for = 0        # intervals in a row whose plan was below the pools

    def decide(self, plan: Plan, have: tuple[int, int], budget: int
               ) -> tuple[int, int] | None:
        """The (prefill, decode) workers to scale to now, or None to stay. A raise of
        one pool lowers the other only as far as `budget` (both pools) makes it."""
        want = (plan.num_prefill, plan.num_decode)
        if want == have:
            self.lower_for = 0
            return None
        if any(w > h for w, h in zip(want, have)):
            self.lower_for = 0
            up = 0 if want[0] > have[0] else 1
            other = max(want[1 - up], min(have[1 - up], budget - want[up]))
            return (want[0], other) if up == 0 else (other, want[1])
        self.lower_for += 1
        if self.lower_for < self.down_after:
            return None
        self.lower_for = 0
        return tuple(max(w, h - 1) for w, h in zip(want, have))


class Planner:
    """The planner's loop on the router's event loop: `run()` until cancelled."""

    def __init__(self, cfg: PlannerConfig, placement, admission, router_metrics, scale,
                 clock=time.monotonic):
        """It reads the pools from `placement` (Placement), the load from `admission`
        (Admission) and `router_metrics.totals` (RouterMetrics, whose registry gets the
        planner's metrics), and resizes the pools with `scale(num_prefill, num_decode,
        timeout_s)` (Scaler.scale)."""
        from ..metrics import PlannerMetrics

        self.cfg, self.clock = cfg, clock
        self.placement, self.admission, self.totals = placement, admission, router_metrics.totals
        self._scale = scale
        self.hysteresis = Hysteresis(cfg.scale_down_intervals)
        self.metrics = PlannerMetrics(router_metrics.registry)
        self.decisions: deque[tuple[Plan, tuple[int, int] | None]] = deque(maxlen=256)
        self._steps: dict[str, tuple[int, StepStats]] = {}   # worker id -> (epoch, last)
        self._history: deque[tuple[StepStats, StepStats]] = deque(maxlen=HISTORY)
        self._output_len: float | None = None
        self._output_share: float | None = None
        self._marks: deque[tuple] = deque(maxlen=HISTORY + 1)
        self.restart_window()

    def restart_window(self) -> None:
        """Load and latencies count from now (the start, and after each scale: what
        the old pools saw says little of the new ones); workers' capacities carry on."""
        self._marks.clear()
        self._marks.append(self._totals())

    async def run(self) -> None:
        self.restart_window()          # the workers are up now
        while True:
            await asyncio.sleep(self.cfg.adjustment_interval_s)
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception:       # one bad interval (a worker call failed) is skipped
                logger.exception("planner interval failed; the pools stay as they are")

    async def step(self) -> tuple[int, int] | None:
        """One interval: observe, size, decide, and scale when the decision says so.
        Returns the (prefill, decode) scaled to, or None. The first interval after a
        start or a scale only observes (one interval's load is too noisy to act on)."""
        iv = await self.observe()
        if len(self._marks) < 3:
            logger.info("planner: %d req in %.1fs, settling", iv.requests, iv.seconds)
            return None
        plan = size(iv, self.cfg)
        have = (iv.num_prefill, iv.num_decode)
        to = self.hysteresis.decide(plan, have, self.cfg.budget)
        self.decisions.append((plan, to))
        for role, need, target in (("prefill", plan.prefill_needed, plan.num_prefill),
                                   ("decode", plan.decode_needed, plan.num_decode)):
            self.metrics.needed.labels(role=role).set(need if math.isfinite(need) else -1)
            self.metrics.target.labels(role=role).set(target)
        logger.log(logging.INFO if to is None else logging.WARNING,
                   "planner: %s -> need P %.2f D %.2f -> plan %dP+%dD, have %dP+%dD: %s",
                   plan.why, plan.prefill_needed, plan.decode_needed, plan.num_prefill,
                   plan.num_decode, *have, "stay" if to is None else "scale to %dP+%dD" % to)
        if to is None:
            return None
        for role, n, h in zip(("prefill", "decode"), to, have):
            if n != h:
                self.metrics.actions.labels(role=role, direction="up" if n > h else "down").inc()
        if sum(map(max, to, have)) > self.cfg.budget:
            # a swap: retire first, so the pools never hold more than the budget (a
            # budget of devices or pods would leave the new worker pending meanwhile)
            await self._scale(*map(min, to, have), self.cfg.drain_timeout_s)
        await self._scale(*to, self.cfg.drain_timeout_s)
        self.restart_window()
        return to

    def _totals(self) -> tuple:
        t, a = self.totals, self.admission
        # prompts a decode worker prefilled count too: the router sends them there when
        # every prefill worker's queue is long (conditional disaggregation), which is
        # prefill demand the pool did not meet (a bench at 1.2 long prompts/s saw the
        # prefill pool shrink when they were left out)
        return (self.clock(), a.admitted_requests + a.refused_requests,
                a.admitted_tokens + a.refused_tokens, t.finished, t.output_tokens,
                t.ttft_s, t.ttft_count, t.itl_s, t.itl_count, a.arrived_max_output,
                t.completed_tokens, t.completed_max_tokens)

    async def observe(self) -> Interval:
        """The intervals since the window's start (at most HISTORY of them: a Poisson
        load's count over one short interval is noisy, at 1 req/s 3 s hold none 5% of
        the time), with the pools as they are now. Requests refused at admission count
        as load, and so do prompts the decode workers prefilled."""
        placement = self.placement
        prefill, decode = list(placement.prefill), list(placement.decode)
        steps = {"prefill": StepStats(), "decode": StepStats()}
        used = 0
        statuses = await asyncio.gather(*(asyncio.wait_for(w.handle.status.remote(), 5)
                                          for w in prefill + decode), return_exceptions=True)
        for s in statuses:
            if isinstance(s, BaseException):      # dead or slow: its steps wait
                continue
            epoch, last = self._steps.get(s.worker_id, (s.epoch, StepStats()))
            steps[s.role] += s.step_stats - (last if epoch == s.epoch else StepStats())
            self._steps[s.worker_id] = (s.epoch, s.step_stats)
            if s.role == "decode":
                used += s.kv_blocks_total - s.kv_blocks_free
        serving = {w.worker_id for w in prefill + decode}
        self._steps = {k: v for k, v in self._steps.items() if k in serving}   # retired
        self._history.append((steps["prefill"], steps["decode"]))
        self._marks.append(self._totals())
        (t0, req0, tok0, fin0, out0, ttft0, nttft0, itl0, nitl0, amax0, c0, cmax0) = self._marks[0]
        (t1, req1, tok1, fin1, out1, ttft1, nttft1, itl1, nitl1, amax1, c1, cmax1) = self._marks[-1]
        if fin1 > fin0:
            self._output_len = (out1 - out0) / (fin1 - fin0)
        if cmax1 > cmax0:
            self._output_share = min((c1 - c0) / (cmax1 - cmax0), 1.0)
        sum_p, sum_d = StepStats(), StepStats()
        for p, d in self._history:
            sum_p, sum_d = sum_p + p, sum_d + d
        return Interval(
            seconds=max(t1 - t0, 1e-3), num_prefill=len(prefill), num_decode=len(decode),
            requests=req1 - req0, prompt_tokens=max(tok1 - tok0, 0),
            queued_requests=self.admission.queued_requests,
            queued_tokens=self.admission.queued_tokens,
            output_len=self._output_len, output_share=self._output_share,
            max_output_len=(amax1 - amax0) / (req1 - req0) if req1 > req0 else 0.0,
            ttft_s=(ttft1 - ttft0) / (nttft1 - nttft0) if nttft1 > nttft0 else None,
            itl_s=(itl1 - itl0) / (nitl1 - nitl0) if nitl1 > nitl0 else None,
            tokens_after_first=nitl1 - nitl0,
            kv_blocks_used=used,
            kv_blocks_per_decode=min((w.num_blocks for w in decode), default=0),
            prefill_steps=sum_p, decode_steps=sum_d)
