"""GenerateRequest (proto) → prompt token ids + SamplingParams, validated.

Every rejection is an InvalidRequestError naming the field and the limit; the server
turns it into INVALID_ARGUMENT.
"""

from __future__ import annotations

import json
import math

from ..engine.sampling_params import DEFAULT_MAX_TOKENS, InvalidRequestError, SamplingParams
from ..engine.structured_output import StructuredOutput, grammar

MAX_PROMPT_CHARS = 1 << 20      # characters of text/messages accepted before tokenizing
# ... and at most this many per token of the model's context. English averages ~4
# characters per token and code ~3, so 16 over a whole context is no longer text. The bound
# keeps tokenizing (on the router: ~3 us per token, up to 3 tokens per character) in
# proportion to what the model can take: 1M emoji are 3M tokens, ~10 s of tokenizer.
MAX_CHARS_PER_TOKEN = 16
# A text of more characters than this many per token of the context is tokenized by
# prefixes first (_encode_within), refused at the first prefix whose tokens exceed the
# context by more than CUT_MARGIN (where the cut may have split a word or a special token).
PREFIX_CHARS_PER_TOKEN = 4
CUT_MARGIN = 64
MAX_MESSAGES = 1024
# UTF-8 bytes, not characters: the router appends its tag (pdserve/request_ids.py), and a KV frame
# carries at most 256 bytes of request id (kv_transfer/base.py MAX_REQUEST_ID_BYTES).
MAX_REQUEST_ID_BYTES = 128


def max_prompt_chars(max_model_len: int) -> int:
    """Most characters of text (or of chat roles and contents) tokenized for a model
    whose context is `max_model_len` tokens."""
    return min(MAX_PROMPT_CHARS, MAX_CHARS_PER_TOKEN * max_model_len)


def _check_chars(field: str, chars: int, max_model_len: int) -> None:
    limit = max_prompt_chars(max_model_len)
    if chars > limit:
        raise InvalidRequestError(field, f"at most {limit} characters for the model's context of "
                                         f"{max_model_len} tokens, got {chars}")


def prompt_chars(req) -> int:
    """The size of the request's prompt as the tokenizer queue orders it: characters of
    text, or of chat roles and contents; token ids count one each."""
    kind = req.WhichOneof("prompt")
    if kind == "text":
        return len(req.text)
    if kind == "messages":
        return sum(len(m.role) + len(m.content) for m in req.messages.messages)
    return len(req.token_ids.ids) if kind == "token_ids" else 0


def _encode_within(tokenizer, text: str, max_model_len: int) -> list[int]:
    """tokenizer(text)'s ids. A text longer than PREFIX_CHARS_PER_TOKEN characters per
    token of the context is tokenized by prefixes of doubling length from there first,
    and refused once one holds more tokens than the context: a prompt far over the
    context costs about twice the tokens of the prefix that overflowed it, not its own
    (up to 3 tokens a character: 1M emoji would be ~10 s of tokenizer).

    Raises:
        InvalidRequestError: a prefix's tokens exceed max_model_len + CUT_MARGIN.
    """
    n = PREFIX_CHARS_PER_TOKEN * max_model_len
    while n < len(text):
        k = len(tokenizer(text[:n])["input_ids"])
        if k > max_model_len + CUT_MARGIN:
            raise InvalidRequestError("text", f"prompt has over {k - CUT_MARGIN} tokens in "
                                              f"its first {n} characters; the model's context "
                                              f"is {max_model_len} tokens")
        n *= 2
    return tokenizer(text)["input_ids"]


