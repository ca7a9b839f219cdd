"""KV tiers under the workers' pools, through the real server on the default model
(engine/kv_tiers.py): prefix blocks the prefill worker's pool evicted come back from the
host tier and the disk tier instead of being computed; the disk tier serves hits after a
`kill -9` of the worker (a request in flight then is retried, not lost); a damaged disk
entry is dropped and its tokens computed; the router's KV-aware routing sees which tier
holds which prefix, across the restart. On the decode worker, a history its pool
evicted loads back from its own host tier for a local prefill of the next turn; with
kv_pull, a next turn on the prefill worker reads the history from the decode worker
(every rank its KV heads, for tensor-parallel workers), or over NIXL from the prefill
worker whose host tier holds it, instead of computing it.
Every answer is HF's greedy one, and every pool is free at the end (each block a store
held given back)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import ray
from serving import Served, hf_greedy, start_ray

pytestmark = pytest.mark.slow
NIXL = pytest.mark.skipif(
    __import__("pdserve.kv_transfer.nixl", fromlist=["x"]).find_module() is None,
    reason="NIXL (nixl-cu12) not installed")

BLOCK = 16
FULL_BLOCKS = 8                    # per prompt, and 3 tokens in a ninth
MAX_TOKENS = 4
# the model's KV per block: 30 layers x K,V x 3 KV heads x 16 tokens x 64 x fp32
BLOCK_BYTES = 30 * 2 * 3 * BLOCK * 64 * 4
GIB = 1 << 30


def prompt(k: int) -> list[int]:
    return [100 + (i * 7919 + k * 104729) % 40000 for i in range(FULL_BLOCKS * BLOCK + 3)]


def next_turn(k: int) -> list[int]:
    """prompt(k)'s full blocks and 10 new tokens: a next turn of that history."""
    return prompt(k)[:FULL_BLOCKS * BLOCK] + [101 + i for i in range(10)]


def greedy(served: Served, p: list[int]) -> list[int]:
    return served.generate(p, max_tokens=MAX_TOKENS, temperature=0)[0]


def prefill_status(served: Served):
    [p] = served.cluster.prefill
    return ray.get(p.status.remote(), timeout=30)


def decode_status(served: Served):
    [d] = served.cluster.decode
    return ray.get(d.status.remote(), timeout=30)


