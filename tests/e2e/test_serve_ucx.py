"""The disaggregated path over the UCX KV transport (ucxx): greedy output identical to HF
transformers with several prompts in flight, cancellation frees every block."""

from __future__ import annotations

import pytest
from serving import Served, hf_greedy, start_ray

from pdserve.client import make_request

pytest.importorskip("ucxx")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served():
    start_ray()
    s = Served(transport="ucx")
    yield s
    s.stop()


@pytest.fixture(autouse=True)
def no_leaks(served):
    yield
    served.assert_all_free()


def test_workers_paired_over_ucx(served):
    cfg = served.cluster.config
    assert cfg.prefill.transport == cfg.decode.transport == "ucx"


def test_concurrent_prompts_match_hf_over_ucx(served):
    from transformers import AutoTokenizer

    from pdserve.engine.loader import resolve_model
    tok = AutoTokenizer.from_pretrained(resolve_model("default"))
    prompts = ["The capital of France is", "Write a haiku about the sea.",
               "def fibonacci(n):\n    " * 4, "Hi"]
    results = served.generate_many(prompts, max_tokens=20, temperature=0)
    for prompt, (ids, _, _) in zip(prompts, results):
        assert ids == hf_greedy("default", tok(prompt)["input_ids"], 20), prompt
    assert max(d["peak_batch_size"] for d in served.decode_status()) > 1


def test_cancel_frees_blocks_over_ucx(served):
    call = served.client.generator.Generate(
        make_request("Tell me about the sea.", max_tokens=300, temperature=0, ignore_eos=True),
        timeout=120)
    assert next(call).token_ids
    call.cancel()
    served.assert_all_free(timeout_s=1.0)
