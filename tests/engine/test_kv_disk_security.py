"""The disk KV tier against whoever can reach its directory and its files
(engine/kv_disk_tier.py): an entry moved to another hash (its MAC covers the hash) is
refused, never served, and a slab of another key (another cluster's) never read; a link planted where a slab
goes is not followed and its target is left as it was; a directory another user could
write is refused; two clusters sharing a directory (and worker names) write two slabs; a
short header read drops its entry; a weight changed in place, to the same size with its
first and last MiB and its mtime kept, changes the fingerprint, so nothing of the old
model's is read. Every test ends with the pool free."""

import os
import time

import pytest
import torch

from pdserve.engine import kv_disk_tier
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.kv_tiers import KVTiers, fingerprint

from tier_helpers import BLOCK_BYTES, BS, GIB, HD, HEADS, LAYERS, NUM_BLOCKS, loaded, stored

pytest.importorskip("nixl_cu12")

KEY = b"k" * 32
HASH_AT = 40          # a slot header's block hash: after the magic (8) and fingerprint (32)


def cache() -> torch.Tensor:
    return torch.randn(LAYERS, 2, NUM_BLOCKS, HEADS, BS, HD)


def tiers(pool, kv, disk_dir, key=KEY, name="t", fp=None, host_blocks=1, disk_blocks=4):
    return KVTiers(pool, kv, fp or fingerprint("m", kv), host_blocks * BLOCK_BYTES / GIB,
                   disk_dir, kv_disk_tier.disk_bytes(disk_blocks, BLOCK_BYTES) / GIB,
                   name=name, key=key)


def test_an_entry_moved_to_another_hash_is_refused(tmp_path):
    """A process that can write the slab copies a genuine entry's slot (header and
    bytes) into a free slot, its hash field set to a prefix it wants to poison: the
    restarted tier indexes it, but its MAC (over the hash too) fails: dropped, never
    served."""
    kv, pool = cache(), BlockPool(NUM_BLOCKS)
    t = tiers(pool, kv, tmp_path)
    try:
        hashes, _ = stored(pool, [kv], t, 2, seed=5)          # hashes[0] on disk
        victim, _ = stored(pool, [kv], t, 1, seed=500)        # hashes[1], victim: disk
        slot = t.disk.index[hashes[0]]
        free = sorted(t.disk.free)[0]
        path, stride = t.disk.path, t.disk.stride
        at, to = t.disk.slot_offset(slot), t.disk.slot_offset(free)
    finally:
        t.close()
    planted = b"\x42" * 16                                     # a prefix nobody stored
    with open(path, "r+b") as f:
        f.seek(at)
        genuine = bytearray(f.read(stride))
        genuine[HASH_AT:HASH_AT + 16] = planted
        f.seek(to)
        f.write(genuine)
    again = tiers(pool, kv, tmp_path)
    try:
        assert again.lookup([planted]) == 1                   # read back from its header
        n, _ = loaded(pool, [kv], again, [planted])
        assert n == 0 and planted not in again.disk.index and again.stats.dropped == 1
        n, _ = loaded(pool, [kv], again, hashes[:1])          # the genuine one serves
        assert n == 1
    finally:
        again.close()
    assert pool.all_free()


def test_a_slab_of_another_key_is_never_read(tmp_path):
    """Another cluster's key (its secret): the slab's header names that key, so it is
    neither read nor written; its own entries serve again afterwards."""
    kv, pool = cache(), BlockPool(NUM_BLOCKS)
    t = tiers(pool, kv, tmp_path)
    try:
        hashes, [want] = stored(pool, [kv], t, 3, seed=9)     # 2 on disk
        first = t.disk.path
    finally:
        t.close()
    other = tiers(pool, kv, tmp_path, key=b"o" * 32)
    try:
        assert other.disk.path != first and other.lookup(hashes) == 0
    finally:
        other.close()
    again = tiers(pool, kv, tmp_path)
    try:
        assert again.disk.path == first
        n, [got] = loaded(pool, [kv], again, hashes[:2])
        assert n == 2 and torch.equal(got, want[:, :, :2])
    finally:
        again.close()
    assert pool.all_free()


def test_a_link_planted_where_a_slab_goes_is_not_followed(tmp_path):
    """A link named as a slab of this fingerprint: passed over (never opened through,
    never reclaimed), its target left as it was; the tier makes its own slab."""
    kv, pool = cache(), BlockPool(NUM_BLOCKS)
    target = tmp_path / "precious"
    target.write_bytes(b"0123456789")
    fp = fingerprint("m", kv)
    link = tmp_path / f"{fp.hex()[:16]}-00000000.kvslab"
    link.symlink_to(target)
    t = tiers(pool, kv, tmp_path, fp=fp)
    try:
        assert t.disk.path != link and not t.disk.path.is_symlink()
        hashes, [want] = stored(pool, [kv], t, 3, seed=1)
        n, [got] = loaded(pool, [kv], t, hashes)
        assert n == 3 and torch.equal(got, want)
    finally:
        t.close()
    assert target.read_bytes() == b"0123456789" and link.is_symlink()
    assert pool.all_free()


@pytest.mark.parametrize("mode, owner", [(0o777, None), (0o770, None), (0o700, 12345)])
def test_a_directory_another_user_could_write_is_refused(tmp_path, mode, owner):
    kv, pool = cache(), BlockPool(NUM_BLOCKS)
    d = tmp_path / "kv"
    d.mkdir()
    os.chmod(d, mode)
    if owner is not None:
        if os.geteuid() != 0:
            pytest.skip("chown to another user needs root")
        os.chown(d, owner, -1)
    with pytest.raises(PermissionError, match="kv_disk_cache_dir=.*chmod 700"):
        tiers(pool, kv, d)
    assert not list(d.iterdir())                               # no slab made
    made = tiers(pool, kv, tmp_path / "new" / "kv")            # made 0700
    made.close()
    assert (os.stat(tmp_path / "new" / "kv").st_mode & 0o777) == 0o700
    assert pool.all_free()


