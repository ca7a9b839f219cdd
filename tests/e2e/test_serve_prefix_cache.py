"""Prefix caching through the real server: a repeated ~1,500-token system prompt is
computed once; later requests compute only their own suffix, get their first token at
least twice as fast, and the same greedy tokens as HF transformers."""

from __future__ import annotations

import time

import pytest
import ray
from serving import Served, hf_greedy, start_ray

from pdserve.client import make_request

pytestmark = pytest.mark.slow

MAX_TOKENS = 8
BLOCK_SIZE = 16


def _system_prompt(tok, min_tokens: int = 1500) -> str:
    rules, i = [], 0
    while len(tok("\n".join(rules))["input_ids"]) < min_tokens:
        i += 1
        rules.append(f"Rule {i}: when the user mentions topic number {i * 7 % 97}, answer "
                     f"politely, cite guideline {i * 13 % 89}, and keep it under {i % 9 + 2} "
                     "sentences.")
    return "You are a support assistant for a railway company.\n" + "\n".join(rules)


def _ttft_and_tokens(served: Served, prompt_ids: list[int]) -> tuple[float, list[int]]:
    t0 = time.perf_counter()
    ttft, ids = None, []
    for msg in served.client.stream(make_request(prompt_ids, max_tokens=MAX_TOKENS,
                                                 temperature=0)):
        if ttft is None and msg.token_ids:
            ttft = time.perf_counter() - t0
        ids += msg.token_ids
    return ttft, ids


def _prefill_counters(served: Served) -> dict:
    [s] = ray.get([p.status.remote() for p in served.cluster.prefill])
    return s


def test_repeated_system_prompt_computes_only_the_suffix():
    start_ray()
    # no local prefill on D: the repeat's short suffix must be computed by the prefill worker
    served = Served(prefill_blocks=256, local_prefill_max_tokens=0)
    try:
        from transformers import AutoTokenizer

        from pdserve.engine.loader import resolve_model
        tok = AutoTokenizer.from_pretrained(resolve_model("default"))
        system = _system_prompt(tok)
        prompts = [
            list(tok.apply_chat_template(
                [{"role": "system", "content": system}, {"role": "user", "content": q}],
                add_generation_prompt=True, tokenize=True)["input_ids"])
            for q in ("Which rule covers topic 14?", "Summarise rule 3 in one sentence, please.")
        ]
        common = next(i for i, (a, b) in enumerate(zip(*prompts)) if a != b)
        assert common >= 1500, common

        before = _prefill_counters(served)
        ttft_cold, got_cold = _ttft_and_tokens(served, prompts[0])
        mid = _prefill_counters(served)
        ttft_warm, got_warm = _ttft_and_tokens(served, prompts[1])
        after = _prefill_counters(served)

        # the first computes everything; the second only what follows the cached blocks
        assert mid.prefill_tokens_computed - before.prefill_tokens_computed == len(prompts[0])
        cached = common // BLOCK_SIZE * BLOCK_SIZE
        assert after.prefix_cache_hit_tokens - mid.prefix_cache_hit_tokens == cached
        assert after.prefill_tokens_computed - mid.prefill_tokens_computed == \
            len(prompts[1]) - cached
        assert ttft_warm <= 0.5 * ttft_cold, (ttft_warm, ttft_cold)

        assert got_cold == hf_greedy("default", prompts[0], MAX_TOKENS)
        assert got_warm == hf_greedy("default", prompts[1], MAX_TOKENS)
        assert after.prefix_cache_blocks >= cached // BLOCK_SIZE
    finally:
        served.stop()
