"""NIXL transport: P writes K/V straight into D's reserved blocks with one-sided RDMA
WRITEs (NVIDIA NIXL over UCX), and a notification names what landed.

This is how Dynamo, vLLM's NixlConnector and SGLang move KV. The pairing, the cluster
secret, the layout check, DONE and ABORT stay on the authenticated TCP control
connection of ``control_server.py`` (same frames, ``frames.py``); the bytes do not cross it::

    D (NixlKVReceiver)                          P (NixlKVSender)
    register the whole cache once               register the whole cache once
    <--------- CHALLENGE / HANDSHAKE (+ P's agent name) / ACK (+ D's agent
               metadata, cache address, num_blocks) ---------------------->
                                                load D's metadata, prepare both
                                                descriptor lists, make_connection
    expect(rid, block_ids)
              <-- BEGIN(rid, epoch) --          first send_layers of rid
    lease the blocks to this writer
              -- BEGIN_ACK(block_ids) -->
                                                per send_layers: one share of the
                                                (layers x K/V x blocks) descriptors
                                                per lane; a lane WRITEs what queued
      <== one-sided WRITE, then a notification: a KV frame header (no payload) ==
    poll thread: get_new_notifs -> mark
    (layer, block) arrived
              <-- DONE / ABORT --------          after its WRITEs completed
    DONE counts once every pair arrived; the lease ends at DONE / ABORT / connection
    loss, and only then does forget() hand the blocks back to D's pool

A descriptor is one (layer, K/V, block): ``[num_kv_heads, block_size, head_dim]``,
contiguous in the cache ``[num_layers, 2, num_blocks, ...]``; NIXL merges runs of
adjacent descriptors into one operation. A CUDA cache registers as VRAM (GPUDirect RDMA
where the NIC supports it): the same code with another memory type.

Why the BEGIN round trip: a one-sided write is invisible to D, so D must know which
blocks a writer may still touch. A request forgotten after its BEGIN keeps its blocks
out of the pool until P says DONE or ABORT or its connection drops (then after
LOST_WRITER_GRACE_S). P closes a connection only once none of its WRITEs to that D is in
flight (cancelled or ended: nixl_sender.NixlKVSender._drop), so a grace period past the
loss covers a P that died with its writes, never a late write of a live one.

The settings below (no progress thread: it spins a core; UCX_NET_DEVICES pinned to the
worker's interface; make_connection at pairing; lanes) and what they were measured at
are in docs/nixl.md.
"""
from __future__ import annotations

import importlib
import os
import uuid
from typing import Any

import numpy as np
import torch

from .base import KVTransferError

MODULES = ("nixl_cu12", "nixl")  # PyPI nixl-cu12 (bundles UCX; runs without a GPU), nixl
IDLE_POLL_S = 0.002        # D's notification poll period once idle (~1% of a core)
BUSY_POLL_S = 0.0002      # ... within BUSY_WINDOW_S of the last notification
BUSY_WINDOW_S = 0.1
DONE_GRACE_S = 5.0         # a DONE may overtake the notifications of P's last WRITEs:
#                            D waits for as many as DONE counts, this long at most
LOST_WRITER_GRACE_S = 1.0  # blocks of a writer whose connection dropped stay held this long
MAX_AGENT_NAME_BYTES = 256
# P's NIXL agents posting in parallel from a thread each, each send cut into one
# contiguous share of its blocks per lane (docs/nixl.md: with cma the copy runs on the
# posting thread). An RDMA NIC gets one queue pair per lane.
LANES = 2
MAX_LANES = 16
LANE_MIN_BYTES = 256 << 10   # a WRITE is cut into shares of at least this many bytes
LANE_POLL_S = 0.001          # a lane thread's progress pass while its WRITEs are in flight
MAX_MERGED_SHARES = 64       # shares queued on a lane that go out as one WRITE, at most


def find_module() -> Any | None:
    """The importable NIXL Python module (MODULES, in order), or None."""
    for name in MODULES:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    return None