def prompt_token_ids(req, tokenizer, vocab_size: int, max_model_len: int) -> list[int]:
    """Token ids of the request's prompt (text, token_ids, or chat messages).

    Raises:
        InvalidRequestError: no prompt, empty prompt, invalid token id, prompt too long.
    """
    kind = req.WhichOneof("prompt")
    if kind is None:
        raise InvalidRequestError("prompt", "set one of text, token_ids or messages")
    if kind == "text":
        _check_chars("text", len(req.text), max_model_len)
        ids = _encode_within(tokenizer, req.text, max_model_len)
    elif kind == "token_ids":
        ids = list(req.token_ids.ids)
        bad = next((t for t in ids if t >= vocab_size), None)
        if bad is not None:
            raise InvalidRequestError("token_ids", f"token id {bad} is out of range: the "
                                                   f"vocabulary has {vocab_size} tokens")
    else:
        msgs = req.messages.messages
        if not msgs:
            raise InvalidRequestError("messages", "at least one message is required")
        if len(msgs) > MAX_MESSAGES:
            raise InvalidRequestError("messages", f"at most {MAX_MESSAGES} messages, got {len(msgs)}")
        # Roles count too: the chat template renders them into the text it tokenizes.
        _check_chars("messages", sum(len(m.role) + len(m.content) for m in msgs), max_model_len)
        if tokenizer.chat_template is None:
            raise InvalidRequestError("messages", "this model has no chat template; send text")
        conv = [{"role": m.role, "content": m.content} for m in msgs]
        try:
            out = tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
        except Exception as e:  # jinja raises for roles/orders a template rejects
            raise InvalidRequestError("messages", f"chat template rejected them: {e}") from e
        ids = list(out["input_ids"] if hasattr(out, "keys") else out)
    if not ids:
        raise InvalidRequestError(kind, "prompt is empty (0 tokens)")
    if len(ids) >= max_model_len:
        raise InvalidRequestError(kind, f"prompt has {len(ids)} tokens; the model's context is "
                                        f"{max_model_len} tokens, leaving none to generate")
    return ids


def sampling_params(req, prompt_len: int, max_model_len: int,
                    vocab_size: int | None = None, check_grammar: bool = False
                    ) -> SamplingParams:
    """SamplingParams from the request's `sampling` message (defaults as in vLLM).

    max_tokens defaults to min(256, room left in the context); an explicit value that does
    not fit is an error, not a silent cut. With `vocab_size`, logit_bias token ids must
    be in [0, vocab_size); with `check_grammar`, structured_outputs' grammar must parse
    (structured_output.grammar: milliseconds, no vocabulary; workers compile it).
    Raises:
        InvalidRequestError: a parameter out of range (message names it and the limit).
    """
    s = req.sampling
    room = max_model_len - prompt_len
    if s.HasField("max_tokens"):
        if s.max_tokens > room:
            raise InvalidRequestError(
                "sampling.max_tokens", f"{s.max_tokens} + {prompt_len} prompt tokens exceeds the "
                                       f"model's context of {max_model_len} tokens")
        max_tokens = s.max_tokens
    else:
        max_tokens = min(DEFAULT_MAX_TOKENS, room)
    floats = {name: float(getattr(s, name)) if s.HasField(name) else default
              for name, default in (("temperature", 1.0), ("top_p", 1.0),
                                    ("presence_penalty", 0.0), ("frequency_penalty", 0.0),
                                    ("repetition_penalty", 1.0), ("min_p", 0.0))}
    for name, v in floats.items():
        if math.isnan(v):
            raise InvalidRequestError(f"sampling.{name}", "is NaN")
    if vocab_size is not None:
        bad = min((t for t in s.logit_bias if t >= vocab_size), default=None)  # map order varies
        if bad is not None:
            raise InvalidRequestError("sampling.logit_bias", f"token id {bad} is out of range: "
                                      f"the vocabulary has {vocab_size} tokens")
    return SamplingParams(
        max_tokens=max_tokens, top_k=s.top_k if s.HasField("top_k") else 0,
        seed=s.seed if s.HasField("seed") else None,
        stop=tuple(s.stop), stop_token_ids=tuple(s.stop_token_ids), ignore_eos=s.ignore_eos,
        min_tokens=s.min_tokens if s.HasField("min_tokens") else 0,
        logit_bias=tuple(sorted(s.logit_bias.items())),
        logprobs=s.logprobs if s.HasField("logprobs") else None,
        prompt_logprobs=s.prompt_logprobs if s.HasField("prompt_logprobs") else None,
        structured_outputs=_structured(s, check_grammar),
        n=s.n if s.HasField("n") else 1, best_of=s.best_of if s.HasField("best_of") else None,
        cache_salt=req.cache_salt, **floats)


def _structured(s, check_grammar: bool) -> StructuredOutput | None:
    kind = s.structured_outputs.WhichOneof("kind") if s.HasField("structured_outputs") else None
    if kind is None:
        return None
    value = getattr(s.structured_outputs, kind)
    spec = ("" if kind == "json_object" else json.dumps(list(value.choices)) if kind == "choice"
            else value)
    so = StructuredOutput(kind, spec)
    if check_grammar:
        try:
            grammar(so)
        except ValueError as e:
            raise InvalidRequestError("sampling.structured_outputs", str(e)) from None
    return so


