"""engine/logits_processors.py and its place in engine/sampler.py: each processor equals
transformers' own logits processor (or, for OpenAI's presence / frequency penalties,
which transformers lacks, the formula written out per row); a batch mixing every kind
of row samples each row as it would be sampled alone."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from pdserve.engine import logits_processors, logprobs
from pdserve.engine.request import RequestState
from pdserve.engine.sampler import sample
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.stop import stop_state

VOCAB = 97
EOS = 3


def logits_and_history(rows: int, seed: int = 0, length: int = 12):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, VOCAB, generator=g) * 3
    history = torch.randint(0, VOCAB, (rows, length), generator=g)
    return logits, history


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_equals_transformers(penalty):
    logits, history = logits_and_history(6)
    want = RepetitionPenaltyLogitsProcessor(penalty)(history, logits.clone())
    got = logits.clone()
    p = SamplingParams(repetition_penalty=penalty)
    # the penalty covers prompt and output alike: split the history either way
    logits_processors.apply(got, [p] * 6, [0, 1, 3, 5, 11, 12], history.tolist(), ())
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits, history = logits_and_history(4, seed=1)
    params = [SamplingParams(presence_penalty=0.7, frequency_penalty=-0.4),
              SamplingParams(frequency_penalty=1.5),
              SamplingParams(presence_penalty=-2.0, step_offset=3),   # 3 from an earlier attempt
              SamplingParams()]
    steps = [5, 12, 2, 4]
    got = logits.clone()
    logits_processors.apply(got, params, steps, [h.tolist() for h in history], ())
    want = logits.clone()
    for i, (p, s) in enumerate(zip(params, steps)):
        n = p.step_offset + s
        output = history[i].tolist()[len(history[i]) - n:] if n else []
        for t in set(output):       # OpenAI: mu[j] -= c[j] * freq + (c[j] > 0) * presence
            want[i, t] -= output.count(t) * p.frequency_penalty + p.presence_penalty
    torch.testing.assert_close(got, want)


def test_logit_bias_equals_transformers_sequence_bias():
    logits, history = logits_and_history(2, seed=2)
    bias = {5: 100.0, 7: -100.0, 11: 2.5}
    want = SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})(history, logits.clone())
    got = logits.clone()
    logits_processors.apply(got, [SamplingParams(logit_bias=tuple(bias.items()))] * 2,
                            [0, 0], None, ())
    torch.testing.assert_close(got, want)
    assert sample(got, [SamplingParams(temperature=0)] * 2, [0, 0]) == [5, 5]


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits, history = logits_and_history(1, seed=3)
    prompt_len = 4
    hf = MinNewTokensLengthLogitsProcessor(prompt_len, min_new_tokens=3, eos_token_id=EOS)
    for step in range(5):
        ids = history[:, :prompt_len + step]
        want = hf(ids, logits.clone())
        got = logits.clone()
        logits_processors.apply(got, [SamplingParams(min_tokens=3)], [step], None, [EOS])
        torch.testing.assert_close(got, want)
    # stop_token_ids too, not EOS under ignore_eos; an earlier attempt's tokens count
    got = logits.clone()
    p = SamplingParams(min_tokens=3, stop_token_ids=(8,), ignore_eos=True, step_offset=1)
    logits_processors.apply(got, [p], [1], None, [EOS])
    assert got[0, 8] == -math.inf and got[0, EOS] == logits[0, EOS]
    got = logits.clone()
    logits_processors.apply(got, [p], [2], None, [EOS])
    torch.testing.assert_close(got, logits)


@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.3, 1.0])
def test_min_p_equals_transformers(min_p):
    logits, history = logits_and_history(5, seed=4)
    scaled = logits / 0.8
    want = MinPLogitsWarper(min_p)(history, scaled.clone()) if min_p else scaled
    got = logits.clone()
    logits_processors.apply_min_p(got, torch.full((5,), 0.8), torch.full((5,), min_p))
    assert torch.equal(got == -math.inf, want == -math.inf)
    torch.testing.assert_close(got[got > -math.inf] / 0.8, want[want > -math.inf])


def test_stop_rule_waits_for_min_tokens():
    p = SamplingParams(min_tokens=3, stop_token_ids=(8,))
    assert stop_state(EOS, 2, 10, p, {EOS}, 100) is None
    assert stop_state(8, 2, 10, p, {EOS}, 100) is None
    assert stop_state(EOS, 3, 10, p, {EOS}, 100) == RequestState.FINISHED_STOPPED
    moved = SamplingParams(min_tokens=3, max_tokens=4, step_offset=2)   # a retry's attempt
    assert stop_state(EOS, 1, 10, moved, {EOS}, 100) == RequestState.FINISHED_STOPPED


def test_a_mixed_batch_samples_each_row_as_alone():
    """One sample() over greedy, penalized, top-k, top-p, min-p and biased rows, seeded:
    every row gets the token it gets when sampled by itself."""
    logits, history = logits_and_history(8, seed=5)
    params = [SamplingParams(temperature=0),
              SamplingParams(temperature=0, repetition_penalty=1.8, logit_bias=((4, 3.0),)),
              SamplingParams(seed=1, top_k=5),
              SamplingParams(seed=2, top_p=0.6, frequency_penalty=0.9),
              SamplingParams(seed=3, min_p=0.2, presence_penalty=1.1),
              SamplingParams(seed=4, temperature=0.7, min_tokens=9),
              SamplingParams(seed=5, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=0.7),
              SamplingParams(temperature=0, min_tokens=2, logit_bias=((EOS, 50.0),))]
    steps = [0, 3, 1, 6, 2, 4, 5, 0]
    hist = [h.tolist() for h in history]
    batch = sample(logits.clone(), params, steps, hist, [EOS])
    alone = [sample(logits[i:i + 1].clone(), [params[i]], [steps[i]], [hist[i]], [EOS])[0]
             for i in range(8)]
    assert batch == alone
    assert batch[7] != EOS           # biased to it, but min_tokens forbids it yet


def test_a_penalized_row_needs_its_tokens():
    logits, _ = logits_and_history(2)
    with pytest.raises(ValueError, match="token_ids"):
        sample(logits, [SamplingParams(), SamplingParams(presence_penalty=1.0)], [0, 0],
               [None, None])


def test_logprobs_are_the_raw_log_softmax_before_any_processor():
    """engine/logprobs.py: the sampled token's logprob, its rank and the top k of its
    position, from the logits as given (vLLM's raw_logprobs), whatever the processors
    then do; rows that did not ask get None."""
    logits, history = logits_and_history(3, seed=6)
    params = [SamplingParams(temperature=0, logprobs=3, repetition_penalty=1.5),
              SamplingParams(temperature=0),
              SamplingParams(seed=9, logprobs=0, logit_bias=((4, 100.0),))]
    want = torch.log_softmax(logits, dim=-1)
    captured = logprobs.capture(logits, params)
    tokens = sample(logits, params, [0, 0, 0], history.tolist(), [EOS])
    assert tokens[2] == 4                                   # the bias decided it ...
    got = captured.of(tokens)
    assert got[1] is None
    for i in (0, 2):
        lp = got[i]
        assert lp.logprob == pytest.approx(want[i, tokens[i]].item(), abs=1e-6)  # ... not this
        assert lp.rank == int((want[i] > want[i, tokens[i]]).sum()) + 1
        top = want[i].topk(params[i].logprobs)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-6)
