"""LLaMA-family decoder over a paged KV cache: Llama (SmolLM2), Mistral, Qwen2, Qwen3.

Module names mirror transformers' (`model.layers.N.self_attn.q_proj`, ...) so a HF
safetensors state dict loads as is. Differences among the families:
    Qwen2: q/k/v projections carry a bias (config.attention_bias).
    Qwen3: RMSNorm over head_dim on q and k before RoPE (config.qk_norm).
Tokens are flat (`[num_tokens, hidden]`, no padding); per-step batch structure lives in
`AttentionMetadata`. Only the rows the caller asks for reach the LM head.

With tensor parallelism (engine/parallel.py, `tp`), each module holds its rank's shard
(its heads, KV heads, intermediate and vocabulary slices) and all-reduces after o_proj
and down_proj; the logits are gathered to rank 0.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from . import cpu_ops
from .attention import AttentionMetadata, decode_attention, prefill_attention, write_kv
from .config import ModelConfig
from .parallel import SINGLE, TensorParallel


def use_fused_ops(x: torch.Tensor) -> bool:
    """The C++ elementwise kernels (engine/csrc/fused_ops.cpp) run `x`'s op: a CPU fp32 or
    bf16 tensor, kernels built. Elsewhere (CUDA, fp16, no build) the torch ops run."""
    return (x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
            and cpu_ops.loaded)


class PackedLinear(nn.Module):
    """`y = x @ W.T (+ b)` through a weight prepacked once for oneDNN (CPU), as Inductor's
    freezing packs linears: on this box a decode-shaped fp32 GEMM (M=64, K=576) runs at
    ~2.4x `F.linear`'s MKL path (docs/performance.md). Several projections of one input
    are one packed matrix (fused QKV, fused gate/up): one GEMM, split after.

    weights: [out_i, in] each, one dtype, CPU; biases: one per weight, or None.
    forward: x [num_tokens, in] -> [num_tokens, sum(out_i)] in x's dtype.
    """

    def __init__(self, weights: list[torch.Tensor], biases: list[torch.Tensor] | None = None,
                 batch_size_hint: int = 64):
        super().__init__()
        w = torch.cat([t.detach() for t in weights])
        self.out_features, self.in_features = w.shape
        self.bias = (torch.cat([b.detach() for b in biases]) if biases is not None else None)
        # the blocked layout oneDNN's GEMM reads; any batch size runs on it
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), batch_size_hint)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_ops.loaded:   # the same GEMM as an op torch.compile keeps opaque
            return cpu_ops.linear_prepacked(x, self.packed, self.bias, self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN prepacked linears: CPU, fp32 or bf16, a torch built with mkldnn; bf16 only
    where oneDNN runs it (AVX-512 BW/VL/DQ or AVX-NE-CONVERT: on an AVX2-only CPU its
    reorder raises, and bf16 linears run through F.linear)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16
                                      and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back, as transformers' LlamaRMSNorm does."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_contiguous() and use_fused_ops(x):
            return cpu_ops.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add before this norm, then the norm: returns (norm(x + residual),
        x + residual); with residual None (the first layer), (norm(x), x). The fused
        kernel works in place on x and residual (both the caller's temporaries)."""
        if residual is None:
            return self(x), x
        if use_fused_ops(x) and x.is_contiguous() and residual.is_contiguous():
            cpu_ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
            return x, residual
        residual = x + residual
        return self(residual), residual


