"""ModelRunner.prefill_with_prompt_logprobs against transformers on a tiny llama: each
prompt token's logprob (and rank, top k) given the tokens before it equals HF's
log-softmax of a full forward over the prompt, in one pass or chunk by chunk (the
prefill worker's chunked prefill), batched beside a sequence that does not ask."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model_dir

from pdserve.engine.config import CacheConfig
from pdserve.engine.model_runner import ModelRunner, PrefillSeq

BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def models():
    from transformers import AutoModelForCausalLM
    d = tiny_model_dir("llama")
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    return ModelRunner(d, CacheConfig(num_blocks=64, block_size=BLOCK_SIZE)), hf


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


@pytest.mark.parametrize("chunks", [(19,), (8, 11), (4, 4, 4, 7)])
def test_prompt_logprobs_equal_hf(models, chunks):
    runner, hf = models
    g = torch.Generator().manual_seed(len(chunks))
    ids = torch.randint(5, 200, (sum(chunks),), generator=g).tolist()
    other = torch.randint(5, 200, (6,), generator=g).tolist()
    table, other_table = list(range(5)), list(range(10, 12))
    got, start = [], 0
    for n in chunks:
        seqs = [PrefillSeq(ids[:start + n], table, start), PrefillSeq(other, other_table, 0)]
        _, entries = runner.prefill_with_prompt_logprobs(seqs, [(ids, 3), None])
        assert entries[1] is None
        got += entries[0]
        start += n
    want = hf_logprobs(hf, ids)
    assert len(got) == len(ids) - 1           # every token after the first
    for pos, e in enumerate(got):             # position pos predicts token pos + 1
        row, target = want[pos], ids[pos + 1]
        assert e.logprob == pytest.approx(row[target].item(), abs=1e-4)
        lp = row[target]            # rank: up to the tokens within float noise of it
        assert int((row > lp + 1e-4).sum()) + 1 <= e.rank <= int((row > lp - 1e-4).sum()) + 1
        assert [t for t, _ in e.top] == row.topk(3).indices.tolist()
