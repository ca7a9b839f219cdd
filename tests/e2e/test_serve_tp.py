"""Tensor-parallel prefill workers through the full path (gRPC → router → a prefill
worker of N Ray actors in one placement group → each rank's KV heads over TCP → a
decode worker of one rank), greedy outputs equal to HF transformers `generate` (or
differing first at a near-tie that the test shows, serving.assert_greedy_equals_hf),
every KV pool free afterwards. Sizes: 4 query / 2 KV heads at TP 2 (KV heads split),
at TP 4 (replicated: two ranks send nothing, tp_plan.py), and the default model (9/3)
at TP 3."""

from __future__ import annotations

import pytest
from serving import Served, assert_greedy_equals_hf, start_ray
from tiny_models import tiny_model_dir

pytestmark = pytest.mark.slow

PROMPTS = [[1, 500, 77], list(range(100, 117)), list(range(2000, 2040)), [5] * 9]
NEW_TOKENS = 12


@pytest.mark.parametrize("prefill_tp", [2, 4])
def test_tiny_model_prefill_tp_equals_hf(prefill_tp):
    start_ray()
    model = str(tiny_model_dir("llama"))
    served = Served(model, decode_blocks=64, prefill_blocks=64, prefill_tp=prefill_tp,
                    prefill_chunk_size=16)          # the 40-token prompt goes in 3 chunks
    try:
        sizes = {w.role: w.tensor_parallel_size for w in served.client.status().workers}
        assert sizes == {"prefill": prefill_tp, "decode": 1}
        results = served.generate_many(PROMPTS, max_tokens=NEW_TOKENS, temperature=0,
                                       ignore_eos=True)
        for prompt, (ids, _, reason) in zip(PROMPTS, results):
            assert reason == "length"
            assert_greedy_equals_hf(model, prompt, ids)
        again = served.generate(PROMPTS[2], max_tokens=NEW_TOKENS, temperature=0,
                                ignore_eos=True)     # P's prefix cache, D's cached prefix
        assert again[0] == results[2][0]
    finally:
        served.stop()          # asserts every KV block on every worker is free


def test_default_model_at_prefill_tp_3_equals_hf():
    start_ray()
    served = Served("default", decode_blocks=64, prefill_blocks=64, prefill_tp=3)
    try:
        prompts = PROMPTS[:2]
        for prompt, (ids, _, _) in zip(prompts, served.generate_many(
                prompts, max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)):
            assert_greedy_equals_hf("default", prompt, ids)
    finally:
        served.stop()


def test_a_size_the_model_cannot_split_fails_the_start_naming_the_field():
    from pdserve.cluster import ClusterStartError

    start_ray()
    with pytest.raises(ClusterStartError, match="tensor-parallel size 3 does not divide "
                                                "the model's num_attention_heads=4"):
        Served(str(tiny_model_dir("llama")), decode_blocks=64, prefill_blocks=64,
               prefill_tp=3)


def test_a_killed_rank_takes_its_worker_down_and_no_request_is_lost():
    """kill -9 of prefill rank 1: rank 0's next step order fails, rank 0 exits, Ray
    restarts the worker (new epoch) with new ranks, and the router's failover (issue 6)
    serves every request in flight, equal to HF; every pool free after."""
    import os
    import signal
    import threading

    import ray

    start_ray()
    model = str(tiny_model_dir("llama"))
    served = Served(model, decode_blocks=64, prefill_blocks=64, prefill_tp=2)
    try:
        p = served.cluster.prefill[0]
        before = ray.get(p.status.remote())
        [rank1] = ray.get(p.ranks.remote())
        os.kill(rank1["pid"], signal.SIGKILL)       # this test's own rank, by its pid
        results = [None] * len(PROMPTS)

        def run(i):
            results[i] = served.generate(PROMPTS[i], max_tokens=NEW_TOKENS, temperature=0,
                                         ignore_eos=True)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(240)
        for prompt, got in zip(PROMPTS, results):
            assert got is not None and got[2] == "length", got
            assert_greedy_equals_hf(model, prompt, got[0])
        after = ray.get(p.status.remote())
        assert after.epoch != before.epoch and after.pid != before.pid   # restarted whole
        [new_rank1] = ray.get(p.ranks.remote())
        assert new_rank1["pid"] != rank1["pid"]
    finally:
        served.stop()
