"""pdserve/bench/tracing.py's arithmetic: each pair's throughput traced ÷ off, whichever
ran first, their median and range, and the spans a traced request exported."""

import pytest

from pdserve.bench.tracing import TracingRun, as_json, ratios, summary


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
