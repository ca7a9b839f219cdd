"""Model fidelity: the paged engine (ModelRunner + BlockPool) against transformers.

For every architecture engine/model.py implements (tiny random-weight checkpoints from
tests/tiny_models.py) and for the default model, greedy generation through ModelRunner,
with prompts of different lengths batched together in prefill and decode, must give the
tokens `AutoModelForCausalLM.generate(do_sample=False)` gives per prompt (no padding),
and every step's logits must match HF's within float32 noise.

EOS handling: the reference runs with min_new_tokens == max_new_tokens == N, which
masks the EOS logits (transformers' MinNewTokensLengthLogitsProcessor); the engine side
masks the same ids before its argmax, so both always produce N tokens. Logits are
compared raw (before that mask): HF's `output_logits`.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from pdserve.engine.block_pool import BlockPool, blocks_needed
from pdserve.engine.config import CacheConfig
from pdserve.engine.model_runner import DecodeSeq, ModelRunner, PrefillSeq
from tiny_models import FAMILIES, default_model_dir, tiny_model_dir

NEW_TOKENS = 20
# Lengths chosen against block_size 16 (and 4): 3 stays in one block until decode moves
# it to a second; 16 fills a block exactly, so its first decode token opens a new one;
# 17 is one past a boundary; 29 crosses 32 while decoding; 40 spans three blocks.
PROMPT_LENS = (3, 16, 17, 29, 40)
TINY_ATOL = 1e-4        # logits are O(10); engine vs HF measured <= 2e-5 (float32)
DEFAULT_ATOL = 1e-3     # 30 layers: measured ~2.5e-5; room for other CPUs' kernels


def _prompts(seed: int = 0) -> tuple[tuple[int, ...], ...]:
    """Deterministic prompts of PROMPT_LENS tokens, avoiding SmolLM2's special ids (< 17)."""
    g = torch.Generator().manual_seed(seed)
    return tuple(tuple(torch.randint(17, 49152, (n,), generator=g).tolist()) for n in PROMPT_LENS)


PROMPTS = _prompts()


# --------------------------------------------------------------------------- helpers

@functools.cache
def _runner(model_dir: Path, block_size: int, num_blocks: int,
            compiled: bool = False) -> ModelRunner:
    """Eager, or with the decoder layers through torch.compile (engine/compile.py; CPU
    kernels and block_size 16 needed, else the runner stays eager and this fails)."""
    runner = ModelRunner(model_dir, CacheConfig(num_blocks=num_blocks, block_size=block_size),
                         compile_model=compiled)
    assert runner.compiled == compiled
    return runner


@functools.cache
def _hf_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _hf_reference(model, prompt: Sequence[int], n: int):
    """(forward logits of the last prompt token [vocab], n greedy tokens, their logits [n, vocab])."""
    ids = torch.tensor([list(prompt)])
    with torch.inference_mode():
        fwd = model(ids).logits[0, -1].float()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             min_new_tokens=n, max_new_tokens=n,
                             output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    assert len(tokens) == n
    return fwd, tokens, torch.cat(out.logits).float()


@functools.cache
def _tiny_reference(family: str):
    """HF reference for PROMPTS on the tiny `family` model (shared by several tests)."""
    model = _hf_model(tiny_model_dir(family))
    return [_hf_reference(model, p, NEW_TOKENS) for p in PROMPTS]


def _make_pool(num_blocks: int, shuffle_seed: int | None = None) -> BlockPool:
    """A pool whose free list is in a shuffled order when `shuffle_seed` is given, so
    block tables come out non-contiguous and non-monotonic."""
    pool = BlockPool(num_blocks)
    if shuffle_seed is not None:
        ids = pool.allocate(num_blocks)
        random.Random(shuffle_seed).shuffle(ids)
        pool.free(ids)
    return pool


def _greedy(logits: torch.Tensor, eos_ids: Sequence[int]) -> int:
    masked = logits.clone()
    masked[list(eos_ids)] = float("-inf")
    return int(masked.argmax())


