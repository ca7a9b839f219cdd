"""engine/tp_tiers.py: a tensor-parallel worker's tiers, rank 0's TPTiers driving each
follower's RankTiers through the leader's orders and gathers (here the followers run in
this process, as follow() would run them, each over its own KV cache). Each rank gets
its own KV heads back; a block held for a store goes back to the pool only once every
rank copied it, held once when stored again meanwhile; a load reports the fewest blocks any rank loaded and forgets, on every
rank, the entry a rank lacked; at start, disk entries not read back by every rank are
forgotten. Every test ends with the pool free and every rank's tiers idle."""

import threading
import time

import pytest
import torch

from pdserve.engine.block_pool import BlockPool, block_hashes
from pdserve.engine.kv_tiers import KVTiers, fingerprint
from pdserve.engine.tp_tiers import RankTiers, TPTiers

from tier_helpers import (BLOCK_BYTES, BS, GIB, HD, HEADS, LAYERS, NUM_BLOCKS, loaded, settle,
                          stored)


class Followers:
    """TPLeader's order and gather, run on RankTiers in this process."""

    def __init__(self, ranks: list[RankTiers]):
        self.ranks = ranks
        self.orders: list[str] = []

    def order(self, name: str, **kwargs) -> None:
        self.orders.append(name)
        for r in self.ranks:
            getattr(r, name)(**kwargs)

    def gather(self, name: str, **kwargs) -> list:
        self.orders.append(name)
        return [getattr(r, name)(**kwargs) for r in self.ranks]


def broken(e: Exception) -> None:
    raise AssertionError(f"group broken: {e!r}")


def rank_tiers(pool, kv, rank, host_blocks, disk_dir=None, disk_blocks=0) -> KVTiers:
    from pdserve.engine import kv_disk_tier
    return KVTiers(pool, kv, fingerprint("m", kv, tp_rank=rank, tp_size=2, kv_heads=(rank,)),
                   host_blocks * BLOCK_BYTES / GIB, disk_dir,
                   kv_disk_tier.disk_bytes(disk_blocks, BLOCK_BYTES) / GIB, name="t",
                   key=b"k" * 32)     # the same across a restart: entries read back


def two_ranks(host_blocks=8, disk_dir=None, disk_blocks=0):
    """(pool, [rank 0's cache, rank 1's], TPTiers, rank 1's KVTiers)."""
    pool = BlockPool(NUM_BLOCKS)
    kvs = [torch.randn(LAYERS, 2, NUM_BLOCKS, HEADS, BS, HD) for _ in range(2)]
    dirs = [None, None] if disk_dir is None else [disk_dir / "r0", disk_dir / "r1"]
    r1 = rank_tiers(None, kvs[1], 1, host_blocks, dirs[1], disk_blocks)
    t = TPTiers(rank_tiers(pool, kvs[0], 0, host_blocks, dirs[0], disk_blocks),
                Followers([RankTiers(r1)]), 2, broken)
    return pool, kvs, t, r1


def close(pool, t, r1) -> None:
    settle(t)
    deadline = time.monotonic() + 5      # rank 1's thread runs an order rank 0 awaits not
    while not r1.idle():
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert t.idle()
    t.close()
    r1.close()
    assert pool.all_free()


def hold_copies(r1) -> threading.Event:
    """Rank 1's tier copies wait for the returned event (5 s at most)."""
    gate = threading.Event()
    copy = r1._store
    r1._store = lambda job: (gate.wait(5), copy(job))
    return gate


def copied_on_every_rank(gate: threading.Event, t, pool) -> None:
    """Let rank 1 copy (hold_copies' `gate`): then every held block is back."""
    gate.set()
    settle(t)
    assert not t.wants_poll and pool.all_free()


def rank0_copied(t) -> None:
    """poll() until rank 0's tiers are idle (its copies done, its refs given back)."""
    deadline = time.monotonic() + 5
    while not t.local.idle():
        assert time.monotonic() < deadline
        t.poll()
        time.sleep(0.005)


