"""pdserve's CPU kernels (engine/csrc/*.cpp), built once by `make` (`python -m
pdserve.engine.cpu_ops`) with torch.utils.cpp_extension and loaded as torch ops
(`torch.ops.pdserve_cpu.*`). Never built at request time: a worker whose build is missing
runs the SDPA fallback of attention.py and logs how to build.

Kernels:
    paged_attention(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, scale)
        each sequence's new tokens (a prompt, a chunk after a cached prefix, one decode
        token) against their paged context, causal, read in place (no gather); fp32 or
        bf16. paged_decode_attention: the same, one token per sequence.
    reshape_and_cache(k, v, k_cache, v_cache, slot_mapping)
        the KV write. See csrc/paged_attention.cpp for both.
    sample_from_logits(logits, temperatures, uniforms)
        one token per row by inverse CDF over the temperature softmax, one uniform draw
        per row. See csrc/sampler.cpp.
    linear_prepacked, attention_layer, register_kv_cache, unregister_kv_cache
        a prepacked oneDNN GEMM and a layer's KV write + attention as opaque ops, so
        torch.compile traces one decoder-layer graph for every layer. See
        csrc/compile_ops.cpp and engine/compile.py.
    rms_norm, fused_add_rms_norm, rotary_embedding, silu_and_mul
        the decoder layer's elementwise ops, one pass each, with transformers' arithmetic
        and roundings. See csrc/fused_ops.cpp.

The library goes under the model cache (`$PDSERVE_CACHE`, default ~/.cache/pdserve)
in ext/<key>; the key is a hash of the sources, torch's version and the compiler flags, so an edited source or another torch never loads a stale library. `-march=native`: the
library is built on the machine that runs it (make on this box; the image's build stage
for a deployment).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import sys
from pathlib import Path

import torch

from .loader import cache_dir

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [_CSRC / "paged_attention.cpp", _CSRC / "fused_ops.cpp", _CSRC / "sampler.cpp",
            _CSRC / "compile_ops.cpp"]
_HEADERS = [_CSRC / "cpu_math.h", _CSRC / "cpu_vec.h"]
_CFLAGS = ["-O3", "-march=native", "-fopenmp"]
_NAME = "pdserve_cpu_ops"


def _build_dir() -> Path:
    h = hashlib.sha256()
    for src in _SOURCES + _HEADERS:
        h.update(src.read_bytes())
    h.update(torch.__version__.encode())
    h.update(" ".join(_CFLAGS).encode())
    return cache_dir() / "ext" / h.hexdigest()[:16]


def library_path() -> Path:
    """Where the built library is (or will be), for this source and torch."""
    return _build_dir() / f"{_NAME}.so"


def build(verbose: bool = False) -> Path:
    """Compile the kernels (gcc, ~30 s on 2 cores); returns the library's path.

    Raises:
        RuntimeError: the compiler failed (its output says why).
    """
    from torch.utils.cpp_extension import load

    out = _build_dir()
    out.mkdir(parents=True, exist_ok=True)
    load(name=_NAME, sources=[str(s) for s in _SOURCES], extra_cflags=_CFLAGS,
         extra_ldflags=["-fopenmp"], build_directory=str(out), is_python_module=False,
         verbose=verbose)
    return library_path()


loaded = False   # the library is in torch.ops.pdserve_cpu: what traced code checks (a
                 # module global Dynamo guards on; it cannot trace available()'s cache)


@functools.cache
def available() -> bool:
    """Load the built kernels into torch.ops.pdserve_cpu; False (with a warning, once)
    when they were not built."""
    global loaded
    path = library_path()
    if not path.is_file():
        logger.warning("pdserve CPU kernels not built (%s missing): attention falls back to "
                       "SDPA; build them with `make` or `python -m pdserve.engine.cpu_ops`",
                       path)
        return False
    torch.ops.load_library(str(path))
    _register_fakes()
    loaded = True
    return True


def _register_fakes() -> None:
    """Shapes of each op's outputs for torch.compile's tracing (FakeTensor): Dynamo and
    Inductor never run the kernels while compiling."""
    ns = "pdserve_cpu::"
    fakes = {
        "paged_attention": lambda q, *_: torch.empty_like(q),
        "paged_decode_attention": lambda q, *_: torch.empty_like(q),
        "attention_layer": lambda q, *_: torch.empty_like(q),
        "reshape_and_cache": lambda *_: None,
        "rms_norm": lambda x, *_: torch.empty_like(x),
        "fused_add_rms_norm": lambda *_: None,
        "rotary_embedding": lambda *_: None,
        "silu_and_mul": lambda x: x.new_empty(x.shape[0], x.shape[1] // 2),
        "linear_prepacked": lambda x, packed, bias, out: x.new_empty(x.shape[0], out),
        "sample_from_logits": lambda logits, *_: logits.new_empty(logits.shape[0],
                                                                  dtype=torch.long),
    }
    for name, fn in fakes.items():
        torch.library.register_fake(ns + name)(fn)


@functools.cache
def native_bf16() -> bool | None:
    """Whether this CPU computes bfloat16 in hardware (avx512_bf16 or AMX, which oneDNN's
    bf16 GEMMs use); None when it cannot tell (no /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f
                          if line.startswith("flags")), None)
    except OSError:
        return None
    if flags is None:
        return None
    return "avx512_bf16" in flags or "amx_bf16" in flags


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_table: torch.Tensor, cu_seqlens_q: torch.Tensor,
                    seq_lens_k: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged context (a cached
    prefix, earlier chunks and the new tokens themselves, whose K/V must already be in
    the cache), read in place (needs `available()`).

    q: [num_tokens, num_heads, head_dim] fp32/bf16 (CPU), the sequences' new tokens one
    after another; k_cache, v_cache: [num_blocks, num_kv_heads, block_size, head_dim],
    q's dtype, contiguous; block_table: [batch, max_blocks] int32; cu_seqlens_q:
    [batch + 1] int32 (sequence b's new tokens are q[cu[b]:cu[b+1]]); seq_lens_k: [batch]
    int32, each sequence's context including its new tokens (new token i of sequence b
    sits at position seq_lens_k[b] - n_b + i and sees keys up to it). head_dim a multiple
    of 16 up to 128, or 256; block_size a multiple of 16.
    Returns [num_tokens, num_heads, head_dim] in q's dtype.

    Raises:
        RuntimeError: shapes or dtypes that do not fit (the message names them), or a
            context its block_table row does not cover.
    """
    return torch.ops.pdserve_cpu.paged_attention(q, k_cache, v_cache, block_table, cu_seqlens_q,
                                                 seq_lens_k, scale)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_table: torch.Tensor, context_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """paged_attention with one new token per sequence: q [batch, num_heads, head_dim],
    context_lens [batch] int32 (tokens including the new one). Returns [batch, num_heads,
    head_dim] in q's dtype.

    Raises:
        RuntimeError: as paged_attention.
    """
    return torch.ops.pdserve_cpu.paged_decode_attention(q, k_cache, v_cache, block_table,
                                                        context_lens, scale)


def reshape_and_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write new tokens' K/V into the paged cache (vLLM's reshape_and_cache), in place.

    k, v: [num_tokens, num_kv_heads, head_dim] (head_dim contiguous; rows may be strided,
    as views of a fused QKV output are); caches: [num_blocks, num_kv_heads, block_size,
    head_dim], k's dtype, contiguous; slot_mapping: [num_tokens] int64, token t to block
    slot // block_size at offset slot % block_size; -1 skips the token.

    Raises:
        RuntimeError: a slot outside the cache, or shapes that do not fit.
    """
    torch.ops.pdserve_cpu.reshape_and_cache(k, v, k_cache, v_cache, slot_mapping)


