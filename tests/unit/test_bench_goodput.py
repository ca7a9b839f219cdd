"""pdserve/bench/slo_attainment.py's measure: SLO attainment per request, goodput read off a
rate sweep (DistServe's definition), the summary's SLO scales; and pdserve/bench/goodput.py's
workloads and arms.
No server: the client's per-request detail is made up."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from pdserve.bench.goodput import GoodputConfig, Prompts, workload
from pdserve.bench.knee import bracket, next_rate, search, wilson
from pdserve.bench.slo_attainment import (as_reps, attainment, goodput, latencies, summarize,
                                          table)


def test_attainment_needs_both_slos_and_counts_failures_as_misses():
    lat = [(0.1, 0.01), (0.3, 0.01), (0.1, 0.05), None]
    assert attainment(lat, 0.2, 0.02) == 0.25
    assert attainment(lat, 0.5, 0.1) == 0.75


@pytest.mark.parametrize("points, want", [
    ([(1, 1.0), (2, 0.95), (3, 0.5)], 2 + (0.95 - 0.9) / (0.95 - 0.5)),   # interpolated
    ([(1, 1.0), (2, 0.8), (3, 0.95)], 1 + 0.1 / 0.2),   # the first fall counts, not a recovery
    ([(1, 0.5), (2, 0.4)], 0.0),                         # the lowest rate misses
    ([(2, 0.99), (1, 1.0)], 2.0),                        # none misses: the top rate
    ([(1, 0.9), (2, 0.9)], 2.0),                         # at the bar is within it
])
def test_goodput_is_the_highest_rate_at_the_attainment(points, want):
    assert goodput(points, 0.9) == pytest.approx(want)


def test_latencies_from_the_clients_detail():
    res = {"ttfts": [0.2, 0.0, 0.3], "itls": [[0.01, 0.03], [], [0.02]],
           "output_lens": [3, 0, 2], "errors": ["", "boom", ""]}
    assert latencies(res) == [(0.2, pytest.approx(0.02)), None, (0.3, 0.02)]


BASE = {"ttft_s": 0.1, "tpot_s": 0.01, "prompt_tokens": 100}


def rep(arms: dict, base: dict = BASE) -> dict:
    return {"workloads": {"chat": {"unloaded": base, "arms": arms}}}


def test_summary_per_pair_over_repetitions_with_spread_and_which_slo_binds():
    fast, slow_decode = (0.1, 0.01), (0.1, 0.05)
    record = {"reps": [
        rep({"vllm": {"1": [fast] * 10, "2": [slow_decode] * 10},
             "strict": {"1": [fast] * 10, "2": [fast] * 10}}),
        rep({"vllm": {"1": [fast] * 10, "2": [fast] * 5 + [slow_decode] * 5},
             "strict": {"1": [fast] * 10, "3": [fast] * 10}}),
        rep({"vllm": {"1": [fast] * 10, "2": [slow_decode] * 10},     # a slower box: the
             "strict": {"1": [fast] * 10, "2": [fast] * 10}},          # base is its own
            base=dict(BASE, tpot_s=0.1)),
    ]}
    s = summarize(record, [(1, 1), (10, 10)])["chat"]["pairs"]
    v, st = s["ttft x1 tpot x1"]["arms"]["vllm"], s["ttft x1 tpot x1"]["arms"]["strict"]
    assert v["goodput"]["reps"] == [pytest.approx(1.1), pytest.approx(1.2), 2.0]
    assert v["goodput"]["median"] == pytest.approx(1.2) and v["goodput"]["low"] == \
        pytest.approx(1.1)
    assert st["goodput"]["reps"] == [2.0, 3.0, 2.0]
    assert st["ratio"]["reps"] == pytest.approx([2 / 1.1, 3 / 1.2, 1.0])
    assert s["ttft x1 tpot x1"]["binds"] == "TPOT"
    assert s["ttft x10 tpot x10"]["binds"] is None
    share, lo, hi, n = v["points"][1]["2"]                      # 5 of 10 with its interval
    assert (share, n) == (0.5, 10) and lo < 0.5 < hi and (lo, hi) == wilson(5, 10)
    text = table(summarize(record, [(1, 1)]))
    assert "| ttft x1 tpot x1 | TPOT | 1.20 [1.10-2.00] | 2.00 [2.00-3.00] (1.82x [1.00-2.50]) |" \
        in text
    assert "100 ms / 10.0 ms, 100 ms / 10.0 ms, 100 ms / 100.0 ms" in text


def test_a_record_of_one_pass_is_one_repetition():
    ok = [(0.1, 0.01)] * 10
    record = {"workloads": {"chat": {"unloaded": BASE, "arms": {"vllm": {"1": ok}}}}}
    assert as_reps(record) == [{"workloads": record["workloads"]}]
    s = summarize(record, [(2, 2)])["chat"]["pairs"]["ttft x2 tpot x2"]
    assert s["arms"]["vllm"]["goodput"]["reps"] == [1.0]
    assert "| ttft x2 tpot x2 | - | 1.00 |" in table(summarize(record, [(2, 2)]))


def test_wilson_s_interval():
    """Wilson's score interval (Brown, Cai and DasGupta 2001, table values): 90 of 100
    is 0.826-0.945; it stays inside [0, 1] at the ends, where the normal one does not."""
    assert wilson(90, 100) == pytest.approx((0.8256, 0.9448), abs=1e-4)
    assert wilson(0, 10)[0] == 0.0 and 0.27 < wilson(0, 10)[1] < 0.28
    assert wilson(10, 10)[1] == 1.0 and 0.72 < wilson(10, 10)[0] < 0.73
    assert wilson(0, 0) == (0.0, 1.0)


def test_bracket_and_next_rate():
    pts = {0.2: 1.0, 0.4: 0.95, 0.8: 0.5}
    assert bracket(pts, 0.9) == (0.4, 0.8)
    assert bracket({0.2: 1.0, 0.4: 0.7, 0.6: 0.95}, 0.9) == (0.2, 0.4)   # the first fall
    assert bracket({0.2: 0.5}, 0.9) == (None, 0.2)
    assert bracket({0.2: 1.0}, 0.9) == (0.2, None)
    step, floor, top = 0.1, 0.1, 8.0
    assert next_rate([(0.4, 0.8)], {0.2, 0.4, 0.8}, step, floor, top) == 0.6
    assert next_rate([(0.4, 0.43)], {0.4, 0.43}, step, floor, top) is None   # within 10%
    assert next_rate([(0.3, None)], {0.3}, step, floor, top) == 0.6         # go higher
    assert next_rate([(None, 0.3)], {0.3}, step, floor, top) == 0.15        # go lower
    assert next_rate([(None, 0.1)], {0.1}, step, floor, top) is None        # at the floor
    assert next_rate([(8.0, None)], {8.0}, step, floor, top) is None        # at the top
    # the first pair resolved, the second not: the second's midpoint
    assert next_rate([(0.4, 0.42), (0.2, 0.4)], {0.2, 0.4, 0.42}, step, floor, top) == 0.3


@pytest.mark.parametrize("knee_at, start", [(0.37, 0.3), (1.3, 0.3), (0.21, 0.8)])
def test_search_finds_each_knee_within_its_step(knee_at, start):
    """Attainment falling from 1 to 0 around the knee (two SLO pairs, the second's knee
    twice the first's): the search ends with each knee bracketed within 10%."""
    seen: dict[float, tuple[float, float]] = {}

    def measure(rate):
        seen[rate] = tuple(1.0 if rate <= k else 0.5 for k in (knee_at, 2 * knee_at))

    def shares_now():
        return [{r: s[i] for r, s in seen.items()} for i in range(2)]

    rates = search(measure, shares_now, start, 0.9, step=0.1, floor=0.05, max_points=20)
    assert len(rates) == len(set(rates)) and len(rates) < 20
    for i, k in enumerate((knee_at, 2 * knee_at)):
        lo, hi = bracket(shares_now()[i], 0.9)
        assert lo <= k < hi and hi - lo <= 0.1 * lo + 1e-9


def test_search_stops_at_max_points_and_at_the_floor():
    calls = []
    search(calls.append, lambda: [{r: 0.0 for r in calls}], 0.4, 0.9, floor=0.1)
    assert calls == [0.4, 0.2, 0.1]                             # misses down to the floor
    calls.clear()
    search(calls.append, lambda: [{r: 1.0 if r < 0.333 else 0.0 for r in calls}], 0.3, 0.9,
           step=0.001, max_points=4)
    assert len(calls) == 4


def test_prompts_per_rate_are_shared_by_arms_and_never_repeat_in_a_server():
    pool = [{"prompt": f"p{i}", "output_tokens": 8, "prompt_tokens": 2} for i in range(5)]
    prompts = Prompts(pool, 2)
    first = prompts.at(0.5)
    assert [r["prompt"] for r in first] == ["p0", "p1"] and prompts.at(0.5) == first
    assert [r["prompt"] for r in prompts.at(0.25)] == ["p2", "p3"]
    spent = [r["prompt"] for r in prompts.at(1.0)]              # the pool is spent at p4
    assert spent == ["p4", "(slice 2)\np0"]
    assert [r["prompt"] for r in prompts.at(2.0)] == ["(slice 3)\np1", "(slice 3)\np2"]


@pytest.mark.parametrize("name, lo, hi, out_lo, out_hi", [
    ("summarize", 1000, 1900, 64, 128), ("longanswer", 4, 64, 256, 512)])
def test_workload_shapes(name, lo, hi, out_lo, out_hi):
    from transformers import AutoTokenizer

    from pdserve.engine.loader import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model("default"))
    reqs = workload(name, tok, 8, seed=3)
    assert len(reqs) == 8 and len({r["prompt"] for r in reqs}) == 8
    # decode(encode) may merge a token or two at the cut
    assert all(lo - 4 <= r["prompt_tokens"] <= hi + 4 for r in reqs), [r["prompt_tokens"] for r in reqs]
    assert all(out_lo <= r["output_tokens"] <= out_hi for r in reqs)
    assert reqs == workload(name, tok, 8, seed=3)          # seeded


