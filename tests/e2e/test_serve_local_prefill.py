"""Decode-side prefix cache and conditional local prefill through the real server:
short uncached prompts are prefilled on the decode worker (no prefill worker, no
transfer); longer ones go to the prefill worker, which sends only the blocks D lacks.
Every answer equals HF transformers' greedy tokens; every pool ends free."""

from __future__ import annotations

import os

import pytest
import ray
from serving import Served, hf_greedy, start_ray

pytestmark = pytest.mark.slow

LOCAL_MAX = 64
MAX_TOKENS = 8
BLOCK_SIZE = 16


def _counters(served: Served) -> tuple[dict, dict]:
    [p] = ray.get([w.status.remote() for w in served.cluster.prefill])
    [d] = ray.get([w.status.remote() for w in served.cluster.decode])
    return p, d


def test_local_prefill_and_only_missing_blocks_sent():
    start_ray()
    served = Served(local_prefill_max_tokens=LOCAL_MAX)
    try:
        short = [300 + 7 * i for i in range(20)]
        long = [1000 + (i * 37) % 20000 for i in range(300)]             # 18 full blocks + 12
        longer = long + [50 + i for i in range(100)]                        # +100: 112 uncached
        follow = long + [70 + i for i in range(30)]                         # +30: 42 uncached
        steps = []   # (name, prompt, P counters after, D counters after)
        for name, prompt in (("short", short), ("long", long), ("longer", longer),
                             ("follow", follow)):
            got, _, _ = served.generate(prompt, max_tokens=MAX_TOKENS, temperature=0,
                                        ignore_eos=True)
            assert got == hf_greedy("default", prompt, MAX_TOKENS, ignore_eos=True), name
            steps.append((name, *_counters(served)))
        (_, p0, d0), (_, p1, d1), (_, p2, d2), (_, p3, d3) = steps

        # short: prefilled on D, the prefill worker never saw it
        assert d0.local_prefills == 1
        assert p0.prefill_tokens_computed == 0 and p0.kv_bytes_sent == 0
        # long: remote, every block sent; D caches its 18 full prompt blocks
        assert d1.local_prefills == 1
        assert p1.prefill_tokens_computed == len(long)
        per_block = p1.kv_bytes_sent / 19
        assert per_block > 0 and d1.prefix_cache_blocks >= 18
        # longer: 112 uncached > 64, remote; D holds 18 blocks, so only 7 of 25 are sent
        assert d2.prefix_cache_hit_tokens - d1.prefix_cache_hit_tokens == 18 * BLOCK_SIZE
        assert p2.kv_bytes_sent - p1.kv_bytes_sent == 7 * per_block
        assert d2.local_prefills == 1
        # follow: 42 uncached after D's 18 cached blocks: prefilled on D
        assert d3.local_prefills == 2
        assert d3.prefix_cache_hit_tokens - d2.prefix_cache_hit_tokens == 18 * BLOCK_SIZE
        assert (p3.prefill_tokens_computed, p3.kv_bytes_sent) == \
            (p2.prefill_tokens_computed, p2.kv_bytes_sent)
    finally:
        served.stop()


def test_chunked_local_prefill_beside_running_requests_matches_hf():
    """The colocated setup of `pdserve bench serve`: every prompt prefilled on D, in
    32-token chunks, while the other requests decode in the same steps."""
    start_ray()
    served = Served(local_prefill_max_tokens=1 << 30, prefill_chunk_size=32)
    try:
        prompts = [[200 + (i * 13 + j * 7) % 5000 for j in range(n)]
                   for i, n in enumerate((150, 90, 40, 230))]
        got = served.generate_many(prompts, max_tokens=MAX_TOKENS, temperature=0,
                                   ignore_eos=True)
        for prompt, (ids, _, _) in zip(prompts, got):
            assert ids == hf_greedy("default", prompt, MAX_TOKENS, ignore_eos=True)
        # n samples of a prompt D prefills in chunks: forked once its last chunk ran
        want = hf_greedy("default", prompts[0], MAX_TOKENS, ignore_eos=True)
        assert served.samples(prompts[0], max_tokens=MAX_TOKENS, temperature=0,
                              ignore_eos=True, n=3) == {0: want, 1: want, 2: want}
        p, d = _counters(served)
        assert d.local_prefills == len(prompts) + 1 and p.prefill_tokens_computed == 0
        assert d.peak_batch_size >= 2          # chunks ran beside other rows
    finally:
        served.stop()


def test_a_prompt_arriving_while_the_prefill_worker_is_idle_is_prefilled_on_decode():
    """router.local_prefill_when_prefill_idle (on for `pdserve serve`): a lone prompt is
    computed by D with the idle prefill worker's threads lent to it (both cores); of
    two prompts sent together, one goes to D and the other to P, which is no longer
    idle once the first is charged to D. Outputs equal HF greedy."""
    start_ray()
    served = Served(router_kw={"local_prefill_when_prefill_idle": True})
    try:
        lone = [400 + (i * 11) % 3000 for i in range(150)]
        got, _, _ = served.generate(lone, max_tokens=MAX_TOKENS, temperature=0,
                                    ignore_eos=True)
        assert got == hf_greedy("default", lone, MAX_TOKENS, ignore_eos=True)
        p, d = _counters(served)
        assert d.local_prefills == 1 and p.prefill_tokens_computed == 0
        own = max(1, (os.cpu_count() or 1) // 2)                           # per worker
        assert d.step_threads == min(2 * own, len(os.sched_getaffinity(0)))  # P's lent
        pair = [[900 + (i * 29 + k * 5) % 4000 for i in range(400)] for k in range(2)]
        got = served.generate_many(pair, max_tokens=MAX_TOKENS, temperature=0,
                                   ignore_eos=True)
        for prompt, (ids, _, _) in zip(pair, got):
            assert ids == hf_greedy("default", prompt, MAX_TOKENS, ignore_eos=True)
        p, d = _counters(served)
        assert d.local_prefills == 2 and p.prefill_tokens_computed == 400
    finally:
        served.stop()


def test_a_tpot_slo_splits_a_local_prefill_beside_running_streams():
    """With a TPOT SLO no step meets (1 ns), the decode worker's steps beside a running
    stream hold one block of a local prefill each (decode_worker/step_budget.py): a
    400-token prompt takes 25 steps, each giving the stream a token, where one 512-token
    chunk would take one. Both answers equal HF's."""
    import threading
    import time

    from tiny_models import tiny_model_dir

    from pdserve.client import make_request

    start_ray()
    model = str(tiny_model_dir("llama"))
    served = Served(model, local_prefill_max_tokens=1000, router_kw={"slo_tpot_ms": 1e-6})
    stream_prompt, prompt = [5, 6, 7], [900 + (i * 13) % 4000 for i in range(400)]
    got: list[int] = []
    try:
        def run():
            for msg in served.client.stream(make_request(stream_prompt, max_tokens=400,
                                                         temperature=0, ignore_eos=True)):
                got.extend(msg.token_ids)

        t = threading.Thread(target=run)
        t.start()
        while len(got) < 20:          # the budget's line learned on the stream's steps
            assert t.is_alive()
            time.sleep(0.01)
        before = len(got)
        first = next(iter(served.client.stream(make_request(prompt, max_tokens=1,
                                                            temperature=0))))
        during = len(got) - before
        t.join(120)
        assert during >= 20, (before, during)
        assert list(first.token_ids) == hf_greedy(model, prompt, 1)
        assert got == hf_greedy(model, stream_prompt, 400, ignore_eos=True)
    finally:
        served.stop()
