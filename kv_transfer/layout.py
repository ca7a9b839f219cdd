"""The KV cache layout both ends of a transfer must agree on before pairing
(``KVLayout``, compared in the handshake), and the wire protocol's version. base.py
re-exports both; the lifecycle of a transfer is described there."""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass, fields

import torch

PROTOCOL_VERSION = 6  # 2: KV frames carry block_start; 3: CHALLENGE + HMAC auth,
#                       CRC32C instead of zlib crc32 (frames.py); 4: a block is
#                       [num_kv_heads, block_size, head_dim] (was [block_size, heads, d]);
#                       5: BEGIN / BEGIN_ACK and the handshake's "nixl" (nixl.py);
#                       6: KV and DONE frames name a KV head range, the layout a
#                       tensor-parallel rank's share of the heads (tp_plan.py)


@dataclass(frozen=True)
class KVLayout:
    """What both ends of a transfer must agree on before pairing.

    model_id: a hash of the model config, so equal shapes of different models do not
        pair. dtype: torch dtype name without the ``torch.`` prefix ("bfloat16").
    block_size is in tokens.

    A tensor-parallel rank's cache holds only its KV heads (engine/parallel.py
    ``kv_head_range``): ``num_kv_heads`` of them, the model's heads
    ``[kv_head_start, kv_head_start + num_kv_heads)`` of ``model_kv_heads`` (0: the
    cache holds them all), on a worker of ``tp_size`` ranks. Two ranks pair when their
    workers' partitions of the heads can (tp_plan.partition_mismatch); frames then
    name the heads they carry in the model's numbering.
    """

    model_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    protocol_version: int = PROTOCOL_VERSION
    kv_head_start: int = 0
    model_kv_heads: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "tp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")
        for name in ("kv_head_start", "model_kv_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"KVLayout.{name} must be an int >= 0, got {value!r}")
        if self.kv_head_start + self.num_kv_heads > self.total_kv_heads:
            raise ValueError(f"KVLayout heads [{self.kv_head_start}, "
                             f"{self.kv_head_start + self.num_kv_heads}) beyond the model's "
                             f"{self.total_kv_heads}")
        if not isinstance(self.dtype, str) or not isinstance(
            getattr(torch, self.dtype, None), torch.dtype
        ):
            raise ValueError(f"KVLayout.dtype must name a torch dtype, got {self.dtype!r}")
        if not isinstance(self.model_id, str):
            raise ValueError(f"KVLayout.model_id must be a str, got {self.model_id!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def total_kv_heads(self) -> int:
        """The model's KV heads (this cache holds num_kv_heads of them)."""
        return self.model_kv_heads or self.num_kv_heads

    @property
    def heads(self) -> range:
        """The model's KV heads this cache holds, in the model's numbering."""
        return range(self.kv_head_start, self.kv_head_start + self.num_kv_heads)

    @functools.cached_property
    def head_bytes(self) -> int:
        """Bytes of one KV head of one block, K or V: ``[block_size, head_dim]``."""
        itemsize = torch.empty((), dtype=self.torch_dtype).element_size()
        return self.block_size * self.head_dim * itemsize

    @property
    def kv_bytes_per_block_layer(self) -> int:
        """Bytes of K plus V for one block of one layer (all of this cache's heads)."""
        return 2 * self.num_kv_heads * self.head_bytes

    def payload_bytes(self, num_layers: int, num_blocks: int, num_heads: int | None = None) -> int:
        """Bytes of a packed ``[num_layers, 2, num_blocks, num_heads, block_size,
        head_dim]`` (num_heads: default, all of this cache's)."""
        heads = self.num_kv_heads if num_heads is None else num_heads
        return num_layers * num_blocks * 2 * heads * self.head_bytes

    _PARTITION = ("num_kv_heads", "kv_head_start", "model_kv_heads", "tp_size")

    def mismatch(
        self, other: KVLayout, mine: str = "prefill", theirs: str = "decode"
    ) -> str | None:
        """None if the two layouts can pair, else one message naming every differing
        field with both values, e.g. ``"block_size: prefill has 16, decode has 32"``;
        tensor-parallel ranks pair when their workers' head partitions can (the message
        then names both sizes, tp_plan.partition_mismatch)."""
        from .tp_plan import partition_mismatch

        diffs = [
            f"{f.name}: {mine} has {getattr(self, f.name)!r}, {theirs} has {getattr(other, f.name)!r}"
            for f in fields(self)
            if f.name not in self._PARTITION and getattr(self, f.name) != getattr(other, f.name)
        ]
        if self.total_kv_heads != other.total_kv_heads:
            diffs.append(f"num_kv_heads (the model's): {mine} has {self.total_kv_heads}, "
                         f"{theirs} has {other.total_kv_heads}")
        else:
            bad = partition_mismatch(self.total_kv_heads, self.tp_size, other.tp_size)
            if bad is not None:       # it names the sizes as prefill's and decode's
                diffs.append(bad)
        return "; ".join(diffs) if diffs else None

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> KVLayout:
        """Raises ValueError on malformed JSON, unknown/missing fields or bad values."""
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"KVLayout JSON is malformed: {e}") from e
        if not isinstance(data, dict):
            raise ValueError(f"KVLayout JSON must be an object, got {type(data).__name__}")
        names = {f.name for f in fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"KVLayout JSON has unknown fields {sorted(unknown)}")
        try:
            return cls(**data)
        except TypeError as e:  # missing required fields
            raise ValueError(f"KVLayout JSON is incomplete: {e}") from e

    @classmethod
    def for_cache(cls, kv: torch.Tensor, model_id: str, *, kv_head_start: int = 0,
                  model_kv_heads: int = 0, tp_size: int = 1) -> KVLayout:
        """Layout of a cache tensor ``[num_layers, 2, num_blocks, heads, block_size,
        head_dim]``; a tensor-parallel rank's names its share of the model's KV heads
        (see the class docstring). ValueError for another shape."""
        if kv.dim() != 6 or kv.shape[1] != 2:
            raise ValueError(
                "kv must be [num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim], "
                f"got shape {tuple(kv.shape)}"
            )
        num_layers, _, _, num_kv_heads, block_size, head_dim = kv.shape
        return cls(
            model_id=model_id,
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            block_size=block_size,
            dtype=str(kv.dtype).removeprefix("torch."),
            kv_head_start=kv_head_start,
            model_kv_heads=model_kv_heads,
            tp_size=tp_size,
        )
