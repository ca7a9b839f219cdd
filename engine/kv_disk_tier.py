"""The disk tier of a worker's KV tiers (engine/kv_tiers.py): one slab file of block
slots, each a header naming its entry then the block's bytes, moved by NIXL's POSIX
backend; the index read back from the headers when a worker restarts.

A slot's header: MAGIC, the fingerprint of model, dtype and KV layout (`fingerprint`),
the block hash, a sequence number (the LRU order across a restart), the CRC32C of the
block's bytes and their length. It is written after the bytes, and cleared before a
slot is reused, so a write cut short leaves no entry or one whose checksum fails.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from .block_pool import BlockHash

logger = logging.getLogger(__name__)

HEADER = struct.Struct("<8s32s16sQIQ")   # magic, fingerprint, block hash, seq, crc, bytes
MAGIC = b"PDKVTIER"
HEADER_BYTES = 4096      # a slot's header region; the block's bytes follow, page-aligned
XFER_TIMEOUT_S = 30.0    # a NIXL file transfer not done by then fails (OSError)


def fingerprint(model_id: str, kv_cache: torch.Tensor, model_dir: Path | None = None,
                tp_rank: int = 0, tp_size: int = 1, kv_heads: Sequence[int] = ()) -> bytes:
    """32 bytes naming what a block's bytes mean: the model (its config's `model_id`, and
    with `model_dir` its weights: each *.safetensors file's name, size and first and last
    MiB, so a fine-tune of the same shape differs), the cache's dtype and block layout
    [num_layers, 2, num_kv_heads, block_size, head_dim], the TP rank and size and the
    model's KV heads this rank's cache holds (`kv_heads`; at TP 1, all of them)."""
    shape = (kv_cache.shape[0], kv_cache.shape[1], *kv_cache.shape[3:])
    h = hashlib.blake2b(f"{model_id}|{kv_cache.dtype}|{tuple(shape)}|rank{tp_rank}/{tp_size}|"
                        f"heads{tuple(kv_heads)}".encode(), digest_size=32)
    for f in sorted(Path(model_dir).glob("*.safetensors")) if model_dir is not None else ():
        size = f.stat().st_size
        h.update(f"|{f.name}|{size}|".encode())
        with open(f, "rb") as w:
            h.update(w.read(1 << 20))
            w.seek(max(size - (1 << 20), 0))
            h.update(w.read(1 << 20))
    return h.digest()


class DiskTier:
    """A slab file of `num_blocks` slots under `directory`, named by `name`; its index
    read back from the slots' headers (those of `fp` only). Reads and writes of block
    bytes go through a NIXL agent with the POSIX backend, between the file and
    registered host buffers. One thread reads and writes; `lock` guards the index
    against readers on others (KVTiers.lookup). `on_change(stored, hash)` is called,
    under `lock`, for each entry the index gains or loses (those read back included).
    `num_dropped`: entries whose check failed.

    Raises:
        RuntimeError: NIXL (pdserve[nixl]) is not installed, or has no POSIX backend.
        OSError: the file cannot be created or opened.
    """

    def __init__(self, directory: Path, name: str, num_blocks: int, block_bytes: int,
                 fp: bytes, host_slab: torch.Tensor, lock: threading.Lock,
                 on_change: Callable[[bool, BlockHash], None] = lambda stored, h: None):
        from ..kv_transfer.nixl import find_module
        nixl = find_module()
        if nixl is None:
            raise RuntimeError("--kv-disk-cache-dir needs NIXL's POSIX backend: "
                               "pip install 'pdserve[nixl]'")
        self.num_blocks, self.block_bytes, self.fp = num_blocks, block_bytes, fp
        self.stride = HEADER_BYTES + -(-block_bytes // 4096) * 4096
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"{name}-{fp.hex()[:16]}.kvslab"
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(self.fd, self.stride * num_blocks)
        self.staging = torch.empty(block_bytes, dtype=torch.uint8)   # reads land here
        self.agent = nixl.nixl_agent(f"pdserve-tiers-{os.getpid()}-{name}",
                                     nixl.nixl_agent_config(enable_prog_thread=False,
                                                            enable_listen_thread=False,
                                                            backends=[]))
        self.agent.create_backend("POSIX", {})
        self._regs = [self.agent.register_memory(host_slab),
                      self.agent.register_memory(self.staging),
                      self.agent.register_memory([(0, self.stride * num_blocks, self.fd,
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
            raw = os.pread(self.fd, HEADER.size, slot * self.stride)
            if len(raw) < HEADER.size:
                continue
            magic, fp, h, seq, _, nbytes = HEADER.unpack(raw)
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
        from ..kv_transfer.host_io import crc32c, tensor_bytes
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
        base = slot * self.stride
        try:
            os.pwrite(self.fd, bytes(HEADER.size), base)        # the old entry is gone
            self._xfer("WRITE", src, base + HEADER_BYTES)
            crc = crc32c([tensor_bytes(src)])
            self._seq += 1
            os.pwrite(self.fd, HEADER.pack(MAGIC, self.fp, h, self._seq, crc,
                                           self.block_bytes), base)
        except BaseException:
            with self._lock:
                self.free.add(slot)
            raise
        with self._lock:
            self.index[h] = slot
            self._on_change(True, h)

    def read(self, h: BlockHash) -> torch.Tensor | None:
        """The bytes of `h`'s entry in the staging buffer (valid until the next read), or
        None: not held, or it could not be read or failed its check (then dropped)."""
        from ..kv_transfer.host_io import crc32c, tensor_bytes
        with self._lock:
            slot = None if self.failed else self.index.get(h)
        if slot is None:
            return None
        base = slot * self.stride
        try:
            self._xfer("READ", self.staging, base + HEADER_BYTES)
            raw = os.pread(self.fd, HEADER.size, base)
        except OSError as e:
            logger.warning("disk KV tier %s: slot %d unreadable (%s); dropped", self.path,
                           slot, e)
            raw = bytes(HEADER.size)
        magic, fp, got, _, crc, _ = HEADER.unpack(raw)
        if (magic, fp, got) != (MAGIC, self.fp, h) or crc32c([tensor_bytes(self.staging)]) != crc:
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

    def drop(self, h: BlockHash) -> None:
        """Forget `h`'s entry and clear its slot's header (OSError: it could not be
        cleared; the entry is forgotten all the same)."""
        with self._lock:
            slot = self.index.pop(h)
            self.free.add(slot)
            self._on_change(False, h)
        os.pwrite(self.fd, bytes(HEADER.size), slot * self.stride)

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
