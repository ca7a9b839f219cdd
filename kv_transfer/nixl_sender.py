"""NIXL sender (prefill worker P side); the transport is described in ``nixl.py``.

P pairs over the TCP control connection (tcp_sender.py), loads D's agent metadata into
each lane's agent, BEGINs a request once (D's block ids come back), then cuts each
send_layers into one contiguous share of the blocks per lane, queues the shares and
returns; send_done / send_abort wait for the request's WRITEs first::

    send_layers(rid, layers, src blocks [b0 .. bn))
      -> lane 0: rows of blocks [b0, bk) + notif KV(layers, b0, n)   (its thread)
      -> lane 1: rows of blocks [bk, bn)                             (its thread)

Each lane's thread posts what queued up behind its last WRITE as one WRITE.
"""

from __future__ import annotations

import base64
import logging
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from . import control, frames
from .base import KVFrameError, KVLayout, KVLayoutMismatch, KVTransferError
from .frames import FrameType
from .nixl import BUSY_POLL_S, LANE_MIN_BYTES, LANES, MAX_LANES, DescRows, HeadRows, memory_of
from .nixl_lane import Lane

from .tcp_sender import TcpKVSender, _SendConn

logger = logging.getLogger(__name__)

# How often P looks (a non-blocking peek) whether D closed the control connection; D
# holds a dropped writer's blocks LOST_WRITER_GRACE_S (1 s) past the loss.
PEER_CHECK_S = 0.005


class _Begun:
    """One request P has BEGUN on a decode worker: D's blocks, and its WRITEs."""

    def __init__(self, dst_block_ids: np.ndarray) -> None:
        self.dst_block_ids = dst_block_ids  # [n] int64, D's reserved blocks (BEGIN_ACK)
        self.num_writes = 0                 # WRITEs handed to lanes (DONE tells D)
        self.pending = 0                    # ... not yet seen complete
        self.error: str | None = None       # the first WRITE that failed
        # (block_start, num blocks, lanes) -> (P's block ids, per lane (src, dst) rows)
        self.shares: dict[tuple[int, int, int], tuple[list[int], list]] = {}
        self.cancelled = False              # failed, or its connection dropped: post no more
        self.cond = threading.Condition()

    def finished_one(self, error: str | None = None) -> None:
        with self.cond:
            self.pending -= 1
            self.error = self.error or error
            self.cancelled = self.cancelled or error is not None  # post nothing more
            self.cond.notify_all()

    def wait(self, timeout_s: float) -> str | None:
        """Wait for every WRITE; None when all completed, else why not."""
        with self.cond:
            if not self.cond.wait_for(lambda: self.pending == 0, timeout_s):
                return f"{self.pending} WRITEs not done in {timeout_s:.0f}s"
            return self.error


@dataclass(eq=False)
class _Peer:
    """A decode worker as P's agents know it (one per control connection)."""

    agent: str                 # D's agent name
    dst: list                  # per lane: the prepared descriptor list of D's whole cache
    num_blocks: int            # D's cache size in blocks
    # D's KV heads (the model's numbering), when they differ from this cache's: then
    # dst lists one descriptor per (layer, K/V, block, head) and a share names heads
    heads: range | None = None
    begun: dict[tuple[str, int], _Begun] = field(default_factory=dict)  # by (rid, epoch)
    checked_at: float = 0.0    # time.monotonic() of the last _peer_closed check


