"""engine/csrc/paged_attention.cpp (engine/cpu_ops.py): attention read in place from the
paged cache [num_blocks, num_kv_heads, block_size, head_dim], against plain softmax
attention over the same blocks in float64; and the KV write that fills it. `make` builds
the kernels; the suite must run them, so a missing build fails here."""

import pytest
import torch

from pdserve.engine import cpu_ops
from pdserve.engine.attention import AttentionMetadata, decode_attention, prefill_attention, write_kv


@pytest.fixture(scope="module", autouse=True)
def built():
    assert cpu_ops.available(), f"CPU kernels not built ({cpu_ops.library_path()}): run make"


def context(cache, table, n):
    """[n, num_kv_heads, head_dim] float64: the first n tokens of a block table."""
    return cache[table].transpose(1, 2).flatten(0, 1)[:n].double()


def reference(q, k_cache, v_cache, tables, ctx_lens, new_lens, scale):
    """float64 causal attention; q [sum(new_lens), h, d] holds each sequence's new tokens,
    the last new_lens[i] of its ctx_lens[i] context tokens."""
    h_kv = k_cache.shape[1]
    g = q.shape[1] // h_kv
    out, start = [], 0
    for table, n_ctx, n_new in zip(tables, ctx_lens, new_lens):
        k = context(k_cache, table, n_ctx).repeat_interleave(g, dim=1)    # (n_ctx, h, d)
        v = context(v_cache, table, n_ctx).repeat_interleave(g, dim=1)
        qs = q[start:start + n_new].double()                              # (n_new, h, d)
        w = torch.einsum("thd,nhd->htn", qs, k).mul(scale)
        pos = torch.arange(n_ctx - n_new, n_ctx)[:, None]                  # query positions
        w = w.masked_fill(torch.arange(n_ctx)[None, :] > pos, float("-inf")).softmax(-1)
        out.append(torch.einsum("htn,nhd->thd", w, v))
        start += n_new
    return torch.cat(out)


def paged(lens, bs, h_kv, d, dtype, seed):
    """A shuffled paged cache with NaN in every slot no sequence holds, and each
    sequence's block table (the batch table padded with block 0, foreign to most rows)."""
    g = torch.Generator().manual_seed(seed)
    blocks = [-(-n // bs) for n in lens]
    total = sum(blocks) + 3
    k_cache = torch.full((total, h_kv, bs, d), float("nan"), dtype=dtype)
    v_cache = torch.full((total, h_kv, bs, d), float("nan"), dtype=dtype)
    ids = torch.randperm(total, generator=g).tolist()
    tables, table = [], torch.zeros(len(lens), max(blocks) + 2, dtype=torch.int32)
    for i, (n, nb) in enumerate(zip(lens, blocks)):
        tables.append(ids[:nb])
        ids = ids[nb:]
        table[i, :nb] = torch.tensor(tables[-1])
        for j, blk in enumerate(tables[-1]):      # only the slots holding tokens
            used = min(bs, n - j * bs)
            k_cache[blk, :, :used] = torch.randn(h_kv, used, d, generator=g).to(dtype)
            v_cache[blk, :, :used] = torch.randn(h_kv, used, d, generator=g).to(dtype)
    return k_cache, v_cache, tables, table, g


# head_dim 16 and 48 are not multiples of 32, which the bf16 dot-product path pairs by
SHAPES = [(9, 3, 64, 16), (4, 4, 32, 16), (8, 2, 128, 32), (12, 2, 64, 16), (4, 2, 16, 16),
          (6, 3, 48, 16), (2, 1, 256, 16)]
DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)]


