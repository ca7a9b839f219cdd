"""Host-memory I/O for the TCP transport: zero-copy views of a paged cache and socket
helpers. (The wire format itself is frames.py.)

Zero copy rests on one fact about the cache layout [num_layers, 2, num_blocks, ...]: for
one layer and K or V, a run of consecutive block ids is one contiguous region of memory,
and a fresh block pool hands out long runs. Those regions go straight to `sendmsg` and
`recv_into`, so neither side gathers or scatters through a staging buffer.
"""

from __future__ import annotations

import socket
import struct

import torch

from .frames import tensor_bytes


def block_runs(block_ids: list[int]) -> list[tuple[int, int]]:
    """Maximal runs of consecutive ids, in order: [3, 4, 5, 9, 10] -> [(3, 3), (9, 2)]
    as (first block, count). A fresh block pool hands out long runs."""
    runs: list[tuple[int, int]] = []
    for b in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs


# Above this many pieces a frame is gathered into one buffer instead (iovec limits,
# and many tiny pieces cost more in syscalls than one copy).
MAX_DIRECT_PIECES = 256


class HostCacheView:
    """Byte views of a host (CPU) cache, in wire payload order, for zero-copy send and
    receive. Built once per transport: per-frame work is only slicing.

    The payload is [n_layers, 2, n_blocks, block_size, heads, head_dim] with blocks in
    block-table order; for each layer and K/V, a run of consecutive blocks is one
    contiguous region of ``kv`` [num_layers, 2, num_blocks, ...]:

        payload = | L0 K run0 | L0 K run1 | L0 V run0 | L0 V run1 | L1 K run0 | ...
    """

    def __init__(self, kv: torch.Tensor):
        self.usable = kv.device.type == "cpu"
        self.flat = tensor_bytes(kv) if self.usable else None     # the whole cache
        self.block_bytes = kv[0, 0, 0].numel() * kv.element_size()  # one block, one layer, K or V
        self.num_blocks = kv.shape[2]

    def regions(self, layer_start: int, layer_end: int,
                runs: list[tuple[int, int]]) -> list[memoryview] | None:
        """Views in payload order; None for a CUDA cache or more than
        MAX_DIRECT_PIECES pieces (then gather/scatter through one staged buffer)."""
        if not self.usable or (layer_end - layer_start) * 2 * len(runs) > MAX_DIRECT_PIECES:
            return None
        flat, bb, out = self.flat, self.block_bytes, []
        for layer in range(layer_start, layer_end):
            for half in (0, 1):
                base = (layer * 2 + half) * self.num_blocks * bb
                out.extend(flat[base + first * bb: base + (first + n) * bb] for first, n in runs)
        return out


def set_kernel_timeouts(sock: socket.socket, seconds: float) -> None:
    """Make `sock` blocking with SO_RCVTIMEO/SO_SNDTIMEO of `seconds`.

    Python's own socket timeouts poll() before every recv/send (two syscalls per call,
    measured ~30% of loopback throughput on 786 KB frames); kernel timeouts cost
    nothing per call. A call that times out raises BlockingIOError (EAGAIN).
    """
    sec = int(seconds)
    tv = struct.pack("ll", sec, int((seconds - sec) * 1e6))
    sock.settimeout(None)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def sendmsg_all(sock: socket.socket, bufs: list) -> None:
    """Send every buffer in order with as few syscalls as the kernel allows (writev);
    handles partial sends. No copies of the payload."""
    views = [memoryview(b).cast("B") for b in bufs if len(b)]
    while views:
        sent = sock.sendmsg(views[:64])           # IOV_MAX is 1024; stay well under
        while sent:
            if sent >= len(views[0]):
                sent -= len(views[0])
                views.pop(0)
            else:
                views[0] = views[0][sent:]
                sent = 0
