"""router/detokenizer.py: incremental UTF-8-safe text and stop strings.

Uses a tiny byte-level BPE trained in-process (no model files): every byte is in the
vocabulary, so any text encodes, and multi-byte characters can split across tokens.
"""

from types import SimpleNamespace

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pdserve.router.detokenizer import Delta, Detokenizer

CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog",
    "café au lait, émigré, naïve résumé",
    "日本語のテキスト and 日本 again",
    "party 🎉 time 🎉🎉 ok",
    "The END. is near; the end is here",
] * 3

MULTIBYTE_TEXT = "Hello café, 日本語 🎉 and émigré! The END. more 🎉🎉 naïve"


@pytest.fixture(scope="module")
def tok():
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, show_progress=False, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    t.train_from_iterator(CORPUS, trainer=trainer)
    return t


@pytest.fixture(scope="module")
def hf_like(tok):
    """What Detokenizer takes: a transformers fast tokenizer's `_tokenizer` attribute."""
    return SimpleNamespace(_tokenizer=tok)


def encode(tok, text):
    return tok.encode(text).ids


def run(detok, ids):
    """Step through ids until a stop; returns (deltas, stopped_at index or None)."""
    deltas = []
    for i, t in enumerate(ids):
        d = detok.step(t)
        assert isinstance(d, Delta)
        deltas.append(d.text)
        if d.stopped:
            return deltas, i
    return deltas, None


def test_tokenizer_splits_multibyte_characters(tok):
    # precondition for the UTF-8 test to mean something
    pieces = [tok.decode([i]) for i in encode(tok, MULTIBYTE_TEXT)]
    assert any("\ufffd" in p for p in pieces)


def test_also_accepts_backend_tokenizer(tok):
    detok = Detokenizer(SimpleNamespace(backend_tokenizer=tok), encode(tok, "Q: "))
    ids = encode(tok, "hi 🎉")
    deltas, _ = run(detok, ids)
    assert "".join(deltas) + detok.flush() == "hi 🎉"


@pytest.mark.parametrize("stop", [(), ("zzz",), ("never here", "q")])
def test_deltas_plus_flush_equal_decode(tok, hf_like, stop):
    ids = encode(tok, MULTIBYTE_TEXT)
    detok = Detokenizer(hf_like, encode(tok, "Prompt: say something "), stop)
    deltas, stopped_at = run(detok, ids)
    assert stopped_at is None
    text = "".join(deltas) + detok.flush()
    assert text == tok.decode(ids) == MULTIBYTE_TEXT
    assert detok.sent == text
    assert all("\ufffd" not in d for d in deltas)   # never half a character


def test_no_stop_holds_nothing_back(tok, hf_like):
    text = "hello world, the quick brown fox"
    ids = encode(tok, text)
    detok = Detokenizer(hf_like, [], ())
    for k, t in enumerate(ids):
        detok.step(t)
        assert detok.sent == tok.decode(ids[:k + 1])
    assert detok.flush() == ""


def test_no_stop_multibyte_released_as_soon_as_complete(tok, hf_like):
    ids = encode(tok, MULTIBYTE_TEXT)
    detok = Detokenizer(hf_like, [], ())
    for k, t in enumerate(ids):
        detok.step(t)
        so_far = tok.decode(ids[:k + 1])
        if "\ufffd" not in so_far:
            assert detok.sent == so_far
        else:                                       # an incomplete character is pending
            assert so_far.startswith(detok.sent)
    assert detok.flush() == ""


def test_stop_spanning_several_tokens_truncates_before_it(tok, hf_like):
    stop = "END. more"
    ids = encode(tok, MULTIBYTE_TEXT)
    # the stop string is split over several tokens of this text
    start = MULTIBYTE_TEXT.index(stop)
    first_tok = next(k for k in range(len(ids)) if len(tok.decode(ids[:k + 1])) > start)
    last_tok = next(k for k in range(len(ids)) if len(tok.decode(ids[:k + 1])) >= start + len(stop))
    assert last_tok - first_tok >= 2
    detok = Detokenizer(hf_like, [], (stop,))
    deltas, stopped_at = run(detok, ids)
    assert stopped_at == last_tok                   # stops on the token that completes it
    assert "".join(deltas) == MULTIBYTE_TEXT[:start] == detok.sent
    assert detok.flush() == ""


