"""Transport-independent KV transfer types: layout descriptor, state enum, errors,
and the two small interfaces every transport implements (KVSender, KVReceiver): the
workers call only these, and `make_sender` / `make_receiver` pick the transport, so a
transport is swapped without touching a worker.

Lifecycle of one request's KV, seen from both ends::

    decode worker D (KVReceiver)               prefill worker P (KVSender)
    ---------------------------------          ---------------------------------
    start() -> addr                            (connects lazily on first use)
                           -- CHALLENGE --->   nonce_d
                           <-- HANDSHAKE --    layout, epoch, nonce_p, auth_p
                           -- HANDSHAKE_ACK -> layout, epoch, error, auth_d
    expect(request_id, dst_block_ids)
      state WAITING
                                               send_layers(addr, rid, epoch, 0, k, src)
      state TRANSFERRING   <-- KV frames --    send_layers(addr, rid, epoch, k, L, src)
                           <-- DONE frame --   send_done(addr, rid, epoch, first_token, L)
      state DONE: get_finished() lists KVCompletion(ok=True, first_token)
    (or FAILED, KVCompletion(ok=False, error), on abort, stale epoch, lost connection,
     a (layer, block) missing or sent twice, blocks beyond the reservation, a checksum
     mismatch)

A frame may also carry only part of the block table: ``send_layers(..., src,
block_start=b)`` fills D's reserved positions ``b .. b + len(src) - 1``, so a request
chunked at prefill can go out chunk by chunk (each chunk's layers as they are computed);
DONE counts only once every (layer, block) of the reservation arrived.

The cache both ends share the layout of is one contiguous tensor::

    kv: [num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim]   (0 = K, 1 = V)

P's ``num_blocks`` may differ from D's; every other dimension and the dtype must match,
which is what :class:`KVLayout` describes and the handshake compares.

Pairing is also gated on the cluster's shared secret (``secret=`` on both ends,
WorkerConfig.kv_secret): D opens every connection with a random nonce, P answers with
an HMAC-SHA256 proof over both sides' nonces, D with its own (``auth.py``), so the
secret never crosses the wire and each end checks the other. A side with a secret
refuses a peer without one, and the other way round: D then sends a refusal
(KVAuthError on P, "cluster secret mismatch") and closes the connection before any KV
frame is read.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .layout import PROTOCOL_VERSION, KVLayout  # noqa: F401  (re-exported)


# Longest request id (UTF-8 bytes) a frame may carry; bounds what a receiver reads
# before it has validated anything else.
MAX_REQUEST_ID_BYTES = 256


class KVTransferError(RuntimeError):
    """A transfer failed (socket error, refused handshake, ...). Aborts one request.
    `pairing`: it failed while pairing with the peer (the sender logs those, once per
    peer: tcp_sender.TcpKVSender)."""

    pairing = False


class KVLayoutMismatch(KVTransferError):
    """P and D caches cannot pair; the message names every differing field."""


class KVFrameError(KVTransferError):
    """A frame on the wire is malformed or truncated; the connection is dropped."""


class KVAuthError(KVTransferError):
    """The peer did not prove the cluster's shared secret (or one side has none); the
    handshake is refused and the connection closed."""


class TransferState(enum.IntEnum):
    """State of one expected request on the receiver. Finished states are last, so
    ``state >= TransferState.DONE`` means "finished"."""

    WAITING = 0  # reserved, no KV frame arrived yet
    TRANSFERRING = 1  # at least one KV frame arrived, DONE frame not yet
    DONE = 2  # every (layer, block) arrived, then the DONE frame
    FAILED = 3  # aborted, stale epoch, connection lost, inconsistent frames


@dataclass(frozen=True)
class KVCompletion:
    """Outcome of one expected request, as the receiver's ``get_finished()`` lists it.

    first_token is the token P sampled (set when ok); error says what went wrong
    (set when not ok).
    """

    request_id: str
    ok: bool
    first_token: int | None
    error: str | None


@dataclass(frozen=True)
class KVFinished:
    """What a receiver's ``get_finished()`` returns (vLLM's connector is polled the same
    way): the expected requests whose transfer finished since the last call, and the
    forgotten ones whose blocks no write can touch any more (D frees those now)."""

    completions: list[KVCompletion]
    released: list[str]


def check_cache(kv: torch.Tensor, layout: KVLayout) -> None:
    """Raise KVLayoutMismatch unless ``kv`` is a contiguous cache of ``layout``."""
    if not kv.is_contiguous():
        raise ValueError("kv cache tensor must be contiguous")
    mine = KVLayout.for_cache(kv, layout.model_id, kv_head_start=layout.kv_head_start,
                              model_kv_heads=layout.model_kv_heads, tp_size=layout.tp_size)
    msg = mine.mismatch(layout, mine="kv tensor", theirs="layout")
    if msg is None and mine.num_kv_heads != layout.num_kv_heads:   # mismatch pairs shares
        msg = f"num_kv_heads: kv tensor has {mine.num_kv_heads}, layout has {layout.num_kv_heads}"
    if msg is not None:
        raise KVLayoutMismatch(f"kv tensor does not match its layout: {msg}")


class KVSender(ABC):
    """Prefill side: pushes a request's K/V blocks into a decode worker's blocks.

    Connections are opened lazily per ``addr``, handshaken once and reused; every call
    is blocking and may be made from several threads at once (one lock per connection).
    On a socket error the connection is dropped (the next call reconnects) and
    KVTransferError raised.
    """

    def __init__(self, kv: torch.Tensor, layout: KVLayout) -> None:
        check_cache(kv, layout)
        self.kv = kv  # [num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim]
        self.layout = layout

    def _check_send(self, layer_start: int, layer_end: int, src_block_ids: Sequence[int],
                    block_start: int, heads: range | None = None) -> tuple[list[int], int]:
        """Validate send_layers arguments; returns (block ids, K/V payload bytes).
        Raises ValueError naming the bad range, ids, heads or block_start."""
        mine = self.layout.heads
        if heads is not None and not (len(heads) and mine.start <= heads.start
                                      and heads.stop <= mine.stop and heads.step == 1):
            raise ValueError(f"heads {heads} not a non-empty run within this cache's KV "
                             f"heads {mine}")
        if block_start < 0:  # a non-int fails in frames.pack_header, also ValueError
            raise ValueError(f"block_start must be >= 0, got {block_start}")
        if not 0 <= layer_start < layer_end <= self.layout.num_layers:
            raise ValueError(f"layer range [{layer_start}, {layer_end}) not within "
                             f"[0, {self.layout.num_layers})")
        ids = [int(b) for b in src_block_ids]
        total = self.kv.shape[2]
        if not ids or not all(0 <= b < total for b in ids):
            raise ValueError(f"src_block_ids must be non-empty ids in [0, {total}), got {ids}")
        return ids, self.layout.payload_bytes(layer_end - layer_start, len(ids),
                                              None if heads is None else len(heads))

    @abstractmethod
    def connect(self, addr: tuple[str, int]) -> int:
        """Open (or reuse) the connection to D at ``addr`` and pair: exchange layouts and
        epochs, and prove the cluster secret both ways. Returns D's epoch. Raises
        KVLayoutMismatch naming every differing field and both values, KVAuthError
        ("KV handshake refused by <addr>: cluster secret mismatch") when either end
        lacks the other's secret, KVTransferError when D cannot be reached."""

    @abstractmethod
    def send_layers(
        self,
        addr: tuple[str, int],
        request_id: str,
        epoch: int,
        layer_start: int,
        layer_end: int,
        src_block_ids: Sequence[int],
        block_start: int = 0,
        heads: range | None = None,
    ) -> int:
        """Send K and V of layers ``[layer_start, layer_end)`` of P's blocks
        ``src_block_ids``; they land, in the same order, in D's reserved blocks at
        block-table positions ``block_start .. block_start + len(src_block_ids) - 1``
        (the order D gave to expect()). ``heads``: only these KV heads (the model's
        numbering, within this cache's; None: all of them), for a tensor-parallel
        peer holding a share of the heads (tp_plan.py). Each (layer, position) must be sent exactly once
        before send_done; frames may come in any order. Returns the K/V payload bytes
        sent. Raises ValueError on bad arguments (block_start < 0 included),
        KVLayoutMismatch if D refuses the pairing, KVTransferError on socket failure; a
        range beyond D's reservation fails the request on D."""

    @abstractmethod
    def send_done(
        self,
        addr: tuple[str, int],
        request_id: str,
        epoch: int,
        first_token: int | None,
        num_layers_sent: int,
        heads: range | None = None,
    ) -> None:
        """Tell D the request's KV is complete (of ``heads``, as send_layers sent them;
        None: all) and hand over the first sampled token (None from a tensor-parallel
        rank that did not sample it)."""

    @abstractmethod
    def send_abort(self, addr: tuple[str, int], request_id: str, epoch: int, reason: str) -> None:
        """Tell D the request is abandoned; D fails it with ``reason``."""

    @abstractmethod
    def close(self) -> None:
        """Close every connection. Idempotent."""


