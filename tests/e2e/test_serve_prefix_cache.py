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


def test_prompts_of_different_cache_salts_share_no_block():
    """vLLM's cache_salt: the same prompt under salt "b" after salt "a" finds nothing in
    either worker's prefix cache (its every token computed again, no block of D's shared),
    under "a" again finds "a"'s blocks; each answer is HF's."""
    start_ray()
    served = Served(prefill_blocks=256, local_prefill_max_tokens=0)
    prompt = [100 + (i * 7919) % 40000 for i in range(200)]
    cached = (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE      # never the last token's block
    try:
        def counters():
            p = _prefill_counters(served)
            [d] = served.decode_status()
            return p.prefill_tokens_computed, p.prefix_cache_hit_tokens, d.prefix_cache_hit_tokens

        want = hf_greedy("default", prompt, MAX_TOKENS)
        seen = [counters()]
        for salt in ("a", "b", "a"):
            got, _, _ = served.generate(prompt, max_tokens=MAX_TOKENS, temperature=0,
                                        cache_salt=salt)
            assert got == want, salt
            seen.append(counters())
        (c0, p0, d0), (c1, p1, d1), (c2, p2, d2), (c3, p3, d3) = seen
        assert c1 - c0 == len(prompt) and c2 - c1 == len(prompt), seen   # "b" shares nothing
        assert (p2 - p1, d2 - d1) == (0, 0), seen
        assert c3 - c2 == len(prompt) - cached and p3 - p2 == cached, seen   # "a" again: hit
    finally:
        served.stop()
