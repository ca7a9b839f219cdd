"""Batched token sampling: the logits processors (engine/logits_processors.py:
penalties, logit_bias, min_tokens, min_p), then greedy, or temperature, top-k, top-p and a
per-request seed.

Seeded requests draw from a generator re-seeded per step with (seed, step), so a seeded
request gives the same tokens whether its first token was sampled on the prefill worker
and the rest on a decode worker, or all in one place (and after a migration).
Sampling is by inverse CDF: one uniform draw u per row picks the first token whose
cumulative probability (float64) exceeds u, what `torch.multinomial` does for one
sample. It needs one random number per row where the exponential race (argmax of
p / Exp(1), vLLM's sampler) needs one per vocabulary entry: on CPU, torch's `exponential_`
over a [64, 49152] batch costs ~48 ms, a whole decode step's quarter, against ~6 ms for
this (`pdserve bench step`, docs/performance.md). On CPU the draw itself runs in C++
(engine/csrc/sampler.cpp: the softmax's max, its sum per chunk of 256 tokens, then the
chunk the draw falls in; no float64 copy of the batch): 64 x 49,152 rows in ~2 ms where
softmax + float64 cumsum + searchsorted took ~11 ms on two threads under load.
A row with NaN logits gets its argmax (a valid token id) on every path.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch

from . import cpu_ops, logits_processors
from .logprobs import TokenLogprobs, capture
from .sampling_params import SamplingParams


@torch.inference_mode()   # logits from the model are inference tensors; edited in place
def sample(logits: torch.Tensor, params: Sequence[SamplingParams], steps: Sequence[int],
           token_ids: Sequence[Sequence[int] | None] | None = None,
           eos_token_ids: Collection[int] = ()) -> list[int]:
    """Pick one token per row.

    logits: [batch, vocab] float32 (any device), modified in place by the logits
    processors; params[i] and steps[i] (tokens the request has generated so far here, 0
    for the first; params[i].step_offset is added for a request that moved workers)
    belong to row i. token_ids[i]: the request's prompt + output so far, needed where
    params[i].penalized (else None). eos_token_ids: the model's, for min_tokens.
    A structured output's token bitmask is applied by the caller first
    (structured_output.apply_bitmask), so the logprobs captured before sampling see it.
    Returns batch token ids. Raises ValueError for a penalized row without token_ids.
    """
    assert logits.shape[0] == len(params) == len(steps), (logits.shape, len(params), len(steps))
    logits_processors.apply(logits, params, steps, token_ids, eos_token_ids)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if not random_rows:
        return logits.argmax(dim=-1).tolist()
    dev = logits.device
    if len(random_rows) == len(params):   # all random: no argmax, no row gather
        out = torch.empty(len(params), dtype=torch.long, device=dev)
        rows, sub = slice(None), logits
    else:
        out = logits.argmax(dim=-1)
        rows = torch.tensor(random_rows, device=dev)
        sub = logits[rows]
    u = torch.empty(len(random_rows), dtype=torch.float64, device=dev)
    unseeded = [j for j, i in enumerate(random_rows) if params[i].seed is None]
    if unseeded:
        u[unseeded] = torch.rand(len(unseeded), dtype=torch.float64, device=dev)
    for j, i in enumerate(random_rows):
        p = params[i]
        if p.seed is not None:
            gen = torch.Generator(device=dev)
            gen.manual_seed((p.seed * 1_000_003 + p.step_offset + steps[i]) % 2**63)
            u[j] = torch.rand(1, dtype=torch.float64, device=dev, generator=gen)
    sub_params = [params[i] for i in random_rows]
    temps = torch.tensor([max(p.temperature, 1e-5) for p in sub_params], dtype=torch.float32)
    filtered = _filter(sub, sub_params, temps.to(dev))
    if filtered is not None:      # already divided by the temperature
        sub, temps = filtered, torch.ones_like(temps)
    if dev.type == "cpu" and sub.dtype == torch.float32 and cpu_ops.available():
        out[rows] = cpu_ops.sample_from_logits(sub, temps, u)
        return out.tolist()
    if filtered is None:
        sub = sub / temps.to(dev)[:, None]
    cdf = sub.softmax(dim=-1).double().cumsum_(dim=-1)   # (softmax in float64 is ~10x slower)
    # r < total always (so the pick is a token with p > 0: zero-probability tokens
    # repeat their predecessor's cumulative value and are never the first to exceed r)
    total = cdf[:, -1:]
    r = torch.minimum(u[:, None] * total, total.nextafter(torch.zeros_like(total)))
    picked = torch.searchsorted(cdf, r, right=True).squeeze(1)
    bad = ~torch.isfinite(total.squeeze(1))          # NaN logits: the argmax, a valid id
    out[rows] = torch.where(bad, sub.argmax(dim=-1), picked.clamp_max(sub.shape[-1] - 1))
    return out.tolist()


_TOP_CANDIDATES = 256   # tokens ranked per row for top-k / top-p before any full sort


def sample_requests(logits: torch.Tensor, reqs: Sequence[Any], grammars: Callable[[], Any],
                    eos_token_ids: Collection[int] = ()
                    ) -> tuple[list[int | None], list[TokenLogprobs | None], list[str | None]]:
    """The next token of each request of `reqs` (engine/outputs.py StepRequest) from its
    row of `logits` [len(reqs), vocab] float32: its grammar's bitmask applied first
    (structured_output.py; `grammars()` gives the runner's Grammars), so the logprobs
    captured next see it; then sample(); each grammar matcher accepts its token.

    A request's matcher is built at its first sampling, having accepted the tokens it
    generated before (a request moved from another worker: the prompt's last
    params.step_offset too). Returns per request (token, TokenLogprobs or None, error);
    a request whose earlier tokens break its grammar gets (None, None, the reason)."""
    matchers, errors = zip(*(_matcher(r, grammars) for r in reqs))
    if any(m is not None for m in matchers):
        from .structured_output import apply_bitmask
        apply_bitmask(logits, grammars().bitmask(list(matchers)))
    params = [r.params for r in reqs]
    captured = capture(logits, params)
    drawn = sample(logits, params, [r.num_output_tokens for r in reqs],
                   [r.token_ids(r.num_tokens) if r.params.penalized else None for r in reqs],
                   eos_token_ids)
    for t, m in zip(drawn, matchers):
        if m is not None and not m.is_terminated():   # ignore_eos: goes on past a stop
            m.accept_token(t)
    return ([None if e else t for t, e in zip(drawn, errors)],
            [None if e else lp for lp, e in zip(captured.of(drawn), errors)], list(errors))


def _matcher(req: Any, grammars: Callable[[], Any]) -> tuple[Any, str | None]:
    """(req's grammar matcher, None), built on first use; (None, None) without
    structured_outputs; (None, why) when its generated tokens break the grammar."""
    so = req.params.structured_outputs
    if so is None or req.matcher is not None:
        return req.matcher, None
    done = req.token_ids(req.num_tokens)[req.prompt_len - req.params.step_offset:]
    try:
        req.matcher = grammars().matcher(so, done, req.grammar)
    except ValueError as e:
        return None, str(e)
    return req.matcher, None


def _filter(logits: torch.Tensor, params: Sequence[SamplingParams],
            temps: torch.Tensor) -> torch.Tensor | None:
    """Apply min_p to ``logits`` [n, vocab] in place (-inf outside), then return them
    temperature-scaled with top-k then top-p applied, or None when no row has either
    (the caller then scales by the temperature itself)."""
    vocab = logits.shape[-1]
    min_ps = [p.min_p for p in params]
    if any(min_ps):
        logits_processors.apply_min_p(logits, temps, torch.tensor(
            min_ps, device=logits.device, dtype=logits.dtype))
    ks = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params],
                      device=logits.device)
    ps = torch.tensor([p.top_p for p in params], device=logits.device, dtype=logits.dtype)
    if not (bool((ks < vocab).any()) or bool((ps < 1.0).any())):
        return None
    return _top_k_top_p(logits / temps[:, None], ks, ps)


def _top_k_top_p(logits: torch.Tensor, ks: torch.Tensor, ps: torch.Tensor) -> torch.Tensor:
    """Logits [n, vocab] with everything outside each row's top ks[i] tokens, then outside
    the smallest prefix (by probability under the top-k distribution) whose mass reaches
    ps[i], set to -inf; the top token always stays. ks[i] == vocab: no top-k.

    Ranks only the top max(_TOP_CANDIDATES, top_k) tokens of each row (`topk`: ~8 ms for
    64 x 49,152 on one core, where a full sort takes ~250 ms); a row whose top-p prefix
    reaches past them (a flat distribution) is sorted in full (`_sorted_top_k_top_p`),
    so the result is the same either way."""
    vocab = logits.shape[-1]
    limited = ks < vocab
    cand = min(vocab, max(_TOP_CANDIDATES, int(ks[limited].max()) if bool(limited.any()) else 0))
    vals, idx = logits.topk(cand, dim=-1)                        # descending
    ranks = torch.arange(cand, device=logits.device)[None, :]
    vals = vals.masked_fill(ranks >= ks[:, None], float("-inf"))
    # log of the normalizer: over the top k where top-k applies, else over the whole row
    lse = torch.where(limited, vals.logsumexp(dim=-1), logits.logsumexp(dim=-1))
    probs = (vals - lse[:, None]).exp()
    before = probs.cumsum(dim=-1) - probs
    out = torch.full_like(logits, float("-inf")).scatter(
        -1, idx, vals.masked_fill(before >= ps[:, None], float("-inf")))
    whole = ~limited & (ps >= 1.0)                  # unfiltered rows of a mixed batch
    out[whole] = logits[whole]
    # top-p without top-k whose prefix does not end among the candidates
    unsettled = ~limited & (ps < 1.0) & (probs.sum(dim=-1) < ps)
    if bool(unsettled.any()):
        out[unsettled] = _sorted_top_k_top_p(logits[unsettled], ks[unsettled], ps[unsettled])
    return out


def _sorted_top_k_top_p(logits: torch.Tensor, ks: torch.Tensor, ps: torch.Tensor
                        ) -> torch.Tensor:
    """`_top_k_top_p` by a full sort of every row."""
    sorted_logits, idx = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    sorted_logits = sorted_logits.masked_fill(ranks >= ks[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the top token always stays).
    before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(before >= ps[:, None], float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, idx, sorted_logits)
