"""Structured output: generation constrained to a JSON schema, any JSON object, a regex,
a list of choices or an EBNF grammar (SamplingParams.structured_outputs; vLLM's
StructuredOutputsParams names), with xgrammar, vLLM's and SGLang's default backend.

Each worker compiles a request's grammar once per process (xgrammar's GrammarCompiler
caches compiled grammars by their text, up to CACHE_LIMIT_BYTES), as the request arrives
and off its step thread (ModelRunner.compile_grammar, awaited by the prefill worker's
prefill() and the decode worker's reserve()); the request holds the compiled grammar, so a step never
compiles one, however long a schema takes. A worker keeps one GrammarMatcher per request, which has accepted
every token generated so far. Before each sampling step the matchers fill a token
bitmask, [batch, ceil(vocab / 32)] int32 (bit set: allowed), which the sampler applies
first (engine/logits_processors.py); the sampled token is then accepted. Once the
grammar is complete only its stop tokens (the model's EOS) are allowed, so the request
ends there. JSON is compact (xgrammar's any_whitespace=False: no whitespace between
tokens), as small models otherwise tend to emit whitespace without end. The router
builds the grammar from its text (`grammar`, no vocabulary: milliseconds) to refuse
one xgrammar cannot parse with 400 / INVALID_ARGUMENT before any worker sees it; it
does not compile it (vLLM's frontend validates the same way).

Compiling a large schema takes seconds of one core (a 60 KB one: 1.3-2.3 s with the
default model's 49k-token vocabulary on this project's 2-core test box, by load). Each
worker compiles on one thread of its own
(`compile_executor`, niced); where CPU workers lend idle cores (pdserve/core_share.py),
a process compiling says so on its node, and no decode worker there runs its steps on
lent threads meanwhile: an OpenMP team sharing a core with a compile slows several-fold
(a running stream's token gaps went from ~35 to ~300 ms), its own threads alone do not.

Where it runs: the prefill worker's matcher picks the first token (on a retry, after
accepting the tokens already generated, the tail of its prompt); the decode worker's
matcher accepts those same tokens, then constrains every later one.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:         # the router parses and checks grammars without torch
    import torch

logger = logging.getLogger(__name__)

KINDS = ("json", "json_object", "regex", "choice", "grammar")
LOWEST_NICE = 19                  # the compile thread's niceness: the lowest priority
MAX_SPEC_CHARS = 64 * 1024        # a schema, regex or grammar's text
CACHE_LIMIT_BYTES = 256 << 20     # compiled grammars kept per process (vLLM's cap: 512 MiB)


_executor: ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()


def lowest_priority() -> None:
    """This thread (Linux: its native id is its tid) at niceness LOWEST_NICE: for work
    that yields the cores it shares to model steps (a grammar compile). Not SCHED_IDLE:
    a thread starved while it holds the GIL (briefly, at a compile's start and end)
    would stall every thread of its process."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOWEST_NICE)
    except (AttributeError, OSError) as e:
        logger.debug("%s keeps its priority: %r", threading.current_thread().name, e)


def compile_executor() -> ThreadPoolExecutor:
    """This process's grammar-compiling thread: one, at the lowest niceness
    (lowest_priority), so where it shares a core with a step thread of its process
    the step keeps most of it (created on first use)."""
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(1, thread_name_prefix="grammar",
                                           initializer=lowest_priority)
        return _executor


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """What to constrain generation to. kind: "json" (spec: a JSON schema's text),
    "json_object" (any JSON object; spec ""), "regex" (spec: the pattern), "choice"
    (spec: a JSON list of the allowed strings), "grammar" (spec: EBNF, xgrammar's
    GBNF dialect)."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        from .sampling_params import InvalidRequestError
        if self.kind not in KINDS:
            raise InvalidRequestError("sampling.structured_outputs",
                                      f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if len(self.spec) > MAX_SPEC_CHARS:
            raise InvalidRequestError("sampling.structured_outputs",
                                      f"{self.kind} is {len(self.spec)} characters, limit "
                                      f"{MAX_SPEC_CHARS}")


class Grammars:
    """One process's xgrammar state for one model: the tokenizer's vocabulary as
    xgrammar sees it and a compiler with its cache. Thread-safe."""

    def __init__(self, tokenizer: Any, vocab_size: int,
                 stop_token_ids: Sequence[int] | None = None) -> None:
        """stop_token_ids: the model's EOS ids, where a complete grammar ends (default:
        the tokenizer's)."""
        import xgrammar as xgr
        self._xgr = xgr
        self.vocab_size = vocab_size
        self._info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size,
            stop_token_ids=list(stop_token_ids) if stop_token_ids else None)
        self._compiler = xgr.GrammarCompiler(self._info, max_threads=1,
                                             cache_limit_bytes=CACHE_LIMIT_BYTES)
        self._lock = threading.Lock()

    @classmethod
    def for_model(cls, model_dir: str | Path, vocab_size: int) -> Grammars:
        from transformers import AutoTokenizer
        return cls(AutoTokenizer.from_pretrained(model_dir), vocab_size)

    def compile(self, so: StructuredOutput) -> Any:
        """The compiled grammar (seconds of one core for a large schema; a repeat is
        a cache lookup by its text). Raises ValueError naming what xgrammar refused."""
        c = self._compiler
        with self._lock:
            return _by_kind(so, c.compile_json_schema, c.compile_regex, c.compile_grammar)

    def matcher(self, so: StructuredOutput, accepted: list[int], compiled: Any = None) -> Any:
        """A GrammarMatcher that has accepted ``accepted`` (the tokens generated so far),
        of ``compiled`` (compile(so)'s result; None: compiled here). Raises ValueError
        when one of them breaks the grammar."""
        m = self._xgr.GrammarMatcher(compiled if compiled is not None else self.compile(so))
        for t in accepted:
            if m.is_terminated():       # ended on a stop token; ignore_eos went on
                break
            if not m.accept_token(t):
                raise ValueError(f"token {t} generated earlier breaks the {so.kind} grammar")
        return m

    def bitmask(self, matchers: list[Any | None]) -> torch.Tensor | None:
        """[len(matchers), ceil(vocab / 32)] int32 of each row's allowed tokens (rows
        without a matcher, or whose grammar ended on a stop token that ignore_eos went
        past: all); None when no row has one."""
        if not any(m is not None for m in matchers):
            return None
        mask = self._xgr.allocate_token_bitmask(len(matchers), self.vocab_size)
        for i, m in enumerate(matchers):
            if m is not None and not m.is_terminated():
                m.fill_next_token_bitmask(mask, i)
        return mask


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """-inf, in place, on every token of ``logits`` [batch, vocab] whose bit in
    ``bitmask`` [batch, ceil(vocab / 32)] int32 is clear."""
    import torch
    import xgrammar as xgr
    with torch.inference_mode():          # the model's logits are inference tensors
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device))


