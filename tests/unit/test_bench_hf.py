"""pdserve/bench/hf_baseline.py: static-batched HF generate, timed per step."""

import random

import pytest
from tiny_models import VOCAB_SIZE, tiny_model_dir

from pdserve.bench.hf_baseline import load_hf, run_hf
from pdserve.bench.workload import BenchRequest


@pytest.fixture(scope="module")
def hf():
    return load_hf(str(tiny_model_dir("llama")))


def test_static_batches_time_every_token(hf):
    rng = random.Random(0)
    max_tokens = [3, 9, 5, 7]
    reqs = [BenchRequest([rng.randrange(3, VOCAB_SIZE) for _ in range(rng.randint(4, 12))], n)
            for n in max_tokens]
    arrivals = [0.0, 0.0, 0.05, 0.1]
    done: list[int] = []
    results, duration_s = run_hf(hf, reqs, arrivals, batch_size=2, on_done=done.append)

    assert sum(done) == len(reqs) and all(1 <= n <= 2 for n in done)
    assert [r.prompt_tokens for r in results] == [len(r.prompt_token_ids) for r in reqs]
    for r, n, a in zip(results, max_tokens, arrivals):
        assert r.ok and not r.error
        assert len(r.token_times) == n                        # the batch's extra steps dropped
        assert r.ttft > 0                                     # nothing before its arrival
        assert all(b > a for a, b in zip(r.token_times, r.token_times[1:]))
        assert r.e2e == r.token_times[-1]
        assert duration_s >= a + r.e2e - 1e-9
    # The first batch is requests 0 and 1 (both at t=0): they share every step's time,
    # so request 0's tokens come out with request 1's first three.
    assert results[0].token_times == results[1].token_times[:3]
    # Requests 2 and 3 arrived while batch 1 ran: they wait for it to end.
    assert results[2].ttft + arrivals[2] > results[1].e2e
    assert duration_s == pytest.approx(max(a + r.e2e for r, a in zip(results, arrivals)))


def test_sleeps_until_a_late_arrival(hf):
    results, duration_s = run_hf(hf, [BenchRequest([5, 6, 7], 2)], [0.2], batch_size=4)
    assert results[0].ttft > 0 and duration_s > 0.2


def test_bad_input(hf):
    req = BenchRequest([5, 6], 2)
    with pytest.raises(ValueError, match="arrival times"):
        run_hf(hf, [req], [0.0, 1.0])
    with pytest.raises(ValueError, match="batch_size"):
        run_hf(hf, [req], [0.0], batch_size=0)
    with pytest.raises(ValueError, match="max_tokens"):
        run_hf(hf, [BenchRequest([5], 0)], [0.0])
    assert run_hf(hf, [], []) == ([], 0.0)
