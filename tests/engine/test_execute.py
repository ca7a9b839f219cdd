"""ModelRunner.execute: one SchedulerOutput in, one ModelRunnerOutput out. A step of a
decode row, a whole prompt and a prompt's first chunk gives the tokens that prefill and
decode calls give one by one (greedy), nothing for the chunk, the logprobs asked for, a
copied block first; a row whose generated tokens break its grammar fails alone."""

from dataclasses import dataclass, field
from typing import Any

import torch
from tiny_models import tiny_model_dir

from pdserve.engine.config import CacheConfig
from pdserve.engine.model_runner import DecodeSeq, ModelRunner, PrefillSeq
from pdserve.engine.outputs import SchedulerOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.structured_output import StructuredOutput

BS = 4
GREEDY = SamplingParams(temperature=0.0)


@dataclass(eq=False)
class Req:
    """A StepRequest (engine/outputs.py) with prompt + output tokens."""

    request_id: str
    prompt: list[int]
    block_table: list[int]
    num_computed_tokens: int = 0
    output: list[int] = field(default_factory=list)
    params: SamplingParams = GREEDY
    grammar: Any = None
    matcher: Any = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output)

    def token_id(self, i: int) -> int:
        return (self.prompt + self.output)[i]

    def token_ids(self, end: int) -> list[int]:
        return (self.prompt + self.output)[:end]


def runner() -> ModelRunner:
    return ModelRunner(tiny_model_dir("llama"), CacheConfig(num_blocks=32, block_size=BS))


def test_a_mixed_step_gives_what_prefill_and_decode_give_row_by_row():
    r = runner()
    vocab = r.config.vocab_size
    run_prompt = [i * 5 % vocab for i in range(6)]
    r.prefill([PrefillSeq(run_prompt, [0, 1])])
    running = Req("run", run_prompt, [0, 1], num_computed_tokens=6, output=[17],
                  params=SamplingParams(temperature=0.0, logprobs=2))
    whole = Req("whole", [i * 3 % vocab for i in range(7)], [2, 3])
    chunked = Req("chunked", [i * 11 % vocab for i in range(12)], [4, 5, 6])
    out = SchedulerOutput((running, whole, chunked), (1, 7, 8))
    got = r.execute(out)

    want_d = r.decode([DecodeSeq(17, 6, [0, 1])])          # the same K/V, written again
    want_p = r.prefill([PrefillSeq(whole.prompt, [2, 3])])
    assert got.sampled_token_ids == (int(want_d.argmax()), int(want_p.argmax()), None)
    assert got.errors == (None, None, None) and got.prompt_logprobs == (None, None, None)
    lp = got.logprobs[0]
    assert lp is not None and got.logprobs[1:] == (None, None)
    assert lp.rank == 1 and len(lp.top) == 2 and lp.top[0][0] == got.sampled_token_ids[0]
    torch.testing.assert_close(torch.tensor(lp.logprob), torch.log_softmax(want_d[0], -1).max(),
                               rtol=0, atol=1e-5)


def test_blocks_are_copied_before_the_forward_and_prompt_logprobs_come_per_row():
    r = runner()
    vocab = r.config.vocab_size
    prompt = [i * 7 % vocab for i in range(5)]
    r.prefill([PrefillSeq(prompt, [0, 1])])
    # block 1 (tokens 4..) copied to block 9: a row reading [0, 9] sees the same context
    forked = Req("forked", prompt, [0, 9], num_computed_tokens=5, output=[3])
    asking = Req("asking", prompt, [2, 3],
                 params=SamplingParams(temperature=0.0, prompt_logprobs=1))
    got = r.execute(SchedulerOutput((forked, asking), (1, 5), blocks_to_copy=((1, 9),)))
    want = r.decode([DecodeSeq(3, 5, [0, 1])])
    assert got.sampled_token_ids[0] == int(want.argmax())
    assert got.prompt_logprobs[0] is None
    assert len(got.prompt_logprobs[1]) == len(prompt) - 1   # each token after the first


def test_a_row_whose_tokens_break_its_grammar_fails_alone():
    r = runner()
    vocab = r.config.vocab_size
    grammar = SamplingParams(temperature=0.0, step_offset=1,
                             structured_outputs=StructuredOutput("choice", '["yes", "no"]'))
    # step_offset 1: the prompt's last token was generated on another worker, and "x"
    # starts neither "yes" nor "no"
    x = r.tokenizer("x", add_special_tokens=False)["input_ids"][0]
    prompt = [i * 13 % vocab for i in range(4)] + [x]
    bad = Req("bad", prompt, [0, 1], params=grammar)
    good = Req("good", prompt, [2, 3])
    got = r.execute(SchedulerOutput((bad, good), (5, 5)))
    assert got.sampled_token_ids[0] is None and got.errors[0]
    assert got.sampled_token_ids[1] is not None and got.errors[1] is None
