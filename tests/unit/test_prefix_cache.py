"""engine/block_pool.py prefix cache: chained block hashes, sharing, LRU eviction."""

import random

import pytest

from pdserve.engine.block_pool import BlockPool, NoFreeBlocksError, block_hashes


def test_block_hashes_chain_full_blocks_only():
    a = block_hashes(list(range(10)), 4)
    assert len(a) == 2 and all(len(h) == 16 for h in a)        # tokens 8, 9: partial
    assert block_hashes(list(range(8)) + [99, 98, 97, 96], 4)[:2] == a
    b = block_hashes([0, 1, 2, 3, 4, 5, 6, 9], 4)
    assert b[0] == a[0] and b[1] != a[1]
    # the same block of tokens after a different prefix hashes differently (the chain)
    c = block_hashes([7, 7, 7, 7, 4, 5, 6, 7], 4)
    assert c[1] != a[1]
    assert block_hashes([1, 2, 3], 4) == []


def test_match_shares_cached_blocks():
    pool = BlockPool(8)
    h = block_hashes(list(range(12)), 4)
    blocks = pool.allocate(3)
    pool.cache_blocks(blocks, h)
    assert pool.num_cached == 3
    got = pool.match_prefix(h[:2] + [b"x" * 16])
    assert got == blocks[:2]
    assert [pool.ref_count(b) for b in blocks] == [2, 2, 1]
    assert pool.match_prefix([b"y" * 16] + h) == []           # a miss stops the run
    pool.free(got)
    pool.free(blocks)
    assert pool.all_free() and pool.num_free == 8 and pool.num_cached == 3


def test_freed_cached_blocks_are_evicted_lru_only_when_free_ones_run_out():
    pool = BlockPool(4)
    h = block_hashes(list(range(12)), 4)
    blocks = pool.allocate(3)
    pool.cache_blocks(blocks, h)
    pool.free([blocks[1]])
    pool.free([blocks[0]])
    pool.free([blocks[2]])                    # LRU order now: 1, 0, 2
    assert pool.allocate(1) not in ([blocks[0]], [blocks[1]], [blocks[2]])
    assert pool.num_cached == 3
    assert pool.allocate(1) == [blocks[1]]    # least recently freed goes first
    assert pool.num_cached == 2
    assert pool.match_prefix(h) == [blocks[0]]  # h[1] evicted: the run stops there
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(3)
    assert pool.num_cached == 2               # all or none: nothing evicted


def test_match_revives_an_evictable_block():
    pool = BlockPool(2)
    h = block_hashes(list(range(4)), 4)
    [b] = pool.allocate(1)
    pool.cache_blocks([b], h)
    pool.free([b])
    assert pool.match_prefix(h) == [b] and pool.ref_count(b) == 1
    assert pool.num_free == 1
    assert pool.allocate(1) != [b]            # held again: never evicted
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)


def test_same_prefix_cached_twice_keeps_the_first():
    pool = BlockPool(4)
    h = block_hashes(list(range(4)), 4)
    a, b = pool.allocate(1), pool.allocate(1)
    pool.cache_blocks(a, h)
    pool.cache_blocks(b, h)
    assert pool.num_cached == 1 and pool.match_prefix(h) == a
    pool.free(a + b + a)
    assert pool.all_free()


def test_random_workload_keeps_invariants():
    """Requests with shared prefixes come and go; ref counts, the free/evictable split
    and the hash maps stay consistent, and a matched block always holds its prefix."""
    rng = random.Random(0)
    pool, bs = BlockPool(24), 2
    content = {}                                   # block -> tokens it was computed for
    held = []
    for _ in range(2000):
        if held and (rng.random() < 0.5 or pool.num_free < 4):
            pool.free(held.pop(rng.randrange(len(held))))
            continue
        prompt = [rng.randrange(3) for _ in range(rng.randrange(1, 9))]
        hashes = block_hashes(prompt, bs)
        hit = pool.match_prefix(hashes)
        for i, b in enumerate(hit):
            assert content[b] == prompt[: (i + 1) * bs]
        need = -(-len(prompt) // bs) - len(hit)
        try:
            new = pool.allocate(need)
        except NoFreeBlocksError:
            pool.free(hit)
            continue
        table = hit + new
        for i, b in enumerate(new, start=len(hit)):
            content[b] = prompt[: (i + 1) * bs]
        pool.cache_blocks(table[: len(hashes)], hashes)
        held.append(table)
        refs = {}
        for t in held:
            for b in t:
                refs[b] = refs.get(b, 0) + 1
        assert all(pool.ref_count(b) == refs.get(b, 0) for b in range(pool.num_blocks))
        assert pool.num_free == pool.num_blocks - len(refs)
    for t in held:
        pool.free(t)
    assert pool.all_free()


def test_cache_events_mirror_the_cache():
    """A reader polling cache_events rebuilds exactly the set of cached hashes, from
    events while it keeps up and from a snapshot when it fell behind the bounded log."""
    rng = random.Random(1)
    pool, bs = BlockPool(6), 2          # log keeps 24 events
    mirror, seq = set(), 0
    held = []

    def sync():
        nonlocal seq, mirror
        seq, events, snapshot = pool.cache_events(seq)
        if snapshot is not None:
            mirror = set(snapshot)
        for stored, h in events or ():
            (mirror.add if stored else mirror.discard)(h)

    for step in range(400):
        if held and (rng.random() < 0.5 or pool.num_free < 3):
            pool.free(held.pop())
        else:
            prompt = [rng.randrange(4) for _ in range(6)]
            hashes = block_hashes(prompt, bs)
            hit = pool.match_prefix(hashes)
            table = hit + pool.allocate(3 - len(hit))
            pool.cache_blocks(table, hashes)
            held.append(table)
        if step % (1 if step < 200 else 37) == 0:    # later: far behind the log
            sync()
            assert mirror == set(pool._block_of), step
    sync()
    assert pool.cache_events(seq) == (seq, [], None)              # caught up: nothing new
    seq2, events, snapshot = pool.cache_events(10**9)    # ahead (restarted pool): snapshot
    assert events is None and set(snapshot) == set(pool._block_of)
