"""pdserve/bench/local_prefill.py: the rule that picks local_prefill_max_tokens."""

from pdserve.bench.local_prefill import Point, pick_threshold


def pt(n, remote, local, itl_remote=0.05, itl_local=0.05):
    return Point(n, remote, local, itl_remote, itl_local)


def test_largest_length_where_local_wins_and_stalls_little():
    points = [pt(16, 0.10, 0.05), pt(32, 0.12, 0.08), pt(64, 0.15, 0.14), pt(128, 0.2, 0.3)]
    assert pick_threshold(points) == 64


def test_a_loss_stops_the_sweep_even_if_a_longer_length_wins_again():
    points = [pt(64, 0.1, 0.2), pt(16, 0.1, 0.05), pt(32, 0.1, 0.05)]
    assert pick_threshold(points) == 32          # sorted by length; 64 loses


def test_itl_stall_beyond_tolerance_disqualifies():
    points = [pt(16, 0.1, 0.05), pt(32, 0.1, 0.05, itl_local=0.08)]
    assert pick_threshold(points, itl_tolerance=1.5) == 16
    assert pick_threshold(points, itl_tolerance=2.0) == 32


def test_zero_when_remote_always_wins():
    assert pick_threshold([pt(16, 0.05, 0.1)]) == 0
