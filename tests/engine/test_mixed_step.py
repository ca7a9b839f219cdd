"""ModelRunner.mixed: a step's prefill chunks and decode rows in one varlen forward give
the logits of a prefill pass followed by a decode pass (the decode worker's two-pass
step), in fp32 and bf16 (bit for bit on this box; the bound allows a GEMM library that
blocks differently by row count)."""

import random

import pytest
import torch
from tiny_models import tiny_model_dir

from pdserve.engine.config import CacheConfig
from pdserve.engine.model_runner import DecodeSeq, ModelRunner, PrefillSeq


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)])
def test_mixed_equals_prefill_then_decode(dtype, tol):
    bs = 16
    runner = ModelRunner(tiny_model_dir("llama"), CacheConfig(num_blocks=64, block_size=bs,
                                                              dtype=dtype))
    rng = random.Random(0)
    vocab = runner.config.vocab_size
    ids = list(range(64))
    rng.shuffle(ids)
    # three running sequences (contexts 20, 37, 5): their prompts prefilled first
    ctx = [20, 37, 5]
    tables = [ids[0:2], ids[2:5], ids[5:6]]
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in ctx]
    runner.prefill([PrefillSeq(p, t) for p, t in zip(prompts, tables)])
    decode = [DecodeSeq(rng.randrange(vocab), n, t) for n, t in zip(ctx, tables)]
    # a whole prompt and a chunk after 16 cached tokens
    long = [rng.randrange(vocab) for _ in range(40)]
    prefill = [PrefillSeq([rng.randrange(vocab) for _ in range(23)], ids[10:12]),
               PrefillSeq(long, ids[12:15], num_computed_tokens=16)]
    runner.prefill([PrefillSeq(long[:16], ids[12:15])])             # the chunk's prefix
    want_p = runner.prefill(prefill)
    want_d = runner.decode(decode)
    got_p, got_d = runner.mixed(prefill, decode)     # rewrites the same K/V in place
    assert got_p.shape == want_p.shape and got_d.shape == want_d.shape
    torch.testing.assert_close(got_p, want_p, rtol=0, atol=tol)
    torch.testing.assert_close(got_d, want_d, rtol=0, atol=tol)


def test_every_step_kind_calls_back_after_each_layer_and_threads_may_change_there():
    """The decode worker hands lent threads back between layers (on_layer_done sets
    fewer torch threads): decode, mixed and prefill call it once a layer, in order, and
    the logits match those of a step on one thread throughout."""
    bs, nthreads = 16, torch.get_num_threads()
    runner = ModelRunner(tiny_model_dir("llama"), CacheConfig(num_blocks=16, block_size=bs))
    layers, vocab = runner.config.num_layers, runner.config.vocab_size
    prompt = [i * 7 % vocab for i in range(21)]
    runner.prefill([PrefillSeq(prompt, [0, 1])])
    decode = [DecodeSeq(5, 21, [0, 1])]
    chunk = [PrefillSeq([i * 3 % vocab for i in range(18)], [2, 3])]
    seen = []

    def give_back(i):
        seen.append(i)
        torch.set_num_threads(1)

    try:
        for step in (lambda cb: runner.decode(decode, cb),
                     lambda cb: runner.mixed(chunk, decode, cb)[1],
                     lambda cb: runner.prefill(chunk, cb)):
            torch.set_num_threads(1)
            want = step(None)
            seen.clear()
            torch.set_num_threads(max(2, nthreads))
            got = step(give_back)
            assert seen == list(range(layers)) and torch.get_num_threads() == 1
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    finally:
        torch.set_num_threads(nthreads)
