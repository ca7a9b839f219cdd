"""engine/kv_tiers.py: blocks stored to the host tier come back byte for byte; a full
host tier moves its oldest entries to the disk tier, which survives a restart (a new
KVTiers over the same file); a damaged disk entry is dropped, not served; another
fingerprint's entries are not read; the tiers' cache events tell a reader which tier
holds each block; a disk tier whose I/O fails loses entries, never slots, and one whose
transfer never ends turns off; on CUDA (gpu-marked) a device pool round-trips through
pinned host memory and disk. Every test ends with the pool free and the tiers idle
(each block held for a store given back)."""

import time

import pytest
import torch

from pdserve.engine.block_pool import BlockPool, block_hashes
from pdserve.engine.kv_tiers import KVTiers, fingerprint
from pdserve.messages import CacheEvents
from pdserve.router.routing import PrefixIndex

from tier_helpers import BLOCK_BYTES, BS, GIB, HD, HEADS, LAYERS, NUM_BLOCKS, loaded, stored

pytest.importorskip("nixl_cu12")


def cache() -> torch.Tensor:
    return torch.randn(LAYERS, 2, NUM_BLOCKS, HEADS, BS, HD)


KEY = b"k" * 32       # the disk entries' MAC key (kv_disk_tier.disk_key of a secret)


def tiers(pool, kv, host_blocks, disk_dir=None, disk_blocks=0, fp=None, key=KEY, name="t"):
    from pdserve.engine import kv_disk_tier
    return KVTiers(pool, kv, fp or fingerprint("m", kv), host_blocks * BLOCK_BYTES / GIB,
                   disk_dir, kv_disk_tier.disk_bytes(disk_blocks, BLOCK_BYTES) / GIB, name=name,
                   key=key)


def test_host_tier_round_trip():
    kv, pool = cache(), BlockPool(NUM_BLOCKS)
    t = tiers(pool, kv, host_blocks=8)
    try:
        hashes, [want] = stored(pool, [kv], t, 3, seed=1)
        assert t.lookup(hashes) == 3 and t.lookup(hashes[:1] + [b"x" * 16]) == 1
        n, [got] = loaded(pool, [kv], t, hashes)
        assert n == 3 and torch.equal(got, want)
        assert (t.stats.stored_host, t.stats.host_hits, t.stats.disk_hits) == (3, 3, 0)
        assert t.stats.bytes_loaded == 3 * BLOCK_BYTES
        t.store(pool.allocate(0), [])                      # nothing to store: no job
    finally:
        t.close()
    assert pool.all_free() and t.idle()


def test_a_full_host_tier_moves_blocks_to_disk_which_survives_a_restart(tmp_path):
    kv, pool = cache(), BlockPool(NUM_BLOCKS)
    t = tiers(pool, kv, host_blocks=2, disk_dir=tmp_path, disk_blocks=8)
    try:
        hashes, [want] = stored(pool, [kv], t, 5, seed=100)    # 3 oldest go to disk
        assert t.stats.stored_disk == 3 and len(t.disk.index) == 3
        n, [got] = loaded(pool, [kv], t, hashes)
        assert n == 5 and torch.equal(got, want)
        assert (t.stats.host_hits, t.stats.disk_hits) == (2, 3)
    finally:
        t.close()
    again = tiers(pool, kv, host_blocks=2, disk_dir=tmp_path, disk_blocks=8)
    try:
        assert again.lookup(hashes) == 3                   # the disk's, in order
        n, [got] = loaded(pool, [kv], again, hashes[:3])
        assert n == 3 and torch.equal(got, want[:, :, :3])
    finally:
        again.close()
    assert pool.all_free()
    other = tiers(pool, kv, host_blocks=2, disk_dir=tmp_path, disk_blocks=8,
                  fp=fingerprint("another-model", kv))
    try:
        assert other.lookup(hashes) == 0
    finally:
        other.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_device_pool_round_trips_through_pinned_host_memory_and_disk(tmp_path):
    """On CUDA the pool is device memory and the host tier pinned host memory: blocks
    come back byte for byte from both tiers into device blocks."""
    kv, pool = cache().cuda(), BlockPool(NUM_BLOCKS)
    t = tiers(pool, kv, host_blocks=2, disk_dir=tmp_path, disk_blocks=8)
    try:
        assert t.host.slab.is_pinned()
        hashes, [want] = stored(pool, [kv], t, 5, seed=100)    # 3 oldest go to disk
        n, [got] = loaded(pool, [kv], t, hashes)
        assert n == 5 and got.is_cuda and torch.equal(got, want)
        assert (t.stats.host_hits, t.stats.disk_hits) == (2, 3)
    finally:
        t.close()
    assert pool.all_free()


