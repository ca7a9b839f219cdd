"""Relaying a decode worker's token events to the client: detokenized responses with
stop strings and usage (Relay)."""

from __future__ import annotations

from collections.abc import Container

from ..engine.logprobs import TokenLogprobs
from ..engine.request import TokenEvent
from ..engine.sampling_params import SamplingParams
from ..engine.stop import stop_state
from ..proto import pdserve_pb2 as pb
from .detokenizer import Detokenizer


class Relay:
    """Turns token events into GenerateResponses: detokenizes, applies stop strings and
    the token-level stop rule (engine/stop.py, the one D applies), counts usage;
    `finish_reason` is set once the request is over.

    Because the relay applies the same rule to every token it streams, a stream whose
    last token ended it (an EOS first token from P, a stop token id, max_tokens) is
    finished here even when D's finish event never arrives (D died): the router never
    retries a stream that had already ended.
    """

    def __init__(self, request_id: str, detok: Detokenizer, prompt_len: int,
                 params: SamplingParams, eos_token_ids: Container[int], max_model_len: int):
        self.request_id, self.detok, self.prompt_len = request_id, detok, prompt_len
        self.params, self.eos_token_ids, self.max_model_len = params, eos_token_ids, max_model_len
        self.token_ids: list[int] = []   # every token streamed to the client
        self.finish_reason: str | None = None
        self.stopped_here = False    # ended by the router, not by D's finish event: D may
                                     # still hold the request (abort it)
        self.error: str | None = None    # the attempt failed on D (the router retries)

    def absorb(self, events: list[TokenEvent]) -> pb.GenerateResponse | None:
        """The response for `events` (None when they carry nothing to send). Tokens past
        the one that ended the stream are dropped."""
        tokens, text, logprobs = [], [], []
        for ev in events:
            for j, t in enumerate(ev.token_ids):
                tokens.append(t)
                if ev.logprobs and ev.logprobs[j] is not None:
                    logprobs.append(self._logprob(t, ev.logprobs[j]))
                delta = self.detok.step(t)
                text.append(delta.text)
                if delta.stopped:        # a stop string: the held-back text is dropped
                    self.finish_reason, self.stopped_here = "stop", True
                    break
                n = len(self.token_ids) + len(tokens)
                state = stop_state(t, n, self.prompt_len + n, self.params,
                                   self.eos_token_ids, self.max_model_len)
                if state is not None:
                    self.finish_reason = state.finish_reason
                    self.stopped_here = ev.finish_reason is None   # D has not said so
                    text.append(self.detok.flush())
                    break
            if self.finish_reason is None and ev.finish_reason == "error":
                self.error = ev.error or "unknown error"
                break
            if self.finish_reason is None and ev.finish_reason is not None:
                self.finish_reason = ev.finish_reason    # cancelled on D
                text.append(self.detok.flush())
            if self.finish_reason is not None:
                break
        self.token_ids += tokens
        if self.finish_reason is not None:
            return pb.GenerateResponse(
                request_id=self.request_id, token_ids=tokens, text="".join(text),
                finish_reason=self.finish_reason, logprobs=logprobs,
                usage=pb.Usage(prompt_tokens=self.prompt_len,
                               completion_tokens=len(self.token_ids)))
        if not tokens:
            return None
        return pb.GenerateResponse(request_id=self.request_id, token_ids=tokens,
                                   text="".join(text), logprobs=logprobs)

    def _logprob(self, token_id: int, lp: TokenLogprobs) -> pb.TokenLogprob:
        text = self.detok.token_text
        return pb.TokenLogprob(
            token_id=token_id, logprob=lp.logprob, rank=lp.rank, token=text(token_id),
            top_logprobs=[pb.TopLogprob(token_id=t, logprob=v, token=text(t)) for t, v in lp.top])
