"""FLOP and byte accounting of a LLaMA-family forward pass (what `pdserve bench gpu`
divides its timings by).

FLOPs of a prompt of T new tokens after C cached ones (`prefill_flops`), after Kaplan et
al. 2020 ("Scaling Laws for Neural Language Models", Table 1: C_forward = 2N + 2 n_layer
n_ctx d_attn per token, N the non-embedding parameters):

    matmuls    2 * T * n_layer * (d*d_attn + 2*d*d_kv + d_attn*d + 3*d*d_ff)
               (q, k, v, o projections; gate, up, down)
    attention  4 * n_layer * d_attn * sum_{i<T} (C + i + 1)
               (q k^T and p v at 2 FLOPs per multiply-add; token i sees C + i + 1 keys)
    LM head    2 * d * vocab, once per prompt (only the last token reaches it)

d_attn = heads * head_dim (query side), d_kv = kv_heads * head_dim. The attention term
counts the keys a causal kernel visits: at C = 0 it is Kaplan's 2 n_layer n_ctx d_attn
per token (n_ctx = T, up to the +1). PaLM's MFU (Chowdhery et al. 2022, Appendix B:
12 L H Q T per token for training, 3 x a forward of 4 L H Q T) counts every key for
every query, twice this: that convention would raise the MFU reported here. Norms,
RoPE, SiLU and softmax are not counted.

Bytes of a decode step over context lengths c_b (`decode_step_bytes`; each includes the
new token): every parameter once except the input embedding, of which only B rows are
read (a tied LM head is counted once, as the LM head), plus the K/V attention reads:
sum_b c_b * n_layer * 2 * d_kv * dtype bytes. New K/V rows written, activations and
logits are not counted. Copy bandwidth counts read + write (2 x the buffer per copy), as
STREAM's Copy does.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    """What the FLOP and byte accounting needs of a LLaMA-family model."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    attention_bias: bool = False     # q/k/v biases (Qwen2)
    qk_norm: bool = False            # per-head q/k RMSNorm weights (Qwen3)

    @classmethod
    def of(cls, cfg) -> ModelShape:
        """From an engine ModelConfig."""
        return cls(cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers,
                   cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.attention_bias, cfg.qk_norm)

    @property
    def d_attn(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def d_kv(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def layer_matmul_params(self) -> int:
        d = self.hidden_size
        return (d * self.d_attn + 2 * d * self.d_kv + self.d_attn * d
                + 3 * d * self.intermediate_size)

    @property
    def layer_params(self) -> int:
        """Every parameter of one decoder layer: matmuls, two RMSNorms, biases, q/k norms."""
        return (self.layer_matmul_params + 2 * self.hidden_size
                + (self.d_attn + 2 * self.d_kv if self.attention_bias else 0)
                + (2 * self.head_dim if self.qk_norm else 0))

    @property
    def decode_weight_params(self) -> int:
        """Parameters a decode step reads in full: layers, final norm, LM head."""
        return (self.num_layers * self.layer_params + self.hidden_size
                + self.vocab_size * self.hidden_size)


def prefill_flops(shape: ModelShape, new_tokens: int, cached_tokens: int = 0) -> int:
    """FLOPs of prefilling one prompt's `new_tokens` after `cached_tokens` (module docstring)."""
    t, c = new_tokens, cached_tokens
    matmuls = 2 * t * shape.num_layers * shape.layer_matmul_params
    keys_visited = t * c + t * (t + 1) // 2
    attention = 4 * shape.num_layers * shape.d_attn * keys_visited
    return matmuls + attention + 2 * shape.hidden_size * shape.vocab_size


def kv_bytes_per_token(shape: ModelShape, dtype_bytes: int) -> int:
    return shape.num_layers * 2 * shape.d_kv * dtype_bytes


def decode_step_bytes(shape: ModelShape, context_lens: list[int],
                      dtype_bytes: int) -> tuple[int, int]:
    """(weight bytes, KV bytes) one decode step reads (module docstring)."""
    return (shape.decode_weight_params * dtype_bytes,
            sum(context_lens) * kv_bytes_per_token(shape, dtype_bytes))


def gemm_tflops(n: int, seconds: float) -> float:
    """TFLOP/s of an n x n x n matmul: 2 n^3 FLOPs."""
    return 2 * n ** 3 / seconds / 1e12


def copy_gbps(nbytes: int, seconds: float) -> float:
    """GB/s (1e9) of copying `nbytes`, counting the read and the write."""
    return 2 * nbytes / seconds / 1e9