def test_two_clusters_sharing_a_directory_write_two_slabs(tmp_path, monkeypatch):
    """Tiers of one fingerprint in two clusters (two keys) at once: the second never
    touches the first's slab (held, and another key's) and makes its own; the first
    shrinks to its share of the directory, the second grows into it; each serves its own
    entries, and after both close each reads back its own."""
    monkeypatch.setattr(kv_disk_tier, "RESIZE_S", 0.05)
    kv_a, kv_b, pool_a, pool_b = cache(), cache(), BlockPool(NUM_BLOCKS), BlockPool(NUM_BLOCKS)
    a = tiers(pool_a, kv_a, tmp_path, key=b"a" * 32, disk_blocks=9)
    b = tiers(pool_b, kv_b, tmp_path, key=b"b" * 32, disk_blocks=9)
    try:
        assert a.disk.path != b.disk.path
        deadline = time.monotonic() + 10
        while not a.disk.num_blocks == b.disk.num_blocks == 4:     # a half each
            assert time.monotonic() < deadline, (a.disk.num_blocks, b.disk.num_blocks)
            time.sleep(0.02)
        hashes, [want_a] = stored(pool_a, [kv_a], a, 3, seed=2)
        _, [want_b] = stored(pool_b, [kv_b], b, 3, seed=2)    # the same hashes
        n, [got] = loaded(pool_a, [kv_a], a, hashes)
        assert n == 3 and torch.equal(got, want_a)
        n, [got] = loaded(pool_b, [kv_b], b, hashes)
        assert n == 3 and torch.equal(got, want_b)
    finally:
        a.close()
        b.close()
    for key, kv, pool, want in ((b"b" * 32, kv_b, pool_b, want_b),
                                (b"a" * 32, kv_a, pool_a, want_a)):
        t = tiers(pool, kv, tmp_path, key=key, disk_blocks=9)  # each finds its own again
        try:
            n, [got] = loaded(pool, [kv], t, hashes[:2])
            assert n == 2 and torch.equal(got, want[:, :, :2])
        finally:
            t.close()
        assert pool.all_free()


def test_a_short_header_read_drops_its_entry(tmp_path, monkeypatch):
    """A failing disk that returns a short header read: the entry is dropped (it was
    raised as struct.error, never dropped, and failed every later load of it)."""
    kv, pool = cache(), BlockPool(NUM_BLOCKS)
    t = tiers(pool, kv, tmp_path)
    try:
        hashes, [want] = stored(pool, [kv], t, 3, seed=4)     # 2 on disk
        pread = os.pread
        monkeypatch.setattr(kv_disk_tier.os, "pread",
                            lambda fd, n, offset: pread(fd, n, offset)[:20])
        n, _ = loaded(pool, [kv], t, hashes)
        monkeypatch.setattr(kv_disk_tier.os, "pread", pread)
        assert n == 0 and hashes[0] not in t.disk.index and t.stats.dropped == 1
        assert t.lookup(hashes) == 0
        n, [got] = loaded(pool, [kv], t, hashes[1:2])          # the other still serves
        assert n == 1 and torch.equal(got, want[:, :, 1:2])
    finally:
        t.close()
    assert pool.all_free()


def test_a_weight_changed_in_place_changes_the_fingerprint(tmp_path, monkeypatch):
    """A fine-tune of the same shape written over the same file: same size, same first
    and last MiB, mtime set back. The fingerprint hashes the whole file, once per file
    version (kept under the cache dir: a restart does not hash again)."""
    from pdserve.engine import loader

    monkeypatch.setattr(loader, "cache_dir", lambda: tmp_path / "cache")
    hashed = []
    sha256_file = loader._sha256_file
    monkeypatch.setattr(loader, "_sha256_file", lambda p: hashed.append(p) or sha256_file(p))
    model = tmp_path / "model"
    model.mkdir()
    weights = model / "model.safetensors"
    data = bytearray(os.urandom(3 << 20))
    weights.write_bytes(data)
    kv = cache()
    before = fingerprint("m", kv, model)
    assert fingerprint("m", kv, model) == before and len(hashed) == 1   # kept
    st = weights.stat()
    data[(3 << 20) // 2] ^= 0xFF                           # the middle MiB only
    with open(weights, "r+b") as f:
        f.write(data)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert weights.stat().st_size == st.st_size and weights.stat().st_mtime_ns == st.st_mtime_ns
    after = fingerprint("m", kv, model)
    assert after != before and len(hashed) == 2
    pool = BlockPool(NUM_BLOCKS)
    t = tiers(pool, kv, tmp_path / "kv", fp=before)
    try:
        hashes, _ = stored(pool, [kv], t, 3, seed=6)          # 2 on disk
    finally:
        t.close()
    changed = tiers(pool, kv, tmp_path / "kv", fp=after)
    try:
        assert changed.lookup(hashes) == 0                     # no disk hit of the old model's
    finally:
        changed.close()
    assert pool.all_free()


def test_the_cluster_secret_comes_from_the_environment_when_given(monkeypatch):
    """$PDSERVE_KV_SECRET keeps the disk tier's key across whole-cluster restarts;
    without it each start makes its own."""
    from pdserve.cluster import kv_secret

    monkeypatch.setenv("PDSERVE_KV_SECRET", "kept")
    assert kv_secret() == "kept"
    assert kv_disk_tier.disk_key(kv_secret()) == kv_disk_tier.disk_key("kept")
    monkeypatch.delenv("PDSERVE_KV_SECRET")
    assert kv_secret() != kv_secret()
