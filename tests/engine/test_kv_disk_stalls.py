"""The disk KV tier on a disk that stops answering (engine/kv_disk_tier.py): its I/O runs
on its own thread, so a transfer that blocks (a hung mount, a failing device: here a
NIXL agent whose transfers block until the test lets them go) costs a load at most its
deadline, the rest computed; blocks the host tier evicts meanwhile are dropped, not
waited on (counted); lookups stop counting the disk's entries while it is behind; the
host tier serves on; the late read never writes the block the load gave up; once the
disk answers again it serves. Every test ends with the pool free and the tiers idle."""

import threading
import time

import pytest
import torch

from pdserve.engine import kv_disk_tier
from pdserve.engine.block_pool import BlockPool, block_hashes
from pdserve.engine.kv_tiers import KVTiers, fingerprint

from tier_helpers import BLOCK_BYTES, BS, GIB, HD, HEADS, LAYERS, NUM_BLOCKS, loaded, stored

pytest.importorskip("nixl_cu12")


class FreezingAgent:
    """A disk tier's NIXL agent whose transfers block, as a syscall on a hung mount does,
    while `frozen` is set (`entered`: one is blocked now)."""

    def __init__(self, agent):
        self.agent, self.thawed, self.entered = agent, threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self.agent, name)

    def transfer(self, handle):
        self.entered.set()
        self.thawed.wait(60)
        return self.agent.transfer(handle)


def tiers(pool, kv, disk_dir, load_timeout_s):
    return KVTiers(pool, kv, fingerprint("m", kv), 1 * BLOCK_BYTES / GIB, disk_dir,
                   kv_disk_tier.disk_bytes(8, BLOCK_BYTES) / GIB, name="t",
                   key=b"k" * 32, load_timeout_s=load_timeout_s)


def store_now(pool, kv, t, n, seed):
    """tier_helpers.stored, waiting for the tiers thread only (the disk may be stuck)."""
    hashes = block_hashes(list(range(seed, seed + n * BS)), BS)
    blocks = pool.allocate(n)
    kv[:, :, blocks] = torch.randn(LAYERS, 2, n, HEADS, BS, HD)
    want = kv[:, :, blocks].clone()
    pool.cache_blocks(blocks, hashes)
    t.store(blocks, hashes)
    until(lambda: t.poll() is not None and t.idle(disk=False), "the store never ended")
    pool.free(blocks)
    return hashes, want


def load_now(pool, kv, t, hashes):
    """tier_helpers.loaded, waiting for the load's report only."""
    blocks = pool.allocate(len(hashes))
    kv[:, :, blocks] = 0
    t.load("k", hashes, blocks)
    done = []
    until(lambda: done.extend(t.poll()) or done, "the load never ended")
    got = kv[:, :, blocks].clone()
    pool.free(blocks)
    return done[0].num_loaded, got


def until(cond, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_disk_that_freezes_mid_load_costs_the_load_its_deadline_only(tmp_path, monkeypatch):
    monkeypatch.setattr(kv_disk_tier, "STALL_S", 0.2)
    kv, pool = torch.randn(LAYERS, 2, NUM_BLOCKS, HEADS, BS, HD), BlockPool(NUM_BLOCKS)
    t = tiers(pool, kv, tmp_path, load_timeout_s=0.5)
    agent = FreezingAgent(t.disk.agent)
    try:
        hashes, [want] = stored(pool, [kv], t, 3, seed=8)    # 2 on disk, 1 in the host tier
        assert t.lookup(hashes) == 3
        t.disk.agent = agent                                 # the disk stops answering
        blocks = pool.allocate(3)
        start = time.monotonic()
        t.load("frozen", hashes, blocks)
        done = []
        until(lambda: done.extend(t.poll()) or done, "the load never ended")
        waited = time.monotonic() - start
        assert done[0].num_loaded == 0 and 0.4 < waited < 1.5, (done, waited)
        assert agent.entered.is_set() and t.stats.loads_timed_out == 1
        kv[:, :, blocks] = 7.0                                # the prompt computes them
        # the disk is behind: lookups skip its entries; a block the host tier evicts is
        # dropped, not queued behind the stuck read; host stores still complete
        assert t.lookup(hashes) == 0
        more, more_want = store_now(pool, kv, t, 2, seed=80)
        assert t.stats.disk_writes_dropped >= 1 and t.lookup(more[-1:]) == 1
        n, got = load_now(pool, kv, t, more[-1:])             # the host tier serves
        assert n == 1 and torch.equal(got, more_want[:, :, -1:])
        agent.thawed.set()                                    # the disk answers again
        until(t.disk.idle, "the disk thread never came back")
        assert torch.all(kv[:, :, blocks] == 7.0)              # the late read wrote nothing
        pool.free(blocks)
        assert not t.disk.failed and t.lookup(hashes) >= 1
        n, [got] = loaded(pool, [kv], t, hashes[:2])
        assert n == 2 and torch.equal(got, want[:, :, :2])
    finally:
        agent.thawed.set()
        t.close()
    assert pool.all_free() and t.idle()


def test_a_disk_stuck_past_xfer_timeout_turns_off_and_the_host_tier_serves(tmp_path,
                                                                           monkeypatch):
    """An operation that never returns (not one NIXL times out: a syscall): the tiers
    thread sees it past XFER_TIMEOUT_S and turns the disk tier off; loads and stores
    go on from the host tier; nothing waits on the stuck thread."""
    monkeypatch.setattr(kv_disk_tier, "STALL_S", 0.1)
    monkeypatch.setattr(kv_disk_tier, "XFER_TIMEOUT_S", 0.5)
    kv, pool = torch.randn(LAYERS, 2, NUM_BLOCKS, HEADS, BS, HD), BlockPool(NUM_BLOCKS)
    t = tiers(pool, kv, tmp_path, load_timeout_s=0.3)
    agent = FreezingAgent(t.disk.agent)
    pread = kv_disk_tier.os.pread
    stuck = threading.Event()

    def hung_pread(fd, n, offset):               # a read of a header that never returns
        if threading.current_thread().name == "kv-disk":
            stuck.wait(60)
        return pread(fd, n, offset)

    try:
        hashes, _ = stored(pool, [kv], t, 2, seed=3)          # hashes[0] on disk
        monkeypatch.setattr(kv_disk_tier.os, "pread", hung_pread)
        n, _ = load_now(pool, kv, t, hashes[:1])              # cut at its deadline
        assert n == 0
        until(lambda: t.disk.failed, "the disk tier never turned off", timeout_s=5)
        assert t.disk.index == {} and t.lookup(hashes[:1]) == 0
        more, want = store_now(pool, kv, t, 1, seed=40)
        n, got = load_now(pool, kv, t, more)
        assert n == 1 and torch.equal(got, want)
    finally:
        stuck.set()
        agent.thawed.set()
        monkeypatch.setattr(kv_disk_tier.os, "pread", pread)
        until(t.disk.idle, "the disk thread never came back")
        t.close()
    assert pool.all_free() and t.idle()