def test_config_refuses_unknown_arms_and_spells_out_told():
    with pytest.raises(ValueError, match="arms"):
        GoodputConfig(arms=("vllm", "magic"))
    with pytest.raises(ValueError, match="add the vllm arm"):
        GoodputConfig(arms=("default", "told"))
    with pytest.raises(ValueError, match="no pair"):
        GoodputConfig(arms=("vllm", "slo3"))                  # TPOT scales 2, 4, 8
    GoodputConfig(arms=("vllm", "slo3"), tpot_scales=(3,))
    cfg = GoodputConfig(arms=("vllm", "default", "told"), ttft_scales=(2, 4), tpot_scales=(8,))
    assert cfg.pairs == [(2, 8), (4, 8)]
    assert cfg.expanded_arms() == ["vllm", "default", "slo8t2", "slo8t4"]


def test_an_slo_arm_is_told_its_scale_and_scored_at_it_only():
    from pdserve.bench.goodput import arm_args
    from pdserve.bench.slo_attainment import scored_at, slo_scales

    assert slo_scales("slo3") == (3.0, None) and slo_scales("slo1.5t8") == (1.5, 8.0)
    assert slo_scales("strict") is None and slo_scales("slowest") is None
    unloaded = {"ttft_s": 0.925, "tpot_s": 0.0272}
    assert arm_args("slo3", unloaded) == ("--slo-tpot-ms", "81.6")
    assert arm_args("slo1.5t8", unloaded) == ("--slo-tpot-ms", "40.8", "--slo-ttft-ms", "7400")
    assert "--max-prefill-queue-tokens" in arm_args("strict", None)
    assert scored_at("slo3", 16, 3) and not scored_at("slo3", 16, 2)
    assert scored_at("slo1.5t8", 8, 1.5) and not scored_at("slo1.5t8", 16, 1.5)
    assert scored_at("strict", 16, 2)
    GoodputConfig(arms=("vllm", "slo1.5t8"), ttft_scales=(8,), tpot_scales=(1.5,))
    with pytest.raises(ValueError, match="arms"):
        GoodputConfig(arms=("vllm", "slo1.5tx"))
    ok = [(0.1, 0.01)] * 10
    record = {"reps": [rep({"vllm": {"1": ok}, "slo10t10": {"1": ok}})]}
    s = summarize(record, [(1, 1), (10, 10)])["chat"]["pairs"]
    assert "slo10t10" not in s["ttft x1 tpot x1"]["arms"]
    assert s["ttft x10 tpot x10"]["arms"]["slo10t10"]["goodput"]["median"] == 1.0
    assert "| ttft x1 tpot x1 | - | 1.00 | - |" in table(summarize(record, [(1, 1), (10, 10)]))


