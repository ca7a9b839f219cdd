"""The SLO planner's model and hysteresis (router/planner.py) on synthetic intervals, no
cluster: the prefill pool follows prompt tokens/s against the TTFT target, the decode
pool output tokens/s against the ITL target, the budget is shared by need, and the pools
shrink only after intervals in a row ask for fewer."""

import asyncio
import math
import re
from types import SimpleNamespace

import pytest

from pdserve.config import ClusterConfig, PlannerConfig
from pdserve.messages import StepStats, WorkerStatus
from pdserve.metrics import RouterMetrics
from pdserve.router.admission import Admission
from pdserve.router.planner import Hysteresis, Interval, Plan, Planner, size


def steps(pairs) -> StepStats:
    s = StepStats()
    for x, t in pairs:
        s += StepStats.of(x, t)
    return s


# a prefill worker: 1000 prompt tokens per busy second; a decode step: 20 ms + 2 ms/row
PREFILL = steps([(512, 0.512)] * 10)
DECODE = steps([(b, 0.020 + 0.002 * b) for b in (1, 4, 8, 16, 32)])
CFG = PlannerConfig(slo_ttft_ms=2000, slo_itl_ms=60, max_prefill_workers=4,
                    max_decode_workers=4)


def interval(requests=10, isl=500, osl=100, seconds=10.0, p=1, d=1, ttft=None, itl=None,
             used=0, **kw) -> Interval:
    return Interval(seconds=seconds, num_prefill=p, num_decode=d, requests=requests,
                    prompt_tokens=requests * isl, output_len=osl, ttft_s=ttft, itl_s=itl,
                    queued_requests=kw.get("queued", 0),
                    queued_tokens=kw.get("queued", 0) * kw.get("queued_isl", isl),
                    kv_blocks_used=used, kv_blocks_per_decode=1000,
                    tokens_after_first=kw.get("streamed", 0),
                    output_share=kw.get("share"), max_output_len=kw.get("max_out", 0.0),
                    prefill_steps=kw.get("prefill_steps", PREFILL),
                    decode_steps=kw.get("decode_steps", DECODE))


def test_step_stats_line_recovers_the_step_model():
    a, b = DECODE.line()
    assert a == pytest.approx(0.020) and b == pytest.approx(0.002)
    assert (DECODE - steps([(1, 0.022)])).steps == 4
    # every step the same size: the line through the origin (an upper bound on b)
    assert PREFILL.line() == (0.0, pytest.approx(0.001))
    assert StepStats().line() is None


def test_prefill_pool_follows_prompt_tokens_against_the_ttft_target():
    # 500-token prompts take 0.5 s; target 2 s: x = 4, rho* = 6/7; one worker takes
    # 857 tokens/s at the target
    light = size(interval(requests=10, isl=500), CFG)        # 500 tokens/s
    heavy = size(interval(requests=40, isl=500), CFG)        # 2000 tokens/s
    assert light.prefill_needed == pytest.approx(500 / (1000 * 6 / 7))
    assert heavy.prefill_needed == pytest.approx(2000 / (1000 * 6 / 7))
    assert (light.num_prefill, heavy.num_prefill) == (1, 3)
    # a target below one prompt's own time: no number of workers meets it -> the max
    hopeless = size(interval(isl=5000), CFG)
    assert math.isinf(hopeless.prefill_needed) and hopeless.num_prefill == 4


def test_decode_pool_follows_output_tokens_against_the_itl_target():
    # a worker holds B* = (60 - 20) / 2 = 20 rows at 60 ms: 333 tokens/s
    few = size(interval(requests=10, osl=100), CFG)          # 100 tokens/s
    many = size(interval(requests=20, osl=400), CFG)         # 800 tokens/s
    assert few.decode_needed == pytest.approx(100 / (20 / 0.060))
    assert many.decode_needed == pytest.approx(800 / (20 / 0.060))
    assert (few.num_decode, many.num_decode) == (1, 3)
    # KV in use sets a floor: 2000 blocks held of 1000 per worker at 80%
    assert size(interval(requests=1, used=2000), CFG).num_decode == 3

    # answers got longer: the running requests streamed 8000 tokens in 10 s while the
    # finished ones (the old, short answers) say 10 x 100; the streamed rate counts
    longer = size(interval(requests=10, osl=100, streamed=8000), CFG)
    assert longer.decode_needed == pytest.approx(800 / (20 / 0.060))
    # and before any request finished, streamed tokens alone size the pool
    assert size(interval(requests=10, osl=None, streamed=8000), CFG).num_decode == 3
    # the arrivals ask for up to 800 tokens each, and finished requests used half of
    # theirs: 400 expected, where the finished ones' mean (100) lags the change
    asked = size(interval(requests=10, osl=100, share=0.5, max_out=800.0), CFG)
    assert asked.decode_needed == pytest.approx(400 / (20 / 0.060))

