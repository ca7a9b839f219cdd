"""What the KV-tier tests share (engine/kv_tiers.py, engine/tp_tiers.py and the
schedulers over them): a small cache's shape, waiting for a tiers object to finish its
work, and blocks computed, stored and loaded back on one rank's cache or several."""

from __future__ import annotations

import time

import torch

from pdserve.engine.block_pool import block_hashes

LAYERS, HEADS, BS, HD = 2, 1, 4, 8
NUM_BLOCKS = 16
BLOCK_BYTES = LAYERS * 2 * HEADS * BS * HD * 4          # float32, one rank's heads
GIB = 1 << 30


def settle(tiers, want_loads: int = 0, timeout_s: float = 5.0) -> list:
    """poll() `tiers` (KVTiers or TPTiers) until idle with `want_loads` loads reported;
    returns the loads (LoadDone each)."""
    loads, deadline = [], time.monotonic() + timeout_s
    while not (tiers.idle() and len(loads) >= want_loads):
        assert time.monotonic() < deadline, (tiers.idle(), loads)
        loads += tiers.poll()
        time.sleep(0.005)
    return loads + tiers.poll()


def stored(pool, kvs: list[torch.Tensor], tiers, n: int, seed: int):
    """n blocks of new prompt tokens computed into the pool on every rank's cache in
    `kvs`, registered and stored; returns (their hashes, each cache's bytes of them),
    the pool's blocks freed (evictable)."""
    hashes = block_hashes(list(range(seed, seed + n * BS)), BS)
    blocks = pool.allocate(n)
    want = []
    for kv in kvs:
        kv[:, :, blocks] = torch.randn(LAYERS, 2, n, HEADS, BS, HD, device=kv.device)
        want.append(kv[:, :, blocks].clone())
    pool.cache_blocks(blocks, hashes)
    tiers.store(blocks, hashes)
    settle(tiers)
    pool.free(blocks)
    return hashes, want


def loaded(pool, kvs: list[torch.Tensor], tiers, hashes):
    """The tiers' entries of `hashes` loaded into new pool blocks: (how many, each
    cache's bytes of those blocks)."""
    blocks = pool.allocate(len(hashes))
    for kv in kvs:
        kv[:, :, blocks] = 0
    tiers.load("k", hashes, blocks)
    [done] = settle(tiers, 1)
    got = [kv[:, :, blocks].clone() for kv in kvs]
    pool.free(blocks)
    return done.num_loaded, got
