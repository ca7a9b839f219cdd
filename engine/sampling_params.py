"""Sampling parameters of one request, validated at the edge (router) and trusted after."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .structured_output import StructuredOutput

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
DEFAULT_MAX_TOKENS = 256
MAX_PENALTY = 2.0           # |presence_penalty|, |frequency_penalty| (OpenAI's range)
MAX_REPETITION_PENALTY = 100.0
MAX_LOGIT_BIAS = 100.0      # |bias| per token (OpenAI's range)
MAX_LOGIT_BIAS_TOKENS = 1024
MAX_LOGPROBS = 20           # top logprobs per token (vLLM's default max_logprobs)
MAX_N = 128                 # samples per request, n or best_of (OpenAI's limit of n)


class InvalidRequestError(ValueError):
    """Bad client input. `field` names the offending request field; maps to INVALID_ARGUMENT."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


MAX_CACHE_SALT_BYTES = 256


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens and when to stop (names and defaults as in vLLM's SamplingParams).

    temperature 0 is greedy. top_k 0, top_p 1.0 and min_p 0 disable those filters. `seed`
    makes sampling reproducible, whichever worker samples (engine/sampler.py).
    `max_tokens` counts generated tokens. `stop` strings are matched on detokenized text
    by the router; token-level stops (EOS, stop_token_ids, max_tokens) by the worker.

    The logits processors (engine/logits_processors.py, applied in vLLM's order, before
    greedy picks too): `repetition_penalty` (1 = off) divides a positive logit, or
    multiplies a negative one, of every token already in prompt or output (transformers'
    and vLLM's rule); `frequency_penalty` subtracts its value times the token's count in
    the output, `presence_penalty` its value once for any token in the output (OpenAI's
    rule); `logit_bias` ((token id, bias) pairs) adds to those logits; `min_tokens`
    forbids EOS and stop_token_ids until that many tokens were generated.

    `logprobs` (None: off) returns, for each generated token, its log-probability and
    the top `logprobs` tokens of its position: log-softmax of the model's logits (after a
    grammar's mask) before any processor, temperature or filter (vLLM's default `logprobs_mode`,
    "raw_logprobs"; engine/logprobs.py). `prompt_logprobs` (None: off) does the same for
    each prompt token after the first, computed by the prefill worker over the whole
    prompt (such a request neither uses nor skips a cached prefix: every position's
    logits are needed).

    `n` independent samples of the prompt share its prefill: the prompt is prefilled
    and its KV moved once, then forked on the decode worker (decode_worker/fork.py).
    Sample i draws with seed + i when `seed` is set (vLLM's rule), so sample 0 is what
    n=1 gives. `best_of` (OpenAI's completions) draws that many samples (>= n) and
    returns the n with the highest cumulative logprob; not streamed.
    """

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutput | None = None   # engine/structured_output.py
    n: int = 1
    best_of: int | None = None
    step_offset: int = 0     # tokens generated before this request moved here (the
                             # router's retry after a worker died); the sampler's step
                             # counts on from it, so seeded draws continue unchanged
    cache_salt: str = ""     # GenerateRequest.cache_salt: not a sampling setting, it goes
                             # with them to both workers, into the prompt's block hashes
                             # (engine/block_pool.block_hashes); never logged

    def __post_init__(self):
        if len(self.cache_salt) > MAX_CACHE_SALT_BYTES or len(
                self.cache_salt.encode("utf-8", "surrogatepass")) > MAX_CACHE_SALT_BYTES:
            raise InvalidRequestError("cache_salt", f"at most {MAX_CACHE_SALT_BYTES} bytes "
                                                    "UTF-8")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError("sampling.max_tokens", f"must be >= 1, got {self.max_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequestError("sampling.temperature",
                                      f"must be a finite number >= 0, got {self.temperature}")
        if not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidRequestError("sampling.top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequestError("sampling.top_k", f"must be >= 0 (0 disables), got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidRequestError("sampling.seed", f"must be in [0, 2^63), got {self.seed}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError("sampling.stop",
                                      f"at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        for s in self.stop:
            if not s or len(s) > MAX_STOP_STRING_CHARS:
                raise InvalidRequestError(
                    "sampling.stop", f"each string must be 1..{MAX_STOP_STRING_CHARS} characters, "
                                     f"got {len(s)}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError("sampling.stop_token_ids",
                                      f"at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not math.isfinite(v) or abs(v) > MAX_PENALTY:
                raise InvalidRequestError(f"sampling.{name}",
                                          f"must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {v}")
        if not (math.isfinite(self.repetition_penalty)
                and 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY):
            raise InvalidRequestError("sampling.repetition_penalty",
                                      f"must be in (0, {MAX_REPETITION_PENALTY}] (1 disables), "
                                      f"got {self.repetition_penalty}")
        if not (math.isfinite(self.min_p) and 0 <= self.min_p <= 1):
            raise InvalidRequestError("sampling.min_p", f"must be in [0, 1], got {self.min_p}")
        if not 0 <= self.min_tokens <= self.step_offset + self.max_tokens:  # a retry's too
            raise InvalidRequestError("sampling.min_tokens",
                                      f"must be in [0, max_tokens={self.max_tokens}], "
                                      f"got {self.min_tokens}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
            raise InvalidRequestError("sampling.logit_bias", f"at most {MAX_LOGIT_BIAS_TOKENS} "
                                      f"tokens, got {len(self.logit_bias)}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not 0 <= v <= MAX_LOGPROBS:
                raise InvalidRequestError(f"sampling.{name}",
                                          f"must be in [0, {MAX_LOGPROBS}], got {v}")
        if not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            raise InvalidRequestError("sampling.n", f"must be in [1, {MAX_N}], got {self.n}")
        if self.best_of is not None and not self.n <= self.best_of <= MAX_N:
            raise InvalidRequestError("sampling.best_of", f"must be in [n={self.n}, {MAX_N}], "
                                                          f"got {self.best_of}")
        for token, bias in self.logit_bias:
            if not (math.isfinite(bias) and abs(bias) <= MAX_LOGIT_BIAS):
                raise InvalidRequestError("sampling.logit_bias", f"token {token}: bias must be "
                                          f"in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}], got {bias}")

    @property
    def num_samples(self) -> int:
        """Samples drawn: best_of when set, else n."""
        return self.best_of or self.n

    def sample(self, index: int) -> SamplingParams:
        """The params of sample `index` (0-based) of `num_samples`: one sample, with
        seed + index (mod 2^63) when seeded."""
        seed = None if self.seed is None else (self.seed + index) % 2**63
        return replace(self, n=1, best_of=None, seed=seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """Whether sampling needs the tokens so far (a penalty is on)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)
