"""Relaying a decode worker's token events to the client: detokenized responses with
stop strings and usage (Relay), one relay per sample of the request (sampling.n)."""

from __future__ import annotations

from collections.abc import Container, Sequence

from ..engine.logprobs import TokenLogprobs
from ..engine.request import TokenEvent
from ..engine.sampling_params import InvalidRequestError, SamplingParams
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

    `index`: the sample it relays (GenerateResponse.index). `emit_logprobs`: whether
    the client asked for the logprobs the events carry (best_of asks for them to rank
    the samples by `cumulative_logprob`, the sum of their tokens' logprobs).
    """

    def __init__(self, request_id: str, detok: Detokenizer, prompt_token_ids: list[int],
                 params: SamplingParams, eos_token_ids: Container[int], max_model_len: int,
                 index: int = 0, emit_logprobs: bool = True):
        self.request_id, self.detok, self.index = request_id, detok, index
        self.emit_logprobs = emit_logprobs
        self.cumulative_logprob = 0.0
        self.prompt_logprobs: Sequence[TokenLogprobs] | None = None  # received from P
        self._prompt_pending = False     # ... and not yet sent
        self.prompt_token_ids, self.prompt_len = prompt_token_ids, len(prompt_token_ids)
        self.params, self.eos_token_ids, self.max_model_len = params, eos_token_ids, max_model_len
        self.token_ids: list[int] = []   # every token streamed to the client
        self.finish_reason: str | None = None
        self.stopped_here = False    # ended by the router, not by D's finish event: D may
                                     # still hold the request (abort it)
        self.error: str | None = None    # the attempt failed on D (the router retries)

    def resume(self, token_ids: list[int]) -> None:
        """Count `token_ids` as streamed already (GenerateRequest.resume_token_ids: the
        client had them from a try it lost): the detokenizer and the stop rule advance
        over them, nothing is sent for them, and no prompt logprobs are asked again.

        Raises:
            InvalidRequestError: they already end the stream (a stop token, a stop
                string, the context).
        """
        self.absorb([TokenEvent(self.request_id, tuple(token_ids))])
        if self.finish_reason is not None:
            raise InvalidRequestError("resume_token_ids", "the stream already ended at "
                                                          f"them ({self.finish_reason})")
        self.prompt_logprobs = ()

    def set_prompt_logprobs(self, entries: Sequence[TokenLogprobs]) -> None:
        """The prefill worker's prompt logprobs (one per prompt token after the first),
        sent with this sample's next response."""
        self.prompt_logprobs, self._prompt_pending = entries, True

    def absorb(self, events: list[TokenEvent]) -> pb.GenerateResponse | None:
        """The response for `events` (None when they carry nothing to send). Tokens past
        the one that ended the stream are dropped."""
        tokens, text, logprobs = [], [], []
        for ev in events:
            for j, t in enumerate(ev.token_ids):
                tokens.append(t)
                if ev.logprobs and ev.logprobs[j] is not None:
                    self.cumulative_logprob += ev.logprobs[j].logprob
                    if self.emit_logprobs:
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
        if not tokens and self.finish_reason is None:
            return None
        msg = pb.GenerateResponse(request_id=self.request_id, token_ids=tokens,
                                  text="".join(text), logprobs=logprobs, index=self.index)
        if self._prompt_pending:
            msg.prompt_logprobs.extend(self._prompt_logprobs(self.prompt_logprobs))
            self._prompt_pending = False
        if self.finish_reason is not None:
            msg.finish_reason = self.finish_reason
            msg.usage.CopyFrom(pb.Usage(prompt_tokens=self.prompt_len,
                                        completion_tokens=len(self.token_ids)))
        return msg

    def _prompt_logprobs(self, entries: Sequence[TokenLogprobs]) -> list[pb.TokenLogprob]:
        """One per prompt token: the first without a logprob, then the prefill worker's."""
        ids = self.prompt_token_ids
        first = pb.TokenLogprob(token_id=ids[0], token=self.detok.token_text(ids[0]))
        return [first] + [self._logprob(t, lp) for t, lp in zip(ids[1:], entries, strict=True)]

    def _logprob(self, token_id: int, lp: TokenLogprobs) -> pb.TokenLogprob:
        text = self.detok.token_text
        return pb.TokenLogprob(
            token_id=token_id, logprob=lp.logprob, rank=lp.rank, token=text(token_id),
            top_logprobs=[pb.TopLogprob(token_id=t, logprob=v, token=text(t)) for t, v in lp.top])
