"""engine/triton_attention.py on CPU, under Triton's interpreter (TRITON_INTERPRET=1).

paged_decode_attention against (a) a plain torch reference with the semantics of
flash_attn_with_kvcache(q[:, None], k_cache, v_cache, cache_seqlens, block_table,
causal=True) and (b) pdserve's CPU decode_attention, over shuffled block tables and
ragged context lengths; store_kvcache against index_copy_ with -1 slots skipped; and
both wired into a tiny model's prefill + decode through ModelRunner.

The kernels run in one spawned child process: triton reads TRITON_INTERPRET when
@triton.jit decorates a function, and its own library (tl.sum, tl.max) is decorated
when `triton` is first imported, so the variable must be set before that import and
holds for the whole process. The child keeps it from this process and from every
process a later test starts. Argument checks need no kernel and run here.

Sizes are small: the interpreter runs every program in Python (numpy per op).
"""

import functools
import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch

pytest.importorskip("triton")

from pdserve.engine.attention import AttentionMetadata, decode_attention


# ------------------------------------------------ run in the interpreter child

def _child_ready() -> bool:
    from triton.runtime import interpreter

    from pdserve.engine import triton_attention
    return isinstance(triton_attention._paged_decode_kernel, interpreter.InterpretedFunction)


def _child_decode(*args):
    from pdserve.engine.triton_attention import paged_decode_attention
    return paged_decode_attention(*args)


def _child_store(k, v, k_cache, v_cache, slot_mapping):
    from pdserve.engine.triton_attention import store_kvcache
    store_kvcache(k, v, k_cache, v_cache, slot_mapping)
    return k_cache, v_cache


@functools.cache
def _child_runner():
    from pdserve.engine.config import CacheConfig
    from pdserve.engine.model_runner import ModelRunner
    from tiny_models import tiny_model_dir

    return ModelRunner(tiny_model_dir("qwen3"), CacheConfig(num_blocks=16, block_size=4))


def _child_model_run(triton_path: bool):
    """Prefill 2 prompts of a tiny GQA model (qwen3: 4/2 heads of 32) on shuffled blocks
    of 4 tokens, then 4 decode steps; with `triton_path`, the dispatch of CUDA without
    flash-attn is forced: every KV write goes through store_kvcache and every decode
    step through paged_decode_attention. Returns (logits [5, 2, vocab], KV cache, calls)."""
    from pdserve.engine import attention, triton_attention
    from pdserve.engine.model_runner import DecodeSeq, PrefillSeq

    calls = {"store_kvcache": 0, "paged_decode_attention": 0}

    class Counting:
        def __getattr__(self, name):
            calls[name] += 1
            return getattr(triton_attention, name)

    use_triton, ops = attention.use_triton, attention._triton_ops
    if triton_path:
        attention.use_triton, attention._triton_ops = (lambda device: True), (lambda: Counting())
    try:
        runner = _child_runner()
        runner.kv_cache.zero_()
        prompts = [[17, 400, 9000], list(range(100, 117))]           # 3 tokens; 4 blocks + 1
        tables = [[11, 2], [5, 14, 0, 7, 3, 9, 12]]                   # room for 4 steps
        rows = [runner.prefill([PrefillSeq(p, t) for p, t in zip(prompts, tables)])]
        for step in range(4):
            toks = rows[-1].argmax(-1).tolist()
            rows.append(runner.decode([DecodeSeq(tok, len(p) + step, t)
                                       for tok, p, t in zip(toks, prompts, tables)]))
        return torch.stack(rows), runner.kv_cache.clone(), calls | {"layers": runner.config.num_layers}
    finally:
        attention.use_triton, attention._triton_ops = use_triton, ops


@pytest.fixture(scope="module")
def child():
    """call(fn, *args) -> fn(*args) in a spawned process started with TRITON_INTERPRET=1."""
    mp = pytest.MonkeyPatch()
    mp.setenv("TRITON_INTERPRET", "1")
    pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    try:
        assert pool.submit(_child_ready).result(), "kernels in the child are not interpreted"
    finally:
        mp.undo()   # the child has its environment; nothing else started here sees it
    yield lambda fn, *args: pool.submit(fn, *args).result()
    pool.shutdown()


# ------------------------------------------------------------------ reference