def _peer_closed(sock: socket.socket) -> bool:
    """Whether D closed the control connection (a pending EOF or error), without
    blocking or consuming anything (D sends nothing unasked)."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True


class NixlKVSender(TcpKVSender):
    """P side (the module docstring). The source blocks must stay as they are until
    send_done / send_abort returns, which they do: P frees a request's blocks after.

    lanes: NIXL agents posting in parallel (LANES). host: this worker's address
    (UCX_NET_DEVICES). io_timeout_s also bounds the wait for a request's WRITEs.
    """

    def __init__(self, kv: torch.Tensor, layout: KVLayout, *, secret: str | None = None,
                 epoch: int = 0, host: str = "127.0.0.1", lanes: int = LANES,
                 connect_timeout_s: float = 5.0, io_timeout_s: float = 30.0) -> None:
        super().__init__(kv, layout, checksum=False, secret=secret, epoch=epoch,
                         connect_timeout_s=connect_timeout_s, io_timeout_s=io_timeout_s)
        if not 1 <= lanes <= MAX_LANES:
            raise ValueError(f"lanes={lanes}: must be in [1, {MAX_LANES}]")
        self._mem, self._device_id = memory_of(kv)
        self._unit = kv[0, 0, 0].numel() * kv.element_size()  # one block of one layer's K
        self._lanes = [Lane(i, kv, layout, host, self._mem, self._device_id, self._unit)
                       for i in range(lanes)]
        self._held: list[socket.socket] = []   # connections kept for WRITEs not ended

    def _handshake_extra(self) -> dict | None:
        return {"agents": [lane.agent.name for lane in self._lanes]}

    def _paired(self, conn: _SendConn, addr: tuple[str, int], ack: control.Handshake) -> None:
        if ack.nixl is None:
            raise KVLayoutMismatch(
                f"decode worker at {addr[0]}:{addr[1]} takes no NIXL writes (it runs the tcp "
                "transport): start every worker with the same --transport")
        # tensor-parallel peers holding other KV heads (the layouts' partitions pair:
        # _connect checked): one descriptor per head, a share is a run of heads
        split = ack.layout.heads if ack.layout.heads != self.layout.heads else None
        try:
            md = base64.b64decode(ack.nixl["metadata"], validate=True)
            base, num_blocks = int(ack.nixl["kv_ptr"]), int(ack.nixl["num_blocks"])
            mem, device_id = str(ack.nixl["mem_type"]), int(ack.nixl["device_id"])
        except (KeyError, TypeError, ValueError) as e:
            raise KVFrameError(f"malformed nixl handshake fields from {addr}: {e}") from e
        if mem != self._mem or num_blocks <= 0:
            raise KVLayoutMismatch(f"decode worker at {addr[0]}:{addr[1]}: cache in {mem} "
                                   f"({num_blocks} blocks), this prefill worker's in {self._mem}")
        try:
            heads = len(split) if split else 0
            unit = self.layout.head_bytes * ack.layout.num_kv_heads   # one block of D's K
            paired = [lane.pair(md, base, num_blocks, self.layout.num_layers, unit, mem,
                                device_id, heads) for lane in self._lanes]
        except Exception as e:  # NIXL's own error types; the connection is dropped
            raise ConnectionError(f"NIXL pairing with {addr[0]}:{addr[1]} failed: "
                                  f"{type(e).__name__}: {e}") from e
        conn.peer = _Peer(paired[0][0], [dst for _, dst in paired], num_blocks, heads=split)

    def _drop(self, conn: _SendConn) -> None:
        """Also end the dropped connection's WRITEs before D can learn of the loss: its
        requests' queued shares are never posted, and every WRITE in flight to that D is
        cancelled, or waited for until it completes or fails (io_timeout_s at most;
        Lane.kill). D hands a lost writer's blocks on LOST_WRITER_GRACE_S after the
        control connection closes, so it closes only once nothing of this sender can
        write into them. A WRITE still in flight after the wait keeps the connection
        open, and D keeps the blocks it leased, until the sender closes (logged)."""
        peer = conn.peer
        if peer is not None:
            for begun in peer.begun.values():
                begun.cancelled = True
            deadline = time.monotonic() + self.io_timeout_s
            alive = sum(lane.kill(dst, deadline) for lane, dst in zip(self._lanes, peer.dst))
            if alive and conn.sock is not None:
                logger.error("%d NIXL WRITEs to %s neither completed nor were cancelled in "
                             "%.0f s: the control connection stays open, so that D keeps "
                             "their blocks, until this sender closes", alive, peer.agent,
                             self.io_timeout_s)
                self._held.append(conn.sock)
                conn.sock = None
        super()._drop(conn)

    def send_layers(self, addr: tuple[str, int], request_id: str, epoch: int,
                    layer_start: int, layer_end: int, src_block_ids: Sequence[int],
                    block_start: int = 0, heads: range | None = None) -> int:
        ids, nbytes = self._check_send(layer_start, layer_end, src_block_ids, block_start,
                                       heads)
        heads = self.layout.heads if heads is None else heads
        fields = self._head_fields(heads)
        # One notification for the whole call, on lane 0's share: D only judges a request
        # at DONE, which P sends once every lane's WRITEs completed (landed at D), so a
        # notification naming blocks another lane carries is never read too early.
        notif = frames.pack_header(
            FrameType.KV, request_id, epoch=epoch, layer_start=layer_start,
            layer_end=layer_end, block_start=block_start, num_blocks=len(ids),
            dtype_code=self._dtype_code, payload_len=nbytes, **fields)

        def write(conn: _SendConn) -> None:
            peer: _Peer = conn.peer
            if peer.heads is None and heads != self.layout.heads:
                raise ValueError(f"heads {heads}: the decode worker at {addr} holds this "
                                 f"cache's heads {self.layout.heads}; send them all")
            begun = peer.begun.get((request_id, epoch))
            if begun is None:
                begun = peer.begun[(request_id, epoch)] = _Begun(
                    self._begin(conn, request_id, epoch, fields))
            if begun.error is not None:
                raise ConnectionError(f"request {request_id}: {begun.error}")
            now = time.monotonic()
            if now - peer.checked_at > PEER_CHECK_S:   # a syscall: not on every call
                peer.checked_at = now
                if _peer_closed(conn.sock):   # D hung up: its grace period is running
                    raise ConnectionError("decode worker closed the control connection")
            if self.kv.is_cuda:  # on_layer_done fires when the layer is queued, not done
                torch.cuda.current_stream(self.kv.device).synchronize()
            lanes = max(1, min(len(self._lanes), len(ids), nbytes // LANE_MIN_BYTES))
            key = (block_start, len(ids), lanes, heads.start, heads.stop)
            shares = begun.shares.get(key)
            if shares is None or shares[0] != ids:
                shares = begun.shares[key] = (
                    ids, self._cut(request_id, begun, ids, block_start, lanes, peer, heads))
            jobs = [(begun, self._lanes[k].head_src() if peer.heads else self._lanes[k].src,
                     peer.dst[k], src.rows(layer_start, layer_end),
                     dst.rows(layer_start, layer_end), b"" if k else notif)
                    for k, (src, dst) in enumerate(shares[1])]
            with begun.cond:
                begun.num_writes += 1      # notifications: lane 0's share carries the one
                begun.pending += lanes
            for lane, job in zip(self._lanes, jobs):   # Lane.post's job
                lane.jobs.put(job)

        self._with_conn(addr, write)
        return nbytes

    def close(self) -> None:
        super().close()
        for lane in self._lanes:
            lane.close()
        for sock in self._held:
            sock.close()
        self._held.clear()

    # ---- internals -----------------------------------------------------------------

    def _cut(self, request_id: str, begun: _Begun, ids: list[int], block_start: int,
             lanes: int, peer: _Peer, heads: range) -> list[tuple[DescRows, DescRows]]:
        """P's blocks ``ids`` and D's blocks from ``block_start`` on, cut into one
        contiguous share per lane: (src rows, dst rows) of each; of the KV ``heads``
        only, on a peer holding other heads than this cache (HeadRows)."""
        dst_ids = begun.dst_block_ids
        if block_start + len(ids) > len(dst_ids):
            raise KVTransferError(
                f"request {request_id}: blocks [{block_start}, {block_start + len(ids)}) "
                f"beyond D's reservation of {len(dst_ids)}")
        src = np.asarray(ids, dtype=np.int64)
        dst = dst_ids[block_start:block_start + len(ids)]
        cuts = [len(ids) * k // lanes for k in range(lanes + 1)]
        if peer.heads is None:
            return [(DescRows(src[a:b], self.kv.shape[2]), DescRows(dst[a:b], peer.num_blocks))
                    for a, b in zip(cuts, cuts[1:])]
        mine, n = self.layout.heads, len(heads)
        return [(HeadRows(src[a:b], self.kv.shape[2], len(mine), heads.start - mine.start, n),
                 HeadRows(dst[a:b], peer.num_blocks, len(peer.heads),
                          heads.start - peer.heads.start, n))
                for a, b in zip(cuts, cuts[1:])]

    def _begin(self, conn: _SendConn, request_id: str, epoch: int,
               fields: dict[str, int]) -> np.ndarray:
        """BEGIN round trip (naming the KV heads this sender writes, ``fields``): D's
        reserved block ids for the request [n] int64. KVTransferError when D refuses
        (the connection stays up)."""
        conn.sock.sendall(frames.pack_header(FrameType.BEGIN, request_id, epoch=epoch,
                                             **fields))
        try:
            h, body = self._read_frame(conn.sock, FrameType.BEGIN_ACK)
        except (TimeoutError, BlockingIOError) as e:   # the socket's kernel timeout
            raise TimeoutError(f"no BEGIN_ACK for request {request_id} within "
                               f"{self.io_timeout_s:.0f}s: decode worker stalled") from e
        if h.request_id != request_id:
            raise KVFrameError(f"expected BEGIN_ACK for {request_id}, got {h.request_id}")
        block_ids, error = control.decode_begin_ack(body)
        if error is not None:
            raise KVTransferError(f"decode worker refused KV of request {request_id}: {error}")
        if max(block_ids) >= conn.peer.num_blocks:
            raise KVFrameError(f"BEGIN_ACK block ids beyond D's {conn.peer.num_blocks} blocks")
        return np.asarray(block_ids, dtype=np.int64)

    def _settle(self, conn: _SendConn, request_id: str, epoch: int) -> int:
        """Forget a request's BEGIN once every WRITE it posted completed; returns its
        notification count. ConnectionError when one failed or they outlast
        io_timeout_s: the connection is then dropped, and D holds the blocks a grace
        period past that."""
        begun = conn.peer.begun.pop((request_id, epoch), None) if conn.peer else None
        if begun is None:
            return 0
        deadline, polls = time.monotonic() + self.io_timeout_s, 0
        while begun.pending > 0 and time.monotonic() < deadline:
            for lane in self._lanes:      # drive every lane's progress from here
                lane.reap()
            polls += 1
            if polls > 100:               # past the first progress calls, yield the core
                time.sleep(BUSY_POLL_S)
        error = begun.wait(max(0.0, deadline - time.monotonic()))
        if error is not None:
            begun.cancelled = True   # its queued shares: D may hand the blocks on
            raise ConnectionError(f"request {request_id} to {conn.peer.agent}: {error}")
        return begun.num_writes
