"""The disk KV tier's files (engine/kv_disk_tier.py): what their bytes mean (the
fingerprint) and under which key (disk_key); the directory, which is
the operator's (`--kv-disk-cache-dir`), made 0700 when missing and refused when another
user owns it or it is writable by group or others, and bounded as a whole
(SlabDirectory: every live slab an equal share; a free one adopted by a new tier of its
fingerprint, or reclaimed); a slab is opened with O_NOFOLLOW (a link planted where one
goes is never followed, nor its target written), held under an exclusive flock for the
life of its tier, and starts with a file header naming its fingerprint, KV format and key
(an HMAC of the fingerprint under the key): a tier uses only a free slab of its own kind,
never one another live process holds (another cluster's, sharing the directory).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import hmac
import logging
import os
import secrets
import stat
import struct
import time
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

FILE_HEADER = struct.Struct("<8sI32s32s")   # magic, KV format, fingerprint, key tag
FILE_MAGIC = b"PDKVSLAB"
FILE_HEADER_BYTES = 4096  # the file's header region; slot 0 follows
KV_FORMAT_VERSION = 2    # what a block's bytes and a slot's header mean, in the fingerprint


def disk_key(secret: str | None) -> bytes:
    """The key of the disk tier's entry MACs: HMAC-SHA256 of a label under the cluster
    secret (WorkerConfig.kv_secret); a random one without a secret (then nothing a
    restarted process wrote is read back)."""
    if secret is None:
        return os.urandom(32)
    return hmac.new(secret.encode(), b"pdserve kv disk tier", "sha256").digest()


def fingerprint(model_id: str, kv_cache: torch.Tensor, model_dir: Path | None = None,
                tp_rank: int = 0, tp_size: int = 1, kv_heads: Sequence[int] = ()) -> bytes:
    """32 bytes naming what a block's bytes mean: pdserve's KV_FORMAT_VERSION, the model
    (its config's `model_id`, and with `model_dir` its weights: each *.safetensors file's
    name and sha256, loader.file_digest, kept per file version so a restart does not
    hash again: a fine-tune written over the same files, of the same shape, differs),
    the cache's dtype and block layout [num_layers, 2, num_kv_heads, block_size,
    head_dim], the TP rank and size and the model's KV heads this rank's cache holds
    (`kv_heads`; at TP 1, all of them)."""
    from .loader import file_digest

    shape = (kv_cache.shape[0], kv_cache.shape[1], *kv_cache.shape[3:])
    h = hashlib.blake2b(f"kv-format{KV_FORMAT_VERSION}|{model_id}|{kv_cache.dtype}|"
                        f"{tuple(shape)}|rank{tp_rank}/{tp_size}|heads{tuple(kv_heads)}".encode(),
                        digest_size=32)
    for f in sorted(Path(model_dir).glob("*.safetensors")) if model_dir is not None else ():
        h.update(f"|{f.name}|{file_digest(f)}".encode())
    return h.digest()


def safe_dir(directory: Path) -> Path:
    """`directory`, made (mode 0700) when missing; refused when another user owns it or
    it is writable by group or others, whoever could then plant or swap slabs.

    Raises:
        PermissionError: naming kv_disk_cache_dir, its owner and mode, and what to change.
        OSError: it cannot be made, or is not a directory."""
    try:
        directory.mkdir(mode=0o700, parents=True)
        os.chmod(directory, 0o700)          # mkdir's mode is cut by the umask
    except FileExistsError:
        pass
    st = os.stat(directory, follow_symlinks=False)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(errno.ENOTDIR, f"kv_disk_cache_dir={directory}: not a "
                                                "directory (a link is not followed)")
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise PermissionError(
            f"kv_disk_cache_dir={directory}: owned by uid {st.st_uid} with mode "
            f"{stat.S_IMODE(st.st_mode):o}; the disk KV tier needs a directory of its own "
            f"user (uid {os.geteuid()}) that no one else can write: chown it, chmod 700")
    return directory


class SlabDirectory:
    """The disk tier's directory (safe_dir), shared by every worker, rank and cluster
    whose tiers use it, and bounded as a whole: its slabs, each held under an exclusive
    flock by the live tier that uses it, take at most `budget_bytes` together
    (`--kv-disk-cache-gib`), each live slab an equal share (share()). A slab whose tier
    is gone is free: a new tier of its fingerprint and key adopts it (a restarted or
    scaled-out worker starts warm), and once it has been free for `reclaim_after_s` (by
    its mtime: a live tier touches its slab every few seconds) a tier short of its share
    deletes it. Structural changes (claim, share) run under the
    directory's own lock file, `.lock`.

    Raises:
        PermissionError, OSError: as safe_dir."""

    def __init__(self, directory: Path, budget_bytes: int, reclaim_after_s: float = 60.0):
        self.directory = safe_dir(Path(directory))
        self.budget_bytes, self.reclaim_after_s = budget_bytes, reclaim_after_s

    @contextmanager
    def locked(self):
        """The directory's lock held (claim and share run under it, and the file size
        changes they lead to)."""
        fd = os.open(self.directory / ".lock",
                     os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def claim(self, fp: bytes, key: bytes, version: int, stride: int
              ) -> tuple[Path, int, int]:
        """(path, fd, slots) of a slab for a tier of fingerprint `fp`, KV format
        `version` and `key`: a free one whose file header names those (the most
        recently written: its entries read back), else a new one
        (`<fingerprint>-<random>.kvslab`); held under our flock, sized to its share
        (slots of `stride` bytes after the file header; 0 when the directory has no room
        now: it grows at a later share)."""
        ours = FILE_HEADER.pack(FILE_MAGIC, version, fp,
                                hmac.new(key, b"pdserve kv slab" + fp, "sha256").digest())
        with self.locked():
            mine, free = None, []
            try:
                for path in sorted(self.directory.glob(f"{fp.hex()[:16]}-*.kvslab")):
                    fd = _lock_file(path, create=False)
                    if fd is None:
                        continue
                    if os.pread(fd, FILE_HEADER.size, 0) == ours:
                        free.append((os.fstat(fd).st_mtime_ns, path, fd))
                    else:
                        os.close(fd)
                if free:
                    _, path, fd = mine = max(free)
                    free.remove(mine)
            finally:
                for _, _, other in free:
                    os.close(other)
            if mine is None:
                path = self.directory / f"{fp.hex()[:16]}-{secrets.token_hex(4)}.kvslab"
                fd = _lock_file(path, create=True)
                if fd is None:
                    raise OSError(f"disk KV tier: could not create {path}")
                os.pwrite(fd, ours, 0)
            slots = self.share(path, stride)
            os.ftruncate(fd, FILE_HEADER_BYTES + slots * stride)
            return path, fd, slots

    def share(self, own: Path, stride: int) -> int:
        """How many slots of `stride` bytes slab `own` may have now (call under
        locked(), and change its size there): budget_bytes over the live slabs (those
        another tier holds, and `own`), less what the other slabs take: a live one at
        most its share (it shrinks to it within RESIZE_S, so a new tier has its share
        at once and the directory is over its bound that long at most), a free one its
        size until it has been free for reclaim_after_s, when it is deleted (the oldest
        first) as far as `own`'s share needs the room."""
        live, live_sizes, others, free = 1, [], 0, []
        try:
            for path in self.directory.glob("*.kvslab"):
                if path == own:
                    continue
                try:
                    st = os.stat(path, follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if not stat.S_ISREG(st.st_mode):
                    continue
                fd = _lock_file(path, create=False, quiet=True)
                if fd is None:
                    live += 1                          # another tier's, in use
                    live_sizes.append(st.st_size)
                else:
                    others += st.st_size
                    free.append((st.st_mtime, path, fd, st.st_size))
            target = self.budget_bytes // live
            room = self.budget_bytes - others - sum(min(n, target) for n in live_sizes)
            now = time.time()
            for mtime, path, fd, size in sorted(free):
                if room >= target or now - mtime < self.reclaim_after_s:
                    break
                os.unlink(path)                        # held: no one adopts it meanwhile
                logger.info("disk KV tier: %s free for %.0f s: reclaimed", path, now - mtime)
                room += size
        finally:
            for _, _, fd, _ in free:
                os.close(fd)
        return max((min(target, room) - FILE_HEADER_BYTES) // stride, 0)


def _lock_file(path: Path, create: bool, quiet: bool = False) -> int | None:
    """An fd of `path` under our exclusive flock, or None: missing (unless `create`),
    a link, not a private regular file of this user's (logged unless `quiet`), or
    locked by another process."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT | os.O_EXCL if create else 0)
    try:
        fd = os.open(path, flags, 0o600)
    except FileNotFoundError:
        return None
    except FileExistsError:
        return None
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        if not quiet:
            logger.warning("disk KV tier: %s is a link: not followed, not used", path)
        return None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        os.close(fd)
        if not quiet:
            logger.warning("disk KV tier: %s is not a private file of this user's: not used",
                           path)
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:                   # another process's, sharing the directory
        os.close(fd)
        return None
    return fd
