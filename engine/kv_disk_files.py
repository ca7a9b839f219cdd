"""The disk KV tier's files (engine/kv_disk_tier.py): what their bytes mean (the
fingerprint) and under which key (disk_key); the directory, which is
the operator's (`--kv-disk-cache-dir`), made 0700 when missing and refused when another
user owns it or it is writable by group or others; a slab is opened with O_NOFOLLOW (a
link planted where it goes is never followed, nor its target written), held under an
exclusive flock for the life of its tier, and starts with a file header naming its
fingerprint, KV format and key (an HMAC of the fingerprint under the key): a worker uses
only a slab of its own, and one whose slab another live process holds (another
cluster's worker of the same name sharing the directory) takes the next free name.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import hmac
import logging
import os
import stat
import struct
from collections.abc import Sequence
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

FILE_HEADER = struct.Struct("<8sI32s32s")   # magic, KV format, fingerprint, key tag
FILE_MAGIC = b"PDKVSLAB"
FILE_HEADER_BYTES = 4096  # the file's header region; slot 0 follows
SLAB_NAMES = 8           # names tried per worker and fingerprint (<name>-<fp>[.<i>].kvslab)
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


def open_slab(directory: Path, name: str, fp: bytes, key: bytes, version: int
              ) -> tuple[Path, int]:
    """(path, fd) of this worker's slab among its SLAB_NAMES names, opened without
    following a link and held under an exclusive flock: the first whose file header
    names this fingerprint, KV format `version` and key (its entries read back), else a
    name no file holds, else the least recently written of another key's or format's
    (its entries unreadable here; made empty). A name held by another process, a link, or a file not
    private to this user is passed over.

    Raises:
        OSError: no name is left."""
    stem = f"{name}-{fp.hex()[:16]}"
    ours = FILE_HEADER.pack(FILE_MAGIC, version, fp,
                            hmac.new(key, b"pdserve kv slab" + fp, "sha256").digest())
    missing, others = [], []          # names no file holds; (mtime, path, fd) held by us
    try:
        for i in range(SLAB_NAMES):
            path = directory / (f"{stem}.kvslab" if i == 0 else f"{stem}.{i}.kvslab")
            fd = _lock_file(path, create=False)
            if fd is None:
                if not os.path.lexists(path):
                    missing.append(path)
                continue
            if os.pread(fd, FILE_HEADER.size, 0) == ours:
                return path, fd
            others.append((os.fstat(fd).st_mtime_ns, path, fd))
        for path in missing:
            fd = _lock_file(path, create=True)
            if fd is not None:
                os.pwrite(fd, ours, 0)
                return path, fd
        if others:
            _, path, fd = others.pop(min(range(len(others)), key=lambda i: others[i][0]))
            logger.warning("disk KV tier: %s held another key's or format's entries: "
                           "emptied", path)
            os.ftruncate(fd, 0)
            os.pwrite(fd, ours, 0)
            return path, fd
    finally:
        for _, _, fd in others:
            os.close(fd)                      # their locks go with them
    raise OSError(f"disk KV tier: no free slab name {stem}[.N].kvslab in {directory}")


def _lock_file(path: Path, create: bool) -> int | None:
    """An fd of `path` under our exclusive flock, or None: missing (unless `create`),
    a link, not a private regular file of this user's, or locked by another process."""
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
        logger.warning("disk KV tier: %s is a link: not followed, not used", path)
        return None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        os.close(fd)
        logger.warning("disk KV tier: %s is not a private file of this user's: not used", path)
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:                   # another process's, sharing the directory
        os.close(fd)
        return None
    return fd
