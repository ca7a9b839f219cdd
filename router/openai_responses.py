"""OpenAI API response shapes built from GenerateResponses (pdserve.v1): completion and
chat completion bodies, stream chunks, the logprobs objects, and the error body
(http_api.py serves them; the request side is openai_protocol.py). Shapes follow
OpenAI's API reference, and vLLM's where pdserve serves its extensions."""

from __future__ import annotations

from typing import NamedTuple

from ..proto import pdserve_pb2 as pb


def logprobs_body(entries, chat: bool, offset: int = 0) -> dict:
    """OpenAI's `logprobs` object of a choice (or of one stream chunk) for ``entries``
    (pb.TokenLogprob). Completions: tokens, token_logprobs, top_logprobs ({token:
    logprob}) and text_offset (characters into the completion, from ``offset``). Chat:
    content, one {token, logprob, bytes, top_logprobs} per token."""
    if chat:
        return {"content": [
            {"token": e.token, "logprob": e.logprob, "bytes": list(e.token.encode()),
             "top_logprobs": [{"token": t.token, "logprob": t.logprob,
                               "bytes": list(t.token.encode())} for t in e.top_logprobs]}
            for e in entries]}
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    # the first prompt token (echo) has no logprob: null, as OpenAI and vLLM give it
    has = [e.HasField("logprob") for e in entries]
    return {"tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob if h else None for e, h in zip(entries, has)],
            # the sampled token's too (OpenAI's legacy completions and vLLM): k + 1 at most
            "top_logprobs": [{t.token: t.logprob for t in e.top_logprobs} | {e.token: e.logprob}
                             if h else None for e, h in zip(entries, has)],
            "text_offset": offsets}



def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class Choice(NamedTuple):
    """One sample's whole answer: its text, finish_reason, and logprobs body or None."""
    text: str
    finish_reason: str
    logprobs: dict | None = None


def completion(rid: str, created: int, model: str, choices: list[Choice],
               u: dict) -> dict:
    """A text_completion body; `u` is usage() over every choice."""
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": i, "text": c.text, "logprobs": c.logprobs,
                         "finish_reason": c.finish_reason} for i, c in enumerate(choices)],
            "usage": u}


def chat_completion(rid: str, created: int, model: str, choices: list[Choice],
                    u: dict) -> dict:
    """A chat.completion body; `u` is usage() over every choice."""
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": i, "message": {"role": "assistant", "content": c.text},
                         "logprobs": c.logprobs, "finish_reason": c.finish_reason}
                        for i, c in enumerate(choices)],
            "usage": u}


class ChunkWriter:
    """The stream chunks of one request, message by message, for each choice (its
    `index`): text deltas, then a chunk with its finish_reason; once every one of the
    `n` choices has ended and with stream_options.include_usage, one chunk with empty
    choices and the usage of them all. A chat choice's chunks open with one carrying
    the assistant role; a completions choice's, with echo, with the prompt."""

    def __init__(self, rid: str, created: int, model: str, chat: bool, include_usage: bool,
                 logprobs: bool = False, echo: str | None = None, n: int = 1):
        self.head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": created, "model": model}
        self.chat, self.include_usage, self.logprobs = chat, include_usage, logprobs
        self.offset: dict[int, int] = {}   # choice -> characters sent (text_offset); opened
        self.echo = echo      # completions: the prompt text, sent before the first token
        self.n, self.ended, self.completion_tokens = n, 0, 0

    def _chunk(self, index: int, delta: dict | str, finish_reason: str | None,
               entries=()) -> dict:
        choice = {"index": index} | ({"delta": delta} if self.chat else {"text": delta})
        lp = None
        if self.logprobs and entries:
            lp = logprobs_body(entries, self.chat, self.offset[index])
        choice |= {"logprobs": lp, "finish_reason": finish_reason}
        return self.head | {"choices": [choice]} | ({"usage": None} if self.include_usage
                                                    else {})

    def chunks(self, msg: pb.GenerateResponse) -> list[dict]:
        out, i = [], msg.index
        if i not in self.offset:
            self.offset[i] = 0
            if self.chat:
                out.append(self._chunk(i, {"role": "assistant", "content": ""}, None))
            if self.echo is not None:
                out.append(self._chunk(i, self.echo, None, msg.prompt_logprobs))
                self.offset[i] += sum(len(e.token) for e in msg.prompt_logprobs)
        if msg.text or (self.logprobs and msg.logprobs):
            out.append(self._chunk(i, {"content": msg.text} if self.chat else msg.text, None,
                                   msg.logprobs))
            self.offset[i] += sum(len(e.token) for e in msg.logprobs)
        if msg.finish_reason:
            out.append(self._chunk(i, {} if self.chat else "", msg.finish_reason))
            self.ended += 1
            self.completion_tokens += msg.usage.completion_tokens
            if self.include_usage and self.ended == self.n:
                out.append(self.head | {"choices": [], "usage": usage(
                    msg.usage.prompt_tokens, self.completion_tokens)})
        return out


def error_body(message: str, type_: str, param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
