"""router/validation.py under hostile input (tests/hostile_requests.py), with the real
tokenizer and context of the tiny llama model the end-to-end fuzz serves: every request
is either turned into a prompt and SamplingParams a worker can serve, or refused with an
InvalidRequestError whose message starts with a field of the request. The character
limit also bounds the tokenizer's work: it never sees more than
validation.max_prompt_chars(max_model_len) characters."""

from __future__ import annotations

import math

import pytest
from hostile_requests import FIELDS, describe, generate_requests
from hypothesis import HealthCheck, given, settings
from tiny_models import VOCAB_SIZE, tiny_model_dir

from pdserve.engine.sampling_params import (
    MAX_LOGIT_BIAS_TOKENS,
    MAX_REPETITION_PENALTY,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    InvalidRequestError,
)
from pdserve.kv_transfer.base import MAX_REQUEST_ID_BYTES as KV_FRAME_REQUEST_ID_BYTES
from pdserve.router import validation

MAX_MODEL_LEN = 2048    # tiny models' max_position_embeddings (checked in `model`)


class _MeteredTokenizer:
    """The real tokenizer, recording the most characters one call was given."""

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self.chat_template = tokenizer.chat_template
        self.most_chars = 0

    def __call__(self, text):
        self.most_chars = max(self.most_chars, len(text))
        return self._tok(text)

    def apply_chat_template(self, conv, **kw):
        chars = sum(len(m["role"]) + len(m["content"]) for m in conv)
        self.most_chars = max(self.most_chars, chars)
        return self._tok.apply_chat_template(conv, **kw)


@pytest.fixture(scope="module")
def model():
    """(tokenizer, ModelConfig) as the router builds them."""
    from transformers import AutoConfig, AutoTokenizer

    from pdserve.engine.config import ModelConfig

    d = tiny_model_dir("llama")
    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(d))
    assert (cfg.vocab_size, cfg.max_model_len) == (VOCAB_SIZE, MAX_MODEL_LEN)
    return AutoTokenizer.from_pretrained(d), cfg


def _validate(req, tokenizer, cfg):
    """The router's validation steps, in its order (router.Router.generate)."""
    rid = validation.request_id(req)
    # The router sends f"{rid}#{8 hex digits}" in KV frames, which carry at most 256 bytes.
    assert rid is None or 0 < len(rid.encode()) + 9 <= KV_FRAME_REQUEST_ID_BYTES, rid
    ids = validation.prompt_token_ids(req, tokenizer, cfg.vocab_size, cfg.max_model_len)
    return ids, validation.sampling_params(req, len(ids), cfg.max_model_len, cfg.vocab_size,
                                           check_grammar=True)


@settings(max_examples=1000, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.large_base_example])
@given(drawn=generate_requests(vocab_size=VOCAB_SIZE, max_model_len=MAX_MODEL_LEN))
def test_only_invalid_request_errors_escape(model, drawn):
    req, (tokenizer, cfg) = drawn.msg, model
    metered = _MeteredTokenizer(tokenizer)
    limit = validation.max_prompt_chars(cfg.max_model_len)
    try:
        ids, p = _validate(req, metered, cfg)
    except InvalidRequestError as e:
        assert metered.most_chars <= limit, (str(e), describe(req))
        assert e.field in FIELDS, (str(e), describe(req))
        assert str(e).startswith(f"{e.field}: ") and len(str(e)) > len(e.field) + 2, str(e)
        return
    # Accepted: everything a worker relies on holds.
    assert metered.most_chars <= limit, describe(req)
    n = cfg.max_model_len
    assert 0 < len(ids) < n and all(0 <= t < cfg.vocab_size for t in ids), describe(req)
    assert 1 <= p.max_tokens <= n - len(ids), (p, len(ids))
    assert math.isfinite(p.temperature) and p.temperature >= 0, p
    assert 0 < p.top_p <= 1 and p.top_k >= 0, p
    assert p.seed is None or 0 <= p.seed < 2**63, p
    assert len(p.stop) <= MAX_STOP_STRINGS, len(p.stop)
    assert all(1 <= len(s) <= MAX_STOP_STRING_CHARS for s in p.stop), p.stop
    assert len(p.stop_token_ids) <= MAX_STOP_TOKEN_IDS, len(p.stop_token_ids)
    assert abs(p.presence_penalty) <= 2 and abs(p.frequency_penalty) <= 2, p
    assert 0 < p.repetition_penalty <= MAX_REPETITION_PENALTY and 0 <= p.min_p <= 1, p
    assert 0 <= p.min_tokens <= p.max_tokens, p
    assert p.logprobs is None or 0 <= p.logprobs <= 20, p
    assert len(p.logit_bias) <= MAX_LOGIT_BIAS_TOKENS and all(
        0 <= t < cfg.vocab_size and abs(b) <= 100 for t, b in p.logit_bias), p.logit_bias