def test_a_follower_store_of_an_entry_it_holds_copies_nothing_and_makes_it_most_recent():
    """store_exactly (a tensor-parallel follower's store of rank 0's choice,
    engine/tp_tiers.py) of a hash its host tier holds copies nothing and counts no
    store; the entry becomes the most recently used, so the next store evicts the
    other."""
    t = tiers(None, cache(), host_blocks=2)
    a, b, c = block_hashes(list(range(3 * BS)), BS)
    try:
        for block, h in ((0, a), (1, b), (0, a), (2, c)):
            t.store_exactly([block], [h])
        handed, deadline = [], time.monotonic() + 5
        while True:
            handed += t.take_finished()[0]
            if t.idle():
                break
            assert time.monotonic() < deadline, handed
            time.sleep(0.005)
        assert handed == [0, 1, 0, 2]                     # every block handed back
        assert t.stats.stored_host == 3
        assert (t.lookup([a]), t.lookup([b]), t.lookup([c])) == (1, 0, 1)
    finally:
        t.close()


def test_a_damaged_disk_entry_is_dropped_not_served(tmp_path):
    from pdserve.engine.kv_disk_tier import HEADER_BYTES
    kv, pool = cache(), BlockPool(NUM_BLOCKS)
    t = tiers(pool, kv, host_blocks=1, disk_dir=tmp_path, disk_blocks=4)
    try:
        hashes, [want] = stored(pool, [kv], t, 3, seed=7)      # 2 on disk, 1 in host
        slot = t.disk.index[hashes[1]]
        with open(t.disk.path, "r+b") as f:                # one byte of hashes[1]'s block
            f.seek(t.disk.slot_offset(slot) + HEADER_BYTES + 100)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0xFF]))
        n, [got] = loaded(pool, [kv], t, hashes)
        assert n == 1 and torch.equal(got[:, :, :1], want[:, :, :1])   # stops at the damage
        assert t.stats.dropped == 1 and hashes[1] not in t.disk.index
        assert t.lookup(hashes) == 1
    finally:
        t.close()
    assert pool.all_free()


class FailingAgent:
    """A disk tier's NIXL agent whose transfers raise (as NIXL's own exception classes,
    not OSError, do) while `failing`, or, when `hang`, never end."""

    def __init__(self, agent, hang=False):
        self.agent, self.failing, self.hang = agent, True, hang

    def __getattr__(self, name):
        return getattr(self.agent, name)

    def transfer(self, handle):
        if self.hang:
            return "PROC"
        if self.failing:
            raise RuntimeError("NIXL_ERR_BACKEND")
        return self.agent.transfer(handle)

    def check_xfer_state(self, handle):
        return "PROC" if self.hang else self.agent.check_xfer_state(handle)


def test_a_disk_tier_whose_io_fails_loses_entries_never_capacity(tmp_path):
    kv, pool = cache(), BlockPool(NUM_BLOCKS)
    t = tiers(pool, kv, host_blocks=1, disk_dir=tmp_path, disk_blocks=2)
    t.disk.agent = agent = FailingAgent(t.disk.agent)
    try:
        hashes, _ = stored(pool, [kv], t, 3, seed=11)      # 2 moves to disk fail
        assert t.disk.index == {} and len(t.disk.free) == 2
        assert t.lookup(hashes[2:]) == 1 and t.stats.stored_disk == 0
        agent.failing = False
        hashes, [want] = stored(pool, [kv], t, 3, seed=50)  # 2 on disk, 1 in host
        assert len(t.disk.index) == 2 and t.lookup(hashes) == 3
        agent.failing = True
        n, _ = loaded(pool, [kv], t, hashes)                # the first read fails
        assert n == 0 and hashes[0] not in t.disk.index and len(t.disk.free) == 1
        agent.failing = False
        n, [got] = loaded(pool, [kv], t, hashes[1:])
        assert n == 2 and torch.equal(got, want[:, :, 1:])
    finally:
        t.close()
    assert pool.all_free()


