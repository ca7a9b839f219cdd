"""Preemption on the decode worker through the real server: a decode pool that holds
every prompt but not every answer preempts the newest requests, resumes them by
recomputing their KV, and still returns every answer token-identical to HF transformers."""

from __future__ import annotations

import pytest
from serving import Served, hf_greedy, start_ray

from pdserve.engine.block_pool import blocks_needed

pytestmark = pytest.mark.slow

MAX_TOKENS = 24
BLOCK_SIZE = 16        # WorkerConfig's default
# Continuations the default model carries on for MAX_TOKENS tokens (no early EOS), 16 to
# 22 tokens each: every prompt takes 1-2 blocks, every answer 1-2 more.
PROMPTS = [
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "The bicycle is a marvel of engineering. To understand how it works, we start with",
    "Step 1: Mix the flour, water, salt and yeast in a large bowl. Step 2:",
    "The planets of the solar system, in order from the Sun, are Mercury,",
    "The printing press, invented by Johannes Gutenberg around 1440, changed the world because",
    "Dear Anna, I am writing to tell you about my trip to the mountains last winter. We",
]


def test_small_decode_pool_preempts_and_answers_match_hf():
    tok = _tokenizer()
    prompt_ids = [tok(p)["input_ids"] for p in PROMPTS]
    prompt_blocks = sum(blocks_needed(len(ids), BLOCK_SIZE) for ids in prompt_ids)
    most_alone = max(blocks_needed(len(ids) + MAX_TOKENS, BLOCK_SIZE) for ids in prompt_ids)
    together = sum(blocks_needed(len(ids) + MAX_TOKENS - 1, BLOCK_SIZE) for ids in prompt_ids)
    decode_blocks = prompt_blocks          # every prompt is reserved at once, nothing more
    assert most_alone <= decode_blocks < together, (most_alone, decode_blocks, together)

    start_ray()
    served = Served(decode_blocks=decode_blocks)
    try:
        results = served.generate_many(prompt_ids, max_tokens=MAX_TOKENS, temperature=0)
        [status] = served.decode_status()
        assert status.num_preemptions > 0, status
        for prompt, ids, (got, _, reason) in zip(PROMPTS, prompt_ids, results):
            ref = hf_greedy("default", ids, MAX_TOKENS)
            assert got == ref, f"prompt {prompt[:30]!r}: got {got}, HF {ref}"
            assert reason == "length"
    finally:
        served.stop()                      # every KV pool free, nothing left waiting


def _tokenizer():
    from transformers import AutoTokenizer

    from pdserve.engine.loader import resolve_model
    return AutoTokenizer.from_pretrained(resolve_model("default"))
