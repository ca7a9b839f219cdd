"""pdserve/bench/kv_pull.py without a cluster: the least-squares fit of pull seconds
against bytes recovers a known latency and bandwidth, and the table shows each history
length's two TTFTs and their ratio. (The cluster's run is the benchmark itself.)"""

import pytest

from pdserve.bench.kv_pull import PullPoint, as_json, fit, table


def point(n, pull_bytes, pull_s):
    return PullPoint(n, 3, 1.0, 0.25, 0.25, pull_s, pull_bytes, 400.0, 3 * n // 16, 0)


def test_fit_recovers_latency_and_bandwidth():
    pts = [point(n, n * 46_080, 0.006 + n * 46_080 / 1.4e9) for n in (256, 512, 1024, 2048)]
    latency_s, bytes_per_s = fit(pts)
    assert latency_s == pytest.approx(0.006, rel=1e-6)
    assert bytes_per_s == pytest.approx(1.4e9, rel=1e-6)
    assert as_json(pts, {})["fit"]["latency_s"] == pytest.approx(0.006, rel=1e-6)


def test_table_shows_both_ttfts_and_the_ratio():
    text = table([point(512, 23_592_960, 0.02)])
    assert "512" in text and "1000 ms" in text and "250 ms" in text and "0.250" in text
    assert "20.0 ms" in text and "23.6" in text
