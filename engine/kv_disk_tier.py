"""The disk tier of a worker's KV tiers (engine/kv_tiers.py): one slab file of block
slots, each a header naming its entry then the block's bytes, moved by NIXL's POSIX
backend; the index read back from the headers when a worker restarts.

The file starts with a header naming its fingerprint and key (an HMAC of the
fingerprint under the key), then its slots. A slot's header: MAGIC, the fingerprint of model, dtype and KV layout (`fingerprint`),
the block hash, a sequence number (the LRU order across a restart), the block's length
and an HMAC-SHA256 of all of those and the block's bytes, keyed by `disk_key` (derived
from the cluster secret): an entry written by anyone without the key (a process that can
write the directory, another cluster sharing it) or moved to another slot or hash fails
it and is dropped, never served. The header is written after the bytes, and cleared
before a slot is reused, so a write cut short leaves no entry or one that fails its
check.

The directory is the operator's (`--kv-disk-cache-dir`): made 0700 when missing, refused
when another user owns it or it is writable by group or others. A slab is opened with
O_NOFOLLOW (a link planted where it goes is never followed, nor its target written) and
held under an exclusive flock for the life of the tier: a process that finds its slab
taken (another cluster's worker of the same name sharing the directory) uses the next
free name, so no two write one file.
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
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from .block_pool import BlockHash

logger = logging.getLogger(__name__)

HEADER = struct.Struct("<8s32s16sQQ32s")   # magic, fingerprint, block hash, seq, bytes, mac
MAGIC = b"PDKVSLT2"
HEADER_BYTES = 4096      # a slot's header region; the block's bytes follow, page-aligned
FILE_HEADER = struct.Struct("<8sI32s32s")   # magic, KV format, fingerprint, key tag
FILE_MAGIC = b"PDKVSLAB"
FILE_HEADER_BYTES = 4096  # the file's header region; slot 0 follows
XFER_TIMEOUT_S = 30.0    # a NIXL file transfer not done by then fails (OSError)
KV_FORMAT_VERSION = 2    # what a block's bytes and a slot's header mean, in the fingerprint
SLAB_NAMES = 8           # names tried per worker and fingerprint (<name>-<fp>[.<i>].kvslab)


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


def _open_slab(directory: Path, name: str, fp: bytes, key: bytes) -> tuple[Path, int]:
    """(path, fd) of this worker's slab among its SLAB_NAMES names, opened without
    following a link and held under an exclusive flock: the first whose file header is
    this fingerprint's under this key (its entries read back), else a name no file
    holds, else the least recently written of another key's or format's (its entries
    unreadable here; made empty). A name held by another process, a link, or a file not
    private to this user is passed over.

    Raises:
        OSError: no name is left."""
    stem = f"{name}-{fp.hex()[:16]}"
    ours = FILE_HEADER.pack(FILE_MAGIC, KV_FORMAT_VERSION, fp,
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


class DiskTier:
    """A slab file of `num_blocks` slots under `directory` (safe_dir), named by `name`
    and `fp` (_open_slab); its index read back from the slots' headers (those of `fp`
    only), each entry checked against its MAC under `key` (disk_key) when read. Reads
    and writes of block bytes go through a NIXL agent with the POSIX backend, between
    the file and registered host buffers. One thread reads and writes; `lock` guards the
    index against readers on others (KVTiers.lookup). `on_change(stored, hash)` is
    called, under `lock`, for each entry the index gains or loses (those read back
    included). `num_dropped`: entries whose check failed.

    Raises:
        RuntimeError: NIXL (pdserve[nixl]) is not installed, or has no POSIX backend.
        PermissionError: the directory is not safe (safe_dir).
        OSError: the file cannot be created or opened.
    """

    def __init__(self, directory: Path, name: str, num_blocks: int, block_bytes: int,
                 fp: bytes, host_slab: torch.Tensor, lock: threading.Lock,
                 on_change: Callable[[bool, BlockHash], None] = lambda stored, h: None,
                 key: bytes | None = None):
        from ..kv_transfer.nixl import find_module
        nixl = find_module()
        if nixl is None:
            raise RuntimeError("--kv-disk-cache-dir needs NIXL's POSIX backend: "
                               "pip install 'pdserve[nixl]'")
        self.num_blocks, self.block_bytes, self.fp = num_blocks, block_bytes, fp
        self.key = key if key is not None else disk_key(None)
        self.stride = HEADER_BYTES + -(-block_bytes // 4096) * 4096
        self.path, self.fd = _open_slab(safe_dir(Path(directory)), name, fp, self.key)
        os.ftruncate(self.fd, self.slot_offset(num_blocks))
        self.staging = torch.empty(block_bytes, dtype=torch.uint8)   # reads land here
        self.agent = nixl.nixl_agent(f"pdserve-tiers-{os.getpid()}-{name}",
                                     nixl.nixl_agent_config(enable_prog_thread=False,
                                                            enable_listen_thread=False,
                                                            backends=[]))
        self.agent.create_backend("POSIX", {})
        self._regs = [self.agent.register_memory(host_slab),
                      self.agent.register_memory(self.staging),
                      self.agent.register_memory([(0, self.slot_offset(num_blocks), self.fd,
                                                   "kvslab")], "FILE")]
        self.index: OrderedDict[BlockHash, int] = OrderedDict()   # LRU first
        self.free = set(range(num_blocks))
        self.num_dropped = 0
        self.failed = False          # _fail(): a transfer overran XFER_TIMEOUT_S
        self._lock = lock
        self._on_change = on_change
        self._seq = 0
        self._recover()

    def _recover(self) -> None:
        """The index from the slots' headers: entries of this fingerprint, LRU order by
        their sequence numbers; other slots are free."""
        found = []
        for slot in range(self.num_blocks):
            raw = os.pread(self.fd, HEADER.size, self.slot_offset(slot))
            if len(raw) < HEADER.size:
                continue
            magic, fp, h, seq, nbytes, _ = HEADER.unpack(raw)
            if magic == MAGIC and fp == self.fp and nbytes == self.block_bytes:
                found.append((seq, h, slot))
        for seq, h, slot in sorted(found):
            if h in self.index:                      # a later write of the same hash
                self.free.add(self.index.pop(h))
            self.index[h] = slot
            self.free.discard(slot)
            self._seq = max(self._seq, seq)
        with self._lock:
            for h in self.index:
                self._on_change(True, h)
        if found:
            logger.info("disk KV tier %s: %d blocks back from a previous run", self.path,
                        len(self.index))

    def write(self, h: BlockHash, src: torch.Tensor) -> None:
        """`src` (a host-slab slot, its block's bytes) into a slot under `h`, the least
        recently used entry's when none is free. The header goes last: a write cut short
        leaves no entry, or one whose checksum fails.

        Raises:
            OSError: the file or NIXL failed, or the tier is off (_fail); the slot is
                free again, `h` not held."""
        with self._lock:
            if self.failed:
                raise OSError(f"disk KV tier {self.path} is off")
            if h in self.index:
                self.index.move_to_end(h)
                return
            if self.free:
                slot = self.free.pop()
            else:
                old, slot = self.index.popitem(last=False)
                self._on_change(False, old)
        base = self.slot_offset(slot)
        try:
            os.pwrite(self.fd, bytes(HEADER.size), base)        # the old entry is gone
            self._xfer("WRITE", src, base + HEADER_BYTES)
            self._seq += 1
            os.pwrite(self.fd, self._header(h, self._seq, src), base)
        except BaseException:
            with self._lock:
                self.free.add(slot)
            raise
        with self._lock:
            self.index[h] = slot
            self._on_change(True, h)

    def read(self, h: BlockHash) -> torch.Tensor | None:
        """The bytes of `h`'s entry in the staging buffer (valid until the next read), or
        None: not held, or it could not be read or failed its check (then dropped): a
        header that does not name `h`, a short read, a MAC that does not match."""
        with self._lock:
            slot = None if self.failed else self.index.get(h)
        if slot is None:
            return None
        base = self.slot_offset(slot)
        try:
            self._xfer("READ", self.staging, base + HEADER_BYTES)
            raw = os.pread(self.fd, HEADER.size, base)
        except OSError as e:
            logger.warning("disk KV tier %s: slot %d unreadable (%s); dropped", self.path,
                           slot, e)
            raw = b""
        ok = len(raw) == HEADER.size
        if ok:
            magic, fp, got, seq, nbytes, _ = HEADER.unpack(raw)
            ok = ((magic, fp, got, nbytes) == (MAGIC, self.fp, h, self.block_bytes)
                  and hmac.compare_digest(raw, self._header(h, seq, self.staging)))
        if not ok:
            logger.warning("disk KV tier %s: slot %d fails its check; dropped", self.path, slot)
            self.num_dropped += 1
            try:
                self.drop(h)
            except OSError as e:            # its header stays: checked again at a restart
                logger.warning("disk KV tier %s: slot %d header not cleared: %s",
                               self.path, slot, e)
            return None
        with self._lock:
            self.index.move_to_end(h)
        return self.staging

    def slot_offset(self, slot: int) -> int:
        """Where slot `slot` starts in the file (bytes): after the file's header."""
        return FILE_HEADER_BYTES + slot * self.stride

    def _header(self, h: BlockHash, seq: int, block: torch.Tensor) -> bytes:
        """A slot's header for `h`'s entry of bytes `block` (a uint8 host buffer), its
        MAC over the other fields and the bytes (hashlib releases the GIL meanwhile)."""
        from ..kv_transfer.host_io import tensor_bytes
        fields = HEADER.pack(MAGIC, self.fp, h, seq, self.block_bytes, bytes(32))[:-32]
        mac = hmac.new(self.key, fields, "sha256")
        mac.update(tensor_bytes(block))
        return fields + mac.digest()

    def drop(self, h: BlockHash) -> None:
        """Forget `h`'s entry and clear its slot's header (OSError: it could not be
        cleared; the entry is forgotten all the same)."""
        with self._lock:
            slot = self.index.pop(h)
            self.free.add(slot)
            self._on_change(False, h)
        os.pwrite(self.fd, bytes(HEADER.size), self.slot_offset(slot))

    def _xfer(self, op: str, buf: torch.Tensor, offset: int) -> None:
        """One NIXL transfer of `buf`'s bytes to (WRITE) or from (READ) the file at
        `offset`. Raises OSError when the backend reports an error or raises (NIXL's
        own exception classes), or the transfer is not done within XFER_TIMEOUT_S."""
        try:
            local = self.agent.get_xfer_descs([(buf.data_ptr(), self.block_bytes, 0)], "DRAM")
            remote = self.agent.get_xfer_descs([(offset, self.block_bytes, self.fd)], "FILE")
            handle = self.agent.initialize_xfer(op, local, remote, self.agent.name)
        except Exception as e:
            raise OSError(f"NIXL POSIX {op} of {self.path} at {offset}: {e}") from e
        try:
            state = self.agent.transfer(handle)
            deadline = time.monotonic() + XFER_TIMEOUT_S
            while state not in ("DONE", "ERR"):
                if time.monotonic() > deadline:
                    self._fail(f"a {op} not done after {XFER_TIMEOUT_S} s")
                    state = "overdue"
                    break
                state = self.agent.check_xfer_state(handle)
            if state != "DONE":
                raise OSError(f"NIXL POSIX {op} of {self.path} at {offset} failed: {state}")
        except OSError:
            raise
        except Exception as e:
            raise OSError(f"NIXL POSIX {op} of {self.path} at {offset}: {e}") from e
        finally:
            try:
                self.agent.release_xfer_handle(handle)
            except Exception as e:      # an overdue transfer's: the tier is off already
                logger.warning("disk KV tier %s: transfer handle not released: %s",
                               self.path, e)

    def _fail(self, why: str) -> None:
        """Turn this tier off until a restart (a transfer still running may yet write
        the staging buffer or the file): every entry forgotten, read() finds none,
        write() raises OSError. The file's entries are checked again at a restart."""
        logger.error("disk KV tier %s: %s; off until a restart", self.path, why)
        with self._lock:
            self.failed = True
            for h in self.index:
                self._on_change(False, h)
            self.index.clear()

    def close(self) -> None:
        for reg in self._regs:
            self.agent.deregister_memory(reg)
        os.close(self.fd)