def reference(q, k_cache, v_cache, block_table, context_lens, scale):
    """flash_attn_with_kvcache's result for one query per sequence, in float64: keys
    0 .. context_lens[i]-1 gathered by block_table, query head h reads KV head h // g."""
    b, h, _ = q.shape
    h_kv = k_cache.shape[2]
    out = []
    for i in range(b):
        n = int(context_lens[i])
        blocks = block_table[i, :-(-n // k_cache.shape[1])].long()
        k = k_cache[blocks].flatten(0, 1)[:n].double().repeat_interleave(h // h_kv, dim=1)  # (n, h, d)
        v = v_cache[blocks].flatten(0, 1)[:n].double().repeat_interleave(h // h_kv, dim=1)
        w = torch.einsum("hd,nhd->hn", q[i].double(), k).mul(scale).softmax(-1)
        out.append(torch.einsum("hn,nhd->hd", w, v))
    return torch.stack(out).to(q.dtype)                                     # (b, h, d)


def paged_case(lens, h, h_kv, d, block_size, seed, dtype=torch.float32):
    """A two-layer cache (layer 1 used, as ModelRunner slices it) whose sequences hold
    shuffled, non-contiguous blocks. k_cache, v_cache are what attention.py passes the
    kernels: [num_blocks, block_size, num_kv_heads, head_dim] views (strided) of pdserve's
    [num_blocks, num_kv_heads, block_size, head_dim] cache. Every slot no sequence owns
    (tails of last blocks, spare blocks, block_table padding) is NaN in the copies k_nan,
    v_nan: reading one shows."""
    g = torch.Generator().manual_seed(seed)
    blocks = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks) + 3
    kv = torch.randn(2, 2, num_blocks, h_kv, block_size, d, generator=g).to(dtype)
    k_cache, v_cache = kv[1, 0].transpose(1, 2), kv[1, 1].transpose(1, 2)
    ids = torch.randperm(num_blocks, generator=g).tolist()
    spare = ids[sum(blocks):]
    table = torch.full((len(lens), max(blocks) + 1), spare[0], dtype=torch.int32)
    owned = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    for i, (n, nb) in enumerate(zip(lens, blocks)):
        row, ids = ids[:nb], ids[nb:]
        table[i, :nb] = torch.tensor(row, dtype=torch.int32)
        for p in range(n):
            owned[row[p // block_size] * block_size + p % block_size] = True
    poison = (~owned).view(num_blocks, block_size, 1, 1)
    k_nan, v_nan = (c.masked_fill(poison, float("nan")) for c in (k_cache, v_cache))
    q = torch.randn(h, len(lens), d, generator=g).to(dtype).transpose(0, 1)  # strided (b, h, d)
    return q, k_cache, v_cache, k_nan, v_nan, table, torch.tensor(lens, dtype=torch.int32)


# (num_heads, num_kv_heads, head_dim, block_size): SmolLM2-135M's 9/3 heads of 64, and
# 4/2 of 32 with a block size that is not a power of two.
SHAPES = [(9, 3, 64, 16), (4, 2, 32, 5)]


@pytest.mark.parametrize("h,h_kv,d,bs", SHAPES)
def test_paged_decode_matches_flash_attn_semantics_and_cpu_decode(child, h, h_kv, d, bs):
    # 1 token; exactly one, two and five blocks; one past a boundary; 70 spans 2 tiles
    lens = [1, bs, 2 * bs, bs + 1, 7, 5 * bs, 70]
    q, k_cache, v_cache, k_nan, v_nan, table, ctx = paged_case(lens, h, h_kv, d, bs, seed=h)
    scale = d ** -0.5
    got = child(_child_decode, q, k_nan, v_nan, table, ctx, scale)
    assert got.shape == q.shape and got.dtype == q.dtype and got.is_contiguous()
    torch.testing.assert_close(got, reference(q, k_cache, v_cache, table, ctx, scale))

    meta = AttentionMetadata(is_prefill=False, slot_mapping=torch.zeros(len(lens), dtype=torch.long),
                             block_table=table, context_lens=ctx, max_context_len=max(lens),
                             context_lens_host=tuple(lens))
    # decode_attention (pdserve's layout) reads whole blocks and masks by weight: it needs
    # the NaN-free cache
    torch.testing.assert_close(got, decode_attention(q, k_cache.transpose(1, 2),
                                                     v_cache.transpose(1, 2), meta, scale))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_paged_decode_half_precision_accumulates_in_fp32(child, dtype):
    lens = [1, 16, 33, 64]
    q, k_cache, v_cache, *_, table, ctx = paged_case(lens, 4, 2, 32, 16, seed=7, dtype=dtype)
    got = child(_child_decode, q, k_cache, v_cache, table, ctx, 0.2)
    assert got.dtype == dtype
    # the reference runs in float64 on the same half-precision inputs: only the
    # output's rounding (and fp32 accumulation) separates them
    torch.testing.assert_close(got, reference(q, k_cache, v_cache, table, ctx, 0.2),
                               atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("h_kv,d,dtype", [(3, 64, torch.float32), (2, 32, torch.bfloat16)])
def test_store_kvcache_matches_index_copy_skipping_minus_one(child, h_kv, d, dtype):
    g = torch.Generator().manual_seed(d)
    num_blocks, bs, t = 6, 16, 11
    kv = torch.randn(1, 2, num_blocks, h_kv, bs, d, generator=g).to(dtype)
    k_cache, v_cache = kv[0, 0].transpose(1, 2), kv[0, 1].transpose(1, 2)   # as attention.py

    # k, v as the model makes them: views of one projection output each (strided rows)
    kv_new = torch.randn(t, 2, h_kv * d, generator=g).to(dtype)
    k, v = kv_new[:, 0].view(t, h_kv, d), kv_new[:, 1].view(t, h_kv, d)
    slots = torch.randperm(num_blocks * bs, generator=g)[:t]
    slots[[1, 4, 10]] = -1
    want_k, want_v = k_cache.contiguous(), v_cache.contiguous()
    keep = slots >= 0
    want_k.view(-1, h_kv, d).index_copy_(0, slots[keep], k[keep])
    want_v.view(-1, h_kv, d).index_copy_(0, slots[keep], v[keep])

    got_k, got_v = child(_child_store, k, v, k_cache, v_cache, slots)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    got_k, _ = child(_child_store, k[:0], v[:0], want_k, want_v, slots[:0])  # no tokens: no launch
    assert torch.equal(got_k, want_k)


def test_bad_arguments_raise_value_error():
    """Checked before any launch, so they run here, with compiled (not interpreted) kernels."""
    from pdserve.engine import triton_attention as ta

    q, k_cache, v_cache, *_, table, ctx = paged_case([3, 5], 4, 2, 32, 4, seed=0)
    bad_decode = {
        "block_table int32": dict(block_table=table.long()),
        "context_lens int32": dict(context_lens=ctx.long()),
        "context_lens [batch]": dict(context_lens=ctx[:1]),
        "num_heads multiple": dict(q=q[:, :3]),
        "head_dim": dict(q=q[..., :16]),
        "q dtype": dict(q=q.double()),
        "cache shapes": dict(v_cache=v_cache[:-1]),
        "cache dtype": dict(k_cache=k_cache.double(), v_cache=v_cache.double(), q=q.double()),
    }
    for what, change in bad_decode.items():
        args = dict(q=q, k_cache=k_cache, v_cache=v_cache, block_table=table, context_lens=ctx,
                    scale=0.1) | change
        with pytest.raises(ValueError):
            ta.paged_decode_attention(**args)
            pytest.fail(f"no ValueError for {what}")
    k = torch.zeros(2, 2, 32)
    slots = torch.tensor([0, 1])
    for what, args in {
        "slot_mapping int64": (k, k, k_cache, v_cache, slots.int()),
        "k/v shape": (k, k[:, :1], k_cache, v_cache, slots),
        "kv heads": (k[:, :1], k[:, :1], k_cache, v_cache, slots),
        "k dtype": (k.half(), k.half(), k_cache, v_cache, slots),
    }.items():
        with pytest.raises(ValueError):
            ta.store_kvcache(*args)
            pytest.fail(f"no ValueError for {what}")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):   # compiled kernel, CPU tensors
        ta.paged_decode_attention(q, k_cache, v_cache, table, ctx, 0.1)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        ta.store_kvcache(k, k, k_cache, v_cache, slots)


def test_model_decode_through_triton_kernels_matches_cpu_path(child):
    want_logits, want_cache, calls = child(_child_model_run, False)
    assert calls["store_kvcache"] == calls["paged_decode_attention"] == 0
    got_logits, got_cache, calls = child(_child_model_run, True)
    layers = calls.pop("layers")
    assert calls == {"store_kvcache": 5 * layers, "paged_decode_attention": 4 * layers}
    torch.testing.assert_close(got_cache, want_cache)
    torch.testing.assert_close(got_logits, want_logits, atol=1e-4, rtol=1e-4)
