"""engine/sampling_params.py: every bad value is an InvalidRequestError naming the field
and the limit."""

import math

import pytest

from pdserve.engine.sampling_params import (
    DEFAULT_MAX_TOKENS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    InvalidRequestError,
    SamplingParams,
)


def test_defaults_match_vllm():
    p = SamplingParams()
    assert p.max_tokens == DEFAULT_MAX_TOKENS == 256
    assert p.temperature == 1.0 and p.top_p == 1.0 and p.top_k == 0
    assert p.seed is None and p.stop == () and p.stop_token_ids == () and not p.ignore_eos
    assert not p.greedy


@pytest.mark.parametrize("kw, greedy", [
    (dict(temperature=0.0), True),
    (dict(top_k=1), True),
    (dict(temperature=2.0, top_k=1), True),
    (dict(temperature=0.7), False),
    (dict(top_k=2), False),
    (dict(top_p=0.1), False),
])
def test_greedy_property(kw, greedy):
    assert SamplingParams(**kw).greedy is greedy


def test_limits_themselves_are_accepted():
    SamplingParams(
        max_tokens=1, temperature=0.0, top_p=1.0, top_k=0, seed=0,
        stop=tuple("x" * MAX_STOP_STRING_CHARS for _ in range(MAX_STOP_STRINGS)),
        stop_token_ids=tuple(range(MAX_STOP_TOKEN_IDS)),
    )
    SamplingParams(top_p=1e-6, seed=2**63 - 1, stop=("a",), temperature=1e6)


@pytest.mark.parametrize("kw, field, limit", [
    (dict(max_tokens=0), "sampling.max_tokens", ">= 1"),
    (dict(max_tokens=-5), "sampling.max_tokens", ">= 1"),
    (dict(temperature=-1.0), "sampling.temperature", ">= 0"),
    (dict(temperature=math.nan), "sampling.temperature", "finite"),
    (dict(temperature=math.inf), "sampling.temperature", "finite"),
    (dict(temperature=-math.inf), "sampling.temperature", "finite"),
    (dict(top_p=0.0), "sampling.top_p", "(0, 1]"),
    (dict(top_p=1.5), "sampling.top_p", "(0, 1]"),
    (dict(top_p=-0.1), "sampling.top_p", "(0, 1]"),
    (dict(top_p=math.nan), "sampling.top_p", "(0, 1]"),
    (dict(top_p=math.inf), "sampling.top_p", "(0, 1]"),
    (dict(top_k=-1), "sampling.top_k", ">= 0"),
    (dict(stop=("s",) * (MAX_STOP_STRINGS + 1)), "sampling.stop", f"at most {MAX_STOP_STRINGS}"),
    (dict(stop=("ok", "")), "sampling.stop", f"1..{MAX_STOP_STRING_CHARS}"),
    (dict(stop=("x" * (MAX_STOP_STRING_CHARS + 1),)), "sampling.stop", f"1..{MAX_STOP_STRING_CHARS}"),
    (dict(stop_token_ids=tuple(range(MAX_STOP_TOKEN_IDS + 1))), "sampling.stop_token_ids",
     f"at most {MAX_STOP_TOKEN_IDS}"),
    (dict(seed=-1), "sampling.seed", "[0, 2^63)"),
    (dict(seed=2**63), "sampling.seed", "[0, 2^63)"),
    (dict(seed=2**64 - 1), "sampling.seed", "[0, 2^63)"),
])
def test_bad_value_names_field_and_limit(kw, field, limit):
    with pytest.raises(InvalidRequestError) as ei:
        SamplingParams(**kw)
    err = ei.value
    assert isinstance(err, ValueError)
    assert err.field == field
    msg = str(err)
    assert msg.startswith(f"{field}: ")
    assert limit in msg, msg


def test_is_frozen():
    p = SamplingParams()
    with pytest.raises(AttributeError):
        p.max_tokens = 3  # type: ignore[misc]
