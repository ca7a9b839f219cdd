"""engine/loader.load_tokenizer gives the tokenizer AutoTokenizer gives: the same class
and the same ids, chat template and text, whether it loads the generic fast class
directly (Llama: the default model, the tiny Llama) or through AutoTokenizer (a Qwen2,
whose class AutoTokenizer picks from the model type)."""

import pytest
from tiny_models import tiny_model_dir
from transformers import AutoTokenizer

from pdserve.engine.loader import load_tokenizer, resolve_model

TEXTS = ["Hello, world!", "  spaces\tand\nnewlines  ", "<|im_start|>user\nhi<|im_end|>",
         "émigré 東京 🙂", ""]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}]


@pytest.mark.parametrize("model", ["default", "llama", "qwen2"])
def test_the_tokenizer_is_autotokenizers(model):
    d = resolve_model("default") if model == "default" else tiny_model_dir(model)
    got, want = load_tokenizer(d), AutoTokenizer.from_pretrained(d)
    assert type(got) is type(want)
    for text in TEXTS:
        ids = want(text)["input_ids"]
        assert got(text)["input_ids"] == ids
        assert got.decode(ids) == want.decode(ids)
        assert got.decode(ids, skip_special_tokens=True) == want.decode(
            ids, skip_special_tokens=True)
    assert got.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == \
        want.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert (got.eos_token_id, got.bos_token_id, got.pad_token_id, len(got)) == (
        want.eos_token_id, want.bos_token_id, want.pad_token_id, len(want))


@pytest.mark.parametrize("model", ["default", "llama"])
def test_a_llama_tokenizer_loads_without_autotokenizer(model, monkeypatch):
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("AutoTokenizer used")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)
    d = resolve_model("default") if model == "default" else tiny_model_dir(model)
    assert load_tokenizer(d)("Hello")["input_ids"]