def sample_from_logits(logits: torch.Tensor, temperatures: torch.Tensor,
                       uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row (needs `available()`): the first token whose cumulative
    probability under softmax(logits[i] / temperatures[i]) exceeds uniforms[i].

    logits: [rows, vocab] float32 (CPU), -inf for tokens that must not be picked;
    temperatures: [rows] float32 > 0; uniforms: [rows] float64 in [0, 1).
    Returns [rows] int64 token ids; a row with NaN logits (or no finite one) gets its
    argmax.

    Raises:
        RuntimeError: a temperature <= 0, a uniform outside [0, 1), wrong shapes.
    """
    return torch.ops.pdserve_cpu.sample_from_logits(logits, temperatures, uniforms)


def linear_prepacked(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                     out_features: int) -> torch.Tensor:
    """x [num_tokens, in] @ W.T (+ bias) through a weight prepacked by
    torch.ops.mkldnn._reorder_linear_weight (W [out_features, in], fp32/bf16, CPU).
    Returns [num_tokens, out_features] in x's dtype."""
    return torch.ops.pdserve_cpu.linear_prepacked(x, packed, bias, out_features)


def register_kv_cache(kv_cache: torch.Tensor) -> int:
    """Register a contiguous KV cache [num_layers, 2, num_blocks, num_kv_heads,
    block_size, head_dim] for attention_layer; returns its id (held until
    unregister_kv_cache)."""
    return torch.ops.pdserve_cpu.register_kv_cache(kv_cache)


def unregister_kv_cache(cache_id: int) -> None:
    torch.ops.pdserve_cpu.unregister_kv_cache(cache_id)


def attention_layer(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    slot_mapping: torch.Tensor, block_table: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, scale: float,
                    cache_id: int, layer: int) -> torch.Tensor:
    """reshape_and_cache of k, v into layer `layer` of the cache registered as
    `cache_id`, then paged_attention of q over it (shapes as there).
    Returns [num_tokens, num_heads, head_dim] in q's dtype.

    Raises:
        RuntimeError: an unknown cache_id, a layer outside the cache, or what
            reshape_and_cache / paged_attention refuse.
    """
    return torch.ops.pdserve_cpu.attention_layer(q, k, v, slot_mapping, block_table,
                                                 cu_seqlens_q, context_lens, scale, cache_id,
                                                 layer)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm in one pass (needs `available()`).

    x: [..., hidden] fp32/bf16, contiguous (CPU); weight: [hidden], x's dtype.
    Returns a new tensor shaped like x: `weight * (x * rsqrt(mean(x**2) + eps))`, the norm
    in fp32 and the result in x's dtype.
    """
    return torch.ops.pdserve_cpu.rms_norm(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> None:
    """In place: `residual = x + residual`, then `x = rms_norm(residual)` (the residual
    add of a decoder layer and the next norm, vLLM's fused_add_rms_norm). x, residual:
    [num_tokens, hidden], one dtype, contiguous; weight: [hidden]."""
    torch.ops.pdserve_cpu.fused_add_rms_norm(x, residual, weight, eps)


def rotary_embedding(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor) -> None:
    """RoPE in place, rotate-half convention: `x = x * cos[pos] + rotate_half(x) *
    sin[pos]` on q [num_tokens, num_heads, head_dim] and k [num_tokens, num_kv_heads,
    head_dim] (each token's heads contiguous; rows may be strided, as views of a fused
    QKV output are). cos, sin: [max_model_len, head_dim] float32, rounded to q's dtype as
    used; positions: [num_tokens] int64.

    Raises:
        RuntimeError: a position outside the tables, or shapes that do not fit.
    """
    torch.ops.pdserve_cpu.rotary_embedding(q, k, positions, cos, sin)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [num_tokens, 2 * intermediate] (gate then up, the fused projection's
    output) -> silu(gate) * up, [num_tokens, intermediate], in gate_up's dtype."""
    return torch.ops.pdserve_cpu.silu_and_mul(gate_up)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    print(f"building pdserve CPU kernels into {library_path().parent} ...", flush=True)
    print(f"built {build(verbose='-v' in sys.argv)}")