def _engine_generate(runner: ModelRunner, pool: BlockPool, prompts: Sequence[Sequence[int]],
                     max_new: Sequence[int], *, decode_order_seed: int | None = None):
    """Greedy generation of all `prompts` as one batch, the way a scheduler drives it.

    Blocks are allocated for the prompt at prefill and one at a time when a decode
    position enters a new block; a sequence leaves the decode batch and frees its blocks
    as soon as it has `max_new[i]` tokens (so later allocations reuse them, stale K/V
    included). With `decode_order_seed`, every decode step shuffles the batch order.
    Returns (tokens per prompt, logits per prompt [n_i, vocab], every block table used).
    """
    bs = runner.block_size
    eos = runner.config.eos_token_ids
    tables = [pool.allocate(blocks_needed(len(p), bs)) for p in prompts]
    logits = runner.prefill([PrefillSeq(list(p), tuple(t)) for p, t in zip(prompts, tables)])
    assert logits.shape == (len(prompts), runner.config.vocab_size)
    steps = [[row] for row in logits]
    tokens = [[_greedy(row, eos)] for row in logits]
    seen_tables: list[tuple[int, ...]] = []
    running = []
    for i in range(len(prompts)):
        if len(tokens[i]) >= max_new[i]:
            seen_tables.append(tuple(tables[i]))
            pool.free(tables[i])
        else:
            running.append(i)
    rng = random.Random(decode_order_seed) if decode_order_seed is not None else None
    while running:
        if rng is not None:
            rng.shuffle(running)
        seqs = []
        for i in running:
            pos = len(prompts[i]) + len(tokens[i]) - 1  # position of the newest token
            need = blocks_needed(pos + 1, bs) - len(tables[i])
            if need > 0:
                tables[i] += pool.allocate(need)
            seqs.append(DecodeSeq(tokens[i][-1], pos, tuple(tables[i])))
        logits = runner.decode(seqs)
        assert logits.shape == (len(seqs), runner.config.vocab_size)
        for row, i in zip(logits, list(running)):
            steps[i].append(row)
            tokens[i].append(_greedy(row, eos))
            if len(tokens[i]) >= max_new[i]:
                seen_tables.append(tuple(tables[i]))
                pool.free(tables[i])
                running.remove(i)
    return tokens, [torch.stack(s) for s in steps], seen_tables


def _assert_matches(tokens, logits, refs, atol: float, label: str = "") -> None:
    """Engine tokens/logits of each prompt against the HF reference (a prefix of it when
    the engine generated fewer tokens). Reports the first diverging step."""
    for i, (toks, lg, (_, ref_toks, ref_lg)) in enumerate(zip(tokens, logits, refs)):
        n = len(toks)
        assert toks == ref_toks[:n], (
            f"{label}prompt {i}: tokens diverge at step "
            f"{next(k for k in range(n) if toks[k] != ref_toks[k])}: engine {toks} vs HF {ref_toks[:n]}")
        diff = (lg - ref_lg[:n]).abs().amax(dim=-1)
        assert bool((diff <= atol).all()), (
            f"{label}prompt {i}: logits differ from HF by {diff.max().item():.2e} (> {atol}) "
            f"at step {int(diff.argmax())}; per step: {[f'{d:.1e}' for d in diff.tolist()]}")


# --------------------------------------------------------------------------- tests