def grammar(so: StructuredOutput) -> Any:
    """``so`` as an xgrammar Grammar, built from its text alone: no vocabulary, so
    milliseconds where compiling takes seconds (a 60 KB schema: ~20 ms against ~2 s).
    What the router checks before any worker compiles (vLLM validates the same way).
    Raises ValueError naming what xgrammar refused."""
    import xgrammar as xgr
    return _by_kind(so, xgr.Grammar.from_json_schema, xgr.Grammar.from_regex,
                    xgr.Grammar.from_ebnf)


def _by_kind(so: StructuredOutput, json_schema: Callable[..., Any],
             regex: Callable[[str], Any], ebnf: Callable[[str], Any]) -> Any:
    """``so`` through the builder of its kind: xgrammar's Grammar.from_json_schema /
    from_regex / from_ebnf (grammar) or a GrammarCompiler's compile_json_schema /
    compile_regex / compile_grammar (Grammars.compile), the same arguments to each
    pair, so the router's parse and a worker's compile accept and refuse alike; a
    choice is an EBNF of its strings. xgrammar's errors are raised as a ValueError
    naming ``so``'s kind."""
    try:
        if so.kind in ("json", "json_object"):      # compact: no free whitespace
            return json_schema(so.spec or '{"type": "object"}', any_whitespace=False,
                               strict_mode=True)
        if so.kind == "regex":
            return regex(so.spec)
        return ebnf(_choice_grammar(so.spec) if so.kind == "choice" else so.spec)
    except (RuntimeError, ValueError, TypeError) as e:
        why = re.sub(r"^\[[^]]*\] \S+:\d+: ", "", str(e).splitlines()[-1])  # xgrammar's prefix
        raise ValueError(f"{so.kind} does not compile: {why[:300]}") from None


def _choice_grammar(spec: str) -> str:
    """EBNF accepting exactly one of the JSON list of strings ``spec``."""
    try:
        choices = json.loads(spec)
    except json.JSONDecodeError as e:
        raise ValueError(f"choice is not a JSON list: {e}") from None
    if not (isinstance(choices, list) and choices and all(isinstance(c, str) and c
                                                          for c in choices)):
        raise ValueError("choice must be a non-empty list of non-empty strings")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
