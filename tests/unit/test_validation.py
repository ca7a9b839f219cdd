"""router/validation.py: GenerateRequest (real proto) → prompt ids + SamplingParams.

The tokenizer is a stand-in (one id per character), so no model files are read.
"""

import math

import pytest

from pdserve.engine.sampling_params import DEFAULT_MAX_TOKENS, InvalidRequestError
from pdserve.proto import pdserve_pb2 as pb
from pdserve.router import validation
from pdserve.router.validation import prompt_token_ids, request_id, sampling_params

VOCAB = 100
MAX_MODEL_LEN = 32


class FakeTokenizer:
    """Just what validation uses: __call__, chat_template, apply_chat_template."""

    def __init__(self, chat_template="{{ messages }}", template_error=None):
        self.chat_template = chat_template
        self.template_error = template_error
        self.chat_calls = []

    def __call__(self, text):
        return {"input_ids": [ord(c) % VOCAB for c in text]}

    def apply_chat_template(self, conv, add_generation_prompt=False, tokenize=False):
        self.chat_calls.append((conv, add_generation_prompt, tokenize))
        if self.template_error is not None:
            raise self.template_error
        ids = [1]
        for m in conv:
            ids += [2] + self(m["content"])["input_ids"]
        return ids + [3] if add_generation_prompt else ids


def ids_of(req, tok=None, max_model_len=MAX_MODEL_LEN):
    return prompt_token_ids(req, tok or FakeTokenizer(), VOCAB, max_model_len)


def expect_invalid(fn, field, *in_message):
    with pytest.raises(InvalidRequestError) as ei:
        fn()
    assert ei.value.field == field, ei.value
    for s in in_message:
        assert s in str(ei.value), str(ei.value)
    return ei.value


# --- prompt ------------------------------------------------------------------------------

def test_text_prompt_is_tokenized():
    assert ids_of(pb.GenerateRequest(text="abc")) == [97 % VOCAB, 98 % VOCAB, 99 % VOCAB]


def test_token_ids_prompt_is_passed_through():
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[0, 5, VOCAB - 1]))
    assert ids_of(req) == [0, 5, VOCAB - 1]


def test_no_prompt():
    expect_invalid(lambda: ids_of(pb.GenerateRequest()), "prompt", "text", "token_ids", "messages")


def test_empty_text():
    expect_invalid(lambda: ids_of(pb.GenerateRequest(text="")), "text", "empty", "0 tokens")


def test_empty_token_ids():
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[]))
    assert req.WhichOneof("prompt") == "token_ids"
    expect_invalid(lambda: ids_of(req), "token_ids", "0 tokens")


def test_text_too_many_characters(monkeypatch):
    monkeypatch.setattr(validation, "MAX_PROMPT_CHARS", 10)
    expect_invalid(lambda: ids_of(pb.GenerateRequest(text="x" * 11)), "text", "at most 10", "11")


@pytest.mark.parametrize("bad", [VOCAB, VOCAB + 1, 2**32 - 1])
def test_token_id_out_of_vocab(bad):
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, bad, 2]))
    expect_invalid(lambda: ids_of(req), "token_ids", str(bad), f"{VOCAB} tokens")


def test_prompt_at_context_length_is_rejected():
    ok = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * (MAX_MODEL_LEN - 1)))
    assert len(ids_of(ok)) == MAX_MODEL_LEN - 1
    for n in (MAX_MODEL_LEN, MAX_MODEL_LEN + 5):
        req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * n))
        expect_invalid(lambda: ids_of(req), "token_ids", f"{n} tokens", f"{MAX_MODEL_LEN} tokens")
    expect_invalid(lambda: ids_of(pb.GenerateRequest(text="y" * MAX_MODEL_LEN)), "text",
                   str(MAX_MODEL_LEN))


def test_messages_use_chat_template_with_generation_prompt():
    tok = FakeTokenizer()
    req = pb.GenerateRequest(messages=pb.ChatMessages(messages=[
        pb.ChatMessage(role="system", content="s"), pb.ChatMessage(role="user", content="hi")]))
    out = ids_of(req, tok)
    assert out == [1, 2, ord("s") % VOCAB, 2, ord("h") % VOCAB, ord("i") % VOCAB, 3]
    (conv, add_gen, tokenize), = tok.chat_calls
    assert conv == [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
    assert add_gen and tokenize


def test_messages_empty():
    req = pb.GenerateRequest(messages=pb.ChatMessages())
    assert req.WhichOneof("prompt") == "messages"
    expect_invalid(lambda: ids_of(req), "messages", "at least one")


def test_messages_without_chat_template():
    req = pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="a")]))
    expect_invalid(lambda: ids_of(req, FakeTokenizer(chat_template=None)), "messages", "chat template")


def test_messages_rejected_by_template():
    req = pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="bogus", content="a")]))
    tok = FakeTokenizer(template_error=ValueError("roles must alternate"))
    err = expect_invalid(lambda: ids_of(req, tok), "messages", "roles must alternate")
    assert isinstance(err.__cause__, ValueError)