def test_each_arm_s_unloaded_ttft_against_the_default_s_in_the_same_repetition():
    """--max-points 0 measures the arms' unloaded latency only: no goodput is scored,
    and the told arm's lone first tokens are compared with the default's rep by rep."""
    def lone(default_s, told_s):
        r = rep({"default": {}, "slo4t4": {}})
        r["workloads"]["chat"]["arms_unloaded"] = {
            "vllm": dict(BASE), "default": dict(BASE, ttft_s=default_s),
            "slo4t4": dict(BASE, ttft_s=told_s)}
        return r

    record = {"reps": [lone(1.0, 1.05), lone(2.0, 1.9), lone(1.0, 1.2)]}
    s = summarize(record, [(4, 4)])["chat"]
    assert s["unloaded_vs_default"]["slo4t4"]["reps"] == pytest.approx([1.05, 0.95, 1.2])
    assert s["unloaded_vs_default"]["slo4t4"]["median"] == pytest.approx(1.05)
    assert s["pairs"]["ttft x4 tpot x4"]["arms"] == {}          # no rate point, no goodput
    text = table(summarize(record, [(4, 4)]))
    assert "slo4t4 1200 ms [1050-1900] (1.05x default's [0.95-1.20])" in text
    assert "| SLOs" not in text


def test_a_ratio_is_taken_within_its_repetition_only():
    """An arm missing from a repetition (a run stopped before its turn) gets no ratio
    there, and the next repetition's ratio is its own goodput over that repetition's
    vLLM, whatever vLLM's goodput was in the one before (0 there: no ratio)."""
    ok, bad = [(0.1, 0.01)] * 10, [None] * 10
    record = {"reps": [rep({"vllm": {"1": bad}, "x": {"1": ok}}),       # vLLM 0: no ratio
                       rep({"vllm": {"1": ok}, "x": {"1": ok, "2": ok}}),
                       rep({"vllm": {"1": ok, "2": ok, "4": ok}})]}     # x not run yet
    c = summarize(record, [(1, 1)])["chat"]["pairs"]["ttft x1 tpot x1"]["arms"]["x"]
    assert c["goodput"]["reps"] == [1.0, 2.0] and c["ratio"]["reps"] == [2.0]


