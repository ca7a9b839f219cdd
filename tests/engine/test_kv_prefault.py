"""A CPU KV cache's pages are committed ahead of the block pool's first use of them
(engine/kv_prefault.py), and only a window ahead: residency read with mincore(2)."""

import ctypes
import mmap
import os

import pytest
import torch

from pdserve.engine.attention import allocate_kv_cache
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.kv_prefault import KVPrefault, prefault_pool

PAGE = os.sysconf("SC_PAGESIZE")
LAYERS, BLOCKS, HEADS, BLOCK_SIZE, HEAD_DIM = 2, 1024, 2, 16, 64   # 8 KiB blocks, 8 MiB regions


def resident(t: torch.Tensor) -> float:
    """Share of the pages under `t` (contiguous) that are resident."""
    assert t.is_contiguous()
    start = t.data_ptr() - t.data_ptr() % PAGE
    end = t.data_ptr() + t.numel() * t.element_size()
    n = -(-(end - start) // PAGE)
    vec = (ctypes.c_ubyte * n)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    assert libc.mincore(start, end - start, vec) == 0, os.strerror(ctypes.get_errno())
    return sum(v & 1 for v in vec) / n


def blocks_resident(cache: torch.Tensor, lo: int, hi: int) -> set[float]:
    """resident() of blocks [lo, hi) in each layer's K and V region."""
    return {resident(cache[layer, kv, lo:hi]) for layer in range(LAYERS) for kv in range(2)}


@pytest.fixture
def cache() -> torch.Tensor:
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        pytest.skip("the KV cache is an anonymous mapping on Linux only")
    return allocate_kv_cache((LAYERS, 2, BLOCKS, HEADS, BLOCK_SIZE, HEAD_DIM), torch.float32,
                             "cpu")


def test_blocks_are_committed_a_window_ahead_of_the_pool_and_no_further(cache):
    window = 64 * LAYERS * 2 * HEADS * BLOCK_SIZE * HEAD_DIM * 4     # 64 blocks' bytes
    pool = BlockPool(BLOCKS)
    assert blocks_resident(cache, 0, BLOCKS) == {0.0}, "the cache is committed unwritten"
    prefault = KVPrefault(cache, BLOCKS, window_bytes=window)
    pool.on_fresh = prefault.advance
    try:
        assert prefault.wait(30) and prefault.committed == 64
        assert blocks_resident(cache, 0, 64) == {1.0}
        # THP may commit a whole 2 MiB page around the window's end: 256 blocks here
        assert blocks_resident(cache, 512, BLOCKS) == {0.0}
        held = pool.allocate(300)
        assert pool.fresh_from == 300
        assert prefault.wait(30) and prefault.committed == 364
        assert blocks_resident(cache, 300, 364) == {1.0}
        assert blocks_resident(cache, 768, BLOCKS) == {0.0}
        pool.free(held)
        again = pool.allocate(10)            # never-used blocks first (block_pool.py)
        assert again == list(range(300, 310)) and pool.fresh_from == 310
        assert prefault.wait(30) and prefault.committed == 374
        pool.free(again)
        assert pool.all_free()
    finally:
        prefault.close()


def test_committing_keeps_what_was_written_meanwhile(cache):
    pool = BlockPool(BLOCKS)
    cache[:, :, 100:200] = 7.0          # written before its pages are asked for
    prefault = prefault_pool(pool, cache)
    try:
        pool.free(pool.allocate(BLOCKS))
        assert prefault.wait(60) and prefault.committed == BLOCKS
        assert bool((cache[:, :, 100:200] == 7.0).all()) and float(cache[:, :, :100].abs().sum()) == 0
        assert blocks_resident(cache, 0, BLOCKS) == {1.0}
    finally:
        prefault.close()


def test_a_device_cache_has_no_prefault():
    assert prefault_pool(BlockPool(4), torch.zeros(1, 2, 4, 1, 4, 8, device="meta")) is None