def test_too_many_messages(monkeypatch):
    monkeypatch.setattr(validation, "MAX_MESSAGES", 2)
    req = pb.GenerateRequest(messages=pb.ChatMessages(
        messages=[pb.ChatMessage(role="user", content="a")] * 3))
    expect_invalid(lambda: ids_of(req), "messages", "at most 2", "3")


class NeverTokenizer(FakeTokenizer):
    """Fails the test if validation tokenizes: the request must be refused before."""

    def __call__(self, text):
        raise AssertionError(f"tokenized {len(text)} characters")

    def apply_chat_template(self, conv, **kw):
        raise AssertionError("rendered the chat template")


def test_character_limit_scales_with_the_context():
    # Found by the fuzz: 1M emoji (under the old flat 1M-character limit) are 3M tokens,
    # ~10 s of tokenizing on the router for a prompt that could never fit the context.
    limit = validation.MAX_CHARS_PER_TOKEN * MAX_MODEL_LEN
    assert validation.max_prompt_chars(MAX_MODEL_LEN) == limit < validation.MAX_PROMPT_CHARS
    assert validation.max_prompt_chars(1 << 30) == validation.MAX_PROMPT_CHARS
    expect_invalid(lambda: ids_of(pb.GenerateRequest(text="😀" * (limit + 1)), NeverTokenizer()),
                   "text", f"at most {limit} characters", f"{MAX_MODEL_LEN} tokens",
                   str(limit + 1))
    # At the limit it is tokenized (and here refused for its tokens, not its characters),
    # its first prefix being enough to tell.
    tok = SizesTokenizer(1)
    first = validation.PREFIX_CHARS_PER_TOKEN * MAX_MODEL_LEN
    expect_invalid(lambda: ids_of(pb.GenerateRequest(text="a" * limit), tok), "text",
                   f"over {first - validation.CUT_MARGIN} tokens in its first {first} characters",
                   f"{MAX_MODEL_LEN} tokens")
    assert tok.sizes == [first]


