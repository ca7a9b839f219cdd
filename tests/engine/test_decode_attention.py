"""engine/attention.py decode on CPU: sequences grouped by context length, K/V gathered
into reused buffers, GQA without repeating K/V, against a plain per-sequence softmax
attention over the same paged cache."""

import torch

from pdserve.engine.attention import _DECODE_GROUP, AttentionMetadata, decode_attention

BS, H, H_KV, D = 4, 6, 2, 8


def reference(q, k_cache, v_cache, tables, lens, scale):
    out = []
    for i, (table, n) in enumerate(zip(tables, lens)):
        k = k_cache[table].transpose(1, 2).flatten(0, 1)[:n].repeat_interleave(H // H_KV, dim=1)
        v = v_cache[table].transpose(1, 2).flatten(0, 1)[:n].repeat_interleave(H // H_KV, dim=1)
        w = torch.einsum("hd,nhd->hn", q[i], k).mul(scale).softmax(-1)
        out.append(torch.einsum("hn,nhd->hd", w, v))
    return torch.stack(out)


def run(lens, seed):
    g = torch.Generator().manual_seed(seed)
    blocks = [-(-n // BS) for n in lens]
    k_cache = torch.randn(sum(blocks) + 3, H_KV, BS, D, generator=g)   # block size 4: not the
    v_cache = torch.randn(sum(blocks) + 3, H_KV, BS, D, generator=g)   # kernel's, SDPA runs
    ids = torch.randperm(sum(blocks) + 3, generator=g).tolist()
    tables, table = [], torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    for i, nb in enumerate(blocks):
        tables.append(ids[:nb])
        ids = ids[nb:]
        table[i, :nb] = torch.tensor(tables[-1])
    q = torch.randn(len(lens), H, D, generator=g)
    meta = AttentionMetadata(is_prefill=False, slot_mapping=torch.zeros(len(lens), dtype=torch.long),
                             block_table=table, context_lens=torch.tensor(lens, dtype=torch.int32),
                             max_context_len=max(lens), context_lens_host=tuple(lens))
    got = decode_attention(q, k_cache, v_cache, meta, 0.3)
    torch.testing.assert_close(got, reference(q, k_cache, v_cache, tables, lens, 0.3))


def test_grouped_decode_matches_plain_attention_across_groups():
    lens = [1, 37, 5, 120, 16, 17, 64, 3, 90, 8, 33, 2, 71, 4, 15, 49, 100, 6, 29]
    assert len(lens) > 2 * _DECODE_GROUP
    run(lens, 0)


def test_reused_gather_buffers_hold_no_stale_keys():
    run([200, 150, 180], 1)         # grows the buffers
    run([3, 9, 1, 12], 2)           # smaller: reads only its own blocks
    run([260] * (_DECODE_GROUP + 1), 3)
