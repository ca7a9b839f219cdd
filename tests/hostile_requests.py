"""Hypothesis strategies for hostile GenerateRequests, shared by the validation fuzz
(tests/unit/test_validation_fuzz.py) and the end-to-end Generate fuzz
(tests/e2e/test_fuzz_generate.py).

Every field of the proto is drawn from ordinary values, boundaries and abuse: empty,
huge and odd strings (NUL, controls, combining marks, RTL, astral emoji, special-token
spellings), NaN / ±inf / negative / subnormal floats, the extremes of each integer type,
out-of-vocabulary token ids, giant lists, and requests over gRPC's 8 MiB limit. Large
payloads are built from a few draws (a unit repeated n times), so a huge example costs
Hypothesis no more than a small one.

Each field is mostly valid and hostile in a fraction of examples, so that a request often
carries a single bad field and reaches the checks behind the first ones. Valid requests
stay cheap to serve: an explicit max_tokens is mostly 1..4, and the default (up to 256
generated tokens) is drawn rarely. Branches are picked with explicit weights (`_pick`), so
the costly ones stay rare however many examples run. Strategies are built once per model
(`generate_requests`): building them inside each draw costs Hypothesis more than the draw.

    from hostile_requests import FIELDS, generate_requests
    @given(generate_requests(vocab_size=49152, max_model_len=2048))
    def test(drawn): drawn.msg ...   # a pb.GenerateRequest
"""

from __future__ import annotations

import math

from hypothesis import strategies as st

from pdserve.engine.sampling_params import (
    MAX_LOGIT_BIAS_TOKENS,
    MAX_N,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)
from pdserve.engine.structured_output import MAX_SPEC_CHARS
from pdserve.proto import pdserve_pb2 as pb
from pdserve.router.validation import (
    MAX_MESSAGES,
    MAX_PROMPT_CHARS,
    MAX_REQUEST_ID_BYTES,
    max_prompt_chars,
)

# Every field an InvalidRequestError may name (the text before ": " in its message).
FIELDS = frozenset({
    "prompt", "text", "token_ids", "messages", "request_id",
    *(f"sampling.{f.name}" for f in pb.SamplingParams.DESCRIPTOR.fields),
})

GRPC_MAX_BYTES = 8 << 20                   # the router's default request size limit
U32_MAX = 2**32 - 1
I32_MIN, I32_MAX = -(2**31), 2**31 - 1
U64_MAX = 2**64 - 1
F32_MAX = 3.4028234663852886e38
F32_TINY = 1.401298464324817e-45           # smallest positive subnormal float32

odd_text = st.text(st.characters(codec="utf-8"), max_size=16)
special_text = st.lists(st.sampled_from(
    ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "\x00", "\ufffd", "\u202e", "😀", " ",
     "\n", "a", "\u0301", "{{ x }}", "{% raw %}"]), min_size=1, max_size=8).map("".join)
# Units whose repetition makes long strings of very different token counts: about 4
# characters per token ("a"), 1 ("一", "\x00"), or 3 tokens per character (emoji).
units = st.sampled_from(("a", "ab ", "\u4e00", "😀", " ", "\x00", "\n", "#"))
hostile_floats = st.one_of(
    st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -0.0, 1.0, -1.0, F32_TINY, -F32_TINY,
                     F32_MAX, -F32_MAX, 1e-5, 1e-6]),
    st.floats(width=32))


def _pick(draw, *weighted):
    """Draw one of (weight, strategy) pairs, then a value from it. Hypothesis favours
    small integers, so list the common (cheap) branch first."""
    k = draw(st.integers(0, sum(w for w, _ in weighted) - 1))
    for w, strategy in weighted:
        if k < w:
            return draw(strategy)
        k -= w
    raise AssertionError("unreachable")


def _around(n: int, spread: int = 1):
    """Sizes at and next to a limit n."""
    return st.integers(max(0, n - spread), n + spread)


def repeated(sizes):
    """A unit repeated n times, n drawn from `sizes`."""
    return st.tuples(units, sizes).map(lambda t: t[0] * t[1])


class Drawn:
    """A drawn GenerateRequest (`msg`) whose repr stays short however large it is, so a
    failing example prints in a few lines."""

    __slots__ = ("msg",)

    def __init__(self, msg: pb.GenerateRequest):
        self.msg = msg

    def __repr__(self) -> str:
        return describe(self.msg, limit=2000)


