"""OpenAI API request bodies -> pdserve.v1: the bodies of /v1/completions and
/v1/chat/completions (pydantic) and their conversion into a GenerateRequest (the
response, stream-chunk and error shapes are openai_responses.py; http_api.py serves
both).

Names follow OpenAI's API reference, and vLLM's `entrypoints/openai/protocol.py` where
pdserve extends it (`top_k`, `min_p`, `repetition_penalty`, `min_tokens`,
`stop_token_ids`, `ignore_eos`). A parameter OpenAI has that pdserve does not serve
(tools, suffix) is refused with 400 naming it, never dropped silently; so
is one OpenAI does not have (OpenAI does the same). Range checks stay in validation.py / SamplingParams, shared with gRPC: this module
checks only what the proto's types cannot hold (a negative max_tokens in a uint32, a
lone surrogate in a string).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict

from ..engine.sampling_params import MAX_N, InvalidRequestError
from ..proto import pdserve_pb2 as pb

UINT32_MAX = (1 << 32) - 1
INT32_MAX = (1 << 31) - 1


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool | None = None   # a last chunk with empty choices and the usage
    # vLLM's extension (guidellm sends it): accepted, but usage still comes only in that
    # last chunk
    continuous_usage_stats: bool | None = None


class _Common(BaseModel):
    """The parameters both endpoints take."""
    model_config = ConfigDict(extra="forbid")   # unknown parameters: 400, as OpenAI does

    model: str | None = None        # any value is accepted; responses name the served model
    max_tokens: int | None = None   # generated tokens (default: SamplingParams')
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None        # extension (vLLM): 0 or -1 disables
    seed: int | None = None
    stop: Any = None                # a string or a list of strings (checked in to_request)
    n: int | None = None            # choices: samples of one prefill (SamplingParams.n)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = False  # extension (vLLM): generate max_tokens tokens
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # extension (vLLM)
    min_p: float | None = None      # extension (vLLM)
    min_tokens: int | None = None   # extension (vLLM)
    stop_token_ids: list[int] | None = None  # extension (vLLM)
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias
    # Structured output, one way of: OpenAI's response_format ({"type": "text" |
    # "json_object" | "json_schema", "json_schema": {"name", "schema", "strict"}}),
    # vLLM's structured_outputs ({"json" | "regex" | "choice" | "grammar" |
    # "json_object": ...}) or its older guided_json / guided_regex / guided_choice /
    # guided_grammar.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    user: str | None = None         # OpenAI's end-user id: ignored, unless the router maps
                                    # it to the cache salt (cache_salt_from_user)
    cache_salt: str | None = None   # extension (vLLM): GenerateRequest.cache_salt


class CompletionRequest(_Common):
    prompt: Any                     # text, token ids, or a list holding one of either
    echo: bool | None = None        # the prompt before the completion (and its logprobs)
    best_of: int | None = None      # samples drawn, the n best returned; not streamed
    logprobs: int | None = None     # top logprobs per token (0: the sampled one's only)
    suffix: str | None = None       # unset only


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")   # tool_calls, audio, ...: 400

    role: str                       # "developer" is served as "system" (OpenAI's meaning)
    content: Any = None             # a string, or a list of {"type": "text", "text": ...}
    name: str | None = None         # accepted; chat templates do not render it


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None   # OpenAI's newer name; wins over max_tokens
    logprobs: bool | None = None    # each token's logprob (and top_logprobs of them)
    top_logprobs: int | None = None
    tools: list[Any] | None = None  # none only
    tool_choice: Any = None         # unset or "none" only
    parallel_tool_calls: bool | None = None  # accepted (no tools, so no effect)


# Parameters pdserve does not serve: (accepted when, what to do instead).
_UNSERVED = {
    "suffix": (lambda v: v is None, "suffix (insertion) is not supported"),
    "tools": (lambda v: not v, "tools (function calling) are not supported"),
    "tool_choice": (lambda v: v in (None, "none"), "tools (function calling) are not "
                                                  "supported"),
}


def to_request(body: CompletionRequest | ChatCompletionRequest,
               request_id: str, salt_from_user: bool = False) -> pb.GenerateRequest:
    """The GenerateRequest that `body` asks for; its cache_salt is body.cache_salt, or
    with `salt_from_user` (RouterConfig.cache_salt_from_user) the body's `user`.

    Raises:
        InvalidRequestError: a parameter pdserve does not serve, or a value the proto
            cannot carry; `field` is the OpenAI parameter (e.g. "messages[0].content").
    """
    for name, (served, hint) in _UNSERVED.items():
        if name in type(body).model_fields and not served(getattr(body, name)):
            raise InvalidRequestError(name, f"got {getattr(body, name)!r}; {hint}")
    if body.stream_options is not None and not body.stream:
        raise InvalidRequestError("stream_options", "only allowed when stream is true")
    req = pb.GenerateRequest(request_id=request_id)
    salt = body.cache_salt if body.cache_salt is not None else (
        body.user if salt_from_user else None)
    if salt:
        req.cache_salt = salt
    if isinstance(body, ChatCompletionRequest):
        _set_messages(req, body.messages)
    else:
        _set_prompt(req, body.prompt)
    s = req.sampling
    _set_sampling(s, body)
    _set_token_lists(s, body)
    return req


def _set_sampling(s: pb.SamplingParams, body) -> None:
    """max_tokens, the sampler's knobs, n / best_of, stop strings, logprobs and the
    structured output, each checked against what the proto carries."""
    param, max_tokens = max_tokens_param(body), body.max_tokens
    if param == "max_completion_tokens":
        max_tokens = body.max_completion_tokens
    if max_tokens is not None:
        if max_tokens < 1:      # the message SamplingParams gives; uint32 cannot hold < 0
            raise InvalidRequestError(param, f"must be >= 1, got {max_tokens}")
        if max_tokens > UINT32_MAX:
            raise InvalidRequestError(param, f"{max_tokens} exceeds any model's context")
        s.max_tokens = max_tokens     # beyond this model's context: validation says so
    if body.temperature is not None:
        s.temperature = body.temperature
    if body.top_p is not None:
        s.top_p = body.top_p
    if body.top_k is not None:
        if body.top_k < -1:
            raise InvalidRequestError("top_k", f"must be >= 0 (0 or -1 disables), got "
                                               f"{body.top_k}")
        s.top_k = min(max(body.top_k, 0), INT32_MAX)   # more than the vocabulary: all of it
    if body.seed is not None:
        if not 0 <= body.seed < 1 << 63:
            raise InvalidRequestError("seed", f"must be in [0, 2^63), got {body.seed}")
        s.seed = body.seed
    for name in ("n", "best_of"):
        v = getattr(body, name, None)
        if v is not None:
            if not 1 <= v <= MAX_N:     # the proto's uint32 cannot hold < 0
                raise InvalidRequestError(name, f"must be in [1, {MAX_N}], got {v}")
            setattr(s, name, v)
    if body.stream and getattr(body, "best_of", None) not in (None, body.n or 1):
        raise InvalidRequestError("best_of", "must equal n when stream is true: best_of "
                                             "ranks its samples once they have ended")
    s.stop.extend(_stop(body.stop))
    s.ignore_eos = bool(body.ignore_eos)
    _set_logprobs(s, body)
    _set_structured(s.structured_outputs, body)
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"):
        if getattr(body, name) is not None:
            setattr(s, name, getattr(body, name))


def _set_token_lists(s: pb.SamplingParams, body) -> None:
    """min_tokens, stop_token_ids and logit_bias: token ids within uint32."""
    if body.min_tokens is not None:
        if not 0 <= body.min_tokens <= UINT32_MAX:
            raise InvalidRequestError("min_tokens", f"must be >= 0, got {body.min_tokens}")
        s.min_tokens = body.min_tokens
    for t in body.stop_token_ids or ():
        if not 0 <= t <= UINT32_MAX:
            raise InvalidRequestError("stop_token_ids", f"token id {t} is out of range")
        s.stop_token_ids.append(t)
    for key, bias in (body.logit_bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise InvalidRequestError("logit_bias", f"key {key[:32]!r} is not a token id") from None
        if not 0 <= token <= UINT32_MAX:
            raise InvalidRequestError("logit_bias", f"token id {token} is out of range")
        s.logit_bias[token] = bias


def _set_structured(so: pb.StructuredOutputs, body) -> None:
    """The request's structured output, from whichever parameter names it (at most one;
    the router parses its grammar and refuses what does not parse)."""
    asked = {}           # parameter -> (kind, value)
    rf = body.response_format
    if rf is not None:
        kind = rf.get("type")
        if kind == "json_object":
            asked["response_format"] = ("json_object", True)
        elif kind == "json_schema":
            schema = (rf.get("json_schema") or {}).get("schema")
            if not isinstance(schema, (dict, bool)):
                raise InvalidRequestError("response_format", "json_schema.schema must be a "
                                                             "JSON schema object")
            asked["response_format"] = ("json", schema)
        elif kind != "text":
            raise InvalidRequestError("response_format", f"type must be text, json_object or "
                                                         f"json_schema, got {kind!r}")
    if body.structured_outputs:
        kinds = [k for k, v in body.structured_outputs.items() if v not in (None, False)]
        if len(kinds) != 1 or kinds[0] not in ("json", "json_object", "regex", "choice",
                                               "grammar"):
            raise InvalidRequestError("structured_outputs", "set exactly one of json, "
                                      f"json_object, regex, choice, grammar; got {kinds}")
        asked["structured_outputs"] = (kinds[0], body.structured_outputs[kinds[0]])
    for name in ("json", "regex", "choice", "grammar"):
        if getattr(body, f"guided_{name}") is not None:
            asked[f"guided_{name}"] = (name, getattr(body, f"guided_{name}"))
    if len(asked) > 1:
        raise InvalidRequestError(sorted(asked)[1], f"only one structured output per request; "
                                                    f"got {', '.join(sorted(asked))}")
    for param, (kind, value) in asked.items():
        if kind == "json_object":
            so.json_object = True
        elif kind == "json":
            so.json = value if isinstance(value, str) else json.dumps(value)
        elif kind == "choice":
            if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
                raise InvalidRequestError(param, "choice must be a list of strings")
            so.choice.choices.extend(_utf8(param, c) for c in value)
        elif not isinstance(value, str):
            raise InvalidRequestError(param, f"{kind} must be a string")
        else:
            setattr(so, kind, _utf8(param, value))


def _set_logprobs(s: pb.SamplingParams, body) -> None:
    """Completions' `logprobs: k`, chat's `logprobs: true` + `top_logprobs: k`."""
    if isinstance(body, ChatCompletionRequest):
        if body.top_logprobs is not None and not body.logprobs:
            raise InvalidRequestError("top_logprobs", "only allowed when logprobs is true")
        k = (body.top_logprobs or 0) if body.logprobs else None
        param = "top_logprobs"
    else:
        k, param = body.logprobs, "logprobs"
    if k is not None:
        if not 0 <= k <= UINT32_MAX:
            raise InvalidRequestError(param, f"must be >= 0, got {k}")
        s.logprobs = k
        if getattr(body, "echo", False):     # the prompt's too (lm-eval's loglikelihood)
            s.prompt_logprobs = k


def wants_logprobs(body) -> bool:
    """Whether the response carries logprobs (the request asked for them)."""
    return bool(body.logprobs) if isinstance(body, ChatCompletionRequest) else (
        body.logprobs is not None)


def echo_text(body, tokenizer) -> str | None:
    """The prompt text a completions request with `echo` puts before its completion (the
    prompt as sent, or its token ids decoded); None without echo."""
    if not getattr(body, "echo", False):
        return None
    prompt = body.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else tokenizer.decode(prompt)


def max_tokens_param(body) -> str:
    """The parameter that bounds the output: max_completion_tokens when a chat request
    sets it (it wins, as at OpenAI), else max_tokens."""
    if getattr(body, "max_completion_tokens", None) is not None:
        return "max_completion_tokens"
    return "max_tokens"


def openai_param(field: str, body) -> str | None:
    """The OpenAI parameter for an InvalidRequestError's `field`: the proto's names
    (validation.py: "sampling.top_p", "text", "messages") mapped back; None for the
    request as a whole."""
    chat = isinstance(body, ChatCompletionRequest)
    if field == "sampling.max_tokens":
        return max_tokens_param(body)
    if field == "sampling.logprobs" and chat:
        return "top_logprobs"
    if field.startswith("sampling."):
        return field.removeprefix("sampling.")
    if field in ("text", "token_ids", "prompt", "messages"):
        return "messages" if chat else "prompt"
    if field in ("request", "request_id"):
        return None
    return field                  # already an OpenAI parameter (this module's)


def _utf8(param: str, text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:   # JSON can carry lone surrogates ("\ud800")
        raise InvalidRequestError(param, f"not valid Unicode text ({e.reason} at "
                                         f"character {e.start})") from None
    return text


def _set_prompt(req: pb.GenerateRequest, prompt: Any) -> None:
    if (isinstance(prompt, list) and len(prompt) == 1
            and isinstance(prompt[0], (str, list))):
        prompt = prompt[0]        # a batch of one prompt
    if isinstance(prompt, str):
        req.text = _utf8("prompt", prompt)
    elif isinstance(prompt, list) and all(type(t) is int for t in prompt):
        bad = next((t for t in prompt if not 0 <= t <= UINT32_MAX), None)
        if bad is not None:
            raise InvalidRequestError("prompt", f"token id {bad} is out of range (ids are "
                                                "in [0, vocabulary size))")
        req.token_ids.SetInParent()   # an empty list is still a token prompt (refused: empty)
        req.token_ids.ids.extend(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise InvalidRequestError("prompt", f"a batch of {len(prompt)} prompts: pdserve serves "
                                            "one prompt per request; send them separately")
    else:
        raise InvalidRequestError("prompt", "must be a string, a list of token ids, or a list "
                                            "holding one of either")


def _set_messages(req: pb.GenerateRequest, messages: list[ChatMessage]) -> None:
    req.messages.SetInParent()    # no message: the router says at least one is required
    for i, m in enumerate(messages):
        role = "system" if m.role == "developer" else m.role
        req.messages.messages.add(role=_utf8(f"messages[{i}].role", role),
                                  content=_content(f"messages[{i}].content", m.content))


def _content(param: str, content: Any) -> str:
    """A message's text: a string, or its text parts joined by newlines (as vLLM does)."""
    if isinstance(content, str):
        return _utf8(param, content)
    if not isinstance(content, list):
        raise InvalidRequestError(param, "must be a string or a list of text parts "
                                         "({\"type\": \"text\", \"text\": ...})")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind != "text" or not isinstance(part.get("text"), str):
            raise InvalidRequestError(f"{param}[{j}]", f"only text parts ({{\"type\": \"text\", "
                                                      f"\"text\": ...}}) are supported, got "
                                                      f"{kind!r}")
        texts.append(_utf8(f"{param}[{j}].text", part["text"]))
    return "\n".join(texts)


def _stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise InvalidRequestError("stop", "must be a string or a list of strings")
    return [_utf8("stop", s) for s in stops]
