"""TCP transport: the fallback and the single-box test transport.

Same frames (``frames.py``) and receiver state machine (``reservations.py``) as every
transport; blocking sockets with TCP_NODELAY, zero-copy sends from tensor memory
(``memoryview``) and ``recv_into`` a staging tensor on receive::

    P: kv[layers, :, src_idx] -> contiguous [n_layers, 2, n_blocks, bs, H, D]
         -> header + request_id + payload (+ crc32) ---------------------------+
                                                                               |
    D: recv_into staging (uint8) -> view(dtype, shape) -> check crc <----------+
         -> kv[layers, :, dst_idx[block_start : block_start + n_blocks]] = staged

The two roles live in ``tcp_sender.py`` and ``tcp_receiver.py``; this module is the
name the transport registry points at.
"""

from .tcp_receiver import THREAD_PREFIX, TcpKVReceiver
from .tcp_sender import TcpKVSender

__all__ = ["THREAD_PREFIX", "TcpKVReceiver", "TcpKVSender"]