def describe(req: pb.GenerateRequest, limit: int = 300) -> str:
    """A short repr of a possibly huge request, for assertion messages."""
    text = repr(req)     # the text format: one line per field, strings escaped
    return text if len(text) <= limit else f"{text[:limit]}... ({req.ByteSize()} bytes)"


def generate_requests(vocab_size: int, max_model_len: int) -> st.SearchStrategy[Drawn]:
    """GenerateRequests for a model of `vocab_size` tokens and a `max_model_len` context,
    hostile in any number of fields at once."""
    n_ctx = max_model_len
    char_limit = max_prompt_chars(max_model_len)
    valid_id = st.integers(0, vocab_size - 1)
    hostile_id = st.one_of(st.sampled_from([vocab_size, vocab_size + 1, U32_MAX]),
                           st.integers(vocab_size, U32_MAX))
    over_chars = st.integers(char_limit + 1, MAX_PROMPT_CHARS + 1)
    # Strings whose UTF-8 alone exceeds gRPC's limit: refused before the router sees them.
    # Sending one takes ~0.5 s, so they are rare.
    over_grpc = st.tuples(units, st.integers(1, 4096)).map(
        lambda t: t[0] * ((GRPC_MAX_BYTES + t[1]) // len(t[0].encode()) + 1))

    # a valid id is printable (router/validation.py); odd ones that are not are bad ids
    request_id = st.one_of(st.just(""), odd_text.filter(str.isprintable))  # weights below
    # Multi-byte characters: up to the limit in characters, up to 4x over it in UTF-8 bytes.
    long_request_id = st.text(st.characters(codec="utf-8", min_codepoint=0x800),
                              min_size=MAX_REQUEST_ID_BYTES // 4, max_size=MAX_REQUEST_ID_BYTES)
    bad_request_id = st.one_of(
        st.sampled_from(["r" * MAX_REQUEST_ID_BYTES, "r" * (MAX_REQUEST_ID_BYTES + 1),
                         "😀" * (MAX_REQUEST_ID_BYTES // 4), "😀" * (MAX_REQUEST_ID_BYTES // 4 + 1),
                         "😀" * MAX_REQUEST_ID_BYTES, "é" * MAX_REQUEST_ID_BYTES, "#", "a#b",
                         "\x00", "r\nWARNING pdserve.router.attempt: forged", "\x1b[2J",
                         "a\u2028b"]),
        repeated(st.integers(MAX_REQUEST_ID_BYTES // 4, 2 << 20)),
        odd_text.filter(lambda t: not t.isprintable()))

    @st.composite
    def _texts(draw):
        return _pick(draw, (40, odd_text.filter(bool)), (15, special_text),
                     (30, repeated(st.integers(1, 2 * n_ctx))),  # both sides of the context
                     (3, st.just("")), (8, repeated(_around(char_limit))),
                     (3, repeated(over_chars)), (1, over_grpc))
    texts = _texts()

    @st.composite
    def _token_ids(draw):
        kind = _pick(draw, (55, st.just("short")), (5, st.just("empty")),
                     (20, st.just("mixed")), (18, st.just("long")), (2, st.just("giant")))
        if kind == "short":
            return draw(st.lists(valid_id, min_size=1, max_size=16))
        if kind == "empty":
            return []
        if kind == "mixed":
            return draw(st.lists(st.one_of(valid_id, hostile_id), min_size=1, max_size=16))
        # Around the context, or far beyond it (3M ids of 3 bytes: over 8 MiB).
        n = draw(st.one_of(_around(n_ctx - 1), st.integers(1, 3 * n_ctx)) if kind == "long"
                 else st.sampled_from([100_000, 3_000_000]))
        ids = [draw(valid_id)] * n
        if draw(st.booleans()):
            ids[draw(st.integers(0, n - 1))] = draw(hostile_id)
        return ids
    token_ids = _token_ids()

    message = st.builds(
        pb.ChatMessage,
        role=st.one_of(st.sampled_from(["user", "system", "assistant", "tool", "", "USER",
                                        "bogus"]), odd_text),
        content=st.one_of(odd_text, special_text))

    @st.composite
    def _chat(draw):
        kind = _pick(draw, (80, st.just("short")), (5, st.just("empty")), (5, st.just("many")),
                     (5, st.just("giant")), (5, st.just("long")))
        if kind == "short":
            return draw(st.lists(message, min_size=1, max_size=4))
        if kind == "empty":
            return []
        if kind == "many":    # the message count limit
            n = draw(_around(MAX_MESSAGES))
            return [pb.ChatMessage(role="user", content=draw(st.sampled_from(["", "hi"])))] * n
        if kind == "giant":   # a role or content at the character limit, and far beyond
            big = _pick(draw, (12, repeated(_around(char_limit))), (6, repeated(over_chars)),
                        (1, over_grpc))
            if draw(st.booleans()):
                return [pb.ChatMessage(role=big, content="x")]
            return [pb.ChatMessage(role="user", content=big)]
        # contents that reach the context together
        part = draw(repeated(st.integers(1, n_ctx // 2)))
        return [pb.ChatMessage(role="user", content=part)] * draw(st.integers(2, 6))
    chat = _chat()

    max_tokens = st.one_of(
        st.just(0),
        st.sampled_from([n_ctx, n_ctx + 1, 1 << 16, I32_MAX, I32_MAX + 1, U32_MAX]),
        st.integers(n_ctx, U32_MAX))
    scalars = {  # field: (valid, hostile)
        "temperature": (st.floats(0, 2, width=32), hostile_floats),
        "top_p": (st.floats(0, 1, exclude_min=True, width=32), hostile_floats),
        "top_k": (st.integers(0, 100), st.one_of(
            st.sampled_from([-1, 1, vocab_size, vocab_size + 1, I32_MIN, I32_MAX]),
            st.integers(I32_MIN, I32_MAX))),
        "seed": (st.integers(0, 2**63 - 1), st.one_of(
            st.sampled_from([2**63 - 1, 2**63, U64_MAX]), st.integers(0, U64_MAX))),
    }
    # the logits processors' and logprobs' fields: mostly unset, so that enough requests
    # stay valid to be served
    rare_scalars = {
        "presence_penalty": (st.floats(-2, 2, width=32), hostile_floats),
        "frequency_penalty": (st.floats(-2, 2, width=32), hostile_floats),
        "repetition_penalty": (st.floats(0.5, 2, width=32), hostile_floats),
        "min_p": (st.floats(0, 1, width=32), hostile_floats),
        "logprobs": (st.integers(0, 5), st.one_of(
            st.sampled_from([20, 21, U32_MAX]), st.integers(0, U32_MAX))),
        "min_tokens": (st.integers(0, 4), st.one_of(
            st.sampled_from([n_ctx, U32_MAX]), st.integers(0, U32_MAX))),
        "n": (st.integers(1, 4), st.one_of(
            st.sampled_from([0, MAX_N + 1, U32_MAX]), st.integers(0, U32_MAX))),
        "best_of": (st.integers(1, 5), st.one_of(
            st.sampled_from([0, MAX_N + 1, U32_MAX]), st.integers(0, U32_MAX))),
    }
    # logit_bias: ids in and beyond the vocabulary, biases in and beyond [-100, 100]
    logit_bias = st.dictionaries(
        st.one_of(st.integers(0, vocab_size - 1), st.sampled_from([vocab_size, U32_MAX])),
        st.one_of(st.floats(-100, 100, width=32), hostile_floats), max_size=6)
    logit_bias_many = st.integers(MAX_LOGIT_BIAS_TOKENS - 1, 5000).map(
        lambda n: {i: 1.0 for i in range(n)})
    # structured outputs: grammars that compile, ones that do not, odd and giant text
    structured = st.one_of(
        st.sampled_from([pb.StructuredOutputs(json='{"type": "object"}'),
                         pb.StructuredOutputs(json_object=True),
                         pb.StructuredOutputs(regex="[0-9]+"),
                         pb.StructuredOutputs(choice=pb.Choices(choices=["yes", "no"])),
                         pb.StructuredOutputs(grammar='root ::= "a"'),
                         pb.StructuredOutputs(json='{"type": 5}'),
                         pb.StructuredOutputs(regex="(("),
                         pb.StructuredOutputs(choice=pb.Choices()),
                         pb.StructuredOutputs(grammar="root ::= ")]),
        st.builds(lambda t: pb.StructuredOutputs(json=t), odd_text),
        st.builds(lambda t: pb.StructuredOutputs(regex=t), odd_text),
        st.builds(lambda t: pb.StructuredOutputs(grammar=t), odd_text),
        st.builds(lambda n: pb.StructuredOutputs(regex="a" * n), _around(MAX_SPEC_CHARS)))
    stop_short = st.lists(st.one_of(odd_text, special_text), min_size=1, max_size=4)
    stop_many = st.tuples(st.sampled_from(["x", "", "\x00", "😀"]),
                          st.one_of(_around(MAX_STOP_STRINGS), st.integers(1, 100_000))
                          ).map(lambda t: [t[0]] * t[1])
    stop_long = st.one_of(repeated(_around(MAX_STOP_STRING_CHARS)),
                          repeated(st.integers(1, MAX_PROMPT_CHARS))).map(lambda s: [s])
    # Giant list of giant strings that stays under 8 MiB: validation, not gRPC, refuses it.
    stop_both = st.integers(MAX_STOP_STRINGS, 30_000).map(
        lambda n: ["y" * MAX_STOP_STRING_CHARS] * n)
    stop_ids_short = st.lists(st.one_of(st.integers(0, vocab_size + 10), st.just(U32_MAX)),
                              min_size=1, max_size=8)
    stop_ids_long = st.tuples(st.integers(0, U32_MAX),
                              st.one_of(_around(MAX_STOP_TOKEN_IDS), st.integers(1, 1_000_000))
                              ).map(lambda t: [t[0]] * t[1])

    @st.composite
    def _sampling(draw) -> pb.SamplingParams:
        s = pb.SamplingParams()
        mt = _pick(draw, (75, st.sampled_from([1, 1, 2, 2, 3, 4])), (1, st.none()),
                   (24, max_tokens))
        if mt is not None:     # None: the default, min(256, room) tokens
            s.max_tokens = mt
        for name, (valid, hostile) in scalars.items():
            value = _pick(draw, (2, st.none()), (1, valid), (1, hostile))
            if value is not None:
                setattr(s, name, value)
        for name, (valid, hostile) in rare_scalars.items():
            value = _pick(draw, (12, st.none()), (3, valid), (1, hostile))
            if value is not None:
                setattr(s, name, value)
        s.stop.extend(_pick(draw, (50, st.just([])), (30, stop_short), (7, stop_many),
                            (7, stop_long), (6, stop_both)))
        s.stop_token_ids.extend(_pick(draw, (60, st.just([])), (30, stop_ids_short),
                                      (10, stop_ids_long)))
        s.ignore_eos = draw(st.booleans())
        s.logit_bias.update(_pick(draw, (85, st.just({})), (13, logit_bias),
                                  (2, logit_bias_many)))
        so = _pick(draw, (90, st.none()), (10, structured))
        if so is not None:
            s.structured_outputs.CopyFrom(so)
        return s
    sampling = _sampling()

    @st.composite
    def _requests(draw) -> Drawn:
        req = pb.GenerateRequest(request_id=_pick(draw, (92, request_id), (3, long_request_id),
                                                  (5, bad_request_id)))
        if _pick(draw, (99, st.just(True)), (1, st.just(False))):   # else every default
            req.sampling.CopyFrom(draw(sampling))
        kind = _pick(draw, (35, st.just("text")), (35, st.just("token_ids")),
                     (27, st.just("messages")), (3, st.none()))
        if not req.sampling.HasField("max_tokens") and _pick(draw, (19, st.just(True)),
                                                             (1, st.just(False))):
            # The default max_tokens is min(256, room): mostly leave a few tokens of room,
            # both to check that cap and because 256 tokens take seconds to serve.
            kind = None
            req.token_ids.ids.extend([draw(valid_id)] * (n_ctx - draw(st.integers(1, 8))))
        if kind == "text":
            req.text = draw(texts)
        elif kind == "token_ids":
            req.token_ids.SetInParent()      # set even when empty: an empty prompt, not none
            req.token_ids.ids.extend(draw(token_ids))
        elif kind == "messages":
            req.messages.SetInParent()
            req.messages.messages.extend(draw(chat))
        return Drawn(req)     # built here, not by .map: Hypothesis would print map's input

    return _requests()
