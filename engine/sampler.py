"""Batched token sampling: greedy, temperature, top-k, top-p, per-request seed.

Seeded requests draw from a generator re-seeded per step with (seed, step), so a seeded
request gives the same tokens whether its first token was sampled on the prefill worker
and the rest on a decode worker, or all in one place (and after a migration).
Sampling uses the exponential-race form (argmax of p / Exp(1), as vLLM's sampler does),
which equals drawing from the categorical distribution p.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .sampling_params import SamplingParams


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           steps: Sequence[int]) -> list[int]:
    """Pick one token per row.

    logits: [batch, vocab] float32 (any device); params[i] and steps[i] (tokens the
    request has generated so far here, 0 for the first; params[i].step_offset is added
    for a request that moved workers) belong to row i.
    Returns batch token ids.
    """
    assert logits.shape[0] == len(params) == len(steps), (logits.shape, len(params), len(steps))
    out = logits.argmax(dim=-1)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        rows = torch.tensor(random_rows, device=logits.device)
        probs = _filtered_probs(logits[rows], [params[i] for i in random_rows])
        q = torch.empty_like(probs)
        for j, i in enumerate(random_rows):
            p = params[i]
            if p.seed is None:
                q[j].exponential_()
            else:
                gen = torch.Generator(device=logits.device)
                gen.manual_seed((p.seed * 1_000_003 + p.step_offset + steps[i]) % 2**63)
                q[j].exponential_(generator=gen)
        out[rows] = (probs / q).argmax(dim=-1)
    return out.tolist()


def _filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Softmax of temperature-scaled logits with top-k then top-p applied. [n, vocab]."""
    temps = torch.tensor([p.temperature for p in params], device=logits.device, dtype=logits.dtype)
    logits = logits / temps.clamp_min(1e-5)[:, None]
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, idx = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[-1]
        ks = torch.tensor([k if k > 0 else vocab for k in top_k], device=logits.device)
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        sorted_logits = sorted_logits.masked_fill(ranks >= ks[:, None], float("-inf"))
        probs = sorted_logits.softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the top token always stays).
        before = probs.cumsum(dim=-1) - probs
        ps = torch.tensor(top_p, device=logits.device, dtype=probs.dtype)
        sorted_logits = sorted_logits.masked_fill(before >= ps[:, None], float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, idx, sorted_logits)
    return logits.softmax(dim=-1)