class KVReceiver(ABC):
    """Decode side: receives K/V into blocks reserved with :meth:`expect`; D's step loop
    polls :meth:`get_finished` for finished transfers and released blocks (a connector
    that is polled, not called back). ``notify`` (e.g. ``threading.Event.set``) runs
    from the receiver's threads whenever there is something new to poll; it must be
    quick and thread-safe."""

    def __init__(
        self,
        kv: torch.Tensor,
        layout: KVLayout,
        epoch: int,
        host: str = "127.0.0.1",
        *,
        notify: Callable[[], None] | None = None,
    ) -> None:
        check_cache(kv, layout)
        if not isinstance(epoch, int) or not 0 <= epoch < 2**64:
            raise ValueError(f"epoch must be an int in [0, 2**64), got {epoch!r}")
        if notify is not None and not callable(notify):
            raise ValueError("notify must be callable")
        self.kv = kv  # [num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim]
        self.layout = layout
        self.epoch = epoch
        self.host = host
        from .reservations import ReservationTable  # shared state machine of every transport
        self._table = ReservationTable(kv, layout, epoch, notify)

    @abstractmethod
    def start(self) -> tuple[str, int]:
        """Start listening; returns the (host, port) senders connect to."""

    def expect(self, request_id: str, dst_block_ids: Sequence[int]) -> None:
        """Reserve: frames for ``request_id`` are scattered into ``dst_block_ids``.
        ValueError for bad ids or a re-expect with other blocks."""
        self._table.expect(request_id, dst_block_ids)

    def forget(self, request_id: str, lease_timeout_s: float | None = None) -> None:
        """Drop a reservation (or a finished record); later frames are discarded.
        Never blocks: get_finished() lists the request as released once no write into
        its blocks is in flight; only then may D hand those blocks to another request.
        `lease_timeout_s`: a one-sided writer's lease on it (NIXL) ends at the latest
        that long from now, its connection closed (a pull's writer sends nothing past
        the pull's own expiry: KVPullOrder.timeout_s); None: when the writer ends it."""
        self._table.forget(request_id)

    def get_finished(self) -> KVFinished:
        """Transfers finished (done or failed) and forgotten requests released since
        the last call; each reported once."""
        return self._table.get_finished()

    def state(self, request_id: str) -> TransferState:
        """State of an expected request; KeyError if unknown or forgotten."""
        return self._table.state(request_id)

    def num_active(self) -> int:
        """Requests expected and not finished (or still leased to a writer): 0 once every
        request was forgotten and released."""
        return self._table.num_active()

    @abstractmethod
    def close(self) -> None:
        """Stop threads and close sockets. Idempotent."""
