"""pdserve/request_ids.py: an attempt's id names its router replica, found again from
the id or any of its samples' ids, whatever the client's id holds, and carries 128 random
bits, so that attempts at requests reusing one client id never share an id."""

from pdserve.decode_worker.fork import sample_id
from pdserve.request_ids import attempt_id, router_of


def test_the_router_index_comes_back_from_an_attempt_and_its_samples():
    for client in ("r", "a#b", "x#3.0123abcd", "#", "😀/7", ""):
        for router in (0, 1, 12):
            a = attempt_id(client, router)
            assert a.startswith(client + "#") and a != attempt_id(client, router)
            assert router_of(a) == router and router_of(sample_id(a, 3)) == router


def test_an_id_without_the_tag_is_router_0s():
    for rid in ("plain", "a#b", "a#1.xyz", "a#1.0123abcd/x", "bench-7"):
        assert router_of(rid) == 0


def test_an_attempt_id_carries_128_random_bits():
    """Attempts at requests reusing one client id are told apart by the tag alone (a
    decode worker's reserve is idempotent per id): 32 hex digits, 128 bits."""
    tags = [attempt_id("same", 0).rpartition(".")[2] for _ in range(2000)]
    assert all(len(t) == 32 and int(t, 16) >= 0 for t in tags)
    assert len(set(tags)) == len(tags)
    assert len({t[:8] for t in tags}) == len(tags)     # no 32-bit prefix repeats either
