"""The rows a ModelRunner computes (PrefillSeq, DecodeSeq) and the flat tensors of a
decode step (InputBatch)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .attention import AttentionMetadata


@dataclass(frozen=True, slots=True)
class PrefillSeq:
    """One sequence of a prefill batch: its tokens up to the last one to compute, and
    the blocks that hold them.

    The first `num_computed_tokens` tokens' K/V are already in the blocks (a prefix-cache
    hit, an earlier chunk of a chunked prefill): only the rest are computed, attending
    to them. 0 <= num_computed_tokens < len(token_ids).
    """

    token_ids: Sequence[int]
    block_table: Sequence[int]   # block ids; len >= ceil(len(token_ids) / block_size)
    num_computed_tokens: int = 0


@dataclass(frozen=True, slots=True)
class DecodeSeq:
    """One running sequence of a decode batch: its newest token at `position`."""

    token_id: int
    position: int                # 0-based; context length after this step is position + 1
    block_table: Sequence[int]   # must cover position


@dataclass(frozen=True, slots=True)
class InputBatch:
    """The flat tensors of one decode step, as ModelRunner.decode builds them (on the
    runner's device); what the model's decode forward and DecodeGraphs consume."""

    input_ids: torch.Tensor      # [batch] int64, each sequence's newest token
    positions: torch.Tensor      # [batch] int64
    slot_mapping: torch.Tensor   # [batch] int64, cache slot of each new token's K/V
    block_table: torch.Tensor    # [batch, longest block table] int32, padded with 0
    context_lens: torch.Tensor   # [batch] int32, tokens including the new one
    context_lens_host: tuple[int, ...]  # context_lens on the host

    def metadata(self, kv_cache_id: int | None = None) -> AttentionMetadata:
        """The step's AttentionMetadata; with `kv_cache_id` (the CPU kernels' one-op
        attention), cu_seqlens_q = 0, 1, ..., batch as well."""
        cu = None
        if kv_cache_id is not None:
            cu = torch.arange(len(self.context_lens_host) + 1, dtype=torch.int32,
                              device=self.slot_mapping.device)
        return AttentionMetadata(
            is_prefill=False, slot_mapping=self.slot_mapping, block_table=self.block_table,
            context_lens=self.context_lens, max_context_len=max(self.context_lens_host),
            context_lens_host=self.context_lens_host, cu_seqlens_q=cu, kv_cache_id=kv_cache_id)
