"""engine/structured_output.py with a real tokenizer (the tiny llama's): each kind of
grammar compiles (cached), a bad one is a ValueError naming the problem (the same from
the router's parse without a vocabulary as from a worker's compile), the sampler
under a grammar's bitmask only ever picks allowed tokens, and greedy decoding under a
JSON schema walks to a complete, valid object however the logits push elsewhere."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import VOCAB_SIZE, tiny_model_dir

from pdserve.engine.sampler import sample
from pdserve.engine.sampling_params import InvalidRequestError, SamplingParams
from pdserve.engine.structured_output import MAX_SPEC_CHARS, Grammars, apply_bitmask, grammar
from pdserve.engine.structured_output import StructuredOutput as SO

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "n": {"type": "integer", "minimum": 0,
                                                 "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def grammars():
    from transformers import AutoTokenizer
    d = tiny_model_dir("llama")
    return Grammars(AutoTokenizer.from_pretrained(d), VOCAB_SIZE), AutoTokenizer.from_pretrained(d)


def allowed(mask, row: int, token: int) -> bool:
    return bool((int(mask[row, token // 32]) >> (token % 32)) & 1)


@pytest.mark.parametrize("so, first, refused", [
    (SO("json", json.dumps(SCHEMA)), "{", "x"), (SO("json_object"), "{", "x"),
    (SO("regex", r"[0-9]{3}"), "1", "a"), (SO("choice", '["yes", "no"]'), "no", "x"),
    (SO("grammar", 'root ::= "a" | "b"'), "b", "x")])
def test_every_kind_compiles_and_its_mask_constrains_the_first_token(grammars, so, first,
                                                                      refused):
    """Each kind's bitmask row allows a token its grammar starts with and refuses one it
    cannot; a row without a matcher allows every token."""
    g, tok = grammars
    assert g.compile(so) is not None
    mask = g.bitmask([g.matcher(so, []), None])
    assert mask.shape == (2, (VOCAB_SIZE + 31) // 32)
    ok, bad = (tok(t, add_special_tokens=False)["input_ids"][0] for t in (first, refused))
    assert allowed(mask, 0, ok) and not allowed(mask, 0, bad), (first, refused)
    assert bool((mask[1] == -1).all())
    assert 0 < sum(allowed(mask, 0, t) for t in range(VOCAB_SIZE)) < VOCAB_SIZE


@pytest.mark.parametrize("so, says", [
    (SO("json", '{"type": 5}'), "json does not compile: Type should be a string"),
    (SO("regex", "(("), "regex does not compile"),
    (SO("choice", "[]"), "choice must be a non-empty list"),
    (SO("grammar", "root ::= "), "grammar does not compile"),
])
def test_a_bad_grammar_is_a_value_error_naming_it(grammars, so, says):
    """The same error from the router's parse (no vocabulary) and a worker's compile."""
    with pytest.raises(ValueError, match=says):
        grammar(so)
    with pytest.raises(ValueError, match=says):
        grammars[0].compile(so)


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(kind=st.sampled_from(["json", "regex", "grammar", "choice"]),
       spec=st.one_of(st.text(max_size=24), st.sampled_from([
           '{"type": "array", "items": {"type": "string"}, "minItems": 2}',
           '{"type": "string", "pattern": "^[a-z]+$"}', '{"enum": [1, "a", null]}',
           '{"$ref": "#/$defs/a", "$defs": {"a": {"type": "integer"}}}',
           '[a-z]{2,4}@[0-9]+', 'root ::= "x" root | ""', 'root ::= [^"]*', '["a", "b"]'])))
def test_what_the_router_s_parse_accepts_a_worker_compiles(grammars, kind, spec):
    """grammar() (the router's check) and Grammars.compile (each worker's) agree: a
    spec either parses and compiles, or both refuse it with the same message."""
    so = SO(kind, spec)
    try:
        grammar(so)
    except ValueError as e:
        with pytest.raises(ValueError) as compiled:
            grammars[0].compile(so)
        assert str(compiled.value) == str(e)
        return
    assert grammars[0].compile(so) is not None


def test_params_check_kind_and_size():
    with pytest.raises(InvalidRequestError, match="sampling.structured_outputs: kind"):
        SO("yaml", "x")
    with pytest.raises(InvalidRequestError, match=str(MAX_SPEC_CHARS)):
        SO("regex", "a" * (MAX_SPEC_CHARS + 1))


def test_greedy_under_a_schema_gives_a_valid_object(grammars):
    """Random logits, greedy, the grammar's bitmask first: the tokens decode to JSON that
    validates, and generation ends on a stop token once the object is complete."""
    g, tok = grammars
    so = SO("json", json.dumps(SCHEMA))
    m = g.matcher(so, [])
    params = [SamplingParams(temperature=0, structured_outputs=so)]
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(60):
        logits = torch.randn(1, VOCAB_SIZE, generator=gen) * 5
        apply_bitmask(logits, g.bitmask([m]))
        token = sample(logits, params, [len(out)])[0]
        assert m.accept_token(token)
        if m.is_terminated():
            break
        out.append(token)
    assert m.is_terminated(), tok.decode(out)
    value = json.loads(tok.decode(out))
    assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and 0 <= value["n"] <= 9


def test_a_grammar_ended_on_a_stop_token_constrains_nothing_after_it(grammars):
    """ignore_eos past a complete grammar: the bitmask lets every token through (it
    would raise on the terminated matcher), and a retry's replay stops at the stop token."""
    g, tok = grammars
    so = SO("choice", '["yes"]')
    yes = tok("yes", add_special_tokens=False)["input_ids"]
    eos = tok.eos_token_id
    m = g.matcher(so, yes + [eos])
    assert m.is_terminated()
    assert bool((g.bitmask([m]) == -1).all())          # every bit set: all allowed
    g.matcher(so, yes + [eos, 5, 6])                   # tokens after the end: not replayed


def test_matcher_replays_earlier_tokens_and_refuses_a_breaking_one(grammars):
    g, tok = grammars
    so = SO("regex", "ab+c")
    ids = tok("ab", add_special_tokens=False)["input_ids"]
    g.matcher(so, ids)                         # a retry's tokens so far: accepted
    with pytest.raises(ValueError, match="breaks the regex grammar"):
        g.matcher(so, tok("x", add_special_tokens=False)["input_ids"])
