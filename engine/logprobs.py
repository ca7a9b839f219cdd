"""Log-probabilities of sampled tokens (SamplingParams.logprobs).

Values are "raw logprobs", vLLM's default `logprobs_mode`: log-softmax of the model's
logits as the sampler receives them, before the logits processors, the temperature and
the top-k / top-p / min-p filters, so they equal transformers' `log_softmax` of the same
model's logits (fp32). A structured output's grammar mask comes first, as in vLLM (its
model runner applies the bitmask before the sampler): forbidden tokens get -inf and
the rest are renormalized among the allowed. They are taken from the rows that ask for them, before sample()
edits the logits in place::

    captured = capture(logits, params)       # [rows asking, vocab] log-softmax, a copy
    tokens = sample(logits, params, ...)
    entries = captured.of(tokens)            # one TokenLogprobs (or None) per row
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .sampling_params import SamplingParams

if TYPE_CHECKING:       # messages.py carries TokenLogprobs to the router, which has no torch
    import torch


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """One sampled token's log-probability (natural log), its rank among its position's
    tokens (1: the most likely), and the `top` (token id, logprob) pairs of the position,
    most likely first (SamplingParams.logprobs of them)."""

    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


class Captured:
    """Log-softmax of the rows of a batch that asked for logprobs; see the module."""

    def __init__(self, rows: list[int], num_top: list[int], logprobs: torch.Tensor,
                 batch: int) -> None:
        self.rows, self.num_top, self.logprobs, self.batch = rows, num_top, logprobs, batch

    def of(self, tokens: Sequence[int]) -> list[TokenLogprobs | None]:
        """Per row of the batch, the TokenLogprobs of ``tokens[row]`` (None for a row
        that did not ask)."""
        out: list[TokenLogprobs | None] = [None] * self.batch
        if not self.rows:
            return out
        import torch

        lp = self.logprobs                                          # [m, vocab]
        picked = torch.tensor([tokens[i] for i in self.rows], device=lp.device)
        chosen = lp.gather(1, picked[:, None])                      # [m, 1]
        ranks = (lp > chosen).sum(dim=1) + 1
        k = max(self.num_top)
        top_lp, top_ids = lp.topk(k, dim=1) if k else (lp[:, :0], lp[:, :0].long())
        chosen, ranks = chosen[:, 0].tolist(), ranks.tolist()
        top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
        for j, i in enumerate(self.rows):
            n = self.num_top[j]
            out[i] = TokenLogprobs(chosen[j], ranks[j],
                                   tuple(zip(top_ids[j][:n], top_lp[j][:n])))
        return out


def capture(logits: torch.Tensor, params: Sequence[SamplingParams]) -> Captured:
    """Log-softmax [rows asking, vocab] float32 of the rows of ``logits`` [batch, vocab]
    whose params ask for logprobs (a copy: sample() may then edit ``logits``)."""
    import torch

    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    lp = (torch.log_softmax(logits[rows].float(), dim=-1) if rows
          else logits.new_empty(0, logits.shape[-1]))
    return Captured(rows, [params[i].logprobs for i in rows], lp, len(params))


def of_targets(compute_logits, hidden: torch.Tensor, targets: Sequence[int], num_top: int,
               chunk: int = 256) -> list[TokenLogprobs]:
    """TokenLogprobs of ``targets[j]`` at the position whose final hidden state is
    ``hidden[j]`` ([len(targets), hidden_size]): prompt logprobs. ``compute_logits`` is
    the model's LM head (hidden -> [n, vocab] float32), run ``chunk`` positions at a time
    so a long prompt never holds its whole [n, vocab] logits."""
    out: list[TokenLogprobs] = []
    for start in range(0, len(targets), chunk):
        logits = compute_logits(hidden[start:start + chunk])
        params = [SamplingParams(logprobs=num_top)] * logits.shape[0]
        out += capture(logits, params).of(list(targets[start:start + chunk]))
    return out
