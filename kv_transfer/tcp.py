"""TCP transport: the fallback and the single-box test transport.

Same frames (``frames.py``), handshake (``auth.py``: D's challenge, proofs of the
cluster secret both ways) and receiver state machine (``reservations.py``) as every
transport; blocking sockets with TCP_NODELAY, zero-copy sends from tensor memory
(``memoryview``); on receive, ``recv_into`` the reserved blocks themselves, or, for a
CRC32C-flagged frame (the default, WorkerConfig.kv_checksum), a staging tensor that is
checked before a byte reaches the cache::

    cache   kv: [num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim]  (0 = K, 1 = V)
    payload     [n_layers, 2, n_blocks, n_heads, block_size, head_dim], blocks in
                block-table order; n_heads: all the cache's, or a tensor-parallel
                rank's range of them (the header's head_start, num_heads)

    P: host cache: per layer and K/V, each run of consecutive src blocks is one
         region of kv (one per block when only some heads go), sent in place;
       over MAX_DIRECT_PIECES regions, or a CUDA cache: kv[layers, :, src_idx]
         gathered into one tensor (CUDA: then copied to pinned host memory)
       sendmsg(header + request_id + payload pieces (+ crc32c)) ---------------+
                                                                               |
    D: no crc: recv_into the reserved blocks themselves (host cache) <---------+
       crc:    recv_into staging (uint8) -> check crc
                 -> kv[layers, :, dst_idx[block_start : block_start + n_blocks]] = staged
                    (one memcpy per run of blocks on a host cache; a mismatch fails
                     only that request, the connection goes on)
       CUDA cache: through a pinned host staging buffer, then index_copy_

The checksum's cost (docs/performance.md "KV checksum"): ~0.035 ms per 768 KiB frame on
each end; over loopback 2.3 GB/s without, 1.5 GB/s with. Turn it off (kv_checksum=False)
on links that already carry end-to-end integrity.

The sender is ``tcp_sender.py``; this module is the receiver (D side). Its connections
are a ControlServer's (``control_server.py``: the port bound to the worker's host only,
D's CHALLENGE and the pairing before any KV frame is read, a thread per paired peer);
``tcp_conn.py`` is a connection's frame loop. Each frame header is validated against
the layout, and a KV frame's payload_len against its block range and the reservation,
so a forged length never makes D allocate more than the reservation's bytes (an unknown
request's payload is read and dropped in 1 MiB chunks). Either way the bytes go into
the cache through ReservationTable.write, the one write path (a CUDA cache: through a
pinned host staging buffer).

What fails what:

- a CRC32C mismatch fails that request only (its bytes never reach the cache); the
  connection stays in sync, other requests on it go on;
- a stale epoch, an unknown or forgotten request id: the frame's payload is read and
  dropped (a stale epoch also fails that request);
- anything malformed, a truncated frame, a lost connection: the connection is closed
  with a warning and the requests that received frames over it fail; other
  connections are unaffected.
"""

from __future__ import annotations

from typing import Callable

import torch

from . import control
from .base import KVFrameError, KVLayout, KVReceiver
from .control_server import ControlServer
from .frames import FrameHeader
from .tcp_conn import PairedConnection
from .tcp_sender import TcpKVSender


class TcpKVReceiver(KVReceiver):
    """The TCP receiver: K/V bytes arrive over the paired connections of its
    ControlServer, whose ControlHandler it is (BEGIN refused: no one-sided writes); see
    the module docstring.

    port: 0 picks a free one. io_timeout_s bounds the whole handshake (from the
    connection's accept), and the wait for the rest of a frame once its first byte
    arrived (an idle connection between frames never times out). secret: the cluster's
    shared secret every sender must prove (auth.py); None: pair only with senders that
    have none. start() raises KVTransferError once closed, OSError if host:port can't
    be bound.
    """

    def __init__(self, kv: torch.Tensor, layout: KVLayout, epoch: int,
                 host: str = "127.0.0.1", *, notify: Callable[[], None] | None = None,
                 port: int = 0, io_timeout_s: float = 30.0, secret: str | None = None) -> None:
        super().__init__(kv, layout, epoch, host, notify=notify)
        self._control = ControlServer(self._table, self, host, port=port,
                                      io_timeout_s=io_timeout_s, secret=secret)

    @property
    def port(self) -> int:
        """The port listened on (the one start() bound, once started)."""
        return self._control.port

    def start(self) -> tuple[str, int]:
        return self._control.start()

    def close(self, join_timeout_s: float = 5.0) -> None:
        self._control.close(join_timeout_s)

    # ---- ControlHandler: the control frames (connection threads) -------------------

    def pair_extra(self, conn_id: int, hs: control.Handshake) -> dict | None:
        return None

    def on_begin(self, conn: PairedConnection, h: FrameHeader) -> None:
        raise KVFrameError("BEGIN frame, but this receiver takes KV frames only (tcp)")

    def on_done(self, conn_id: int, h: FrameHeader) -> None:
        self._table.on_done(h)

    def on_abort(self, conn_id: int, h: FrameHeader, reason: str) -> None:
        self._table.on_abort(h, reason)

    def connection_lost(self, conn_id: int, why: str) -> None:
        self._table.connection_lost(conn_id, why)


__all__ = ["TcpKVReceiver", "TcpKVSender"]
