"""KV-aware routing through the real server: with two prefill workers, a prompt that
repeats a cached prefix goes to the worker holding it (not to the idle one); with two
decode workers and decode_routing_policy cache_aware, a next turn goes to the decode
worker holding its history, though the other has fewer streams."""

from __future__ import annotations

import time

import pytest
import ray
from serving import Served, hf_greedy, start_ray

from pdserve.client import make_request

pytestmark = pytest.mark.slow


def _prompt(topic: str, n: int, question: str) -> list[int]:
    """`n` tokens of a topic-specific preamble, then a question (token ids)."""
    offset = sum(map(ord, topic)) * 7 % 5000
    base = [1000 + offset + (i * 7) % 300 for i in range(n)]
    return base + [3000 + ord(c) for c in question]


def _hits(served: Served) -> dict[str, int]:
    return {s.worker_id: s.prefix_cache_hit_tokens
            for s in ray.get([p.status.remote() for p in served.cluster.prefill])}


def test_repeat_goes_to_the_prefill_worker_holding_its_prefix():
    start_ray()
    # no local prefill on D: every repeat must reach a prefill worker
    served = Served(prefill_workers=2, local_prefill_max_tokens=0,
                    router_kw={"routing_policy": "kv_aware"})
    try:
        a = _prompt("trains", 480, "first?")
        b = _prompt("boats", 480, "second?")
        # Both at once: the router spreads them (the second sees the first's queue).
        served.generate_many([a, b], max_tokens=2, temperature=0)
        holder = {}
        for s in ray.get([p.status.remote() for p in served.cluster.prefill]):
            assert s.prefill_tokens_computed in (len(a), len(b)), s
            holder["a" if s.prefill_tokens_computed == len(a) else "b"] = s.worker_id
        assert len(set(holder.values())) == 2, holder       # one prefix on each worker
        time.sleep(0.5)                                       # > cache_sync_interval_s
        for name, prompt in (("b", b[:480] + [9, 9, 9]), ("a", a[:480] + [8, 8])):
            before = _hits(served)
            served.generate(prompt, max_tokens=2, temperature=0)
            after = _hits(served)
            gained = {w: after[w] - before[w] for w in after}
            assert gained[holder[name]] == 480 // 16 * 16, (name, gained, holder)
            assert sum(gained.values()) == gained[holder[name]]
    finally:
        served.stop()


def test_a_next_turn_goes_to_the_decode_worker_holding_its_history():
    start_ray()
    served = Served(prefill_workers=1, decode_workers=2, local_prefill_max_tokens=0,
                    router_kw={"decode_routing_policy": "cache_aware"})
    stream = None
    try:
        history = _prompt("trains", 480, "first?")
        served.generate(history, max_tokens=2, temperature=0)

        def decode_status():
            return {s.worker_id: s for s in served.decode_status()}

        [holder] = [w for w, s in decode_status().items() if s.prefix_cache_blocks]
        time.sleep(0.5)                                       # > cache_sync_interval_s
        # a long stream of another turn on the holder (where its history is): by load
        # alone, the next turn would go to the other decode worker
        stream = served.client.stream(make_request(history + [4000] * 8, max_tokens=3000,
                                                   temperature=0, ignore_eos=True))
        next(iter(stream))
        running = {w: s.running_requests for w, s in decode_status().items()}
        assert running[holder] == 1 and sum(running.values()) == 1, running
        time.sleep(0.5)                                       # > cache_sync_interval_s
        before = decode_status()
        turn = history + [5000 + i for i in range(20)]
        got = served.generate(turn, max_tokens=4, temperature=0)
        after = decode_status()
        gained = {w: after[w].prefix_cache_hit_tokens - before[w].prefix_cache_hit_tokens
                  for w in after}
        assert gained == {w: 480 if w == holder else 0 for w in after}, (gained, holder)
        assert got[0] == hf_greedy("default", turn, 4)
        # the router's count: the stream and the next turn went to the holder for its
        # cache, the history (held by none) by load
        from pdserve.bench.multiturn_servers import _prometheus
        router = _prometheus(f"http://{served.client.status().metrics_address}/metrics")
        assert [router[("pdserve_decode_placements_total", (("by", by),))]
                for by in ("cache", "load")] == [2, 1], router
    finally:
        if stream is not None:
            stream.cancel()
        served.stop()
