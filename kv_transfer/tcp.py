"""TCP transport: the fallback and the single-box test transport.

Same frames (``frames.py``), handshake (``auth.py``: D's challenge, proofs of the
cluster secret both ways) and receiver state machine (``reservations.py``) as every
transport; blocking sockets with TCP_NODELAY, zero-copy sends from tensor memory
(``memoryview``); on receive, ``recv_into`` the reserved blocks themselves, or, for a
CRC32C-flagged frame (the default, WorkerConfig.kv_checksum), a staging tensor that is
checked before a byte reaches the cache::

    P: kv[layers, :, src_idx] -> contiguous [n_layers, 2, n_blocks, bs, H, D]
         -> header + request_id + payload (+ crc32c) --------------------------+
                                                                               |
    D: recv_into staging (uint8) -> check crc <--------------------------------+
         -> kv[layers, :, dst_idx[block_start : block_start + n_blocks]] = staged
            (one memcpy per run of blocks on a host cache; a mismatch fails only
             that request, the connection goes on)

Cost of the checksum, measured on this project's 2-core VM with other work running
(load average 2.0-2.8; google-crc32c 1.9.0, C build): CRC32C (host_io.crc32c, zero-copy)
runs at ~22 GB/s on one core, 0.035 ms per 768 KiB frame on each end (zlib.crc32, the
checksum before it: 3.7 GB/s, 0.21 ms), and the memcpy out of staging adds 0.03-0.08 ms.
Sender and receiver in one process over loopback, 768 KiB frames (one layer of 32
blocks), the arms interleaved, medians of 21 runs: 2.3 GB/s without, 1.5 GB/s with
(zlib.crc32 in the same runs: 0.86 GB/s). What is left of the gap is mostly staging, as
the zero-copy receive is lost: staged with no crc ran at 1.9 GB/s. Between two hosts
each end pays only its own pass, which is above a 100 GbE link's 12.5 GB/s. Turn it off
(kv_checksum=False) on links that already carry end-to-end integrity and need the last
GB/s.

The two roles live in ``tcp_sender.py`` and ``tcp_receiver.py``; this module is the
name the transport registry points at.
"""

from .tcp_receiver import THREAD_PREFIX, TcpKVReceiver
from .tcp_sender import TcpKVSender

__all__ = ["THREAD_PREFIX", "TcpKVReceiver", "TcpKVSender"]
