"""Tensor parallelism inside one worker: the Megatron-LM sharding of a decoder layer
(Shoeybi et al., 2019, "Megatron-LM", section 3), as vLLM applies it to Llama-family
models, over a torch.distributed process group (gloo on CPU, NCCL on CUDA).

    q/k/v, gate/up   column-parallel: rank r holds the rows of its query heads, of the KV
                     heads they read, and its slice of the intermediate size
    o_proj, down     row-parallel: the matching input columns; the ranks' partial sums
                     are all-reduced (two all-reduces per layer)
    embed, lm_head   vocab-parallel: rows [r V/N, (r+1) V/N); a token's embedding comes
                     from the rank that holds its row (the others add zeros; all-reduced),
                     and the logits of the rows that sample are gathered to rank 0, the
                     one that samples, as [n, V]
    norms, RoPE      replicated

KV heads: with at least as many KV heads as ranks, rank r holds h_kv / N of them; with
fewer (N a multiple of h_kv), each rank holds one, the same one on N / h_kv ranks
(vLLM's replication), so a rank's query heads always find their KV heads locally. A
rank's KV cache holds its KV heads only (`num_kv_heads(cfg)`).

Each rank reads only its slices of the checkpoint (`shard`, through safetensors'
lazy slices in model_runner.load_model), never the whole of it.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, NoReturn

import torch

from .config import ModelConfig


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in its worker's tensor-parallel group: `rank` of `size`,
    `group` the torch.distributed ProcessGroup joining the ranks (None: size 1)."""

    rank: int = 0
    size: int = 1
    group: Any = None

    def __post_init__(self):
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} of size {self.size}")
        if self.size > 1 and self.group is None:
            raise ValueError(f"tensor-parallel size {self.size} needs a process group")

    def check(self, cfg: ModelConfig) -> None:
        """Raises ValueError naming the model field that `size` does not divide."""
        n = self.size
        need = {"num_attention_heads": cfg.num_heads, "intermediate_size": cfg.intermediate_size,
                "vocab_size": cfg.vocab_size}
        for field, value in need.items():
            if value % n:
                raise ValueError(f"tensor-parallel size {n} does not divide the model's "
                                 f"{field}={value}")
        kv = cfg.num_kv_heads
        if (kv % n) if kv >= n else (n % kv):
            raise ValueError(f"tensor-parallel size {n} and num_key_value_heads={kv}: one "
                             "must divide the other (KV heads split, or replicated)")

    # --- this rank's share -------------------------------------------------------------

    def num_heads(self, cfg: ModelConfig) -> int:
        return cfg.num_heads // self.size

    def kv_heads(self, cfg: ModelConfig) -> range:
        """The model's KV heads this rank holds (one, replicated, with fewer KV heads
        than ranks)."""
        return kv_head_range(cfg.num_kv_heads, self.size, self.rank)

    def num_kv_heads(self, cfg: ModelConfig) -> int:
        return len(self.kv_heads(cfg))

    def part(self, total: int) -> slice:
        """Rank r's slice of `total` (divisible by size): [r total/N, (r+1) total/N)."""
        per = total // self.size
        return slice(self.rank * per, (self.rank + 1) * per)

    def shard(self, name: str, cfg: ModelConfig) -> tuple[int, slice] | None:
        """(dim, slice) of checkpoint tensor `name` (transformers' names) this rank loads;
        None: the whole tensor (norms)."""
        d = cfg.head_dim
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            h = self.part(cfg.num_heads)
            return 0, slice(h.start * d, h.stop * d)
        if name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias",
                          "self_attn.v_proj.weight", "self_attn.v_proj.bias")):
            kv = self.kv_heads(cfg)
            return 0, slice(kv.start * d, kv.stop * d)
        if name.endswith("self_attn.o_proj.weight"):
            h = self.part(cfg.num_heads)
            return 1, slice(h.start * d, h.stop * d)
        if name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
            return 0, self.part(cfg.intermediate_size)
        if name.endswith("mlp.down_proj.weight"):
            return 1, self.part(cfg.intermediate_size)
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            return 0, self.part(cfg.vocab_size)
        return None

    # --- collectives -------------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place (returned); size 1: `x` as is."""
        if self.size > 1:
            torch.distributed.all_reduce(x, group=self.group)
        return x

    def gather_to_leader(self, x: torch.Tensor) -> torch.Tensor:
        """[n, k] on each rank -> [n, size * k] on rank 0, rank order along the last dim
        (vLLM's gather of the logits: only rank 0 samples). The other ranks get a zero
        view of that shape (stride 0: no memory), which they do not use."""
        if self.size == 1:
            return x
        x = x.contiguous()
        if self.rank > 0:
            torch.distributed.gather(x, None, dst=0, group=self.group)
            return x.new_zeros(()).expand(x.shape[0], x.shape[1] * self.size)
        parts = [torch.empty_like(x) for _ in range(self.size)]
        torch.distributed.gather(x, parts, dst=0, group=self.group)
        return torch.cat(parts, dim=-1)

    def embed(self, table: torch.nn.Embedding, input_ids: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel embedding: this rank's rows of `input_ids` (the others zero),
        summed over the ranks. input_ids [T] int64 -> [T, hidden]."""
        if self.size == 1:
            return table(input_ids)
        rows = self.part(table.num_embeddings * self.size)
        local = input_ids - rows.start
        outside = (local < 0) | (local >= table.num_embeddings)
        x = table(local.masked_fill(outside, 0))
        x.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.all_reduce(x)


def kv_head_range(num_kv_heads: int, size: int, rank: int) -> range:
    """The KV heads rank `rank` of `size` holds: num_kv_heads / size of them, or with
    fewer KV heads than ranks (size a multiple of num_kv_heads) one, the same one on
    size / num_kv_heads consecutive ranks."""
    if num_kv_heads >= size:
        per = num_kv_heads // size
        return range(rank * per, (rank + 1) * per)
    first = rank * num_kv_heads // size
    return range(first, first + 1)


SINGLE = TensorParallel()


def exit_process(code: int = 0) -> NoReturn:
    """End a process that has left its gloo group (after `destroy_process_group`)
    without the interpreter's normal exit: stdout and stderr are flushed, then
    `os._exit(code)`; atexit handlers do not run.

    Why: a gloo worker thread drops its last reference to a finished collective's
    tensors after the collective's waiter has returned, and that decref needs the GIL.
    Destroying the group does not join those threads, and a thread that asks for the GIL
    while CPython 3.11 finalizes is ended by `pthread_exit` inside a noexcept
    destructor: std::terminate, SIGABRT ("terminate called without an active
    exception"). A rank pinned to one CPU hits it whenever its main thread reaches
    finalization before that thread is scheduled. Ray actor ranks are killed, never
    exited, so only processes that end on their own (spawned ranks) need this."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):   # closed or replaced streams
            pass
    os._exit(code)