def restarted(served: Served, pid: int, timeout_s: float = 180.0):
    """The prefill worker's status once Ray restarted it (a new pid) and it is ready."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            st = prefill_status(served)
            if st.pid != pid:
                return st
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass
        assert time.monotonic() < deadline, "the prefill worker did not come back"
        time.sleep(0.2)


def router_sees(served: Served, p: list[int], want: tuple[int, int, int],
                timeout_s: float = 60.0, worker: int = 0) -> None:
    """Wait until the router's mirror of prefill worker `worker`'s cache and tiers
    (routing.PrefixIndex, synced every cache_sync_interval_s) has `p`'s full blocks as
    `want`: (in its pool, then in its host tier, then on its disk)."""
    def matched(router):
        from pdserve.engine.block_pool import block_hashes
        w = router.placement.prefill[worker]
        return router.prefill_router.index.matched(w.worker_id, block_hashes(p, BLOCK))

    deadline = time.monotonic() + timeout_s
    while (got := ray.get(served.cluster.router.__ray_call__.remote(matched), timeout=60)
           ) != want:
        assert time.monotonic() < deadline, f"the router sees {got}, not {want}"
        time.sleep(0.1)


def test_evicted_prefix_blocks_load_back_from_host_and_disk_across_a_kill(tmp_path):
    start_ray()
    # the pool holds two prompts; the host tier ten blocks; the disk tier 64
    served = Served(prefill_blocks=20, kv_host_cache_gib=10 * BLOCK_BYTES / GIB,
                    kv_disk_cache_dir=str(tmp_path / "tier"),
                    kv_disk_cache_gib=64 * (4096 + BLOCK_BYTES) / GIB)
    a, b, c = prompt(0), prompt(1), prompt(2)
    want = {k: hf_greedy("default", p, MAX_TOKENS) for k, p in (("a", a), ("b", b), ("c", c))}

    def ask(p: list[int]) -> list[int]:
        return served.generate(p, max_tokens=MAX_TOKENS, temperature=0)[0]

    try:
        # a, b, c computed: a's blocks leave the pool; the host tier keeps the newest ten
        # blocks stored (b's last two, c's eight), the rest moved to disk
        assert [ask(p) for p in (a, b, c)] == [want["a"], want["b"], want["c"]]
        s1 = prefill_status(served)
        assert s1.kv_tier_host_blocks == 10 and s1.kv_tier_disk_blocks == 14, s1
        router_sees(served, a, (0, 0, FULL_BLOCKS))     # KV-aware routing knows the tiers
        router_sees(served, c, (FULL_BLOCKS, 0, 0))
        assert ask(a) == want["a"]                      # a's 8 blocks from disk
        s2 = prefill_status(served)
        assert s2.kv_tier_disk_hit_blocks - s1.kv_tier_disk_hit_blocks == FULL_BLOCKS
        assert s2.prefill_tokens_computed - s1.prefill_tokens_computed == 3   # the tail
        assert ask(c) == want["c"]                      # c's from the pool or the host
        # kill -9 with b in flight: retried on the restarted worker; the host tier is
        # gone with the process, the disk tier comes back
        result = {}
        t = threading.Thread(target=lambda: result.setdefault("b", ask(b)))
        t.start()
        os.kill(s2.pid, signal.SIGKILL)                 # this test's worker, by its pid
        s3 = restarted(served, s2.pid)
        t.join(300)
        assert result == {"b": want["b"]}
        assert s3.kv_tier_disk_blocks == 14, s3       # read back from the slab file
        router_sees(served, a, (0, 0, FULL_BLOCKS))     # and reported to the router
        assert ask(a) == want["a"]
        s4 = prefill_status(served)
        assert s4.kv_tier_disk_hit_blocks >= FULL_BLOCKS, (s3, s4)
        # every disk entry damaged, and the worker killed again (its pool and host tier
        # empty): a's first block fails its checksum and is dropped; a is computed whole
        _damage_every_slot(tmp_path / "tier")
        os.kill(s4.pid, signal.SIGKILL)
        restarted(served, s4.pid)
        assert ask(a) == want["a"]
        s5 = prefill_status(served)
        assert s5.kv_tier_dropped_blocks == 1 and s5.kv_tier_disk_hit_blocks == 0, s5
        assert s5.prefill_tokens_computed == len(a), s5
    finally:
        served.stop()


def test_a_next_turn_prefilled_on_decode_loads_the_history_from_its_host_tier():
    """The history's K/V reaches D from P and is stored to D's host tier; three other
    prompts push it out of D's pool (20 blocks); the next turn (history + 10 tokens,
    uncached 10 <= local_prefill_max_tokens once the tier's hit counts) is prefilled on D:
    8 blocks loaded, 10 tokens computed, nothing on P."""
    start_ray()
    served = Served(decode_blocks=20, local_prefill_max_tokens=16,
                    kv_host_cache_gib=32 * BLOCK_BYTES / GIB)
    history, turn = prompt(0), next_turn(0)
    want = hf_greedy("default", turn, MAX_TOKENS)
    try:
        for p in (history, prompt(1), prompt(2), prompt(3)):
            greedy(served, p)
        d1, p1 = decode_status(served), prefill_status(served)
        assert d1.kv_tier_host_blocks >= 4 * FULL_BLOCKS and d1.local_prefills == 0, d1
        assert greedy(served, turn) == want
        d2, p2 = decode_status(served), prefill_status(served)
        assert d2.local_prefills == 1 and d2.kv_tier_host_hit_blocks == FULL_BLOCKS, d2
        assert d2.prefill_tokens_computed - d1.prefill_tokens_computed == 10, d2
        assert p2.prefill_tokens_computed == p1.prefill_tokens_computed
    finally:
        served.stop()


def test_a_next_turn_prefilled_on_p_reads_the_history_from_the_decode_worker():
    """kv_pull: the history is computed on P and its K/V sent to D, which caches it;
    two other prompts push it out of P's pool (20 blocks). The next turn (history + 10
    tokens) goes to P (no local prefill): D's reservation holds the history's 8 blocks,
    P reads them from D over TCP (D to P) and computes the 10 new tokens only."""
    start_ray()
    served = Served(prefill_blocks=20, kv_pull=True)
    history, turn = prompt(0), next_turn(0)
    want = hf_greedy("default", turn, MAX_TOKENS)
    try:
        for p in (history, prompt(1), prompt(2)):
            greedy(served, p)
        p1, d1 = prefill_status(served), decode_status(served)
        assert p1.kv_pulled_blocks == 0 and p1.prefix_cache_blocks < 3 * FULL_BLOCKS, p1
        assert greedy(served, turn) == want
        p2, d2 = prefill_status(served), decode_status(served)
        assert p2.kv_pulled_blocks == FULL_BLOCKS and p2.kv_pull_failures == 0, p2
        assert p2.kv_pull_bytes == FULL_BLOCKS * BLOCK_BYTES, p2
        assert p2.prefill_tokens_computed - p1.prefill_tokens_computed == 10, p2
        assert d2.local_prefills == 0 and d2.prefill_tokens_computed == 0, d2
        # the one block D lacked went to D: the turn's last block only
        assert p2.kv_bytes_sent - p1.kv_bytes_sent == BLOCK_BYTES, p2
    finally:
        served.stop()


@NIXL
def test_a_next_turn_reads_the_history_from_the_prefill_worker_that_computed_it():
    """kv_pull across prefill workers over NIXL, placed round robin: the history is
    computed on P0 and stored to its host tier; four other prompts (P1, P0, P1, P0) push
    it out of D's pool (20 blocks, no tier) and its first blocks out of P0's (20
    blocks). The next turn goes to P1, which lacks it, as does D: the router names P0
    as the holder (its mirror of P0's host tier), P0 loads the 8 blocks from its host
    tier and sends them, P1 computes the 10 new tokens only, then sends D every block."""
    start_ray()
    served = Served(prefill_workers=2, prefill_blocks=20, decode_blocks=20, kv_pull=True,
                    transport="nixl", kv_host_cache_gib=32 * BLOCK_BYTES / GIB,
                    decode_kw={"kv_host_cache_gib": 0.0},
                    router_kw={"routing_policy": "round_robin"})
    history, turn = prompt(0), next_turn(0)
    want = hf_greedy("default", turn, MAX_TOKENS)

    def status():
        return ray.get([p.status.remote() for p in served.cluster.prefill], timeout=30)

    try:
        for p in (history, prompt(1), prompt(2), prompt(3), prompt(4)):
            greedy(served, p)
        router_sees(served, history, (0, FULL_BLOCKS, 0), worker=0)
        before = status()
        assert greedy(served, turn) == want
        p0, p1 = status()
        assert p1.kv_pulled_blocks == FULL_BLOCKS and p1.kv_pull_failures == 0, p1
        assert p1.prefill_tokens_computed - before[1].prefill_tokens_computed == 10, p1
        assert p0.kv_pulled_blocks == 0 and p0.prefill_tokens_computed == \
            before[0].prefill_tokens_computed, p0
        assert p0.kv_tier_host_hit_blocks - before[0].kv_tier_host_hit_blocks == \
            FULL_BLOCKS, p0
        # D held none of the turn (every block sent it): the 8 came from P0
        assert p1.kv_bytes_sent - before[1].kv_bytes_sent == (FULL_BLOCKS + 1) * BLOCK_BYTES
    finally:
        served.stop()


def test_tensor_parallel_workers_keep_their_kv_heads_in_their_own_tiers(tmp_path,
                                                                       monkeypatch):
    """Workers of two ranks (tiny Llama, 2 KV heads: one per rank), each rank with its
    own host tier and disk slab (engine/tp_tiers.py), sized as the first test's in
    blocks. A prefill worker of two ranks computes a, b, c, its pool evicting a's
    blocks; restarted (the cluster), it serves a's blocks from both ranks' disk slabs.
    A decode worker of two ranks: a next turn of a history its pool evicted loads it
    from both ranks' host tiers and is prefilled there. Answers are HF's greedy ones
    (up to a TP near-tie) and the answers computed whole."""
    from serving import assert_greedy_equals_hf
    from tiny_models import tiny_model_dir

    start_ray()
    # two cluster starts: one secret for both (the disk entries' MAC key comes from it)
    monkeypatch.setenv("PDSERVE_KV_SECRET", "kept-across-starts")
    model = str(tiny_model_dir("llama"))
    block_bytes = 3 * 2 * 2 * BLOCK * 16 * 4        # 3 layers, K/V, 2 KV heads, 16 dims
    p_tiers = dict(kv_host_cache_gib=10 * block_bytes / GIB,
                   kv_disk_cache_dir=str(tmp_path / "tier"),
                   kv_disk_cache_gib=2 * 64 * (4096 + block_bytes // 2) / GIB)
    a, b, c = prompt(0), prompt(1), prompt(2)

    def ask(served: Served, p: list[int]) -> list[int]:
        return served.generate(p, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)[0]

    served = Served(model, prefill_tp=2, prefill_blocks=20, decode_blocks=64, **p_tiers,
                    decode_kw=dict(kv_host_cache_gib=0, kv_disk_cache_dir=None,
                                   kv_disk_cache_gib=0))
    try:
        first = {k: ask(served, p) for k, p in (("a", a), ("b", b), ("c", c))}
        for k, p in (("a", a), ("b", b), ("c", c)):
            assert_greedy_equals_hf(model, p, first[k])
        s1 = prefill_status(served)
        assert s1.tensor_parallel_size == 2
        assert s1.kv_tier_host_blocks == 10 and s1.kv_tier_disk_blocks == 14, s1
    finally:
        served.stop()
    # the same prefill worker again, now beside a decode worker of two ranks with a host
    # tier of 32 blocks (each rank its own) and a pool of 20
    served = Served(model, prefill_tp=2, prefill_blocks=20, decode_tp=2, decode_blocks=20,
                    local_prefill_max_tokens=16, **p_tiers,
                    decode_kw=dict(kv_host_cache_gib=32 * block_bytes / GIB,
                                   kv_disk_cache_dir=None, kv_disk_cache_gib=0))
    try:
        s2 = prefill_status(served)
        assert s2.kv_tier_disk_blocks == 14, s2       # both ranks' slabs read back
        assert ask(served, a) == first["a"]           # a's 8 blocks from both ranks' disks
        s3 = prefill_status(served)
        assert s3.kv_tier_disk_hit_blocks == FULL_BLOCKS, s3
        assert s3.prefill_tokens_computed == 3, s3     # the tail
        assert len(list((tmp_path / "tier").glob("*.kvslab"))) == 2   # a slab per rank
        for p in (b, c, prompt(3)):                    # a leaves D's pool, stays in its tiers
            ask(served, p)
        d1, p1 = decode_status(served), prefill_status(served)
        assert d1.tensor_parallel_size == 2 and d1.local_prefills == 0, d1
        turn = next_turn(0)
        got = ask(served, turn)
        assert_greedy_equals_hf(model, turn, got)
        d2 = decode_status(served)
        assert d2.local_prefills == 1, d2
        assert d2.kv_tier_host_hit_blocks - d1.kv_tier_host_hit_blocks == FULL_BLOCKS, d2
        assert d2.prefill_tokens_computed - d1.prefill_tokens_computed == 10, d2
        assert prefill_status(served).prefill_tokens_computed == p1.prefill_tokens_computed
    finally:
        served.stop()


def test_a_prefill_worker_of_two_ranks_pulls_the_history_from_a_decode_worker_of_two():
    """kv_pull between tensor-parallel workers (tiny Llama, 2 KV heads: one per rank):
    as test_a_next_turn_prefilled_on_p_reads_the_history_from_the_decode_worker, each
    decode rank sending its KV head of the history's 8 blocks to the prefill rank that
    holds it (prefill_worker/kv_pull.py). The tiny model computes 8 blocks faster than
    a pull's fixed latency, so the prefill worker's cost model is pinned to read (the
    model itself: tests/unit/test_prefill_kv_pull.py). The answer is HF's greedy one
    (up to a TP near-tie), the 10 new tokens alone computed, and every rank's receiver
    idle."""
    from serving import assert_greedy_equals_hf
    from tiny_models import tiny_model_dir

    start_ray()
    model = str(tiny_model_dir("llama"))
    block_bytes = 3 * 2 * 2 * BLOCK * 16 * 4        # 3 layers, K/V, 2 KV heads, 16 dims
    served = Served(model, prefill_tp=2, decode_tp=2, prefill_blocks=20, kv_pull=True)

    def always_read(worker):
        from pdserve.prefill_worker.kv_pull import PullCost
        worker.pulls.cost = PullCost(tokens_per_s=1.0, alpha=0.0)

    try:
        ray.get(served.cluster.prefill[0].__ray_call__.remote(always_read), timeout=30)
        for p in (prompt(0), prompt(1), prompt(2)):
            served.generate(p, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        p1 = prefill_status(served)
        assert p1.kv_pulled_blocks == 0 and p1.tensor_parallel_size == 2, p1
        turn = next_turn(0)
        got = served.generate(turn, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)[0]
        assert_greedy_equals_hf(model, turn, got)
        p2, d2 = prefill_status(served), decode_status(served)
        assert p2.kv_pulled_blocks == FULL_BLOCKS and p2.kv_pull_failures == 0, p2
        assert p2.kv_pull_bytes == FULL_BLOCKS * block_bytes, p2
        assert p2.prefill_tokens_computed - p1.prefill_tokens_computed == 10, p2
        assert d2.local_prefills == 0 and d2.tensor_parallel_size == 2, d2
        [p_rank] = ray.get(served.cluster.prefill[0].ranks.remote(), timeout=30)
        [d_rank] = ray.get(served.cluster.decode[0].ranks.remote(), timeout=30)
        assert p_rank["pulls"] == 0 and d_rank["kv_reservations"] == 0, (p_rank, d_rank)
    finally:
        served.stop()


def _damage_every_slot(directory) -> None:
    """One byte flipped in every slot's block bytes, every slab file in `directory`
    (a 4 KiB file header, then slots of a 4 KiB header and the block)."""
    for f in directory.glob("*.kvslab"):
        stride = 4096 + -(-BLOCK_BYTES // 4096) * 4096
        with open(f, "r+b") as w:
            for slot in range((f.stat().st_size - 4096) // stride):
                w.seek(4096 + slot * stride + 4096 + 7)
                byte = w.read(1)
                w.seek(-1, 1)
                w.write(bytes([byte[0] ^ 0x5A]))