def _interface_of(host: str) -> str | None:
    """Name of the network interface carrying ``host`` (e.g. "lo" for 127.0.0.1)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == host for a in addrs):
            return name
    return None


def _rdma_devices() -> list[str]:
    """RDMA devices of this node (mlx5_0, ...): UCX_NET_DEVICES naming only the IP
    interface would keep UCX off them, so it is left to UCX (or the user) there."""
    try:
        return os.listdir("/sys/class/infiniband")
    except OSError:
        return []


def make_agent(role: str, host: str) -> Any:
    """A NIXL agent with the UCX backend and no progress thread (see the module
    docstring); UCX_NET_DEVICES pinned to ``host``'s interface unless set. Raises
    KVTransferError when NIXL cannot be imported."""
    nixl = find_module()
    if nixl is None:
        raise KVTransferError("the nixl transport needs NIXL: pip install nixl-cu12 "
                              "(or 'pdserve[nixl]'), or choose --transport tcp")
    iface = _interface_of(host)
    if iface is not None and "UCX_NET_DEVICES" not in os.environ and not _rdma_devices():
        os.environ["UCX_NET_DEVICES"] = iface
    name = f"pdserve-{role}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    config = nixl.nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False,
                                    backends=["UCX"])
    return nixl.nixl_agent(name, config)


def memory_of(kv: torch.Tensor) -> tuple[str, int]:
    """(NIXL memory type, device id) of a cache tensor: DRAM for host memory, VRAM for
    CUDA (registered for GPUDirect RDMA)."""
    return ("VRAM", kv.device.index or 0) if kv.device.type == "cuda" else ("DRAM", 0)


def block_descs(base: int, num_layers: int, num_blocks: int, unit_bytes: int,
                device_id: int) -> np.ndarray:
    """Descriptors ``[num_layers * 2 * num_blocks, 3]`` int64 (address, bytes, device)
    of every (layer, K/V, block) of a cache ``[num_layers, 2, num_blocks, ...]`` at
    ``base``; row ``(layer * 2 + half) * num_blocks + block``."""
    rows = np.arange(num_layers * 2 * num_blocks, dtype=np.int64)
    return np.stack([base + rows * unit_bytes, np.full_like(rows, unit_bytes),
                     np.full_like(rows, device_id)], axis=1)


class DescRows:
    """Rows of block_descs of a set of blocks, for any layer range, in the order of a
    KV frame's payload (per layer K then V, blocks in order). Built once per request
    and share; a layer range is then one vector add: row = (layer * 2 + half) *
    num_blocks + block.

    block_ids: [n] int64 blocks of a cache of num_blocks blocks.
    """

    def __init__(self, block_ids: np.ndarray, num_blocks: int) -> None:
        ids = block_ids.astype(np.int32)
        self.layer0 = np.concatenate([ids, ids + num_blocks])   # [2n]: K rows, V rows
        self.stride = 2 * num_blocks                            # rows per layer

    def rows(self, layer_start: int, layer_end: int) -> np.ndarray:
        """``[(layer_end - layer_start) * 2 * n]`` int32."""
        if layer_end - layer_start == 1:
            return self.layer0 + layer_start * self.stride
        layers = np.arange(layer_start, layer_end, dtype=np.int32)[:, None]
        return (layers * self.stride + self.layer0).reshape(-1)


class HeadRows(DescRows):
    """Rows of a cache's per-head descriptors (Lane.head_src, or a peer's list paired
    with `heads`) of a set of blocks and heads ``[first, first + n)`` of each (this
    cache's own head indices), in the order (layer, K/V, block, head): row =
    block row * num_heads + head. Both ends of a WRITE list their heads in that order,
    so a share of heads pairs row for row."""

    def __init__(self, block_ids: np.ndarray, num_blocks: int, num_heads: int,
                 first: int, n: int) -> None:
        super().__init__(block_ids, num_blocks)
        self.num_heads = num_heads
        self.heads = np.arange(first, first + n, dtype=np.int32)

    def rows(self, layer_start: int, layer_end: int) -> np.ndarray:
        blocks = super().rows(layer_start, layer_end)
        return (blocks[:, None] * self.num_heads + self.heads[None, :]).reshape(-1)


# The two roles; this module is the name the transport registry points at.
from .nixl_receiver import NixlKVReceiver  # noqa: E402
from .nixl_sender import NixlKVSender  # noqa: E402

__all__ = ["NixlKVReceiver", "NixlKVSender", "find_module", "make_agent"]
