"""KV cache transfer between prefill (P) and decode (D) workers.

Transports are registered by name as "module:Class" strings and imported only when
chosen, so a CPU-only install never imports a heavy back end (ucx-py) it does not use.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

import torch

from .base import (
    PROTOCOL_VERSION,
    KVAuthError,
    KVCompletion,
    KVFrameError,
    KVLayout,
    KVLayoutMismatch,
    KVReceiver,
    KVSender,
    KVTransferError,
    TransferState,
)

__all__ = [
    "PROTOCOL_VERSION",
    "KVAuthError",
    "KVCompletion",
    "KVFrameError",
    "KVLayout",
    "KVLayoutMismatch",
    "KVReceiver",
    "KVSender",
    "KVTransferError",
    "TransferState",
    "SENDERS",
    "RECEIVERS",
    "make_sender",
    "make_receiver",
    "resolve_transport",
]

# name -> "module:Class", module relative to this package. Importing .ucx imports ucxx
# (or ucx-py), so it happens only when "ucx" is chosen.
SENDERS: dict[str, str] = {"tcp": ".tcp:TcpKVSender", "ucx": ".ucx:UcxKVSender"}
RECEIVERS: dict[str, str] = {"tcp": ".tcp:TcpKVReceiver", "ucx": ".ucx:UcxKVReceiver"}
# Senders that can append a CRC32C to each KV payload. Not UCX: it moves device memory as
# it lies, and a host-side crc would cost a device -> host copy of every byte.
CHECKSUMMED: frozenset[str] = frozenset({"tcp"})


def _load(registry: dict[str, str], kind: str, role: str) -> type:
    try:
        target = registry[kind]
    except KeyError:
        raise ValueError(
            f"unknown KV transfer {role} kind {kind!r}; valid kinds: {sorted(registry)}"
        ) from None
    module_name, _, class_name = target.partition(":")
    module = importlib.import_module(module_name, package=__name__)
    return getattr(module, class_name)


def make_sender(kind: str, kv: torch.Tensor, layout: KVLayout, *, checksum: bool = False,
                secret: str | None = None, **kw: Any) -> KVSender:
    """Construct the ``kind`` sender over cache ``kv``
    ``[num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim]``.

    checksum: CRC32C per KV frame payload where the transport offers it (CHECKSUMMED;
    ignored elsewhere). secret: the cluster's shared secret for the handshake (auth.py).
    ``kw`` goes to the transport. ValueError for an unknown kind."""
    if kind in CHECKSUMMED:
        kw["checksum"] = checksum
    return _load(SENDERS, kind, "sender")(kv, layout, secret=secret, **kw)


def make_receiver(
    kind: str,
    kv: torch.Tensor,
    layout: KVLayout,
    epoch: int,
    on_complete: Callable[[KVCompletion], None],
    host: str = "127.0.0.1",
    *,
    secret: str | None = None,
    **kw: Any,
) -> KVReceiver:
    """Construct (not start) the ``kind`` receiver writing into ``kv``, listening on
    ``host`` (the worker's cluster address: TCP binds only it; ucxx can only listen on
    every interface) and pairing only with senders that prove
    ``secret`` (auth.py; None: senders without one). ValueError for an unknown kind."""
    return _load(RECEIVERS, kind, "receiver")(kv, layout, epoch, host, on_complete=on_complete,
                                              secret=secret, **kw)


def resolve_transport(kind: str) -> str:
    """Map a `--transport` choice to a registered kind: "auto" picks UCX when ucxx (or
    ucx-py) is importable, else TCP, and logs one line saying which and why.

    Raises:
        ValueError: an unknown kind.
    """
    if kind != "auto":
        if kind not in SENDERS:
            raise ValueError(f"--transport {kind!r}: choose one of {sorted(SENDERS) + ['auto']}")
        return kind
    import importlib.util
    import logging

    found = next((m for m in ("ucxx", "ucp") if importlib.util.find_spec(m) is not None), None)
    chosen = "ucx" if found and "ucx" in SENDERS else "tcp"
    logging.getLogger(__name__).warning(
        "KV transport auto -> %s (%s)", chosen,
        f"{found} is importable" if chosen == "ucx" else
        "neither ucxx nor ucx-py is importable; pip install 'pdserve[ucx]' for UCX")
    return chosen