class RotaryEmbedding(nn.Module):
    """RoPE (rotate-half convention) with cos/sin tabulated for every position.

    Frequencies come from transformers' `ROPE_INIT_FUNCTIONS` for scaled variants
    (llama3, linear, yarn, longrope), so scaling matches the reference exactly; the
    unscaled case is `theta ** (-2i/d)` (Su et al., 2021, RoFormer).
    """

    def __init__(self, cfg: ModelConfig, device: torch.device):
        super().__init__()
        # Tables are computed on CPU even when the module is built under
        # `torch.device("meta")` (the runner does, to skip random init of the weights).
        with torch.device("cpu"):
            cos, sin = self._tables(cfg)
        self.register_buffer("cos", cos.to(device), persistent=False)
        self.register_buffer("sin", sin.to(device), persistent=False)

    @staticmethod
    def _tables(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [max_model_len, head_dim] float32 (attention scaling folded in)."""
        params = cfg.rope_parameters
        rope_type, theta = params["rope_type"], params["rope_theta"]
        if rope_type == "default":
            inv_freq = 1.0 / theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim)
            scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
            if rope_type not in ROPE_INIT_FUNCTIONS or rope_type == "dynamic":
                raise ValueError(f"rope_type={rope_type!r} is not supported (position-independent "
                                 f"types only: {sorted(set(ROPE_INIT_FUNCTIONS) - {'dynamic'})})")
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg.hf(), torch.device("cpu"))
        pos = torch.arange(cfg.max_model_len, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq.float())                    # (max_len, d/2)
        emb = torch.cat((freqs, freqs), dim=-1)                        # (max_len, d)
        return emb.cos() * scaling, emb.sin() * scaling

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, h, d], k: [T, h_kv, d], positions: [T] int64 -> rotated q, k (in place
        on the fused kernel's path)."""
        if use_fused_ops(q):
            cpu_ops.rotary_embedding(q, k, positions, self.cos, self.sin)
            return q, k
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)  # (T, 1, d)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        self.tp = tp
        self.num_heads, self.num_kv_heads = tp.num_heads(cfg), tp.num_kv_heads(cfg)  # this rank's
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        bias = cfg.attention_bias
        q_size, kv_size = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, q_size, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_size, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_size, bias=bias)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.qkv_proj: PackedLinear | None = None    # set by prepack()

    def prepack(self) -> None:
        """Fuse q/k/v into one prepacked GEMM and prepack o_proj (CPU)."""
        lin = (self.q_proj, self.k_proj, self.v_proj)
        self.qkv_proj = PackedLinear([m.weight for m in lin],
                                     [m.bias for m in lin] if self.q_proj.bias is not None else None)
        self.o_proj = PackedLinear([self.o_proj.weight])
        del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x, positions, rope: RotaryEmbedding, meta: AttentionMetadata,
                layer: int, kv_cache: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; writes the T tokens' K/V into layer `layer` of
        kv_cache [num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim]."""
        t = x.shape[0]
        if self.qkv_proj is not None:
            q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            q, k, v = self.qkv_proj(x).split((q_size, kv_size, kv_size), dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(t, self.num_heads, self.head_dim)       # (T, h, d)
        k = k.view(t, self.num_kv_heads, self.head_dim)    # (T, h_kv, d)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(positions, q, k)
        if meta.kv_cache_id is not None:   # CPU kernels: the KV write and attention, one op
            o = cpu_ops.attention_layer(q, k, v, meta.slot_mapping, meta.block_table,
                                        meta.cu_seqlens_q, meta.context_lens, self.scale,
                                        meta.kv_cache_id, layer)
            return self.tp.all_reduce(self.o_proj(o.reshape(t, self.num_heads * self.head_dim)))
        k_cache, v_cache = kv_cache[layer, 0], kv_cache[layer, 1]
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.is_prefill:
            o = prefill_attention(q, k, v, meta, self.scale, k_cache, v_cache)
        else:
            o = decode_attention(q, k_cache, v_cache, meta, self.scale)
        return self.tp.all_reduce(self.o_proj(o.reshape(t, self.num_heads * self.head_dim)))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        self.tp = tp
        inter = cfg.intermediate_size // tp.size                 # this rank's slice
        self.gate_proj = nn.Linear(cfg.hidden_size, inter, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, inter, bias=False)
        self.down_proj = nn.Linear(inter, cfg.hidden_size, bias=False)
        self.gate_up_proj: PackedLinear | None = None   # set by prepack()

    def prepack(self) -> None:
        """Fuse gate/up into one prepacked GEMM and prepack down_proj (CPU)."""
        self.gate_up_proj = PackedLinear([self.gate_proj.weight, self.up_proj.weight])
        self.down_proj = PackedLinear([self.down_proj.weight])
        del self.gate_proj, self.up_proj

    def forward(self, x):
        if self.gate_up_proj is not None:
            gate_up = self.gate_up_proj(x)
            if use_fused_ops(gate_up):
                return self.tp.all_reduce(self.down_proj(cpu_ops.silu_and_mul(gate_up)))
            gate, up = gate_up.chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.tp.all_reduce(self.down_proj(F.silu(gate) * up))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        self.self_attn = Attention(cfg, tp)
        self.mlp = MLP(cfg, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, positions, rope, meta, layer: int, kv_cache):
        """x: this layer's input before its residual add (the embeddings for layer 0, with
        residual None), residual: the running hidden state. Returns (the MLP's output,
        residual): the next layer (or the final norm) adds them, fused with its norm, as
        vLLM's layers do; the same sums as transformers' `residual + hidden_states`."""
        x, residual = self.input_layernorm.add_forward(x, residual)
        x = self.self_attn(x, positions, rope, meta, layer, kv_cache)
        x, residual = self.post_attention_layernorm.add_forward(x, residual)
        return self.mlp(x), residual


class _Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel):
        super().__init__()
        # the weight given: no random init (under the loader's meta device, nn.init's
        # normal_ would import torch._dynamo, ~1 s of a worker's start)
        self.embed_tokens = nn.Embedding(
            cfg.vocab_size // tp.size, cfg.hidden_size,
            _weight=torch.empty(cfg.vocab_size // tp.size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, tp) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """The decoder plus LM head. Build on the meta device, then `load_weights` (with
    `tp`, this rank's shards: TensorParallel.shard)."""

    def __init__(self, cfg: ModelConfig, device: torch.device, tp: TensorParallel = SINGLE):
        super().__init__()
        tp.check(cfg)
        self.cfg, self.tp = cfg, tp
        self.model = _Backbone(cfg, tp)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size // tp.size, bias=False)
        self.rope = RotaryEmbedding(cfg, device)
        self.compiled = False   # layers run through torch.compile (engine/compile.py)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: torch.Tensor,
                on_layer_done: Callable[[int], None] | None = None) -> torch.Tensor:
        """Run every layer over a flat batch of tokens, writing their K/V into the cache.

        input_ids, positions: [num_tokens] int64; kv_cache: [num_layers, 2, num_blocks,
        num_kv_heads, block_size, head_dim]. `on_layer_done(i)` is called once layer i's
        K/V is in the cache (prefill streams it to the decode worker from there).
        Returns the final-norm hidden states, [num_tokens, hidden_size].
        """
        x, residual = self.tp.embed(self.model.embed_tokens, input_ids), None
        if self.compiled:   # layer 0 in the others' graph: x + 0 is x, bit for bit
            residual = torch.zeros_like(x)
        for i, layer in enumerate(self.model.layers):
            x, residual = layer(x, residual, positions, self.rope, meta, i, kv_cache)
            if on_layer_done is not None:
                on_layer_done(i)
        return self.model.norm.add_forward(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [n, hidden_size] -> logits [n, vocab_size] float32 (every rank's
        vocabulary slice, gathered to tensor-parallel rank 0; zeros on the others)."""
        return self.tp.gather_to_leader(self.lm_head(hidden).float())

    def prepack(self) -> None:
        """After load_weights, on CPU (can_prepack): every linear becomes a oneDNN-prepacked
        GEMM, q/k/v and gate/up fused. The transformers-named parameters are gone after
        this (the packed copies replace them); load_weights no longer applies."""
        for layer in self.model.layers:
            layer.self_attn.prepack()
            layer.mlp.prepack()
        self.lm_head = PackedLinear([self.lm_head.weight])

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load a transformers-named state dict (tied LM head when it lacks lm_head.weight).

        Raises:
            ValueError: missing or unexpected tensors, or a shape mismatch, named.
        """
        state_dict = dict(state_dict)
        if "lm_head.weight" not in state_dict:
            if not self.cfg.tie_word_embeddings:
                raise ValueError("checkpoint has no lm_head.weight and tie_word_embeddings=False")
            state_dict["lm_head.weight"] = state_dict["model.embed_tokens.weight"]
        own = {k for k, _ in self.named_parameters()}
        missing, unexpected = own - state_dict.keys(), state_dict.keys() - own
        unexpected = {k for k in unexpected if "rotary_emb" not in k}
        if missing or unexpected:
            raise ValueError(f"weights do not match the {self.cfg.architecture} model: "
                             f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
        self.load_state_dict(state_dict, strict=False, assign=True)
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