class SizesTokenizer(FakeTokenizer):
    """One id per `chars` characters; records the length of every text it tokenizes."""

    def __init__(self, chars: int):
        super().__init__()
        self.chars, self.sizes = chars, []

    def __call__(self, text):
        self.sizes.append(len(text))
        return {"input_ids": [7] * -(-len(text) // self.chars)}


def test_a_long_text_is_tokenized_by_doubling_prefixes_while_they_fit():
    """Prefixes from PREFIX_CHARS_PER_TOKEN characters a context token, doubling, then
    the whole text once they all fit: 8 characters a token, 300 characters are 38 tokens
    (over the 32-token context by the whole, not by a prefix) and 500 at one a token go
    over at the first prefix; a text up to the first prefix's length is tokenized once."""
    first = validation.PREFIX_CHARS_PER_TOKEN * MAX_MODEL_LEN       # 128 characters
    tok = SizesTokenizer(8)
    expect_invalid(lambda: ids_of(pb.GenerateRequest(text="a" * 300), tok), "text",
                   "prompt has 38 tokens")
    assert tok.sizes == [first, 2 * first, 300]
    tok = SizesTokenizer(1)
    expect_invalid(lambda: ids_of(pb.GenerateRequest(text="a" * 500), tok), "text",
                   f"first {first} characters")
    assert tok.sizes == [first]
    tok = SizesTokenizer(8)
    assert ids_of(pb.GenerateRequest(text="a" * first), tok) == [7] * 16 and tok.sizes == [first]


def test_chat_roles_count_toward_the_character_limit():
    # Found by the fuzz: only contents were counted, so a 1M-character role went through
    # the chat template and the tokenizer.
    limit = validation.max_prompt_chars(MAX_MODEL_LEN)
    req = pb.GenerateRequest(messages=pb.ChatMessages(messages=[
        pb.ChatMessage(role="r" * limit, content="x")]))
    expect_invalid(lambda: ids_of(req, NeverTokenizer()), "messages",
                   f"at most {limit} characters", str(limit + 1))
    req.messages.messages[0].role = "r" * (limit - 1)    # at the limit: rendered
    assert ids_of(req) == [1, 2, ord("x") % VOCAB, 3]


# --- sampling -------------------------------------------------------------------------------

def sp(prompt_len=10, max_model_len=MAX_MODEL_LEN, **sampling):
    return sampling_params(pb.GenerateRequest(text="x", sampling=pb.SamplingParams(**sampling)),
                           prompt_len, max_model_len)


def test_sampling_defaults():
    p = sp(prompt_len=10, max_model_len=4096)
    assert p.max_tokens == DEFAULT_MAX_TOKENS
    assert p.temperature == 1.0 and p.top_p == 1.0 and p.top_k == 0 and p.seed is None
    assert p.stop == () and p.stop_token_ids == () and not p.ignore_eos


def test_default_max_tokens_is_capped_by_room():
    assert sp(prompt_len=10, max_model_len=MAX_MODEL_LEN).max_tokens == MAX_MODEL_LEN - 10
    assert sp(prompt_len=MAX_MODEL_LEN - 1).max_tokens == 1
    assert sp(prompt_len=100, max_model_len=100 + DEFAULT_MAX_TOKENS).max_tokens == DEFAULT_MAX_TOKENS


def test_explicit_max_tokens_that_fits():
    assert sp(prompt_len=10, max_tokens=MAX_MODEL_LEN - 10).max_tokens == MAX_MODEL_LEN - 10


def test_explicit_max_tokens_beyond_context():
    expect_invalid(lambda: sp(prompt_len=10, max_tokens=MAX_MODEL_LEN - 9), "sampling.max_tokens",
                   str(MAX_MODEL_LEN - 9), "10 prompt tokens", f"{MAX_MODEL_LEN} tokens")


def test_explicit_max_tokens_zero():
    expect_invalid(lambda: sp(max_tokens=0), "sampling.max_tokens", ">= 1")


def test_fields_are_carried_over():
    p = sp(max_tokens=5, temperature=0.5, top_p=0.75, top_k=7, seed=42, stop=["END", "\n\n"],
           stop_token_ids=[9, 10], ignore_eos=True)
    assert p.max_tokens == 5 and p.temperature == 0.5 and p.top_p == 0.75 and p.top_k == 7
    assert p.seed == 42 and p.stop == ("END", "\n\n") and p.stop_token_ids == (9, 10)
    assert p.ignore_eos
    assert sp(temperature=0.0).greedy


@pytest.mark.parametrize("name", ["temperature", "top_p"])
def test_nan_is_rejected(name):
    expect_invalid(lambda: sp(**{name: math.nan}), f"sampling.{name}", "NaN")


@pytest.mark.parametrize("kw, field", [
    (dict(temperature=math.inf), "sampling.temperature"),
    (dict(temperature=-0.5), "sampling.temperature"),
    (dict(top_p=0.0), "sampling.top_p"),
    (dict(top_p=1.5), "sampling.top_p"),
    (dict(top_k=-1), "sampling.top_k"),
    (dict(seed=2**63), "sampling.seed"),
    (dict(stop=[""]), "sampling.stop"),
    (dict(stop_token_ids=list(range(65))), "sampling.stop_token_ids"),
])
def test_out_of_range_values_reach_sampling_params_checks(kw, field):
    expect_invalid(lambda: sp(**kw), field)


# --- request_id ---------------------------------------------------------------------------------

def test_request_id():
    assert request_id(pb.GenerateRequest()) is None
    assert request_id(pb.GenerateRequest(request_id="abc")) == "abc"
    assert request_id(pb.GenerateRequest(request_id="r" * 128)) == "r" * 128


def test_request_id_too_long():
    expect_invalid(lambda: request_id(pb.GenerateRequest(request_id="r" * 129)), "request_id",
                   "at most 128")


def test_request_id_limit_is_in_utf8_bytes():
    # Found by the fuzz: 128 emoji passed a 128-character limit, but with the router's
    # "#" + 8 hex suffix they are 521 bytes, over what a KV frame carries (256): the decode
    # worker's reserve raised ValueError and the call failed with a status other than
    # INVALID_ARGUMENT.
    assert request_id(pb.GenerateRequest(request_id="😀" * 32)) == "😀" * 32   # 128 bytes
    expect_invalid(lambda: request_id(pb.GenerateRequest(request_id="😀" * 33)), "request_id",
                   "at most 128 bytes UTF-8", "got 132")


def test_a_request_id_that_is_not_printable_is_refused():
    """It names the request in every log line of the request: a newline in it would
    forge a log line, an escape sequence rewrite a terminal."""
    for rid in ("a\nWARNING pdserve.router: forged", "x\r", "\t", "\x1b[2J", "a\u2028b",
                "\x00", "\x7f"):
        expect_invalid(lambda: request_id(pb.GenerateRequest(request_id=rid)), "request_id",
                       "printable characters only")
    for rid in ("req-1 #2", "é😀", "a/b:c"):
        assert request_id(pb.GenerateRequest(request_id=rid)) == rid


def test_request_id_limit_fits_a_kv_frame():
    from pdserve.kv_transfer.base import MAX_REQUEST_ID_BYTES as KV_FRAME_LIMIT

    from pdserve.request_ids import attempt_id

    longest = attempt_id("r" * validation.MAX_REQUEST_ID_BYTES, 999) + "/99999"  # a sample's
    assert len(longest.encode()) <= KV_FRAME_LIMIT


def test_cache_salt_goes_with_the_sampling_params_and_is_bounded():
    req = pb.GenerateRequest(cache_salt="s3cr3t")
    assert sampling_params(req, 10, 100).cache_salt == "s3cr3t"
    assert sampling_params(pb.GenerateRequest(), 10, 100).cache_salt == ""
    assert sampling_params(req, 10, 100).sample(1).cache_salt == "s3cr3t"   # n > 1
    expect_invalid(lambda: sampling_params(pb.GenerateRequest(cache_salt="x" * 257), 10, 100),
                   "cache_salt", "at most 256 bytes")
