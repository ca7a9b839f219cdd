"""Every model family through the full path (gRPC → router → prefill → TCP → decode) on
random-weight checkpoints, several prompts of different lengths in flight at once,
token-identical to HF transformers `generate`."""

from __future__ import annotations

import pytest
from serving import Served, hf_greedy, start_ray
from tiny_models import FAMILIES, tiny_model_dir

pytestmark = pytest.mark.slow

# Lengths cross block boundaries (16-token blocks) in prefill and during decode.
PROMPTS = [[1, 500, 77], list(range(100, 117)), list(range(2000, 2040)), [5] * 9]
NEW_TOKENS = 20


@pytest.mark.parametrize("family", FAMILIES)
def test_family_matches_hf_through_the_cluster(family):
    start_ray()
    model = str(tiny_model_dir(family))
    served = Served(model, decode_blocks=64, prefill_blocks=64)
    try:
        results = served.generate_many(PROMPTS, max_tokens=NEW_TOKENS, temperature=0,
                                       ignore_eos=True)
        for prompt, (ids, _, reason) in zip(PROMPTS, results):
            assert ids == hf_greedy(model, prompt, NEW_TOKENS, ignore_eos=True), family
            assert reason == "length"
        assert max(d.peak_batch_size for d in served.decode_status()) > 1
    finally:
        served.stop()          # asserts every KV block on every worker is free
