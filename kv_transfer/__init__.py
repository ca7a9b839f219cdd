"""KV cache transfer between prefill (P) and decode (D) workers.

Transports are registered by name as "module:Class" strings and imported only when
chosen, so an install never imports a heavy back end (NIXL) it does not use.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

import torch

from .base import (
    PROTOCOL_VERSION,
    KVAuthError,
    KVCompletion,
    KVFinished,
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
    "KVFinished",
    "KVFrameError",
    "KVLayout",
    "KVLayoutMismatch",
    "KVReceiver",
    "KVSender",
    "KVTransferError",
    "TransferState",
    "SENDERS",
    "RECEIVERS",
    "ALIASES",
    "make_sender",
    "make_receiver",
    "resolve_transport",
]

# name -> "module:Class", module relative to this package. NIXL itself is imported when
# a nixl sender or receiver is built.
SENDERS: dict[str, str] = {"tcp": ".tcp:TcpKVSender", "nixl": ".nixl:NixlKVSender"}
RECEIVERS: dict[str, str] = {"tcp": ".tcp:TcpKVReceiver", "nixl": ".nixl:NixlKVReceiver"}
# Older names a user may still pass: "ucx" was the two-sided ucxx transport NIXL replaced
# (NIXL runs over UCX).
ALIASES: dict[str, str] = {"ucx": "nixl"}
# Senders that can append a CRC32C to each KV payload. Not NIXL: its one-sided writes
# put the bytes into D's cache with no receiver CPU on the data path.
CHECKSUMMED: frozenset[str] = frozenset({"tcp"})
# Senders that pick their network interface from the worker's own address.
HOST_BOUND: frozenset[str] = frozenset({"nixl"})


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
                secret: str | None = None, epoch: int = 0, host: str = "127.0.0.1",
                **kw: Any) -> KVSender:
    """Construct the ``kind`` sender over cache ``kv``
    ``[num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim]``.

    checksum: CRC32C per KV frame payload where the transport offers it (CHECKSUMMED;
    ignored elsewhere). secret: the cluster's shared secret for the handshake (auth.py).
    epoch: P's own epoch (D logs it). host: P's own address (HOST_BOUND transports
    choose their interface from it). ``kw`` goes to the transport. ValueError for an
    unknown kind."""
    kind = ALIASES.get(kind, kind)
    if kind in CHECKSUMMED:
        kw["checksum"] = checksum
    if kind in HOST_BOUND:
        kw["host"] = host
    return _load(SENDERS, kind, "sender")(kv, layout, secret=secret, epoch=epoch, **kw)


def make_receiver(
    kind: str,
    kv: torch.Tensor,
    layout: KVLayout,
    epoch: int,
    host: str = "127.0.0.1",
    *,
    notify: Callable[[], None] | None = None,
    secret: str | None = None,
    **kw: Any,
) -> KVReceiver:
    """Construct (not start) the ``kind`` receiver writing into ``kv``, listening on
    ``host`` (the worker's cluster address: its control connection binds only it) and
    pairing only with senders that prove ``secret`` (auth.py; None: senders without
    one). ``notify`` runs when get_finished() has news (KVReceiver). ValueError for an
    unknown kind."""
    kind = ALIASES.get(kind, kind)
    return _load(RECEIVERS, kind, "receiver")(kv, layout, epoch, host, notify=notify,
                                              secret=secret, **kw)


def resolve_transport(kind: str) -> str:
    """Map a `--transport` choice to a registered kind: "ucx" means "nixl"; "auto"
    picks NIXL when its module imports (kv_transfer/nixl.py MODULES), else TCP, and
    logs one line saying which and why.

    Raises:
        ValueError: an unknown kind.
    """
    kind = ALIASES.get(kind, kind)
    if kind != "auto":
        if kind not in SENDERS:
            raise ValueError(f"--transport {kind!r}: choose one of "
                             f"{sorted([*SENDERS, *ALIASES, 'auto'])}")
        return kind
    import logging

    from .nixl import find_module

    found = find_module()
    chosen = "nixl" if found is not None else "tcp"
    logging.getLogger(__name__).warning(
        "KV transport auto -> %s (%s)", chosen,
        f"{found.__name__} imports" if found is not None else
        "NIXL does not import; pip install 'pdserve[nixl]' for one-sided RDMA writes")
    return chosen
