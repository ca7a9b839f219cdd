"""Triton kernels for CUDA without flash-attn: paged decode attention and the fused KV write.

engine/attention.py calls these on a CUDA device when flash-attn is not installed (prefill
there stays on torch SDPA). Both kernels take the cache layout `flash_attn_with_kvcache`
takes, with any strides: attention.py passes `cache.transpose(1, 2)`, a view of pdserve's
[num_blocks, num_kv_heads, block_size, head_dim] cache, so a cache written by one back end
is read correctly by the other:

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]  (strides free)
    slot = block_table[seq][pos // block_size] * block_size + pos % block_size

`paged_decode_attention` has the semantics of
`flash_attn_with_kvcache(q[:, None], k_cache, v_cache, cache_seqlens=context_lens,
block_table=block_table, softmax_scale=scale, causal=True)[:, 0]` (one query per sequence,
so `causal` masks nothing: the query sees every cached token, its own included).

Algorithm: one program per (sequence, query head), split-free. It walks the context in
tiles of `_BLOCK_N` tokens, looking up each token's block through block_table (so the
tile size does not depend on block_size), and keeps the running max `m`, normalizer `l`
and unnormalized output `acc` of the online softmax (Milakov & Gimelshein 2018, as
used by FlashAttention, Dao et al. 2022), all in fp32:

    m' = max(m, max_j s_j);  l' = l * e^(m - m') + sum_j e^(s_j - m');
    acc' = acc * e^(m - m') + sum_j e^(s_j - m') v_j;   out = acc / l

One program per (sequence, head) is vLLM's PagedAttention V1 grid
(csrc/attention/attention_kernels.cu); the split of long contexts over several programs
that FlashDecoding / PagedAttention V2 add is left out: it matters at small batch and
long context, and a split-free kernel is the one that is easy to check.

`store_kvcache` is nano-vllm's `store_kvcache_kernel` (nanovllm/layers/attention.py):
one program per new token writes its K and V rows, slot -1 skipped (vLLM's padding
convention), generalised to any strides and to head counts that are not powers of two.

On CPU the kernels run only under Triton's interpreter (TRITON_INTERPRET=1 set before
this module is imported; the tests do this), which is how CPU-only CI checks them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

_BLOCK_N = 64            # context tokens per tile of the decode kernel
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _paged_decode_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, context_lens_ptr, scale,
    stride_ob, stride_oh, stride_od,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_tb, stride_tn,
    GROUP: tl.constexpr,           # query heads per KV head
    BLOCK_SIZE: tl.constexpr,      # tokens per cache block
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,         # next power of two >= HEAD_DIM (tl.arange needs one)
    BLOCK_N: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP        # HF repeat_kv / flash-attn GQA: query head h reads h // g
    ctx = tl.load(context_lens_ptr + seq)

    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_qb + head * stride_qh + offs_d * stride_qd,
                mask=d_mask, other=0.0).to(tl.float32)                          # (D,)

    m_i = tl.full([], float("-inf"), tl.float32)
    l_i = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for start in range(0, ctx, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)                                      # (N,)
        n_mask = pos < ctx
        block = tl.load(block_table_ptr + seq * stride_tb + (pos // BLOCK_SIZE) * stride_tn,
                        mask=n_mask, other=0).to(tl.int64)   # int64: caches exceed 2**31 elems
        off = pos % BLOCK_SIZE
        mask = n_mask[:, None] & d_mask[None, :]                                 # (N, D)
        k = tl.load(k_cache_ptr + (block * stride_kb + off * stride_ks + kv_head * stride_kh)[:, None]
                    + offs_d[None, :] * stride_kd, mask=mask, other=0.0).to(tl.float32)
        s = tl.sum(q[None, :] * k, axis=1) * scale                               # (N,)
        s = tl.where(n_mask, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp(m_i - m_new)          # 0 on the first tile (m_i = -inf)
        p = tl.exp(s - m_new)                                                    # (N,)
        v = tl.load(v_cache_ptr + (block * stride_vb + off * stride_vs + kv_head * stride_vh)[:, None]
                    + offs_d[None, :] * stride_vd, mask=mask, other=0.0).to(tl.float32)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)                       # (D,)
        m_i = m_new
    out = acc / tl.maximum(l_i, 1e-30)       # context_lens 0: acc = 0, so out = 0
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + offs_d * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=d_mask)


@triton.jit
def _store_kvcache_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:                 # -1: a padding token, nothing to write
        return
    block = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]      # (H, D)
    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd,
                mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd,
                mask=mask)
    tl.store(k_cache_ptr + block * stride_kcb + off * stride_kcs + offs_h[:, None] * stride_kch
             + offs_d[None, :] * stride_kcd, k, mask=mask)
    tl.store(v_cache_ptr + block * stride_vcb + off * stride_vcs + offs_h[:, None] * stride_vch
             + offs_d[None, :] * stride_vcd, v, mask=mask)


def _check_device(kernel, *tensors: torch.Tensor) -> None:
    device = tensors[0].device
    if any(t.device != device for t in tensors):
        raise ValueError(f"tensors on different devices: {[str(t.device) for t in tensors]}")
    if device.type == "cpu" and not isinstance(kernel, InterpretedFunction):
        raise ValueError("CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 before "
                         "importing pdserve.engine.triton_attention, or use a CUDA device")


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must "
                         f"both be [num_blocks, block_size, num_kv_heads, head_dim]")
    if k_cache.dtype not in _DTYPES or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"cache dtypes {k_cache.dtype}/{v_cache.dtype}: must be one of "
                         f"{[str(d) for d in _DTYPES]}, the same for K and V")


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_table: torch.Tensor, context_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """Attention of one new query token per sequence over its paged K/V context.

    Args:
        q: [batch, num_heads, head_dim] fp32/fp16/bf16; any strides.
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], q's dtype.
            The current token's K/V must already be written (store_kvcache).
        block_table: [batch, max_blocks] int32, the blocks of each sequence in order;
            entries past a sequence's last block are never read.
        context_lens: [batch] int32, tokens in each sequence's cache including the
            current one; 1 <= context_lens[i] <= max_blocks * block_size (not checked:
            that needs a device sync). A 0 gives a zero output row.
        scale: softmax scale, usually head_dim ** -0.5.
        All tensors on one CUDA device, or CPU under TRITON_INTERPRET=1.

    Returns:
        [batch, num_heads, head_dim], q's dtype and device, contiguous: softmax(q kᵀ
        scale) v per head, query head h reading KV head h // (num_heads // num_kv_heads),
        computed in fp32.

    Raises:
        ValueError: a shape, dtype or device that does not fit the above.
    """
    if q.dim() != 3:
        raise ValueError(f"q {tuple(q.shape)} must be [batch, num_heads, head_dim]")
    _check_cache(k_cache, v_cache)
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if q.dtype != k_cache.dtype:
        raise ValueError(f"q is {q.dtype} but the cache is {k_cache.dtype}")
    if cache_head_dim != head_dim:
        raise ValueError(f"q head_dim {head_dim} != cache head_dim {cache_head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if block_table.dim() != 2 or block_table.shape[0] != batch or block_table.dtype != torch.int32:
        raise ValueError(f"block_table {tuple(block_table.shape)} {block_table.dtype} must be "
                         f"[batch={batch}, max_blocks] int32")
    if context_lens.shape != (batch,) or context_lens.dtype != torch.int32:
        raise ValueError(f"context_lens {tuple(context_lens.shape)} {context_lens.dtype} must be "
                         f"[batch={batch}] int32")
    _check_device(_paged_decode_kernel, q, k_cache, v_cache, block_table, context_lens)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    _paged_decode_kernel[(batch, num_heads)](
        out, q, k_cache, v_cache, block_table, context_lens, float(scale),
        *out.stride(), *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_table.stride(),
        GROUP=num_heads // num_kv_heads, BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_N=_BLOCK_N)
    return out


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """Write each new token's K and V rows into its cache slot, both in one kernel launch.

    Args:
        k, v: [num_tokens, num_kv_heads, head_dim], the cache's dtype; any strides.
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim] fp32/fp16/bf16,
            written in place at [slot // block_size, slot % block_size].
        slot_mapping: [num_tokens] int64; -1 skips that token (padding). Other slots must
            be < num_blocks * block_size and distinct (not checked: that needs a device
            sync; a duplicate leaves either token's row).
        All tensors on one CUDA device, or CPU under TRITON_INTERPRET=1.

    Raises:
        ValueError: a shape, dtype or device that does not fit the above.
    """
    _check_cache(k_cache, v_cache)
    if k.dim() != 3 or k.shape != v.shape or k.shape[1:] != k_cache.shape[2:]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must both be [num_tokens, "
                         f"num_kv_heads, head_dim] = [*, {k_cache.shape[2]}, {k_cache.shape[3]}]")
    if k.dtype != k_cache.dtype or v.dtype != k_cache.dtype:
        raise ValueError(f"k/v are {k.dtype}/{v.dtype} but the cache is {k_cache.dtype}")
    if slot_mapping.shape != (k.shape[0],) or slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping {tuple(slot_mapping.shape)} {slot_mapping.dtype} must be "
                         f"[num_tokens={k.shape[0]}] int64")
    _check_device(_store_kvcache_kernel, k, v, k_cache, v_cache, slot_mapping)
    if k.shape[0] == 0:
        return
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    _store_kvcache_kernel[(k.shape[0],)](
        k, v, k_cache, v_cache, slot_mapping,
        *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim))