def test_every_rank_gets_its_own_heads_back():
    pool, kvs, t, r1 = two_ranks()
    try:
        hashes, want = stored(pool, kvs, t, 3, seed=1)
        assert t.lookup(hashes) == 3 and r1.lookup(hashes) == 3
        n, got = loaded(pool, kvs, t, hashes)
        assert n == 3
        assert all(torch.equal(g, w) for g, w in zip(got, want))
        assert t.stats.bytes_loaded == 2 * 3 * BLOCK_BYTES      # both ranks' heads
    finally:
        close(pool, t, r1)


def test_a_stored_block_is_held_until_every_rank_copied_it():
    pool, kvs, t, r1 = two_ranks()
    gate = hold_copies(r1)
    try:
        hashes = block_hashes(list(range(4 * BS)), BS)
        blocks = pool.allocate(4)
        pool.cache_blocks(blocks, hashes)
        t.store(blocks, hashes)
        pool.free(blocks)
        rank0_copied(t)                    # and gave its ref back
        t.poll()
        assert t.wants_poll and not t.idle()
        assert pool.num_free == pool.num_blocks - 4      # still held for rank 1
        copied_on_every_rank(gate, t, pool)
    finally:
        gate.set()
        close(pool, t, r1)


def test_a_block_stored_again_before_every_rank_copied_it_is_held_once():
    """Rank 0 loses an entry (a host tier of 2 blocks, no disk) while rank 1 has not
    copied it yet, and a request sharing the block stores it again: the block keeps one
    ref until rank 1 copied both, then goes back."""
    pool, kvs, t, r1 = two_ranks(host_blocks=2)
    gate = hold_copies(r1)
    try:
        hashes = block_hashes(list(range(3 * BS)), BS)
        blocks = pool.allocate(3)
        pool.cache_blocks(blocks, hashes)
        t.store(blocks, hashes)                      # request A finished
        t.poll()
        rank0_copied(t)                              # 3 blocks, kept 2
        assert t.held() == set(hashes[1:]) and t.wants_poll
        t.store(blocks[:1], hashes[:1])              # request B shares block 0
        t.poll()
        pool.free(blocks)                            # both requests ended
        assert pool.num_free == pool.num_blocks - 3  # held for rank 1, once each
        copied_on_every_rank(gate, t, pool)
    finally:
        gate.set()
        close(pool, t, r1)


def test_an_entry_one_rank_lacks_ends_the_load_there_and_is_forgotten():
    pool, kvs, t, r1 = two_ranks()
    try:
        hashes, want = stored(pool, kvs, t, 4, seed=7)
        r1.forget(hashes[2:3])                    # rank 1 lost its entry of block 2
        n, got = loaded(pool, kvs, t, hashes)
        assert n == 2                              # blocks 0, 1 on both; 2, 3 computed
        assert all(torch.equal(g[:, :, :2], w[:, :, :2]) for g, w in zip(got, want))
        settle(t)
        assert t.lookup(hashes) == 2 and hashes[2] not in t.held()
        assert hashes[3] in t.held()              # only the lacking entry is dropped
    finally:
        close(pool, t, r1)


def test_disk_entries_not_read_back_by_every_rank_are_forgotten_at_start(tmp_path):
    pytest.importorskip("nixl_cu12")
    pool, kvs, t, r1 = two_ranks(host_blocks=2, disk_dir=tmp_path, disk_blocks=8)
    try:
        hashes, _ = stored(pool, kvs, t, 4, seed=3)    # 2 to disk, 2 in the host tier
        r1.forget(hashes[:1])
        settle(t)
    finally:
        close(pool, t, r1)
    pool, kvs, t, r1 = two_ranks(host_blocks=2, disk_dir=tmp_path, disk_blocks=8)
    try:
        deadline = time.monotonic() + 5    # the tiers threads run the forgets
        while not t.held() == r1.held() == {hashes[1]}:
            assert time.monotonic() < deadline, (t.held(), r1.held())
            time.sleep(0.005)
        n, _ = loaded(pool, kvs, t, hashes[1:2])
        assert n == 1
    finally:
        close(pool, t, r1)