class _Arm:
    """A made-up server: every request within 1 s TTFT and 10 ms TPOT up to `knee`
    req/s, all at 10x past it."""

    def __init__(self, name: str, knee: float, started: list):
        self.name, self.knee, self.startup_s = name, knee, 0.0
        started.append(name)

    def complete(self, *args):
        return "Paris"

    def stop(self):
        pass


def _fake_servers(monkeypatch, knees: dict[str, float], started: list, seen: dict):
    import transformers

    from pdserve.bench import goodput as g
    from pdserve.engine import loader

    monkeypatch.setattr(loader, "resolve_model", lambda name: "/nonexistent")
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        staticmethod(lambda path: None))
    monkeypatch.setattr(g, "workload", lambda name, tok, n, seed, at_most=False: [
        {"prompt": f"p{i}", "output_tokens": 8, "prompt_tokens": 4} for i in range(n)])
    monkeypatch.setattr(g, "start_vllm", lambda cfg, *a: _Arm("vllm", knees["vllm"], started))
    monkeypatch.setattr(g, "start_pdserve", lambda cfg, *a: _Arm(
        "slo" if cfg.pdserve_args else "default",
        knees["slo4t4" if cfg.pdserve_args else "default"], started))
    monkeypatch.setattr(g, "unloaded", lambda *a: {"ttft_s": 0.5, "tpot_s": 0.01})
    monkeypatch.setattr(g, "prefills", lambda server: {"prefill_worker": 0})

    def bench_serve(server, model_dir, prompts, rate, seed, path, temperature):
        seen.setdefault(rate, set()).add(tuple(p["prompt"] for p in prompts))
        slow = 10 if rate > server.knee else 1
        return {"ttfts": [slow * 1.0] * len(prompts), "itls": [[slow * 0.01]] * len(prompts),
                "output_lens": [8] * len(prompts), "failed": 0, "p90_ttft_ms": slow * 1e3,
                "mean_tpot_ms": slow * 10.0}

    monkeypatch.setattr(g, "bench_serve", bench_serve)


