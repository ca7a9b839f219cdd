"""Relaying a decode worker's token stream to the client: detokenized responses with
stop strings and usage (Relay), each wait bounded by the request's deadline."""

from __future__ import annotations

import asyncio
import time

from ..engine.request import TokenEvent
from ..proto import pdserve_pb2 as pb
from .detokenizer import Detokenizer


class Relay:
    """Turns decode TokenEvents into GenerateResponses: detokenizes, applies stop
    strings, counts usage; `finish_reason` is set once the request is over."""

    def __init__(self, request_id: str, detok: Detokenizer, prompt_len: int):
        self.request_id, self.detok, self.prompt_len = request_id, detok, prompt_len
        self.token_ids: list[int] = []   # every token streamed to the client
        self.finish_reason: str | None = None
        self.stopped_here = False    # a stop string matched on the router: D still runs
        self.error: str | None = None    # the attempt failed on D (the router retries)

    def finish(self, reason: str) -> pb.GenerateResponse:
        """The last message, with no new tokens."""
        self.finish_reason = reason
        return pb.GenerateResponse(
            request_id=self.request_id, text=self.detok.flush(), finish_reason=reason,
            usage=pb.Usage(prompt_tokens=self.prompt_len, completion_tokens=len(self.token_ids)))

    def absorb(self, events: list[TokenEvent]) -> pb.GenerateResponse | None:
        tokens, text = [], []
        for ev in events:
            for t in ev.token_ids:
                tokens.append(t)
                delta = self.detok.step(t)
                text.append(delta.text)
                if delta.stopped:
                    self.finish_reason, self.stopped_here = "stop", True
                    break
            if self.finish_reason is None and ev.finish_reason == "error":
                self.error = ev.error or "unknown error"
                break
            if self.finish_reason is None and ev.finish_reason is not None:
                self.finish_reason = ev.finish_reason
                text.append(self.detok.flush())
            if self.finish_reason is not None:
                break
        self.token_ids += tokens
        if self.finish_reason is not None:
            return pb.GenerateResponse(
                request_id=self.request_id, token_ids=tokens, text="".join(text),
                finish_reason=self.finish_reason,
                usage=pb.Usage(prompt_tokens=self.prompt_len,
                               completion_tokens=len(self.token_ids)))
        if not tokens:
            return None
        return pb.GenerateResponse(request_id=self.request_id, token_ids=tokens, text="".join(text))


async def with_deadline(gen, deadline: float):
    """Iterate a Ray ObjectRefGenerator, each wait bounded by the request deadline."""
    it = gen.__aiter__()
    while True:
        try:
            ref = await asyncio.wait_for(it.__anext__(), timeout=max(deadline - time.monotonic(), 0.001))
        except StopAsyncIteration:
            return
        yield ref