def test_a_missed_target_tightens_the_models_target():
    # 800 tokens/s on one worker: rho 0.8, M/D/1 expects 1.5 s; 3 s observed halves the
    # target to 1 s: rho* 2/3, 1.2 workers (0.93 without the correction)
    plan = size(interval(requests=16, ttft=3.0), CFG)
    assert plan.prefill_needed == pytest.approx(800 / (1000 * 2 / 3)) and plan.num_prefill == 2
    assert "TTFT 3000ms/2000ms" in plan.why and "x2.00" in plan.why
    assert size(interval(requests=16), CFG).num_prefill == 1
    # a token's expected step: 20 + 2 x (sum x^2 / sum x = 1361 / 61) ms = 64.6 ms (steps
    # weighted by their tokens); twice that observed: a 30 ms target holds 5 per worker
    plan = size(interval(requests=10, osl=100, itl=2 * (0.020 + 0.002 * 1361 / 61)), CFG)
    assert plan.decode_needed == pytest.approx(100 / (5 / 0.030))
    # a pool with little load needs little however far off its latency (cores shared
    # with a busy prefill pool inflate ITL on one box): the factor is capped at 4
    plan = size(interval(requests=4, osl=4, itl=0.7), CFG)
    assert plan.decode_needed < 0.1 and plan.num_decode == 1 and "x4.00" in plan.why
    # an overloaded pool's expectation is unbounded: no correction
    plan = size(interval(requests=20, ttft=9.0), CFG)
    assert "TTFT 9000ms" in plan.why and not re.search(r"\bx\d", plan.why), plan.why


def test_no_load_asks_for_the_minimum_and_unmeasured_pools_hold():
    idle = size(interval(requests=0, p=2, d=3), CFG)
    assert (idle.num_prefill, idle.num_decode) == (1, 1)
    unmeasured = size(interval(p=2, d=3, prefill_steps=StepStats(), decode_steps=StepStats()),
                      CFG)
    assert (unmeasured.num_prefill, unmeasured.num_decode) == (2, 3)


def test_a_queue_without_arrivals_holds_its_pools():
    # clients waiting on six queued 800-token prompts send nothing (a closed loop): a
    # window of no arrivals still needs the prefill pool that queue waits on, and
    # streams still running need their decode pool
    plan = size(interval(requests=0, p=2, d=2, seconds=6.0, queued=6, queued_isl=800,
                         streamed=3000), CFG)
    assert plan.prefill_needed == pytest.approx(4800 / 6.0 / (1000 * 0.75))   # x = 2.5
    assert plan.decode_needed == pytest.approx(3000 / 6.0 / (20 / 0.060))     # B* = 20
    assert (plan.num_prefill, plan.num_decode) == (2, 2), plan
    assert "queued 6 (4800 tok)" in plan.why
    # the queue counts only when it is more than the window's arrivals
    busy = size(interval(requests=40, isl=500, queued=2), CFG)
    assert busy.prefill_needed == size(interval(requests=40, isl=500), CFG).prefill_needed


def test_the_budget_is_shared_by_need():
    cfg = PlannerConfig(slo_ttft_ms=2000, slo_itl_ms=60, max_prefill_workers=2,
                        max_decode_workers=2, max_workers=3)
    prefill_heavy = size(interval(requests=40, isl=500, osl=10), cfg)   # P 2.3, D small
    assert (prefill_heavy.num_prefill, prefill_heavy.num_decode) == (2, 1)
    decode_heavy = size(interval(requests=20, isl=20, osl=400), cfg)    # P small, D 2.4
    assert (decode_heavy.num_prefill, decode_heavy.num_decode) == (1, 2)
    both = size(interval(requests=60, isl=500, osl=400), cfg)           # both over
    assert both.num_prefill + both.num_decode == 3