def test_a_resumed_run_keeps_finished_repetitions_and_each_rate_s_prompts(tmp_path,
                                                                          monkeypatch):
    from pdserve.bench.goodput import finished_reps, run

    knees = {"vllm": 0.5, "default": 0.6, "slo4t4": 0.7}
    started: list[str] = []
    seen: dict = {}
    _fake_servers(monkeypatch, knees, started, seen)
    cfg = GoodputConfig(arms=("vllm", "default", "slo4t4"), ttft_scales=(4,),
                        tpot_scales=(4,), reps=1, requests=4, max_points=6,
                        out_dir=str(tmp_path))
    first = run(cfg, progress=lambda line: None)
    assert started == ["vllm", "default", "slo"] and len(first["reps"]) == 1
    # a second sitting: --reps 3 with --resume runs repetitions 2 and 3 only, the
    # second in reversed order (vLLM last, so its SLO base is a server of its own)
    started.clear()
    record = run(replace(cfg, reps=3), progress=lambda line: None, resume=True)
    assert started == ["vllm", "slo", "default", "vllm", "vllm", "default", "slo"]
    assert len(record["reps"]) == 3 and record["reps"][0] == json.loads(
        json.dumps(first["reps"][0]))
    # every visit of a rate, in either sitting, sent that rate's one slice
    assert seen and all(len(prompts) == 1 for prompts in seen.values())
    gp = summarize(record, cfg.pairs)["summarize"]["pairs"]["ttft x4 tpot x4"]["arms"]
    assert gp["default"]["goodput"]["reps"] == pytest.approx([0.6] * 3, rel=0.1)
    # a repetition cut short is run again; another configuration is refused, naming it
    cut = dict(record, reps=record["reps"][:2] + [{"workloads": {"summarize": {
        "arms_unloaded": {"vllm": {}}, "arms": {}}}}])
    assert len(finished_reps(cut, replace(cfg, reps=3))) == 2
    with pytest.raises(ValueError, match="requests=4"):
        finished_reps(record, replace(cfg, requests=100))
    saved = tmp_path / "goodput.json"
    saved.write_text(json.dumps(dict(json.loads(saved.read_text()), vllm_setting={"x": 1})))
    with pytest.raises(ValueError, match="vLLM setting"):
        run(replace(cfg, reps=4), progress=lambda line: None, resume=True)