def resume_token_ids(req, params: SamplingParams, prompt_len: int, vocab_size: int,
                     max_model_len: int) -> list[int]:
    """The tokens a resumed stream already delivered (GenerateRequest.resume_token_ids).

    Raises:
        InvalidRequestError: with n > 1 or best_of, as many as max_tokens or more, an
            id outside the vocabulary, or prompt + them past the model's context.
    """
    ids = list(req.resume_token_ids)
    if not ids:
        return ids
    if params.num_samples > 1:
        raise InvalidRequestError("resume_token_ids", "a stream of one sample only "
                                                      "(sampling.n = 1, no best_of)")
    if len(ids) >= params.max_tokens:
        raise InvalidRequestError("resume_token_ids", f"{len(ids)} tokens; at most "
                                                      f"max_tokens - 1 = {params.max_tokens - 1}")
    bad = next((t for t in ids if t >= vocab_size), None)
    if bad is not None:
        raise InvalidRequestError("resume_token_ids", f"token id {bad} is out of range: the "
                                                      f"vocabulary has {vocab_size} tokens")
    if prompt_len + len(ids) >= max_model_len:
        raise InvalidRequestError("resume_token_ids", f"prompt ({prompt_len}) + {len(ids)} "
                                                      "tokens fill the model's context of "
                                                      f"{max_model_len}")
    return ids


def request_id_on_wire(data: bytes) -> None:
    """Refuse a serialized GenerateRequest whose request_id (field 1) is over
    MAX_REQUEST_ID_BYTES, from the field's length prefix, before the bytes are parsed:
    an 8 MiB id then costs the router no parsed copy and no str of it (4 such requests
    in flight held ~100 MB otherwise). Only the top-level fields are walked (a tag and a
    length each: the prompt's tokens are one packed field); bytes it cannot walk are
    left to the parser, which names what is wrong.

    Raises:
        InvalidRequestError: a request_id field longer than MAX_REQUEST_ID_BYTES bytes.
    """
    view, pos, end = memoryview(data), 0, len(data)

    def varint(i: int) -> tuple[int, int]:
        """(value, next position); position past `end` when truncated."""
        value = shift = 0
        while i < end and shift < 64:
            b = view[i]
            value |= (b & 0x7F) << shift
            i, shift = i + 1, shift + 7
            if not b & 0x80:
                return value, i
        return 0, end + 1

    while pos < end:
        tag, pos = varint(pos)
        field, wire = tag >> 3, tag & 7
        if wire == 0:
            _, pos = varint(pos)
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        elif wire == 2:
            n, pos = varint(pos)
            if field == 1 and n > MAX_REQUEST_ID_BYTES and pos <= end:
                raise InvalidRequestError(
                    "request_id", f"at most {MAX_REQUEST_ID_BYTES} bytes UTF-8, got {n}")
            pos += n
        else:                           # groups: the parser's to judge
            return


def request_id(req) -> str | None:
    """The client's request_id, or None to generate one. It names the request in every
    log line of its request (pdserve/tracing.py RequestInLogs), so it holds printable
    characters only (str.isprintable: no newline, tab, escape or other control or
    separator character, which would forge or hide log lines).

    Raises:
        InvalidRequestError: over MAX_REQUEST_ID_BYTES bytes of UTF-8, or a character
            that is not printable."""
    rid = req.request_id
    if len(rid) > MAX_REQUEST_ID_BYTES:     # as many bytes at least: refused uncopied
        raise InvalidRequestError("request_id", f"at most {MAX_REQUEST_ID_BYTES} bytes UTF-8, "
                                                f"got {len(rid)} characters")
    n = len(rid.encode("utf-8"))
    if n > MAX_REQUEST_ID_BYTES:
        raise InvalidRequestError("request_id", f"at most {MAX_REQUEST_ID_BYTES} bytes UTF-8, "
                                                f"got {n}")
    if not rid.isprintable():
        bad = next(c for c in rid if not c.isprintable())
        raise InvalidRequestError("request_id", f"printable characters only, got {bad!r} "
                                                f"at {rid.index(bad)}")
    return rid or None