def test_hysteresis_scales_up_at_once_and_down_after_intervals_in_a_row():
    h = Hysteresis(down_after=2)

    def plan(p, d):
        return Plan(p, d, p, d, "")

    assert h.decide(plan(2, 1), (1, 1), 3) == (2, 1)     # up: at once
    assert h.decide(plan(1, 2), (2, 1), 3) == (1, 2)     # a swap carries the decrease
    assert h.decide(plan(1, 1), (1, 2), 3) is None       # down: once is not enough
    assert h.decide(plan(1, 2), (1, 2), 3) is None       # ... and a steady one resets it
    assert h.decide(plan(1, 1), (1, 2), 3) is None
    assert h.decide(plan(1, 1), (1, 2), 3) == (1, 1)     # two in a row
    assert h.decide(plan(1, 1), (4, 4), 8) is None
    assert h.decide(plan(1, 1), (4, 4), 8) == (3, 3)     # one worker per role per action
    # a raise lowers the other pool only as far as the budget makes it
    assert h.decide(plan(3, 1), (2, 4), 6) == (3, 3)
    assert h.decide(plan(3, 1), (2, 4), 8) == (3, 4)


def test_planner_config_errors_name_the_field():
    with pytest.raises(ValueError, match="slo_itl_ms"):
        PlannerConfig(slo_ttft_ms=100, slo_itl_ms=0)
    with pytest.raises(ValueError, match="min_decode_workers=3, max_decode_workers=2"):
        PlannerConfig(100, 10, min_decode_workers=3, max_decode_workers=2)
    with pytest.raises(ValueError, match="max_workers=1"):
        PlannerConfig(100, 10, max_workers=1)
    with pytest.raises(ValueError, match=r"decode workers at start \(3\) outside"):
        ClusterConfig(num_decode_workers=3, planner=PlannerConfig(100, 10, max_decode_workers=2))
    with pytest.raises(ValueError, match="exceed the planner's max_workers=3"):
        ClusterConfig(num_prefill_workers=2, num_decode_workers=2,
                      planner=PlannerConfig(100, 10, max_workers=3))


class _Handle:
    def __init__(self, status):
        self._status = status
        self.status = SimpleNamespace(remote=self._remote)

    async def _remote(self):
        return self._status()


def _status(worker_id, role, stats, epoch=1, held=0):
    return WorkerStatus(worker_id, role, 0, "", "ready", epoch, 1000, 1000 - held, 0, 0, "",
                        step_stats=stats)


def test_the_planner_observes_its_window_and_scales():
    """Planner.step on a fake router: the first interval after a start only observes;
    then arrivals (refused ones too), TTFT/ITL means and the workers' steps of the window
    (a restarted worker's steps count from zero) decide; a budget-bound swap retires
    before it starts, and the window starts over after a scale."""
    p_stats, d_stats = [PREFILL], [DECODE]
    epoch = [1]
    prefill = SimpleNamespace(worker_id="p0", handle=_Handle(
        lambda: _status("p0", "prefill", p_stats[0], epoch[0])))
    decode = SimpleNamespace(worker_id="d0", num_blocks=1000, handle=_Handle(
        lambda: _status("d0", "decode", d_stats[0], held=100)))
    scaled = []

    async def scale(p, d, timeout_s):
        scaled.append((p, d))

    metrics = RouterMetrics(lambda: 0)
    router = SimpleNamespace(metrics=metrics, admission=Admission(100, 10 ** 6),
                             placement=SimpleNamespace(prefill=[prefill], decode=[decode]))
    cfg = PlannerConfig(slo_ttft_ms=2000, slo_itl_ms=60, max_prefill_workers=2,
                        max_decode_workers=2, max_workers=3, adjustment_interval_s=1)
    now = [0.0]
    planner = Planner(cfg, router.placement, router.admission, metrics, scale,
                      clock=lambda: now[0])

    async def interval(prompts=0, prompt_len=500, answers=0):
        now[0] += 10
        for _ in range(prompts):
            router.admission.admit(prompt_len).release()
        metrics.totals.finished += answers                # 400-token answers, no ITL
        metrics.totals.output_tokens += 400 * answers
        d_stats[0] += DECODE                              # D steps on every interval
        return await planner.step()

    async def main():
        assert await interval(prompts=100) is None         # settling: no decision
        assert not planner.decisions
        return await interval()         # 100 prompts of 500 tokens in 20 s: 2500 tok/s

    assert asyncio.run(main()) == (2, 1) and scaled == [(2, 1)]
    assert len(planner._marks) == 1                        # the window starts over
    text = metrics.registry.get_sample_value
    assert text("pdserve_planner_workers_target", {"role": "prefill"}) == 2
    assert text("pdserve_planner_scale_actions_total", {"role": "prefill",
                                                        "direction": "up"}) == 1
    p1 = SimpleNamespace(worker_id="p1", handle=_Handle(
        lambda: _status("p1", "prefill", PREFILL)))

    async def decode_heavy():
        router.placement.prefill = [prefill, p1]           # the one started
        p_stats[0] = PREFILL + PREFILL                     # p0 restarted (epoch 2): all
        epoch[0] = 2                                       # of its steps count
        assert await interval(answers=30) is None          # settling
        assert planner._history[-1][0].steps == 30         # p0's 20, new p1's 10
        router.admission.max_requests = 0                  # refused ones are load too
        for _ in range(2):
            with pytest.raises(Exception, match="overloaded"):
                router.admission.admit(10)
        router.admission.max_requests = 100
        return await interval(prompts=28, prompt_len=20, answers=30)

    # 30 req in 20 s x 400 tokens: 600 tokens/s over 333 per worker at 60 ms
    assert asyncio.run(decode_heavy()) == (1, 2)
    assert scaled == [(2, 1), (1, 1), (1, 2)]              # retire first: never 4
    plan = planner.decisions[-1][0]
    assert plan.why.startswith("30 req in 20.0s") and plan.decode_needed == pytest.approx(1.8)


