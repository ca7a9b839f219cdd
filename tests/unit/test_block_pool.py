"""engine/block_pool.py: allocation, ref counts, exhaustion, leak check, threads."""

import random
import sys
import threading

import pytest

from pdserve.engine.block_pool import BlockPool, NoFreeBlocksError, blocks_needed


@pytest.mark.parametrize("num_tokens, block_size, expected", [
    (0, 4, 0), (1, 4, 1), (4, 4, 1), (5, 4, 2), (8, 4, 2), (9, 4, 3), (17, 16, 2), (16, 16, 1),
])
def test_blocks_needed_is_ceil_division(num_tokens, block_size, expected):
    assert blocks_needed(num_tokens, block_size) == expected


def test_allocate_and_free_round_trip():
    pool = BlockPool(8)
    assert pool.all_free() and pool.num_free == 8 and pool.usage == 0.0
    a = pool.allocate(3)
    b = pool.allocate(2)
    assert len(a) == 3 and len(b) == 2
    assert len(set(a) | set(b)) == 5, "blocks handed out twice"
    assert all(0 <= i < 8 for i in a + b)
    assert all(pool.ref_count(i) == 1 for i in a + b)
    assert pool.num_free == 3
    assert pool.usage == pytest.approx(5 / 8)
    assert not pool.all_free()
    pool.free(a)
    assert pool.num_free == 6 and all(pool.ref_count(i) == 0 for i in a)
    pool.free(b)
    assert pool.usage == 0.0
    assert pool.all_free()


def test_allocate_zero_takes_nothing():
    pool = BlockPool(2)
    assert pool.allocate(0) == []
    pool.free([])
    assert pool.all_free()


def test_allocate_whole_pool_then_one_more_fails():
    pool = BlockPool(4)
    ids = pool.allocate(4)
    assert sorted(ids) == [0, 1, 2, 3] and pool.usage == 1.0
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)
    pool.free(ids)
    assert pool.all_free()


def test_exhaustion_is_all_or_none_with_counts():
    pool = BlockPool(10)
    held = pool.allocate(7)
    with pytest.raises(NoFreeBlocksError) as ei:
        pool.allocate(4)
    err = ei.value
    assert isinstance(err, RuntimeError)
    assert err.requested == 4 and err.free == 3
    msg = str(err)
    assert "4" in msg and "3 of 10" in msg
    # nothing was taken by the failed call
    assert pool.num_free == 3
    assert sum(pool.ref_count(i) for i in range(10)) == 7
    # and the 3 free blocks are still usable
    rest = pool.allocate(3)
    assert set(rest).isdisjoint(held)
    pool.free(held + rest)
    assert pool.all_free()


def test_incref_keeps_block_until_last_holder_frees():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.incref([a])
    assert pool.ref_count(a) == 2 and pool.ref_count(b) == 1
    pool.free([a, b])
    assert pool.ref_count(a) == 1 and pool.ref_count(b) == 0
    assert pool.num_free == 3 and not pool.all_free()
    pool.free([a])
    assert pool.ref_count(a) == 0
    assert pool.all_free()


def test_incref_twice_needs_three_frees():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.incref([a])
    pool.incref([a])
    for expected in (2, 1, 0):
        pool.free([a])
        assert pool.ref_count(a) == expected
    assert pool.all_free()


def test_double_free_asserts():
    pool = BlockPool(4)
    ids = pool.allocate(2)
    pool.free(ids)
    with pytest.raises(AssertionError, match="double free"):
        pool.free(ids[:1])
    assert pool.all_free()


def test_free_of_never_allocated_block_asserts():
    pool = BlockPool(4)
    with pytest.raises(AssertionError, match="double free"):
        pool.free([3])
    assert pool.all_free()


def test_incref_of_free_block_asserts():
    pool = BlockPool(4)
    with pytest.raises(AssertionError, match="incref of free block"):
        pool.incref([1])
    assert pool.all_free()


def test_freed_blocks_are_reused():
    pool = BlockPool(3)
    first = pool.allocate(3)
    pool.free(first)
    again = pool.allocate(3)
    assert sorted(again) == sorted(first)
    pool.free(again)
    assert pool.all_free()


def test_zero_sized_pool_is_rejected():
    with pytest.raises(AssertionError):
        BlockPool(0)


def test_concurrent_allocate_incref_free_smoke():
    num_blocks, num_threads, iters = 24, 6, 300
    pool = BlockPool(num_blocks)
    owner = [None] * num_blocks          # who holds each block, checked under check_lock
    check_lock = threading.Lock()
    errors = []
    start = threading.Barrier(num_threads)

    def worker(tid: int):
        rng = random.Random(tid)
        try:
            start.wait()
            for _ in range(iters):
                n = rng.randint(1, 5)
                try:
                    ids = pool.allocate(n)
                except NoFreeBlocksError:
                    continue
                with check_lock:
                    for i in ids:
                        assert owner[i] is None, f"block {i} given to {tid} while held by {owner[i]}"
                        owner[i] = tid
                shared = ids[: rng.randint(0, n)]
                pool.incref(shared)       # a second holder, released first
                pool.free(shared)
                with check_lock:
                    for i in ids:
                        owner[i] = None
                pool.free(ids)
        except BaseException as e:  # surfaced in the main thread below
            errors.append(e)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)           # more interleavings per iteration
    try:
        threads = [threading.Thread(target=worker, args=(t,)) for t in range(num_threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert not any(t.is_alive() for t in threads), "worker thread hung"
    finally:
        sys.setswitchinterval(old)
    assert not errors, errors[0]
    assert pool.num_free == num_blocks
    assert pool.all_free()


def test_a_cache_salt_changes_every_hash_from_the_first_block():
    """block_hashes' salt (a request's cache_salt): unsalted hashes are as they were,
    salted ones share nothing with them or with another salt's, from block 0 on."""
    import hashlib

    import numpy as np

    from pdserve.engine.block_pool import block_hashes

    tokens = list(range(100, 164))
    plain = block_hashes(tokens, 16)
    prev, want = b"", []
    for i in range(4):
        prev = hashlib.blake2b(prev + np.asarray(tokens[16 * i:16 * i + 16], np.int64).tobytes(),
                               digest_size=16).digest()
        want.append(prev)
    assert plain == want == block_hashes(tokens, 16, "")
    a, b = block_hashes(tokens, 16, "a"), block_hashes(tokens, 16, "b")
    assert a == block_hashes(tokens, 16, "a") and len(a) == 4
    assert not set(a) & set(plain) and not set(a) & set(b)