def test_earliest_of_several_stops_wins(tok, hf_like):
    text = "the quick brown fox jumps over the lazy dog"
    ids = encode(tok, text)
    detok = Detokenizer(hf_like, [], ("lazy", "brown fox", "jumps"))
    deltas, stopped_at = run(detok, ids)
    assert stopped_at is not None
    assert "".join(deltas) == "the quick "


def test_stop_on_multibyte_string(tok, hf_like):
    ids = encode(tok, MULTIBYTE_TEXT)
    detok = Detokenizer(hf_like, [], ("日本語",))
    deltas, stopped_at = run(detok, ids)
    assert stopped_at is not None
    assert "".join(deltas) == "Hello café, "


def test_stop_at_very_start(tok, hf_like):
    ids = encode(tok, "hello world")
    detok = Detokenizer(hf_like, [], ("hello",))
    deltas, stopped_at = run(detok, ids)
    assert stopped_at is not None and "".join(deltas) == ""


def test_single_character_stop(tok, hf_like):
    ids = encode(tok, "hello, world")
    detok = Detokenizer(hf_like, [], (",",))
    deltas, stopped_at = run(detok, ids)
    assert stopped_at is not None and "".join(deltas) == "hello"


def test_held_back_prefix_is_released_by_later_steps(tok, hf_like):
    # "END." looks like the start of "END!!" while it streams; later text releases it
    text = "The END. is near; the end is here"
    ids = encode(tok, text)
    stop = "END!!"
    hold = len(stop) - 1
    detok = Detokenizer(hf_like, [], (stop,))
    end_tok = next(k for k in range(len(ids)) if "END" in tok.decode(ids[:k + 1]))
    for k, t in enumerate(ids):
        d = detok.step(t)
        assert not d.stopped
        decoded = tok.decode(ids[:k + 1])
        assert decoded.startswith(detok.sent)
        assert len(decoded) - len(detok.sent) == min(hold, len(decoded))   # exactly `hold` unsent
        if k == end_tok:
            assert "END" not in detok.sent          # held: could be the stop string
    assert "END." in detok.sent                     # released before the end
    rest = detok.flush()
    assert len(rest) == hold
    assert detok.sent == text


def test_held_back_prefix_is_released_by_flush(tok, hf_like):
    text = "The END"
    ids = encode(tok, text)
    detok = Detokenizer(hf_like, [], ("END!!",))
    deltas, stopped_at = run(detok, ids)
    assert stopped_at is None
    assert "END" not in "".join(deltas)
    assert "".join(deltas) + detok.flush() == text


def test_prompt_primes_the_stream(tok, hf_like):
    # The prompt only gives context: none of its text is emitted.
    prompt = encode(tok, "hello world, the quick brown fox " * 3)
    ids = encode(tok, "jumps over")
    detok = Detokenizer(hf_like, prompt, ())
    deltas, _ = run(detok, ids)
    assert "".join(deltas) + detok.flush() == "jumps over"


def test_prompt_ending_mid_character_does_not_leak_prompt_text(tok, hf_like):
    text = "smile 😀 now"                           # 😀 is not in the corpus: 4 byte tokens
    ids = encode(tok, text)
    cut = next(c for c in range(1, len(ids)) if tok.decode(ids[:c]).endswith("\ufffd"))
    clean = tok.decode(ids[:cut]).rstrip("\ufffd")  # "smile "
    assert text.startswith(clean)
    detok = Detokenizer(hf_like, ids[:cut], ())
    deltas, _ = run(detok, ids[cut:])
    out = "".join(deltas) + detok.flush()
    # the character that straddles prompt and output is completed by the output; nothing
    # before it belongs to the output
    assert out == text[len(clean):]                 # "😀 now"