def test_a_burst_of_reservations_spreads_over_the_decode_workers():
    """Each decode worker's streams are charged when it is chosen, before its reserve
    returns: a burst's requests see each other (the planner would otherwise read one
    worker saturated and the other idle); a refused reservation takes its charge back
    (and the request tries the next worker)."""
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.messages import DecodeReservation
    from pdserve.router.placement import Placement
    from pdserve.router.routing import PrefillRouter
    from pdserve.router.workers import Worker
    from router_fakes import actor

    class SlowDecode:
        def __init__(self):
            self.reserved, self.release, self.refuse = [], asyncio.Event(), False

        async def reserve(self, rid, prompt_len, params, ids, lease_s, local):
            self.reserved.append(rid)
            await self.release.wait()
            return None if self.refuse else DecodeReservation(("127.0.0.1", 1), 1, 1, 0,
                                                              False, 60)

    class Prefill:
        pass

    cfg = ClusterConfig()
    fakes = [SlowDecode(), SlowDecode()]
    decode = [Worker(actor(f), f"decode-{i}", 64, 1, free_blocks=64)
              for i, f in enumerate(fakes)]
    prefill = [Worker(actor(Prefill()), "prefill-0", 64, 1)]
    placement = Placement(cfg, PrefillRouter("least_loaded", 16, 1.0), prefill, decode)

    async def main():
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        burst = [asyncio.ensure_future(placement.reserve(f"r{i}", 8, SamplingParams(),
                                                         deadline, list(range(8)), 2))
                 for i in range(4)]
        while sum(len(f.reserved) for f in fakes) < 4:
            await asyncio.sleep(0)
        assert [len(f.reserved) for f in fakes] == [2, 2]   # not all four on decode-0
        assert [d.streams for d in decode] == [4, 4]            # 2 requests x 2 samples each
        fakes[1].refuse = True                               # decode-1 is full after all
        for f in fakes:
            f.release.set()
        placed = await asyncio.wait_for(asyncio.gather(*burst), 5)
        assert [held.d for held in placed] == [decode[0]] * 4   # refused: tried decode-0 next
        return prefill[0].queued_tokens

    queued = asyncio.run(main())
    assert [d.streams for d in decode] == [8, 0]       # decode-1's refusals took theirs back
    assert queued == 4 * 8                          # every prompt's tokens on P, once


def test_no_prompt_tokens_need_no_prefill_worker():
    plan = size(interval(requests=10, isl=0), CFG)     # no prompt tokens in the window
    assert plan.prefill_needed == 0 and plan.num_prefill == 1
