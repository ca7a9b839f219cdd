"""Logits processors: what the sampler does to a batch's logits before it picks.

In vLLM v1's order (vllm/v1/sample/sampler.py), each over the whole batch at once (one
tensor op per processor for every row that uses it, never a loop of tensor ops per
request):

1. ``min_tokens``: EOS (unless ignore_eos) and stop_token_ids get -inf while fewer than
   min_tokens tokens were generated (transformers' MinNewTokensLengthLogitsProcessor).
2. ``logit_bias``: each (token, bias) pair added to that token's logit (OpenAI's).
3. Penalties over the tokens so far (vLLM's apply_penalties):
   ``repetition_penalty`` r > 0 for every token in prompt or output: a logit l becomes
   l / r when l > 0, else l * r (transformers' RepetitionPenaltyLogitsProcessor, CTRL,
   Keskar et al. 2019); ``frequency_penalty`` f and ``presence_penalty`` p over the
   output's counts c: l - f * c - p * (c > 0) (OpenAI's definition).

Greedy rows take the argmax of the result. Sampled rows are then divided by their
temperature, and ``min_p`` (apply_min_p) drops every token whose probability is below
min_p times the top token's, before top-k and top-p (vLLM's order; transformers applies
MinPLogitsWarper after them).

"Output" is every token generated for the request, also those generated before a retry
moved it (SamplingParams.step_offset): the router resends them as the tail of the prompt.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Collection, Sequence

import torch

from .sampling_params import SamplingParams


def apply(logits: torch.Tensor, params: Sequence[SamplingParams], steps: Sequence[int],
          token_ids: Sequence[Sequence[int] | None] | None,
          eos_token_ids: Collection[int]) -> None:
    """Apply min_tokens, logit_bias and the penalties to ``logits`` in place.

    logits: [batch, vocab] float32, contiguous, any device. params[i], steps[i] (tokens generated here
    so far, as sample() takes them) and token_ids[i] (prompt + output so far, needed only
    where params[i].penalized; else may be None) belong to row i.
    Raises ValueError when a penalized row has no token_ids."""
    vocab = logits.shape[-1]
    rows, cols, values = [], [], []             # one index_put_ for min_tokens and bias
    for i, p in enumerate(params):
        if p.min_tokens > p.step_offset + steps[i]:
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
            stops = [t for t in stops if 0 <= t < vocab]
            rows += [i] * len(stops)
            cols += stops
            values += [-math.inf] * len(stops)
    if rows:
        _put(logits, rows, cols, values, accumulate=False)
    rows, cols, values = [], [], []
    for i, p in enumerate(params):
        for t, b in p.logit_bias:
            rows.append(i)
            cols.append(t)
            values.append(b)
    if rows:
        _put(logits, rows, cols, values, accumulate=True)
    penalized = [i for i, p in enumerate(params) if p.penalized]
    if penalized:
        if token_ids is None or any(token_ids[i] is None for i in penalized):
            raise ValueError("rows with a penalty need their token_ids")
        _apply_penalties(logits, penalized, [params[i] for i in penalized],
                         [steps[i] for i in penalized], [token_ids[i] for i in penalized])


def apply_min_p(logits: torch.Tensor, temps: torch.Tensor, min_ps: torch.Tensor) -> None:
    """Set to -inf, in place, every logit of ``logits`` [n, vocab] whose token's
    probability at temperature temps[i] [n] is below min_ps[i] [n] times the row's top
    one; min_ps[i] == 0 keeps the row. In log space, unscaled: l < max(l) + T log(min_p),
    so neither a softmax nor a scaled copy."""
    threshold = logits.amax(dim=-1) + temps * min_ps.log()       # log 0 = -inf
    logits.masked_fill_(logits < threshold[:, None], -math.inf)


def _put(logits: torch.Tensor, rows: list[int], cols: list[int], values: list[float],
         accumulate: bool) -> None:
    dev = logits.device
    logits.index_put_((torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)),
                      torch.tensor(values, dtype=logits.dtype, device=dev), accumulate=accumulate)


def _keys(seqs: list[Sequence[int]], rows: list[int], vocab: int,
          device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat index row * vocab + token of every token of seqs[k], in row rows[k];
    which k each came from), both [total tokens] int64."""
    lengths = torch.tensor([len(s) for s in seqs])
    which = torch.repeat_interleave(torch.arange(len(seqs)), lengths)
    tokens = torch.tensor(list(itertools.chain.from_iterable(seqs)), dtype=torch.long)
    keys = torch.tensor(rows, dtype=torch.long)[which] * vocab + tokens
    return keys.to(device), which.to(device)


def _apply_penalties(logits: torch.Tensor, rows: list[int], params: list[SamplingParams],
                     steps: list[int], token_ids: list[Sequence[int]]) -> None:
    """Sparse: only the (row, token) entries of tokens so far are read and written (a
    prompt of a few thousand tokens per row, not a [batch, vocab] mask)."""
    dev, vocab = logits.device, logits.shape[-1]
    flat = logits.view(-1)                        # logits is contiguous [batch, vocab]
    num_output = [p.step_offset + s for p, s in zip(params, steps)]
    rep = [k for k, p in enumerate(params) if p.repetition_penalty != 1.0]
    if rep:                                       # every token of prompt + output, once
        keys, which = _keys([token_ids[k] for k in rep], [rows[k] for k in rep], vocab, dev)
        keys, first = _unique(keys, which)
        penalty = torch.tensor([params[k].repetition_penalty for k in rep], device=dev)[first]
        seen = flat[keys]
        flat[keys] = torch.where(seen > 0, seen / penalty, seen * penalty)
    out = [k for k, p in enumerate(params)
           if (p.frequency_penalty or p.presence_penalty) and num_output[k]]
    if out:
        outputs = [token_ids[k][len(token_ids[k]) - num_output[k]:] for k in out]
        keys, which = _keys(outputs, [rows[k] for k in out], vocab, dev)
        freq = torch.tensor([params[k].frequency_penalty for k in out], device=dev)
        flat.index_add_(0, keys, -freq[which].to(flat.dtype))   # once per occurrence
        keys, first = _unique(keys, which)
        pres = torch.tensor([params[k].presence_penalty for k in out], device=dev)
        flat.index_add_(0, keys, -pres[first].to(flat.dtype))   # once per token


def _unique(keys: torch.Tensor, which: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct keys, and for each the ``which`` of one of its occurrences (all of a
    key's occurrences share it: a key names its row)."""
    uniq, inverse = torch.unique(keys, return_inverse=True)
    owner = torch.empty_like(uniq).scatter_(0, inverse, which)
    return uniq, owner
