"""engine/csrc/paged_attention.cpp (engine/cpu_ops.py): decode attention read in place
from the paged cache, against plain softmax attention over the same blocks in float64.
`make` builds the kernels; the suite must run them, so a missing build fails here."""

import pytest
import torch

from pdserve.engine import cpu_ops
from pdserve.engine.attention import AttentionMetadata, decode_attention


@pytest.fixture(scope="module", autouse=True)
def built():
    assert cpu_ops.available(), f"CPU kernels not built ({cpu_ops.library_path()}): run make"


def reference(q, k_cache, v_cache, tables, lens, scale, h_kv):
    out = []
    g = q.shape[1] // h_kv
    for i, (table, n) in enumerate(zip(tables, lens)):
        k = k_cache[table].flatten(0, 1)[:n].double().repeat_interleave(g, dim=1)  # (n, h, d)
        v = v_cache[table].flatten(0, 1)[:n].double().repeat_interleave(g, dim=1)
        w = torch.einsum("hd,nhd->hn", q[i].double(), k).mul(scale).softmax(-1)
        out.append(torch.einsum("hn,nhd->hd", w, v))
    return torch.stack(out)


def paged(lens, bs, h, h_kv, d, dtype, seed):
    """A shuffled paged cache with NaN in every block no sequence owns, and a decode
    batch over it (tables padded with block 0, which is foreign to most rows)."""
    g = torch.Generator().manual_seed(seed)
    blocks = [-(-n // bs) for n in lens]
    total = sum(blocks) + 3
    k_cache = torch.full((total, bs, h_kv, d), float("nan"), dtype=dtype)
    v_cache = torch.full((total, bs, h_kv, d), float("nan"), dtype=dtype)
    ids = torch.randperm(total, generator=g).tolist()
    tables, table = [], torch.zeros(len(lens), max(blocks) + 2, dtype=torch.int32)
    for i, (n, nb) in enumerate(zip(lens, blocks)):
        tables.append(ids[:nb])
        ids = ids[nb:]
        table[i, :nb] = torch.tensor(tables[-1])
        for j, blk in enumerate(tables[-1]):      # only the slots holding tokens
            used = min(bs, n - j * bs)
            k_cache[blk, :used] = torch.randn(used, h_kv, d, generator=g).to(dtype)
            v_cache[blk, :used] = torch.randn(used, h_kv, d, generator=g).to(dtype)
    q = torch.randn(len(lens), h, d, generator=g).to(dtype)
    return q, k_cache, v_cache, tables, table


@pytest.mark.parametrize("h, h_kv, d, bs", [(9, 3, 64, 16), (4, 4, 32, 8), (8, 2, 128, 32)])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_kernel_matches_attention_over_the_blocks(h, h_kv, d, bs, dtype, tol):
    lens = [1, 37, 5, 120, 16, 17, 64, 3, 300, 8, 33, 2]
    q, k_cache, v_cache, tables, table = paged(lens, bs, h, h_kv, d, dtype, seed=h * d)
    ctx = torch.tensor(lens, dtype=torch.int32)
    got = cpu_ops.paged_decode_attention(q, k_cache, v_cache, table, ctx, 0.125)
    assert got.dtype == dtype and got.shape == q.shape
    want = reference(q, k_cache, v_cache, tables, lens, 0.125, h_kv)
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


def test_decode_attention_dispatches_to_the_kernel(monkeypatch):
    lens = [7, 50, 19]
    q, k_cache, v_cache, tables, table = paged(lens, 16, 9, 3, 64, torch.float32, seed=5)
    meta = AttentionMetadata(is_prefill=False, slot_mapping=torch.zeros(3, dtype=torch.long),
                             block_table=table, context_lens=torch.tensor(lens, dtype=torch.int32),
                             max_context_len=max(lens), context_lens_host=tuple(lens))
    calls = []
    kernel = cpu_ops.paged_decode_attention
    monkeypatch.setattr(cpu_ops, "paged_decode_attention",
                        lambda *a: calls.append(1) or kernel(*a))
    got = decode_attention(q, k_cache, v_cache, meta, 0.125)
    assert calls == [1]
    want = reference(q, k_cache, v_cache, tables, lens, 0.125, 3)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_bad_input_is_refused_with_the_reason():
    q, k_cache, v_cache, _, table = paged([20], 16, 9, 3, 64, torch.float32, seed=1)
    with pytest.raises(RuntimeError, match="not covered by its block_table"):
        cpu_ops.paged_decode_attention(q, k_cache, v_cache, table[:, :1],
                                       torch.tensor([40], dtype=torch.int32), 0.1)
    with pytest.raises(RuntimeError, match="int32"):
        cpu_ops.paged_decode_attention(q, k_cache, v_cache, table.long(),
                                       torch.tensor([20], dtype=torch.int32), 0.1)
