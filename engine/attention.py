"""Attention over a paged KV cache: prefill (varlen, causal) and decode (one query each).

Back ends, chosen per device (docs/architecture.md "Attention back ends"):

| phase   | CUDA + flash-attn                         | CUDA without flash-attn        | CPU                        |
|---------|-------------------------------------------|--------------------------------|----------------------------|
| prefill | `flash_attn_varlen_func` with cu_seqlens  | SDPA, causal, per sequence (torch picks its flash kernel for fp16/bf16) | C++ paged attention reading blocks in place (`cpu_ops.paged_attention`); unbuilt: SDPA, causal, per sequence |
| prefill after a cached prefix | the same, K/V paged via block_table | gather the context by block_table, SDPA with an offset causal mask (math kernel: flash takes no mask) | the C++ kernel; unbuilt: as CUDA without flash-attn |
| decode  | `flash_attn_with_kvcache` + block_table   | Triton paged decode over block_table (`triton_attention.py`, flash_attn_with_kvcache's semantics) | the C++ kernel; unbuilt: per group of similar-length sequences, gather by block_table, masked SDPA |
| KV write | `index_put_` by slot_mapping             | Triton `store_kvcache`: K and V in one kernel | C++ `reshape_and_cache` |

CUDA without flash-attn falls back to the CPU column if triton cannot be imported.

KV cache of one layer, a block's K (or V) of one KV head one contiguous tile (vLLM's CPU
layout, and what tensor-parallel workers need to send a range of heads as one region):

    k_cache, v_cache: [num_blocks, num_kv_heads, block_size, head_dim]
    slot_mapping[t] = block_table[seq][pos // block_size] * block_size + pos % block_size
    token at slot s, KV head h: k_cache[s // block_size, h, s % block_size]

flash-attn and the Triton kernels read `k_cache.transpose(1, 2)`, a
[num_blocks, block_size, num_kv_heads, head_dim] view of the same memory (they take
strides; head_dim stays contiguous).

A sequence of 37 tokens with block_size 16 and block_table [7, 2, 9]:
    tokens  0..15 -> block 7 slots 112..127
    tokens 16..31 -> block 2 slots  32..47
    tokens 32..36 -> block 9 slots 144..148 (slots 149..159 free for decode)
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import cpu_ops

_DECODE_GROUP = 8   # CPU decode: sequences per gather + SDPA call (bounds padding waste)
_HUGE_PAGE = 2 << 20


def allocate_kv_cache(shape: tuple[int, ...], dtype: torch.dtype,
                      device: torch.device | str) -> torch.Tensor:
    """A zeroed KV cache tensor of ``shape``; on a Linux host, its own anonymous mapping,
    2 MiB aligned and backed by transparent huge pages where the kernel allows them (THP
    ``madvise`` or ``always``), whose pages are committed as they are first written.

    Why: a KV transfer pins and copies the cache page by page (UCX's cma
    ``process_vm_writev``, a socket's copy); with 4 KiB pages that cost the copying
    threads ~15% (bench transfer profile, docs/nixl.md). The hint is given before the
    first touch, so the pages fault in huge. An anonymous mapping reads as zeros until
    written (the kernel's zero page), so the cache is not written here: a pool sized
    from a memory budget (pdserve/kv_memory.py) costs memory only as its blocks fill.
    Where THP is off the pages are plain; off Linux and on devices the cache is
    torch.zeros. The mapping lives as long as the tensor (and its views).
    """
    device = torch.device(device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or not hasattr(mmap, "MADV_HUGEPAGE") or nbytes < _HUGE_PAGE:
        return torch.zeros(shape, dtype=dtype, device=device)
    buf = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    offset = -base % _HUGE_PAGE
    try:
        buf.madvise(mmap.MADV_HUGEPAGE, offset, nbytes)
    except OSError:   # a kernel built without THP, a sandbox refusing it: plain pages
        pass
    raw = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=offset)
    return raw.view(dtype).view(shape)


@functools.cache
def _flash_attn():
    """The flash_attn module, or None when it is not installed (always None on CPU-only CI)."""
    try:
        import flash_attn  # noqa: F401  (optional extra `pdserve[gpu]`)
        return flash_attn
    except ImportError:
        return None


# flash-attn 2's paged KV (`flash_attn_with_kvcache` with a block_table) takes only block
# sizes that are multiples of 256 (its docstring; Dao-AILab/flash-attention#828). Smaller
# blocks decode with the Triton kernel instead.
FLASH_ATTN_PAGE_MULTIPLE = 256


def use_flash_attn(device: torch.device) -> bool:
    return device.type == "cuda" and _flash_attn() is not None


@functools.cache
def _triton_ops():
    """engine/triton_attention.py, or None when triton cannot be imported. Only asked for
    on CUDA (use_triton), so CPU runs never import triton."""
    try:
        from . import triton_attention
        return triton_attention
    except ImportError:
        return None


def use_triton(device: torch.device) -> bool:
    """CUDA without flash-attn: decode attention and the KV write run Triton kernels."""
    return device.type == "cuda" and _flash_attn() is None and _triton_ops() is not None


def decode_on_device(device: torch.device, block_size: int) -> bool:
    """Whether decode attention runs a device kernel (flash-attn's paged decode or the
    Triton one) that reads context lengths on the device, as CUDA graphs need; the SDPA
    fallback reads them on the host."""
    flash = use_flash_attn(device)
    return ((flash and block_size % FLASH_ATTN_PAGE_MULTIPLE == 0) or use_triton(device)
            or (flash and _triton_ops() is not None))


def cpu_kernels_fit(device: torch.device, dtype: torch.dtype, head_dim: int,
                    block_size: int) -> bool:
    """CPU attention and the KV write run pdserve's C++ kernels (engine/cpu_ops.py) when
    they were built (cpu_ops.available() loads them) and fit: fp32/bf16, head_dim a
    multiple of 16 (at most 128, or 256), block_size a multiple of 16."""
    return (device.type == "cpu" and head_dim % 16 == 0 and (head_dim <= 128 or head_dim == 256)
            and block_size % 16 == 0 and dtype in (torch.float32, torch.bfloat16)
            and cpu_ops.loaded)


def use_cpu_kernel(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """cpu_kernels_fit for q [..., head_dim] and a cache [num_blocks, num_kv_heads,
    block_size, head_dim]."""
    return cpu_kernels_fit(q.device, q.dtype, q.shape[-1], k_cache.shape[2])


def attention_backend(device: torch.device) -> str:
    """The back ends `device` uses, in words (for logs)."""
    if use_flash_attn(device):
        return "flash-attn"
    if use_triton(device):
        return "SDPA prefill, Triton decode"
    if device.type == "cpu" and cpu_ops.available():
        return "C++ paged attention"
    return "SDPA"


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Per-step batch description shared by every layer.

    Prefill fields (is_prefill=True):
        cu_seqlens_q: [batch+1] int32, cumulative new-token counts per prompt, on device.
        max_seqlen_q: most new tokens of one prompt in the batch.
        seq_lens: the same counts as a Python tuple, for the CPU per-sequence loop.
        cached_lens: tokens of each prompt already in its blocks (a cached prefix or an
            earlier chunk), whose K/V the new tokens attend to; () when none has any.
        cu_seqlens_k: [batch+1] int32, cumulative cached + new tokens (flash-attn's paged
            varlen), and max_seqlen_k; set with cached_lens.
    Decode fields (is_prefill=False):
        max_context_len: the largest context_lens value (tokens).
        context_lens_host: context_lens as a Python tuple (the SDPA fallback groups by it).
    Both:
        slot_mapping: [num_tokens] int64, cache slot each new token's K/V is written to.
        kv_cache_id: set when the CPU kernels run the KV write and attention of every
            layer as one op (cpu_ops.attention_layer): the cache's id in their registry
            (cpu_ops.register_kv_cache). Then cu_seqlens_q is set for decode too
            (0, 1, ..., batch), and block_table / context_lens always.
        block_table: [batch, max_blocks_per_seq] int32, padded with 0 (never read past a
            sequence's context).
        context_lens: [batch] int32, tokens in each sequence's context including its new
            ones (prefill: cached + new; decode: the new token included).
    """

    is_prefill: bool
    slot_mapping: torch.Tensor
    cu_seqlens_q: torch.Tensor | None = None
    max_seqlen_q: int = 0
    seq_lens: tuple[int, ...] = ()
    block_table: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None
    max_context_len: int = 0
    context_lens_host: tuple[int, ...] = ()
    cached_lens: tuple[int, ...] = ()
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_k: int = 0
    kv_cache_id: int | None = None


_workspace = threading.local()   # per step thread: reused gather buffers


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, slot: str) -> torch.Tensor:
    """cache[block_ids] ([len(block_ids), *cache.shape[1:]]) into a buffer reused across
    calls of this thread. A fresh tensor of this size (MBs per layer) is a new mmap on
    every call, and touching its pages cost more than the copy itself (CPU profile:
    the gather was 70% of decode attention before; index_select also beats advanced
    indexing ~10x). The result is valid until the next call with the same `slot`."""
    need = block_ids.numel() * cache[0].numel()
    buf = getattr(_workspace, slot, None)
    if (buf is None or buf.numel() < need or buf.dtype != cache.dtype or buf.device != cache.device
            # a buffer made under inference_mode cannot be written outside it
            or buf.is_inference() != torch.is_inference_mode_enabled()):
        buf = torch.empty(need, dtype=cache.dtype, device=cache.device)
        setattr(_workspace, slot, buf)
    out = buf[:need].view(block_ids.numel(), *cache.shape[1:])
    return torch.index_select(cache, 0, block_ids, out=out)


def _context(cache: torch.Tensor, block_ids: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The first `num_tokens` tokens held by `block_ids` of a cache [num_blocks,
    num_kv_heads, block_size, head_dim], as [num_tokens, num_kv_heads, head_dim]."""
    return cache.index_select(0, block_ids).transpose(1, 2).flatten(0, 1)[:num_tokens]


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter new K/V into the paged cache.

    k, v: [num_tokens, num_kv_heads, head_dim]; caches: [num_blocks, num_kv_heads,
    block_size, head_dim]; slot_mapping: [num_tokens] int64.
    """
    if use_triton(k.device):
        _triton_ops().store_kvcache(k, v, k_cache.transpose(1, 2), v_cache.transpose(1, 2),
                                    slot_mapping)
        return
    if use_cpu_kernel(k, k_cache) and k.stride(-1) == 1 and v.stride(-1) == 1:
        cpu_ops.reshape_and_cache(k, v, k_cache, v_cache, slot_mapping)
        return
    block_size = k_cache.shape[2]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    k_cache.transpose(1, 2)[blocks, offsets] = k     # writes through the view
    v_cache.transpose(1, 2)[blocks, offsets] = v


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      meta: AttentionMetadata, scale: float,
                      k_cache: torch.Tensor | None = None,
                      v_cache: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of each prompt's new tokens over its cached prefix (if any) and
    themselves, for a varlen batch. The new tokens' K/V must already be in the cache
    (write_kv): the paged paths read every key from there.

    q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
    (the new tokens); caches: [num_blocks, num_kv_heads, block_size, head_dim].
    Returns [num_tokens, num_heads, head_dim].
    """
    paged = bool(meta.cached_lens) and any(meta.cached_lens)
    if use_flash_attn(q.device):
        from flash_attn import flash_attn_varlen_func
        if paged:  # keys from the paged cache; causal aligns each query bottom-right
            return flash_attn_varlen_func(
                q, k_cache.transpose(1, 2), v_cache.transpose(1, 2), meta.cu_seqlens_q,
                meta.cu_seqlens_k, meta.max_seqlen_q, meta.max_seqlen_k, softmax_scale=scale,
                causal=True, block_table=meta.block_table)
        return flash_attn_varlen_func(
            q, k, v, meta.cu_seqlens_q, meta.cu_seqlens_q, meta.max_seqlen_q,
            meta.max_seqlen_q, softmax_scale=scale, causal=True)
    if (k_cache is not None and meta.block_table is not None and meta.context_lens is not None
            and use_cpu_kernel(q, k_cache)):    # engine/csrc/paged_attention.cpp
        return cpu_ops.paged_attention(q, k_cache, v_cache, meta.block_table, meta.cu_seqlens_q,
                                       meta.context_lens, scale)
    out = torch.empty_like(q)
    start = 0
    for i, n in enumerate(meta.seq_lens):
        sl = slice(start, start + n)
        cached = meta.cached_lens[i] if paged else 0
        if cached:
            total = cached + n
            block_size = k_cache.shape[2]
            table = meta.block_table[i, :-(-total // block_size)].long()
            kk = _context(k_cache, table, total)                      # (total, h_kv, d)
            vv = _context(v_cache, table, total)
            # new token j sits at position cached + j: it sees keys 0 .. cached + j
            mask = torch.ones(n, total, dtype=torch.bool, device=q.device).tril(cached)
        else:
            kk, vv, mask = k[sl], v[sl], None
        # (1, h, n, d): SDPA's batch/head layout; enable_gqa repeats kv heads implicitly.
        o = F.scaled_dot_product_attention(
            q[sl].transpose(0, 1).unsqueeze(0), kk.transpose(0, 1).unsqueeze(0),
            vv.transpose(0, 1).unsqueeze(0), attn_mask=mask, is_causal=mask is None,
            scale=scale, enable_gqa=True)
        out[sl] = o.squeeze(0).transpose(0, 1)  # (n, h, d)
        start += n
    return out


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """One query per sequence against its paged context (new token already written).

    q: [batch, num_heads, head_dim]; caches: [num_blocks, num_kv_heads, block_size, head_dim].
    Returns [batch, num_heads, head_dim].
    """
    paged_flash = use_flash_attn(q.device)
    if paged_flash and k_cache.shape[2] % FLASH_ATTN_PAGE_MULTIPLE == 0:
        from flash_attn import flash_attn_with_kvcache
        o = flash_attn_with_kvcache(
            q.unsqueeze(1), k_cache.transpose(1, 2), v_cache.transpose(1, 2),
            cache_seqlens=meta.context_lens, block_table=meta.block_table, softmax_scale=scale,
            causal=True)
        return o.squeeze(1)
    # flash-attn present but a block size its paged kernel refuses: Triton if it can
    if use_triton(q.device) or (paged_flash and _triton_ops() is not None):
        return _triton_ops().paged_decode_attention(q, k_cache.transpose(1, 2),
                                                    v_cache.transpose(1, 2), meta.block_table,
                                                    meta.context_lens, scale)
    if use_cpu_kernel(q, k_cache):    # engine/csrc/paged_attention.cpp: blocks read in place
        return cpu_ops.paged_decode_attention(q, k_cache, v_cache, meta.block_table,
                                              meta.context_lens, scale)
    # Without the built kernel (or a head_dim / block_size it does not take):
    # SDPA per group of _DECODE_GROUP sequences of similar length (sorted by context
    # length), each gathering only the blocks its longest member needs: one long
    # sequence no longer makes every other pay for its context. GQA without repeating
    # K/V: a KV head's g query heads are the query "length" axis of one SDPA row
    # (query head i reads KV head i // g, as HF's repeat_kv lays them out).
    b, h, d = q.shape
    h_kv, block_size = k_cache.shape[1:3]
    ctx = meta.context_lens_host or tuple(meta.context_lens.tolist())
    order = sorted(range(b), key=ctx.__getitem__)
    out = torch.empty_like(q)
    for start in range(0, b, _DECODE_GROUP):
        rows = order[start:start + _DECODE_GROUP]
        n, longest = len(rows), ctx[rows[-1]]
        n_blocks = -(-longest // block_size)
        idx = torch.tensor(rows, device=q.device)
        table = meta.block_table[idx, :n_blocks].long()                      # (n, blocks)
        k = _gather(k_cache, table.flatten(), "k").view(
            n, n_blocks, h_kv, block_size, d).transpose(1, 2).reshape(
            n, h_kv, n_blocks * block_size, d)                               # (n, h_kv, S, d)
        v = _gather(v_cache, table.flatten(), "v").view(
            n, n_blocks, h_kv, block_size, d).transpose(1, 2).reshape(
            n, h_kv, n_blocks * block_size, d)
        pos = torch.arange(n_blocks * block_size, device=q.device)
        mask = (pos[None, :] < meta.context_lens[idx, None])[:, None, None, :]  # (n, 1, 1, S)
        o = F.scaled_dot_product_attention(q[idx].view(n, h_kv, h // h_kv, d), k, v,
                                           attn_mask=mask, scale=scale)  # (n, h_kv, g, d)
        out[idx] = o.reshape(n, h, d)
    return out
