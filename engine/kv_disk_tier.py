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

The directory and the slab files are engine/kv_disk_files.py's.

Every disk operation runs on the tier's own thread (`kv-disk`), never on the tiers thread
that feeds it, so a slow or hung disk (a hard-mounted NFS share, a failing device) costs
what waits on it and no more: a block moved to disk is copied into one of a few write
buffers and queued, or dropped (counted: `num_write_drops`) when they are all queued or
the disk is behind; a load's read waits for the disk until the load's deadline and is
then abandoned (`num_timed_out`: its bytes, should they come, are never copied into the
block, which the prompt computes meanwhile); while an operation has run for more than
STALL_S the disk counts as behind (lookups see none of its entries, loads and writes do
not wait on it), and one past XFER_TIMEOUT_S turns the tier off until a restart (check()).
"""

from __future__ import annotations

import hmac
import logging
import os
import queue
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

import torch

from .block_pool import BlockHash
from .kv_disk_files import (FILE_HEADER_BYTES, KV_FORMAT_VERSION, SlabDirectory, disk_key,
                            fingerprint)

__all__ = ["DiskTier", "SlabDirectory", "disk_bytes", "disk_key", "fingerprint", "slot_bytes",
           "HEADER_BYTES", "XFER_TIMEOUT_S"]

logger = logging.getLogger(__name__)

HEADER = struct.Struct("<8s32s16sQQ32s")   # magic, fingerprint, block hash, seq, bytes, mac
MAGIC = b"PDKVSLT2"
HEADER_BYTES = 4096      # a slot's header region; the block's bytes follow, page-aligned
XFER_TIMEOUT_S = 30.0    # a disk operation not done by then turns the tier off
STALL_S = 2.0            # ... one running longer: the disk is behind (module docstring)
RESIZE_S = 5.0           # a slab is resized to its share of the directory this often
WRITE_BUFFER_BYTES = 64 << 20   # host memory for the blocks queued to be written
MAX_WRITE_BUFFERS = 16


class DiskTier:
    """A slab file of `directory` (kv_disk_files.SlabDirectory.claim: a free one of `fp`
    and `key` adopted, else a new one), of as many slots as its share of the
    directory's budget holds, resized to the share every RESIZE_S (entries of slots a
    shrink cuts are forgotten); its index read back from the slots' headers (those of
    `fp` only), each entry checked against its MAC under `key` (disk_key) when read.
    `name` names its NIXL agent. Block bytes move through a NIXL agent with the POSIX backend, between the file
    and registered host buffers, on the tier's thread (see the module docstring); `lock`
    guards the index against readers on others (KVTiers.lookup). `on_change(stored,
    hash)` is called, under `lock`, for each entry the index gains or loses (those read
    back included). Counters: `num_written`, `num_dropped` (entries whose check failed),
    `num_write_drops` (writes dropped: the disk behind or off), `num_timed_out` (reads
    abandoned at their load's deadline).

    Raises:
        RuntimeError: NIXL (pdserve[nixl]) is not installed, or has no POSIX backend.
        PermissionError: the directory is not safe (safe_dir).
        OSError: the file cannot be created or opened.
    """

    def __init__(self, directory: SlabDirectory, name: str, block_bytes: int,
                 fp: bytes, lock: threading.Lock,
                 on_change: Callable[[bool, BlockHash], None] = lambda stored, h: None,
                 key: bytes | None = None):
        from ..kv_transfer.nixl import find_module
        nixl = find_module()
        if nixl is None:
            raise RuntimeError("--kv-disk-cache-dir needs NIXL's POSIX backend: "
                               "pip install 'pdserve[nixl]'")
        self.block_bytes, self.fp, self.dir = block_bytes, fp, directory
        self.key = key if key is not None else disk_key(None)
        self.stride = slot_bytes(block_bytes)
        self.path, self.fd, num_blocks = directory.claim(fp, self.key, KV_FORMAT_VERSION,
                                                         self.stride)
        self.num_blocks = num_blocks
        self.staging = torch.empty(block_bytes, dtype=torch.uint8)   # reads land here
        n_buffers = max(2, min(MAX_WRITE_BUFFERS, WRITE_BUFFER_BYTES // block_bytes))
        self.write_buffers = torch.empty((n_buffers, block_bytes), dtype=torch.uint8)
        self.agent = nixl.nixl_agent(f"pdserve-tiers-{os.getpid()}-{name}",
                                     nixl.nixl_agent_config(enable_prog_thread=False,
                                                            enable_listen_thread=False,
                                                            backends=[]))
        self.agent.create_backend("POSIX", {})
        self._regs = [self.agent.register_memory(self.write_buffers),
                      self.agent.register_memory(self.staging),
                      self.agent.register_memory([(0, self.slot_offset(num_blocks), self.fd,
                                                   "kvslab")], "FILE")]
        self.index: OrderedDict[BlockHash, int] = OrderedDict()   # LRU first
        self.free = set(range(num_blocks))
        self.num_written = self.num_dropped = self.num_write_drops = self.num_timed_out = 0
        self.failed = False          # _fail(): an operation overran XFER_TIMEOUT_S
        self._lock = lock
        self._on_change = on_change
        self._seq = 0
        self._recover()
        self._free_buffers = list(range(n_buffers))
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._queued = 0             # jobs put and not yet done (idle)
        self._busy_since: float | None = None   # time.monotonic() the running job began
        self._resized = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="kv-disk", daemon=True)
        self._thread.start()

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

    # --- the tiers thread ------------------------------------------------------------

    def write(self, h: BlockHash, src: torch.Tensor) -> bool:
        """Queue `src`'s bytes (a host-slab slot, contiguous) for a slot under `h`; never
        waits on the disk. False (counted in num_write_drops): dropped, the tier off or
        behind or its write buffers all queued."""
        with self._lock:
            if h in self.index:
                self.index.move_to_end(h)
                return True
            if self.failed or self.stalled() or not self._free_buffers:
                self.num_write_drops += 1
                return False
            buf = self._free_buffers.pop()
            self._queued += 1
        self.write_buffers[buf].copy_(src.reshape(-1).view(torch.uint8))
        self._jobs.put(("write", h, buf))
        return True

    def load_into(self, h: BlockHash, dst: torch.Tensor, deadline: float) -> bool:
        """Read `h`'s entry into `dst` (a view of the block's shape and dtype) on the
        tier's thread, waiting until `deadline` (time.monotonic()) at most; False: not
        held, the disk behind or off, the entry failed its check (dropped), or the
        deadline came first (the read abandoned: `dst` is never written after)."""
        with self._lock:
            if self.failed or h not in self.index or self.stalled():
                return False
            self._queued += 1
        read = _Read(h, dst)
        self._jobs.put(("read", read))
        if not read.done.wait(max(deadline - time.monotonic(), 0.0)):
            with read.lock:               # a copy under way finishes first
                if read.state == "pending":
                    read.state = "abandoned"
            if read.state == "abandoned":
                with self._lock:
                    self.num_timed_out += 1
                logger.warning("disk KV tier %s: a read not done by its load's deadline: "
                               "abandoned, its tokens computed", self.path)
        return read.state == "done"

    def has(self, h: BlockHash) -> bool:
        """Whether a load would find `h` (lock held by the caller): held, and the tier
        neither off nor behind."""
        return h in self.index and not self.failed and not self.stalled()

    def stalled(self) -> bool:
        """An operation has run for more than STALL_S."""
        since = self._busy_since
        return since is not None and time.monotonic() - since > STALL_S

    def check(self) -> None:
        """Turn the tier off once an operation has run past XFER_TIMEOUT_S (a syscall
        or a transfer that may never return); called by the tiers thread while it
        waits for work."""
        since = self._busy_since
        if not self.failed and since is not None and time.monotonic() - since > XFER_TIMEOUT_S:
            self._fail(f"an operation not done after {XFER_TIMEOUT_S} s")

    def drop(self, h: BlockHash) -> None:
        """Forget `h`'s entry now; its slot's header is cleared, and the slot freed, on
        the tier's thread."""
        with self._lock:
            slot = self.index.pop(h, None)
            if slot is None:
                return
            self._on_change(False, h)
            self._queued += 1
        self._jobs.put(("clear", slot))

    def idle(self) -> bool:
        """Nothing queued or running."""
        with self._lock:
            return self._queued == 0

    def close(self, join_timeout_s: float = 30.0) -> None:
        """Stop the tier's thread after what is queued; the file stays (closed only once
        the thread ended: one stuck in the disk keeps it open)."""
        self._jobs.put(None)
        self._thread.join(join_timeout_s)
        if self._thread.is_alive():
            logger.warning("disk KV tier %s: its thread is still in the disk; the file "
                           "stays open", self.path)
            return
        for reg in self._regs:
            self.agent.deregister_memory(reg)
        try:
            os.utime(self.fd)           # free from now: reclaim_after_s counts from here
        except OSError:
            pass
        os.close(self.fd)

    # --- the tier's thread -----------------------------------------------------------

    def _run(self) -> None:
        while True:
            if time.monotonic() - self._resized >= RESIZE_S:
                self._resize_to_share()
            try:
                job = self._jobs.get(timeout=RESIZE_S)
            except queue.Empty:
                continue
            if job is None:
                return
            self._busy_since = time.monotonic()
            try:
                if job[0] == "write":
                    self._write(job[1], job[2])
                elif job[0] == "read":
                    self._read(job[1])
                else:
                    self._clear(job[1])
            except Exception:         # a fault costs entries, never the thread
                logger.exception("disk KV tier %s: %s failed", self.path, job[0])
            finally:
                self._busy_since = None
                with self._lock:
                    self._queued -= 1

    def _resize_to_share(self) -> None:
        """The slab to its share of the directory now (SlabDirectory.share), under the
        directory's lock: a shrink forgets the entries of the slots it cuts."""
        self._resized = time.monotonic()
        if self.failed:
            return
        try:
            # alive: the slab's mtime is never older than RESIZE_S while its tier lives,
            # so one whose worker was killed counts as free from its death on
            # (SlabDirectory.share's reclaim_after_s), not from its last write
            os.utime(self.fd)
            with self.dir.locked():
                n = self.dir.share(self.path, self.stride)
                old = self.num_blocks
                if n == old:
                    return
                with self._lock:
                    if n < old:
                        for h in [h for h, slot in self.index.items() if slot >= n]:
                            del self.index[h]
                            self._on_change(False, h)
                        self.free = {slot for slot in self.free if slot < n}
                    else:
                        self.free |= set(range(old, n))
                    self.num_blocks = n
                os.ftruncate(self.fd, self.slot_offset(n))
                self.agent.deregister_memory(self._regs[2])
                self._regs[2] = self.agent.register_memory(
                    [(0, self.slot_offset(n), self.fd, "kvslab")], "FILE")
            logger.info("disk KV tier %s: %d -> %d slots (its share of the directory)",
                        self.path, old, n)
        except OSError as e:
            logger.warning("disk KV tier %s: not resized: %s", self.path, e)

    def _write(self, h: BlockHash, buf: int) -> None:
        """Write buffer `buf` into a slot under `h`, the least recently used entry's
        when none is free. The header goes last: a write cut short leaves no entry, or
        one whose MAC fails. A failed write costs its entry, never its slot."""
        src = self.write_buffers[buf]
        try:
            with self._lock:
                if self.failed or h in self.index:
                    return
                if self.free:
                    slot = self.free.pop()
                elif self.index:
                    old, slot = self.index.popitem(last=False)
                    self._on_change(False, old)
                else:                     # no slot: the directory has no room for it
                    self.num_write_drops += 1
                    return
            base = self.slot_offset(slot)
            try:
                os.pwrite(self.fd, bytes(HEADER.size), base)        # the old entry is gone
                self._xfer("WRITE", src, base + HEADER_BYTES)
                self._seq += 1
                os.pwrite(self.fd, self._header(h, self._seq, src), base)
            except OSError as e:
                logger.warning("KV block not moved to the disk tier: %s", e)
                with self._lock:
                    self.free.add(slot)
                return
            with self._lock:
                if self.failed:           # turned off meanwhile: nothing is indexed again
                    return
                self.index[h] = slot
                self.num_written += 1
                self._on_change(True, h)
        finally:
            with self._lock:
                self._free_buffers.append(buf)

    def _read(self, read: _Read) -> None:
        """A load's read: the entry's bytes into the staging buffer, checked, then into
        the load's block unless the load gave it up meanwhile."""
        src = None
        if read.state == "pending":
            src = self._read_entry(read.h)
        with read.lock:
            if read.state == "pending":
                if src is None:
                    read.state = "failed"
                else:
                    read.dst.copy_(src.view(read.dst.dtype).view(read.dst.shape))
                    read.state = "done"
        read.done.set()

    def _read_entry(self, h: BlockHash) -> torch.Tensor | None:
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
            with self._lock:
                self.num_dropped += 1
                held = self.index.get(h) == slot
                if held:
                    del self.index[h]
                    self._on_change(False, h)
            if held:
                self._clear(slot)
            return None
        with self._lock:
            if h in self.index:
                self.index.move_to_end(h)
        return self.staging

    def _clear(self, slot: int) -> None:
        """Clear a forgotten entry's header, then free its slot (a header that cannot be
        cleared is checked again at a restart); a slot a shrink cut since is gone."""
        if slot >= self.num_blocks:
            return
        try:
            os.pwrite(self.fd, bytes(HEADER.size), self.slot_offset(slot))
        except OSError as e:
            logger.warning("disk KV tier %s: slot %d header not cleared: %s", self.path,
                           slot, e)
        with self._lock:
            self.free.add(slot)

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

    def _xfer(self, op: str, buf: torch.Tensor, offset: int) -> None:
        """One NIXL transfer of `buf`'s bytes to (WRITE) or from (READ) the file at
        `offset`, polled with a sleep that grows to 1 ms. Raises OSError when the backend
        reports an error or raises (NIXL's own exception classes), or the transfer is
        not done within XFER_TIMEOUT_S (the tier is then off: it may still write)."""
        try:
            local = self.agent.get_xfer_descs([(buf.data_ptr(), self.block_bytes, 0)], "DRAM")
            remote = self.agent.get_xfer_descs([(offset, self.block_bytes, self.fd)], "FILE")
            handle = self.agent.initialize_xfer(op, local, remote, self.agent.name)
        except Exception as e:
            raise OSError(f"NIXL POSIX {op} of {self.path} at {offset}: {e}") from e
        try:
            state = self.agent.transfer(handle)
            deadline, pause = time.monotonic() + XFER_TIMEOUT_S, 20e-6
            while state not in ("DONE", "ERR"):
                if time.monotonic() > deadline:
                    self._fail(f"a {op} not done after {XFER_TIMEOUT_S} s")
                    state = "overdue"
                    break
                time.sleep(pause)
                pause = min(pause * 2, 1e-3)
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
        """Turn this tier off until a restart (an operation still running may yet write
        the staging buffer or the file): every entry forgotten, loads find none, writes
        are dropped. The file's entries are checked again at a restart."""
        logger.error("disk KV tier %s: %s; off until a restart", self.path, why)
        with self._lock:
            self.failed = True
            for h in self.index:
                self._on_change(False, h)
            self.index.clear()


def slot_bytes(block_bytes: int) -> int:
    """A slot's bytes in a slab: its 4 KiB header and the block's bytes, page-aligned."""
    return HEADER_BYTES + -(-block_bytes // 4096) * 4096


def disk_bytes(num_blocks: int, block_bytes: int) -> int:
    """The directory budget (bytes) a lone slab of `num_blocks` slots takes."""
    return FILE_HEADER_BYTES + num_blocks * slot_bytes(block_bytes)


class _Read:
    """One load's read of an entry into `dst`: state "pending" until the tier's thread
    has it "done" or "failed", or the load gives it up first ("abandoned"); `lock`
    makes the copy into `dst` and the giving up exclusive."""

    __slots__ = ("h", "dst", "state", "lock", "done")

    def __init__(self, h: BlockHash, dst: torch.Tensor):
        self.h, self.dst, self.state = h, dst, "pending"
        self.lock, self.done = threading.Lock(), threading.Event()
