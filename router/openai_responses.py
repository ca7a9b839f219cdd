"""OpenAI API response shapes built from GenerateResponses (pdserve.v1): completion and
chat completion bodies, stream chunks, the logprobs objects, and the error body
(http_api.py serves them; the request side is openai_protocol.py). Shapes follow
OpenAI's API reference, and vLLM's where pdserve serves its extensions."""

from __future__ import annotations

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



def usage(u: pb.Usage) -> dict:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens}


def completion(rid: str, created: int, model: str, text: str, finish_reason: str,
               u: pb.Usage, logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs,
                         "finish_reason": finish_reason}],
            "usage": usage(u)}


def chat_completion(rid: str, created: int, model: str, text: str, finish_reason: str,
                    u: pb.Usage, logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": logprobs, "finish_reason": finish_reason}],
            "usage": usage(u)}


class ChunkWriter:
    """The stream chunks of one request, message by message: text deltas, then a chunk
    with the finish_reason, then (stream_options.include_usage) one with empty choices
    and the usage. Chat streams open with a chunk carrying the assistant role."""

    def __init__(self, rid: str, created: int, model: str, chat: bool, include_usage: bool,
                 logprobs: bool = False, echo: str | None = None):
        self.head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": created, "model": model}
        self.chat, self.include_usage, self.logprobs = chat, include_usage, logprobs
        self.opened = False
        self.offset = 0       # characters of completion text sent (text_offset)
        self.echo = echo      # completions: the prompt text, sent before the first token

    def _chunk(self, delta: dict | str, finish_reason: str | None, entries=()) -> dict:
        choice = ({"index": 0, "delta": delta} if self.chat else {"index": 0, "text": delta})
        lp = None
        if self.logprobs and entries:
            lp = logprobs_body(entries, self.chat, self.offset)
        choice |= {"logprobs": lp, "finish_reason": finish_reason}
        return self.head | {"choices": [choice]} | ({"usage": None} if self.include_usage
                                                    else {})

    def chunks(self, msg: pb.GenerateResponse) -> list[dict]:
        out = []
        if self.chat and not self.opened:
            out.append(self._chunk({"role": "assistant", "content": ""}, None))
        if self.echo is not None and not self.opened:
            out.append(self._chunk(self.echo, None, msg.prompt_logprobs))
            self.offset += sum(len(e.token) for e in msg.prompt_logprobs)
        self.opened = True
        if msg.text or (self.logprobs and msg.logprobs):
            out.append(self._chunk({"content": msg.text} if self.chat else msg.text, None,
                                   msg.logprobs))
            self.offset += sum(len(e.token) for e in msg.logprobs)
        if msg.finish_reason:
            out.append(self._chunk({} if self.chat else "", msg.finish_reason))
            if self.include_usage:
                out.append(self.head | {"choices": [], "usage": usage(msg.usage)})
        return out


def error_body(message: str, type_: str, param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
