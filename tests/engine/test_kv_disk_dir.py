"""The disk KV tier's directory as a whole (engine/kv_disk_files.py SlabDirectory):
`--kv-disk-cache-gib` bounds the directory, not one slab; the live slabs share it
equally, each resized to its share; a slab whose tier is gone is adopted by the next tier
of its fingerprint and key, its entries read back (a scale-out starts warm), and once it
has been free for reclaim_after_s a tier short of its share deletes it. Every test ends
with the pools free."""

import time

import pytest
import torch

from pdserve.engine import kv_disk_tier
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.kv_tiers import KVTiers, fingerprint

from tier_helpers import BLOCK_BYTES, BS, GIB, HD, HEADS, LAYERS, NUM_BLOCKS, loaded, stored

pytest.importorskip("nixl_cu12")

SLOTS = 9          # the directory's budget, in slots of a lone slab


def tier(pool, kv, d, reclaim_after_s=60.0):
    return KVTiers(pool, kv, fingerprint("m", kv), BLOCK_BYTES / GIB, d,
                   kv_disk_tier.disk_bytes(SLOTS, BLOCK_BYTES) / GIB, name="t", key=b"k" * 32,
                   reclaim_after_s=reclaim_after_s)


def until(cond, what, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def slabs(d) -> list:
    return sorted(d.glob("*.kvslab"))


def test_the_directory_is_shared_adopted_and_reclaimed(tmp_path, monkeypatch):
    monkeypatch.setattr(kv_disk_tier, "RESIZE_S", 0.05)
    budget = kv_disk_tier.disk_bytes(SLOTS, BLOCK_BYTES)
    kvs = [torch.randn(LAYERS, 2, NUM_BLOCKS, HEADS, BS, HD) for _ in range(3)]
    pools = [BlockPool(NUM_BLOCKS) for _ in range(3)]
    a = tier(pools[0], kvs[0], tmp_path, reclaim_after_s=0.5)
    assert a.disk.num_blocks == SLOTS                        # alone: the whole budget
    b = tier(pools[1], kvs[1], tmp_path)
    try:
        until(lambda: a.disk.num_blocks == b.disk.num_blocks == 4, "no equal shares")
        assert sum(p.stat().st_size for p in slabs(tmp_path)) <= budget
        hashes, [want] = stored(pools[1], [kvs[1]], b, 3, seed=5)   # 2 on b's disk
        b_path = b.disk.path
    finally:
        b.close()                                            # its slab is free now
    c = tier(pools[2], kvs[2], tmp_path)                     # a scale-out: adopts it
    try:
        assert c.disk.path == b_path and c.lookup(hashes) == 2
        n, [got] = loaded(pools[2], [kvs[2]], c, hashes[:2])
        assert n == 2 and torch.equal(got, want[:, :, :2])
    finally:
        c.close()
    try:                    # free for reclaim_after_s: a, short of its share, deletes it
        until(lambda: slabs(tmp_path) == [a.disk.path] and a.disk.num_blocks == SLOTS,
              (slabs(tmp_path), a.disk.num_blocks))
        assert sum(p.stat().st_size for p in slabs(tmp_path)) <= budget
        hashes, [want] = stored(pools[0], [kvs[0]], a, 3, seed=50)
        n, [got] = loaded(pools[0], [kvs[0]], a, hashes)
        assert n == 3 and torch.equal(got, want)
    finally:
        a.close()
    assert all(p.all_free() for p in pools)
