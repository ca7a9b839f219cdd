"""pdserve/bench/tracing.py's arithmetic: each pair's throughput traced ÷ off, whichever
ran first, their median and range, and the spans a traced request exported."""

import pytest

from pdserve.bench.tracing import (TracingRun, as_json, peer_as_json, peer_summary, ratios,
                                   summary)


def test_pairs_compare_on_with_off_whichever_ran_first():
    runs = [TracingRun(0, False, 100.0, 56, 0), TracingRun(0, True, 90.0, 56, 504),
            TracingRun(1, True, 110.0, 56, 560), TracingRun(1, False, 100.0, 56, 0),
            TracingRun(2, False, 80.0, 56, 0), TracingRun(2, True, 80.0, 56, 532)]
    assert ratios(runs) == pytest.approx([0.9, 1.1, 1.0])
    s = summary(runs)
    assert (s["ratio_on_off_median"], s["ratio_on_off_min"], s["ratio_on_off_max"]) == \
        pytest.approx((1.0, 0.9, 1.1))
    assert s["spans_per_request"] == pytest.approx(9.5)
    assert as_json(runs, {"pairs": 3})["runs"][1]["spans"] == 504


def _peer(pair: int, arm: str, greedy: float, sampled: float, spans: int = 0) -> dict:
    return {"pair": pair, "arm": arm, "spans": spans,
            "runs": {"t0_s1": {"output_throughput": greedy, "completed": 64},
                     "t1_s101": {"output_throughput": sampled, "completed": 64}}}


def test_the_peer_harness_compares_on_with_off_and_off_with_the_build_before():
    """Per cell and pair: on ÷ off and off ÷ before, whatever order the arms ran in."""
    records = [_peer(0, "off", 100, 50), _peer(0, "on", 95, 50, 1290),
               _peer(0, "before", 100, 52),
               _peer(1, "on", 100, 48, 1161), _peer(1, "before", 80, 50),
               _peer(1, "off", 100, 48)]
    s = peer_summary(records)
    assert s["t0_s1"]["on_off"]["pairs"] == pytest.approx([0.95, 1.0])
    assert s["t0_s1"]["off_before"]["pairs"] == pytest.approx([1.0, 1.25])
    assert s["t1_s101"]["off_before"]["median"] == pytest.approx((50 / 52 + 48 / 50) / 2)
    assert (s["t1_s101"]["on_off"]["min"], s["t1_s101"]["on_off"]["max"]) == (1.0, 1.0)
    assert s["spans_per_request"] == pytest.approx((10 + 9) / 2)     # 129 requests each
    out = peer_as_json(records, {"pairs": 2})
    assert out["summary"] == s and out["config"] == {"pairs": 2}
    assert out["sessions"][1] == {"pair": 0, "arm": "on", "spans": 1290}   # no client runs


def test_without_a_build_before_only_on_and_off_are_compared():
    s = peer_summary([_peer(0, "off", 100, 50), _peer(0, "on", 90, 45, 129)])
    assert set(s["t0_s1"]) == {"on_off"}
