"""KV-aware routing through the real server: with two prefill workers, a prompt that
repeats a cached prefix goes to the worker holding it (not to the idle one)."""

from __future__ import annotations

import time

import pytest
import ray
from serving import Served, start_ray

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
