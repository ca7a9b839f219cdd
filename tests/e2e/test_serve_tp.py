"""Tensor-parallel workers through the full path (gRPC → router → a prefill worker of
N Ray actors in one placement group → each prefill rank's KV heads over TCP to the
decode ranks that hold them → a decode worker of M ranks), greedy outputs equal to HF
transformers `generate` (or differing first at a near-tie that the test shows,
serving.assert_greedy_equals_hf), every KV pool free afterwards and every decode
rank's receiver without an open reservation. (P TP, D TP) with 4 query / 2 KV heads:
(2,1), (1,2), (2,2) split the KV heads; (4,1) replicates them on the prefill side (two
ranks send nothing, tp_plan.py) and (1,4) on the decode side (two ranks receive each
head); 8 / 2 heads at (4,2): replicated on P, split on D; and the default model (9/3
heads) at (3,1)."""

from __future__ import annotations

import pytest
import ray
from serving import Served, assert_greedy_equals_hf, start_ray
from tiny_models import make_tiny_model, tiny_model_dir

pytestmark = pytest.mark.slow

NIXL = pytest.mark.skipif(
    __import__("pdserve.kv_transfer.nixl", fromlist=["x"]).find_module() is None,
    reason="NIXL (nixl-cu12) not installed")
PROMPTS = [[1, 500, 77], list(range(100, 117)), list(range(2000, 2040)), [5] * 9]
NEW_TOKENS = 12


def assert_ranks_idle(served: Served) -> None:
    """Every decode rank's KV receiver has no open reservation (rank 0's pool is
    checked by Served.stop)."""
    for d in served.cluster.decode:
        assert [r["kv_reservations"] for r in ray.get(d.ranks.remote())] == [0] * (
            ray.get(d.status.remote()).tensor_parallel_size - 1)


@pytest.mark.parametrize("prefill_tp, decode_tp, heads, transport", [
    (2, 1, 4, "tcp"), (4, 1, 4, "tcp"), (1, 2, 4, "tcp"), (2, 2, 4, "tcp"), (1, 4, 4, "tcp"),
    (4, 2, 8, "tcp"),               # 8 / 2 heads: two query heads per rank at TP 4
    # NIXL's one-sided writes of head runs: two writers per request, one writer to two
    pytest.param(2, 1, 4, "nixl", marks=NIXL), pytest.param(1, 2, 4, "nixl", marks=NIXL)])
def test_tiny_model_tp_equals_hf(prefill_tp, decode_tp, heads, transport, tmp_path):
    start_ray()
    model = str(tiny_model_dir("llama") if heads == 4 else
                make_tiny_model("llama", tmp_path / "m", num_attention_heads=heads))
    served = Served(model, decode_blocks=64, prefill_blocks=64, prefill_tp=prefill_tp,
                    decode_tp=decode_tp, transport=transport,
                    prefill_chunk_size=16)          # the 40-token prompt goes in 3 chunks
    try:
        sizes = {w.role: w.tensor_parallel_size for w in served.client.status().workers}
        assert sizes == {"prefill": prefill_tp, "decode": decode_tp}
        results = served.generate_many(PROMPTS, max_tokens=NEW_TOKENS, temperature=0,
                                       ignore_eos=True)
        for prompt, (ids, _, reason) in zip(PROMPTS, results):
            assert reason == "length"
            assert_greedy_equals_hf(model, prompt, ids)
        again = served.generate(PROMPTS[2], max_tokens=NEW_TOKENS, temperature=0,
                                ignore_eos=True)     # P's prefix cache, D's cached prefix
        assert again[0] == results[2][0]
        served.assert_all_free()
        assert_ranks_idle(served)
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
    """kill -9 of prefill rank 1, its host KV tier holding blocks: rank 0's next step
    order fails, rank 0 exits, Ray restarts the worker (new epoch) with new ranks, and
    the router's failover serves every request in flight, equal to HF (the tiers' hits
    are gone with the processes: misses, not errors); every pool free after."""
    import os
    import signal
    import threading
    import time

    import ray

    start_ray()
    model = str(tiny_model_dir("llama"))
    served = Served(model, decode_blocks=64, prefill_blocks=64, prefill_tp=2,
                    kv_host_cache_gib=1 / 1024)
    try:
        p = served.cluster.prefill[0]
        served.generate(PROMPTS[2], max_tokens=1, temperature=0)   # its 2 full blocks stored
        deadline = time.monotonic() + 30        # by every rank's tiers thread
        while (before := ray.get(p.status.remote())).kv_tier_host_blocks < 2:
            assert time.monotonic() < deadline, before
            time.sleep(0.05)
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


def test_a_killed_decode_rank_loses_no_stream():
    """The kill test with a decode worker of 2 ranks: kill -9 of rank 1 while
    every stream is mid-decode; rank 0's next step fails, it exits, Ray restarts the
    worker (new epoch, new ranks), and the router resumes each stream after the tokens
    it had sent: nothing repeated, nothing missing, equal to HF."""
    import os
    import signal
    import threading
    import time

    from pdserve.client import make_request

    start_ray()
    model = str(tiny_model_dir("llama"))
    n = 400
    served = Served(model, decode_blocks=256, prefill_blocks=64, decode_tp=2)
    try:
        d = served.cluster.decode[0]
        before = ray.get(d.status.remote())
        [rank1] = ray.get(d.ranks.remote())
        tokens = [[] for _ in PROMPTS]
        errors = []

        def run(i):
            try:
                for msg in served.client.stream(make_request(
                        PROMPTS[i], max_tokens=n, temperature=0, ignore_eos=True)):
                    tokens[i] += msg.token_ids
            except Exception as e:      # grpc.RpcError: the test fails below
                errors.append(e)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while not all(len(t) >= 4 for t in tokens):
            assert time.monotonic() < deadline and not errors, (tokens, errors)
            time.sleep(0.002)
        assert all(len(t) < n for t in tokens), "finished before the kill"
        os.kill(rank1["pid"], signal.SIGKILL)        # this test's own rank, by its pid
        for t in threads:
            t.join(240)
        assert not errors, errors
        for prompt, got in zip(PROMPTS, tokens):
            assert len(got) == n
            assert_greedy_equals_hf(model, prompt, got)
        after = ray.get(d.status.remote())
        assert after.epoch != before.epoch and after.pid != before.pid   # restarted whole
        served.assert_all_free()
        assert_ranks_idle(served)
    finally:
        served.stop()
