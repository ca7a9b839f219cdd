"""The disk KV tier through the real server, against what its disk and its directory
do to it (engine/kv_disk_tier.py, engine/kv_disk_files.py): a disk frozen mid-load costs
the requests that hit it their load budget only; scale-out / scale-in cycles leave a slab
per live worker, the directory within its bound; a weight changed in place serves no
disk hit. Every answer is HF's greedy one, and every pool is free at the end."""

from __future__ import annotations

import os
import threading
import time

import pytest
import ray
from serving import Served, hf_greedy, start_ray
from test_serve_kv_tiers import (BLOCK, BLOCK_BYTES, FULL_BLOCKS, GIB, MAX_TOKENS, greedy,
                                 prefill_status, prompt)

pytestmark = pytest.mark.slow


def test_a_disk_frozen_mid_load_costs_its_requests_their_load_budget_only(tmp_path):
    """The prefill worker's disk stops answering (its disk tier's transfers block, as on
    a hung mount: a shim put into the worker's process) while three requests whose
    prefix is on disk arrive: each waits out the 1 s load budget at most, its prompt then
    computed, and answers HF's tokens; the loads cut are counted; once the disk answers
    again the worker serves on, every pool free."""
    start_ray()
    served = Served(prefill_blocks=20, kv_host_cache_gib=10 * BLOCK_BYTES / GIB,
                    kv_disk_cache_dir=str(tmp_path / "tier"),
                    kv_disk_cache_gib=64 * (4096 + BLOCK_BYTES) / GIB,
                    kv_tier_load_timeout_s=1.0)
    a, b, c = prompt(0), prompt(1), prompt(2)
    want = hf_greedy("default", a, MAX_TOKENS)
    [p] = served.cluster.prefill

    def freeze(worker, on: bool):
        """In the worker: its disk tier's NIXL transfers block until thawed."""
        import threading as th

        disk = worker.tiers.disk
        if on:
            thawed, agent = th.Event(), disk.agent

            class Frozen:
                def __getattr__(self, name):
                    return getattr(agent, name)

                def transfer(self, handle):
                    thawed.wait(120)
                    return agent.transfer(handle)

            disk.agent, disk.thaw = Frozen(), thawed
        else:
            disk.thaw.set()

    try:
        start = time.monotonic()
        assert greedy(served, a) == want
        cold_s = time.monotonic() - start             # a computed whole
        greedy(served, b)
        greedy(served, c)
        s1 = prefill_status(served)
        assert s1.kv_tier_disk_blocks == 14, s1        # a's 8 blocks (and more) on disk
        ray.get(p.__ray_call__.remote(freeze, True), timeout=30)
        took, results = {}, {}

        def ask(k):
            t0 = time.monotonic()
            results[k] = greedy(served, a)
            took[k] = time.monotonic() - t0

        threads = [threading.Thread(target=ask, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert results == {k: want for k in range(3)}, results
        s2 = prefill_status(served)
        assert s2.kv_tier_loads_timed_out >= 1 and s2.kv_tier_disk_hit_blocks == 0, s2
        # a budget, then a's tokens computed (three prompts in a batch, a fair share of
        # the two cores beside the cold run's)
        assert max(took.values()) < 1.0 + 3 * cold_s + 2.0, (took, cold_s)
        ray.get(p.__ray_call__.remote(freeze, False), timeout=30)
        assert greedy(served, c) == hf_greedy("default", c, MAX_TOKENS)
    finally:
        served.stop()


def test_scale_cycles_leave_a_slab_per_live_worker_within_the_directorys_bound(tmp_path):
    """--kv-disk-cache-gib 0.02 bounds the directory the prefill and decode workers'
    disk tiers share (tiny Llama): six scale-out / scale-in cycles of the prefill pool,
    each new prefill worker adopting the slab the last retired one left (a scale-out
    starts warm: the slabs never number more than the live workers and that one), and
    once a retired worker's slab has been free for kv_disk_reclaim_after_s, the live
    workers reclaim it: a slab per live worker, the directory within its bound."""
    from tiny_models import tiny_model_dir

    start_ray()
    model = str(tiny_model_dir("llama"))
    block_bytes = 3 * 2 * 2 * BLOCK * 16 * 4        # 3 layers, K/V, 2 KV heads, 16 dims
    d, budget = tmp_path / "tier", int(0.02 * GIB)
    served = Served(model, prefill_blocks=20, decode_blocks=64,
                    kv_host_cache_gib=4 * block_bytes / GIB, kv_disk_cache_dir=str(d),
                    kv_disk_cache_gib=0.02, kv_disk_reclaim_after_s=2.0)

    def slabs():
        return sorted(d.glob("*.kvslab"))

    try:
        assert len(slabs()) == 2                      # prefill-0's and decode-0's
        most = 0
        for cycle in range(6):
            up = served.client.scale(2, 1, timeout_s=120)
            assert len(up.started) == 1, up
            served.generate(prompt(cycle), max_tokens=2, temperature=0, ignore_eos=True)
            most = max(most, len(slabs()))
            down = served.client.scale(1, 1, timeout_s=120)
            assert len(down.retired) == 1, down
            most = max(most, len(slabs()))
        assert most <= 3, most                        # a new worker adopted the free slab
        deadline = time.monotonic() + 60
        while not (len(slabs()) <= 2 and sum(p.stat().st_size for p in slabs()) <= budget):
            assert time.monotonic() < deadline, [(p.name, p.stat().st_size) for p in slabs()]
            time.sleep(0.2)
    finally:
        served.stop()
    assert sum(p.stat().st_size for p in slabs()) <= budget


def test_a_weight_changed_in_place_serves_no_disk_hit(tmp_path, monkeypatch):
    """A fine-tune of the same shape written over the same checkpoint (same size, its
    mtime set back) between two cluster starts that keep one secret: the fingerprint
    hashes the whole file, so the restarted workers read nothing of the old model's disk
    entries, and compute the prompt on the new weights (HF's tokens for them)."""
    from serving import assert_greedy_equals_hf
    from tiny_models import make_tiny_model

    start_ray()
    monkeypatch.setenv("PDSERVE_KV_SECRET", "kept-across-starts")
    model = make_tiny_model("llama", tmp_path / "model")
    block_bytes = 3 * 2 * 2 * BLOCK * 16 * 4        # 3 layers, K/V, 2 KV heads, 16 dims
    kw = dict(prefill_blocks=20, kv_host_cache_gib=4 * block_bytes / GIB,
              kv_disk_cache_dir=str(tmp_path / "tier"),
              kv_disk_cache_gib=64 * (4096 + block_bytes) / GIB,
              decode_kw=dict(kv_host_cache_gib=0, kv_disk_cache_dir=None, kv_disk_cache_gib=0))
    a, b = prompt(0), prompt(1)

    def ask(served, p):
        return served.generate(p, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)[0]

    served = Served(str(model), **kw)
    try:
        ask(served, a)
        ask(served, b)                                 # a's blocks go to the disk tier
        assert prefill_status(served).kv_tier_disk_blocks >= FULL_BLOCKS
    finally:
        served.stop()
    weights = model / "model.safetensors"
    st = weights.stat()
    data = bytearray(weights.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 4096, 4):
        data[i] ^= 0x01                                # low mantissa bits of ~1k weights
    weights.write_bytes(data)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert weights.stat().st_size == st.st_size
    served = Served(str(model), **kw)
    try:
        got = ask(served, a)
        s = prefill_status(served)
        assert s.kv_tier_disk_hit_blocks == 0 and s.prefill_tokens_computed == len(a), s
        assert_greedy_equals_hf(str(model), a, got)   # the new weights' answer
    finally:
        served.stop()
