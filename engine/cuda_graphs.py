"""CUDA graphs of the decode forward, one per batch size (nano-vllm's `capture_cudagraph`).

A decode step of a small model is hundreds of small kernels; launching them one by one
from Python costs more than running them. ModelRunner (enforce_eager=False on CUDA)
captures the model's decode forward once per batch size in `batch_sizes(max)` =
[1, 2, 4, 8, 16, 32, ..., max] and replays the smallest graph that holds a batch.

Static buffers (every graph reads the leading rows of the same ones; one memory pool for
all graphs, captured largest first so the smaller ones fit in what the largest took):

    input_ids, positions, slot_mapping   [max_bs]                      int64
    context_lens                         [max_bs]                      int32
    block_table                          [max_bs, max_blocks_per_seq]  int32
    logits                               [max_bs, vocab]               float32

A batch of n sequences replayed on the graph of size bs >= n:

    row      0 .. n-1               n .. bs-1 (padding)
    tokens   the batch's            0 at position 0
    slots    the batch's            pad_block * block_size (the sink slot)
    context  the batch's            1: the sink slot itself
    table    the batch's, 0-padded  [pad_block, ...]

`pad_block` is a cache block no sequence ever owns (ModelRunner allocates one past the
pool's). Padded rows write their K/V there and attend to it, so they never touch a real
sequence's cache and never read an empty context (a NaN row on some kernels). The write
path (`index_copy_` by slot) has no "skip" value such as vLLM's -1. Rows n .. bs-1 are
reset on every replay: a larger batch earlier left real slots there.

Capture and replay go through a `GraphBackend`: `CudaGraphBackend` is torch.cuda's; tests
substitute one that replays by calling the captured function, which checks all of the
above on CPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

from .attention import AttentionMetadata

if TYPE_CHECKING:
    from .model_runner import InputBatch

logger = logging.getLogger(__name__)

# forward(input_ids [bs] int64, positions [bs] int64, meta) -> logits [bs, vocab] float32
DecodeForward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def batch_sizes(max_batch_size: int) -> list[int]:
    """Captured batch sizes, ascending: nano-vllm's [1, 2, 4, 8] + 16, 32, ... <= max."""
    assert max_batch_size >= 1, f"max_batch_size={max_batch_size}: need >= 1"
    return ([b for b in (1, 2, 4, 8) if b <= max_batch_size]
            + list(range(16, max_batch_size + 1, 16)))


class GraphBackend(Protocol):
    def capture(self, fn: Callable[[], None], pool: object | None) -> tuple[object, object]:
        """Capture `fn` into a new graph allocating from `pool` (None: a new pool);
        returns (graph, the pool it used)."""

    def replay(self, graph: object) -> None:
        """Run a captured graph once (its inputs are whatever the static buffers hold)."""


class CudaGraphBackend:
    """torch.cuda.CUDAGraph. `fn` runs once eagerly before capture: lazy initialisation
    (cuBLAS workspaces, Triton/flash-attn kernel loading) must not happen while capturing."""

    def capture(self, fn: Callable[[], None], pool: object | None) -> tuple[object, object]:
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            fn()
        torch.cuda.synchronize()
        return graph, graph.pool() if pool is None else pool

    def replay(self, graph: object) -> None:
        graph.replay()


class DecodeGraphs:
    """Decode forward replayed from per-batch-size graphs, eager beyond the largest.

    forward: the model's decode forward (ModelRunner._decode_forward); it must read the
    batch only through its arguments (the graphs bake in the tensors it is given).
    pad_block: a block id past every sequence's (see the module docstring).
    """

    @torch.inference_mode()
    def __init__(self, forward: DecodeForward, *, max_batch_size: int, max_blocks_per_seq: int,
                 block_size: int, pad_block: int, vocab_size: int,
                 device: torch.device | str, backend: GraphBackend | None = None):
        self.forward, self.backend = forward, backend or CudaGraphBackend()
        self.batch_sizes = batch_sizes(max_batch_size)
        self.max_blocks_per_seq, self.block_size = max_blocks_per_seq, block_size
        self.pad_block, self.pad_slot = pad_block, pad_block * block_size
        n = self.batch_sizes[-1]
        kw = {"device": device}
        self.input_ids = torch.zeros(n, dtype=torch.long, **kw)
        self.positions = torch.zeros(n, dtype=torch.long, **kw)
        self.slot_mapping = torch.full((n,), self.pad_slot, dtype=torch.long, **kw)
        self.context_lens = torch.ones(n, dtype=torch.int32, **kw)
        self.block_table = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, **kw)
        self.block_table[:, 0] = pad_block
        self.logits = torch.zeros(n, vocab_size, dtype=torch.float32, **kw)
        self.graphs: dict[int, object] = {}
        self.pool: object | None = None
        for bs in reversed(self.batch_sizes):   # largest first: the rest reuse its pool
            self.graphs[bs], self.pool = self.backend.capture(self._body(bs), self.pool)
        logger.info("captured decode graphs for batch sizes %s", self.batch_sizes)

    def _body(self, bs: int) -> Callable[[], None]:
        # context_lens_host stays empty: a graph must not depend on host values (CPU
        # SDPA then reads context_lens itself, which only a test's replay ever runs).
        meta = AttentionMetadata(
            is_prefill=False, slot_mapping=self.slot_mapping[:bs],
            block_table=self.block_table[:bs], context_lens=self.context_lens[:bs],
            max_context_len=self.max_blocks_per_seq * self.block_size)

        def body() -> None:
            self.logits[:bs] = self.forward(self.input_ids[:bs], self.positions[:bs], meta)
        return body

    def graph_size(self, num_seqs: int) -> int | None:
        """The smallest captured batch size >= num_seqs; None beyond the largest."""
        return next((b for b in self.batch_sizes if b >= num_seqs), None)

    @torch.inference_mode()
    def run(self, batch: InputBatch) -> torch.Tensor:
        """Logits [batch size, vocab] float32 of one decode step, the batch's K/V written;
        a fresh tensor (the static one is overwritten by the next replay)."""
        n = batch.input_ids.shape[0]
        bs = self.graph_size(n)
        blocks = -(-max(batch.context_lens_host) // self.block_size)
        if bs is None or blocks > self.max_blocks_per_seq:
            return self.forward(batch.input_ids, batch.positions, batch.metadata())
        w = min(batch.block_table.shape[1], self.max_blocks_per_seq)
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.slot_mapping[:n].copy_(batch.slot_mapping)
        self.context_lens[:n].copy_(batch.context_lens)
        self.block_table[:n, :w].copy_(batch.block_table[:, :w])
        if bs > n:   # padding rows: back to the sink (see the module docstring)
            self.input_ids[n:bs] = 0
            self.positions[n:bs] = 0
            self.slot_mapping[n:bs] = self.pad_slot
            self.context_lens[n:bs] = 1
            self.block_table[n:bs, 0] = self.pad_block
        self.backend.replay(self.graphs[bs])
        return self.logits[:n].clone()