@pytest.mark.parametrize("h, h_kv, d, bs", SHAPES)
@pytest.mark.parametrize("dtype, tol", DTYPES)
def test_decode_matches_attention_over_the_blocks(h, h_kv, d, bs, dtype, tol):
    lens = [1, 37, 5, 120, 16, 17, 64, 3, 300, 8, 33, 2]
    k_cache, v_cache, tables, table, g = paged(lens, bs, h_kv, d, dtype, seed=h * d)
    q = torch.randn(len(lens), h, d, generator=g).to(dtype)
    ctx = torch.tensor(lens, dtype=torch.int32)
    got = cpu_ops.paged_decode_attention(q, k_cache, v_cache, table, ctx, 0.125)
    assert got.dtype == dtype and got.shape == q.shape
    want = reference(q, k_cache, v_cache, tables, lens, [1] * len(lens), 0.125)
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("h, h_kv, d, bs", SHAPES)
@pytest.mark.parametrize("dtype, tol", DTYPES)
def test_prefill_with_cached_prefixes_matches_causal_attention(h, h_kv, d, bs, dtype, tol):
    """Varlen batch: whole prompts (no prefix), chunks after a cached prefix, a one-token
    chunk (the decode path inside a prefill batch), lengths off every tile boundary."""
    ctx_lens = [1, 37, 200, 120, 16, 17, 64, 300, 45]
    new_lens = [1, 37, 33, 1, 16, 5, 64, 130, 2]
    k_cache, v_cache, tables, table, g = paged(ctx_lens, bs, h_kv, d, dtype, seed=h + d)
    q = torch.randn(sum(new_lens), h, d, generator=g).to(dtype)
    cu = torch.tensor([0] + new_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    got = cpu_ops.paged_attention(q, k_cache, v_cache, table, cu,
                                  torch.tensor(ctx_lens, dtype=torch.int32), d ** -0.5)
    assert got.dtype == dtype and got.shape == q.shape
    want = reference(q, k_cache, v_cache, tables, ctx_lens, new_lens, d ** -0.5)
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


def test_one_thread_and_two_give_the_same_result():
    ctx_lens, new_lens = [300, 40, 77], [300, 3, 1]
    k_cache, v_cache, _, table, g = paged(ctx_lens, 16, 3, 64, torch.float32, seed=3)
    q = torch.randn(sum(new_lens), 9, 64, generator=g)
    cu = torch.tensor([0, 300, 303, 304], dtype=torch.int32)
    lens = torch.tensor(ctx_lens, dtype=torch.int32)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_ops.paged_attention(q, k_cache, v_cache, table, cu, lens, 0.125)
        torch.set_num_threads(2)
        two = cpu_ops.paged_attention(q, k_cache, v_cache, table, cu, lens, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)     # each item is computed whole by one thread


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reshape_and_cache_writes_each_token_to_its_slot(dtype):
    h_kv, bs, d = 3, 16, 64
    k_cache = torch.zeros(6, h_kv, bs, d, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    qkv = torch.randn(5, 9 * 64 + 2 * h_kv * d).to(dtype)     # strided rows, as a fused QKV
    k = qkv[:, 9 * 64:9 * 64 + h_kv * d].view(5, h_kv, d)
    v = qkv[:, 9 * 64 + h_kv * d:].view(5, h_kv, d)
    slots = torch.tensor([17, -1, 95, 0, 40])
    cpu_ops.reshape_and_cache(k, v, k_cache, v_cache, slots)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(k_cache[s // bs, :, s % bs], k[t])
            assert torch.equal(v_cache[s // bs, :, s % bs], v[t])
    written = {s for s in slots.tolist() if s >= 0}
    untouched = [s for s in range(6 * bs) if s not in written]
    assert not k_cache.transpose(1, 2).flatten(0, 1)[untouched].any()


def test_write_kv_fallback_matches_the_kernel():
    """The torch path (an unbuilt or unfit kernel) writes the same layout."""
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(7, 3, 64, generator=g), torch.randn(7, 3, 64, generator=g)
    slots = torch.randperm(64, generator=g)[:7]
    kernel = [torch.zeros(4, 3, 16, 64) for _ in range(2)]
    fallback = [torch.zeros(4, 3, 16, 64) for _ in range(2)]
    cpu_ops.reshape_and_cache(k, v, *kernel, slots)
    blocks, offsets = slots // 16, slots % 16
    fallback[0].transpose(1, 2)[blocks, offsets] = k
    fallback[1].transpose(1, 2)[blocks, offsets] = v
    write_kv(k, v, *kernel, slots)          # the dispatcher, again: idempotent
    assert torch.equal(kernel[0], fallback[0]) and torch.equal(kernel[1], fallback[1])


def test_attention_dispatches_to_the_kernel(monkeypatch):
    lens = [7, 50, 19]
    k_cache, v_cache, tables, table, g = paged(lens, 16, 3, 64, torch.float32, seed=5)
    q = torch.randn(3, 9, 64, generator=g)
    meta = AttentionMetadata(is_prefill=False, slot_mapping=torch.zeros(3, dtype=torch.long),
                             block_table=table, context_lens=torch.tensor(lens, dtype=torch.int32),
                             max_context_len=max(lens), context_lens_host=tuple(lens))
    calls = []
    for name in ("paged_decode_attention", "paged_attention"):
        kernel = getattr(cpu_ops, name)
        monkeypatch.setattr(cpu_ops, name,
                            lambda *a, _k=kernel, _n=name: calls.append(_n) or _k(*a))
    got = decode_attention(q, k_cache, v_cache, meta, 0.125)
    want = reference(q, k_cache, v_cache, tables, lens, [1, 1, 1], 0.125)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    prefill = AttentionMetadata(
        is_prefill=True, slot_mapping=torch.zeros(3, dtype=torch.long),
        cu_seqlens_q=torch.tensor([0, 1, 2, 3], dtype=torch.int32), max_seqlen_q=1,
        seq_lens=(1, 1, 1), block_table=table, context_lens=torch.tensor(lens, dtype=torch.int32),
        cached_lens=tuple(n - 1 for n in lens))
    got = prefill_attention(q, None, None, prefill, 0.125, k_cache, v_cache)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    assert calls == ["paged_decode_attention", "paged_attention"]


def test_bad_input_is_refused_with_the_reason():
    k_cache, v_cache, _, table, g = paged([20], 16, 3, 64, torch.float32, seed=1)
    q = torch.randn(1, 9, 64, generator=g)
    with pytest.raises(RuntimeError, match="not covered by its block_table"):
        cpu_ops.paged_decode_attention(q, k_cache, v_cache, table[:, :1],
                                       torch.tensor([40], dtype=torch.int32), 0.1)
    with pytest.raises(RuntimeError, match="int32"):
        cpu_ops.paged_decode_attention(q, k_cache, v_cache, table.long(),
                                       torch.tensor([20], dtype=torch.int32), 0.1)
    with pytest.raises(RuntimeError, match="new tokens <= context"):
        cpu_ops.paged_attention(q.expand(3, 9, 64).contiguous(), k_cache, v_cache, table,
                                torch.tensor([0, 3], dtype=torch.int32),
                                torch.tensor([2], dtype=torch.int32), 0.1)
    with pytest.raises(RuntimeError, match="block_size must be a multiple of 16"):
        cpu_ops.paged_decode_attention(q, k_cache[:, :, :8].contiguous(),
                                       v_cache[:, :, :8].contiguous(), table,
                                       torch.tensor([5], dtype=torch.int32), 0.1)
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_ops.reshape_and_cache(torch.zeros(1, 3, 64), torch.zeros(1, 3, 64), k_cache,
                                  v_cache, torch.tensor([k_cache.shape[0] * 16]))