def test_tiny_models_are_distinct_and_non_degenerate():
    """Guards the tests below: random weights that collapse to one repeated token (or
    families that silently load as the same thing) would make them vacuous."""
    for family in FAMILIES:
        _, ref_toks, _ = _tiny_reference(family)[3]
        assert len(set(ref_toks)) >= 3, f"{family}: degenerate greedy output {ref_toks}"
    firsts = {family: tuple(_tiny_reference(family)[0][1]) for family in FAMILIES}
    assert len(set(firsts.values())) == len(FAMILIES), firsts


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_logits_match_hf_forward(family):
    """A varlen prefill of prompts of different lengths: each last-token row equals HF's
    forward logits of that prompt alone."""
    runner = _runner(tiny_model_dir(family), 16, 24)
    pool = _make_pool(24)
    tables = [pool.allocate(blocks_needed(len(p), 16)) for p in PROMPTS]
    logits = runner.prefill([PrefillSeq(list(p), tuple(t)) for p, t in zip(PROMPTS, tables)])
    for i, (row, (fwd, _, _)) in enumerate(zip(logits, _tiny_reference(family))):
        torch.testing.assert_close(row, fwd, atol=TINY_ATOL, rtol=0,
                                   msg=lambda m: f"prompt {i} (len {len(PROMPTS[i])}): {m}")
    for t in tables:
        pool.free(t)
    assert pool.all_free()


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_after_cached_prefix_matches_hf_forward(family):
    """Prefix caching and chunked prefill: each prompt's first `cached` tokens are
    prefilled first (alone, with other prompts), then the rest attends to them through the
    block table: block_size 4 from a shuffled free list, cut points inside blocks, on
    block boundaries and one token before the end, all in one varlen batch. The last
    rows equal HF's forward logits of the whole prompt."""
    runner = _runner(tiny_model_dir(family), 4, 72)
    pool = _make_pool(72, shuffle_seed=3)
    cuts = [1, 8, 9, 28, 39]    # tokens already cached, per prompt in PROMPTS
    tables = [pool.allocate(blocks_needed(len(p), 4)) for p in PROMPTS]
    runner.prefill([PrefillSeq(list(p[:c]), tuple(t)) for p, c, t in zip(PROMPTS, cuts, tables)])
    logits = runner.prefill([PrefillSeq(list(p), tuple(t), num_computed_tokens=c)
                             for p, c, t in zip(PROMPTS, cuts, tables)])
    for i, (row, (fwd, _, _)) in enumerate(zip(logits, _tiny_reference(family))):
        torch.testing.assert_close(row, fwd, atol=TINY_ATOL, rtol=0,
                                   msg=lambda m: f"prompt {i} (cut {cuts[i]}): {m}")
    with pytest.raises(ValueError, match="num_computed_tokens"):
        runner.prefill([PrefillSeq(list(PROMPTS[0]), tuple(tables[0]), num_computed_tokens=3)])
    for t in tables:
        pool.free(t)
    assert pool.all_free()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_hf_generate(family, compiled):
    """block_size 16, all prompts prefilled and decoded together for NEW_TOKENS steps;
    the eager step and the torch.compile'd one."""
    runner = _runner(tiny_model_dir(family), 16, 24, compiled)
    pool = _make_pool(24)
    tokens, logits, _ = _engine_generate(runner, pool, PROMPTS, [NEW_TOKENS] * len(PROMPTS))
    assert all(len(t) == NEW_TOKENS for t in tokens)
    _assert_matches(tokens, logits, _tiny_reference(family), TINY_ATOL)
    assert pool.all_free()


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_hf_small_shuffled_blocks(family):
    """block_size 4 (every prompt spans many blocks) from a shuffled free list, so block
    tables are non-contiguous; the decode batch order changes every step, and sequences
    finish at different steps, freeing blocks that others then reuse (stale K/V)."""
    num_blocks = 72
    runner = _runner(tiny_model_dir(family), 4, num_blocks)
    pool = _make_pool(num_blocks, shuffle_seed=1234)
    max_new = [NEW_TOKENS, 7, NEW_TOKENS, 12, 1]
    tokens, logits, tables = _engine_generate(runner, pool, PROMPTS, max_new, decode_order_seed=5)
    assert [len(t) for t in tokens] == max_new
    assert any(any(b != a + 1 for a, b in zip(t, t[1:])) for t in tables), tables
    _assert_matches(tokens, logits, _tiny_reference(family), TINY_ATOL)
    assert pool.all_free()


@pytest.mark.parametrize("family", FAMILIES)
def test_batch_invariance(family):
    """Greedy tokens of a prompt do not depend on what else shares its batches."""
    runner = _runner(tiny_model_dir(family), 16, 24)
    pool = _make_pool(24, shuffle_seed=7)
    batched, batched_logits, _ = _engine_generate(runner, pool, PROMPTS, [NEW_TOKENS] * len(PROMPTS))
    assert pool.all_free()
    for i, p in enumerate(PROMPTS):
        alone, alone_logits, _ = _engine_generate(runner, pool, [p], [NEW_TOKENS])
        assert alone[0] == batched[i], f"prompt {i}: alone {alone[0]} vs batched {batched[i]}"
        torch.testing.assert_close(alone_logits[0], batched_logits[i], atol=TINY_ATOL, rtol=0)
        assert pool.all_free()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_default_model_matches_hf_generate(compiled):
    """SmolLM2-135M-Instruct (30 layers, GQA 9/3, tied): a raw-text prompt and two chat
    prompts (5, 37, 48 tokens) batched, 16 greedy tokens each, against HF; the eager
    step and the torch.compile'd one."""
    from transformers import AutoModelForCausalLM

    model_dir = default_model_dir()
    runner = _runner(model_dir, 16, 16, compiled)
    tok = runner.tokenizer
    prompts = [tok("The capital of France is").input_ids]
    for q in ("What is 2+2?",
              "Write a haiku about the sea and explain each line of it in detail, please."):
        ids = tok.apply_chat_template([{"role": "user", "content": q}],
                                      add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    assert len({len(p) for p in prompts}) == 3, [len(p) for p in prompts]
    n = 16
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    refs = [_hf_reference(hf, p, n) for p in prompts]
    del hf

    pool = _make_pool(16)
    tokens, logits, _ = _engine_generate(runner, pool, prompts, [n] * len(prompts))
    for i, (lg, (fwd, _, _)) in enumerate(zip(logits, refs)):
        torch.testing.assert_close(lg[0], fwd, atol=DEFAULT_ATOL, rtol=0,
                                   msg=lambda m: f"prefill logits of prompt {i}: {m}")
    _assert_matches(tokens, logits, refs, DEFAULT_ATOL)
    assert len(set(tokens[1])) >= 3, tok.decode(tokens[1])
    assert pool.all_free()