def test_a_disk_transfer_that_never_ends_turns_the_disk_tier_off(tmp_path, monkeypatch):
    """A transfer past XFER_TIMEOUT_S (it may still write the staging buffer) turns the
    disk tier off: its entries forgotten, nothing read or written there again; the host
    tier serves on."""
    from pdserve.engine import kv_disk_tier
    monkeypatch.setattr(kv_disk_tier, "XFER_TIMEOUT_S", 0.05)
    kv, pool = cache(), BlockPool(NUM_BLOCKS)
    t = tiers(pool, kv, host_blocks=1, disk_dir=tmp_path, disk_blocks=4)
    try:
        hashes, _ = stored(pool, [kv], t, 2, seed=3)       # hashes[0] on disk
        assert list(t.disk.index) == hashes[:1]
        t.disk.agent = FailingAgent(t.disk.agent, hang=True)
        hashes, [want] = stored(pool, [kv], t, 2, seed=30)  # a move to disk overruns
        assert t.disk.failed and t.disk.index == {} and t.stats.stored_disk == 1
        n, [got] = loaded(pool, [kv], t, hashes[1:])        # the host's entry
        assert n == 1 and torch.equal(got, want[:, :, 1:])
    finally:
        t.close()
    assert pool.all_free()


def mirror(index: PrefixIndex, t: KVTiers) -> None:
    """Fold `t`'s tier events since the index's last poll into it, as the router does."""
    seq, events, snapshot = t.cache_events(index.tier_since("p"))
    index.apply("p", CacheEvents(0, 0, tier_seq=seq, tier_events=events,
                                 tier_snapshot=snapshot))


def held(index: PrefixIndex, hashes) -> list[str]:
    """Where the mirror has each of `hashes`: "host", "disk" or "-"."""
    out = []
    for h in hashes:
        _, host, disk = index.matched("p", [h])
        out.append("host" if host else "disk" if disk else "-")
    return out


def test_cache_events_mirror_each_tier_through_moves_drops_and_a_restart(tmp_path):
    """A reader polling cache_events (routing.PrefixIndex) knows which tier holds each
    block: host inserts, host-to-disk moves, a disk slot reused, a damaged entry
    dropped, and the entries a restarted disk tier reads back."""
    from pdserve.engine.kv_disk_tier import HEADER_BYTES
    kv, pool = cache(), BlockPool(NUM_BLOCKS)
    index = PrefixIndex()
    t = tiers(pool, kv, host_blocks=2, disk_dir=tmp_path, disk_blocks=3)
    try:
        a, _ = stored(pool, [kv], t, 2, seed=10)
        mirror(index, t)
        assert held(index, a) == ["host", "host"]
        b, _ = stored(pool, [kv], t, 3, seed=500)          # a's two and b[0] go to disk
        mirror(index, t)
        assert held(index, a + b) == ["disk", "disk", "disk", "host", "host"]
        c, _ = stored(pool, [kv], t, 1, seed=900)          # b[1] to disk: a[0]'s slot reused
        mirror(index, t)
        assert held(index, a + b + c) == ["-", "disk", "disk", "disk", "host", "host"]
        slot = t.disk.index[b[0]]
        with open(t.disk.path, "r+b") as f:              # damage b[0]'s bytes
            f.seek(slot * t.disk.stride + HEADER_BYTES + 5)
            f.write(b"\xff\x00\xff")
        assert loaded(pool, [kv], t, b[:1])[0] == 0
        mirror(index, t)
        assert held(index, a + b) == ["-", "disk", "-", "disk", "host"]
    finally:
        t.close()
    again = tiers(pool, kv, host_blocks=2, disk_dir=tmp_path, disk_blocks=3)
    try:
        index.forget("p")                                # a new epoch: from event 0
        mirror(index, again)
        assert held(index, a + b + c) == ["-", "disk", "-", "disk", "-", "-"]
        stale = PrefixIndex()                            # ahead of the log: a snapshot
        stale.apply("p", CacheEvents(0, 0, tier_seq=10**6))
        mirror(stale, again)
        assert held(stale, a + b) == held(index, a + b)
    finally:
        again.close()
    assert pool.all_free()
