"""pdserve bench planner's set-up (pdserve/bench/planner.py), without serving: every run
gets the same workers (capped cores, no core lending, prompts always on prefill
workers), the planner's run its bounds, budget and margin-scaled targets; the table
reports the planner against the best and the worst fixed split."""

from __future__ import annotations

import pytest

from pdserve.bench.planner import PlannerBenchConfig, table


def test_every_run_has_the_same_fixed_size_workers_and_the_planner_its_bounds():
    cfg = PlannerBenchConfig(budget=4, cpu_limit=0.5)
    assert cfg.splits() == [(3, 1), (2, 2), (1, 3)]
    fixed, planned = cfg.cluster_config((3, 1)), cfg.cluster_config(None)
    assert (fixed.num_prefill_workers, fixed.num_decode_workers, fixed.planner) == (3, 1, None)
    assert (planned.num_prefill_workers, planned.num_decode_workers) == (1, 1)
    for c in (fixed, planned):
        assert c.prefill.cpu_limit == c.decode.cpu_limit == 0.5
        assert c.prefill.num_threads == c.decode.num_threads == 1
        assert not c.lends_idle_prefill_cores()
        assert c.router.max_prefill_queue_tokens == 0       # no conditional disaggregation
        assert not c.router.rebalance_on_scale_up
        assert (c.router.slo_ttft_ms, c.router.slo_tpot_ms) == (5000, 200)   # goodput's
    p = planned.planner
    assert (p.slo_ttft_ms, p.slo_itl_ms) == (5000 * 0.75, 200 * 0.75)      # the margin
    assert (p.min_prefill_workers, p.max_prefill_workers, p.budget) == (1, 3, 4)
    on = PlannerBenchConfig(conditional_disagg=True, cpu_limit=None,
                            rebalance_on_scale_up=True).cluster_config(None)
    assert on.router.max_prefill_queue_tokens is None and on.prefill.cpu_limit is None
    assert on.router.rebalance_on_scale_up


@pytest.mark.parametrize("kw", [{"budget": 2}, {"phase_s": 0}, {"decode_rate": -1}])
def test_bad_settings_are_refused_naming_them(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        PlannerBenchConfig(**kw)


def test_the_table_puts_the_planner_against_the_best_and_worst_split():
    def run(name, goodput):
        phase = {"goodput_req_s": goodput}
        return {"run": name, "goodput_req_s": goodput, "phases": [phase, phase],
                "ttft_ms": {"p50": 100.0}, "tpot_ms": {"p50": 50.0}, "failed": 0,
                "kv_blocks_leaked": 0}
    text = table(PlannerBenchConfig(), [run("planner", 0.6), run("fixed 2P+1D", 0.3),
                                        run("fixed 1P+2D", 0.4)])
    assert "planner / best fixed: 1.50x, planner / worst fixed: 2.00x" in text
