"""Tiny random-weight HF checkpoints of every architecture engine/model.py implements.

Each checkpoint is a real transformers model directory (config.json, model.safetensors,
generation_config.json) plus the default model's tokenizer files, so it loads through
`pdserve.engine.loader.resolve_model` / `load_model` and through
`AutoModelForCausalLM.from_pretrained` alike, and shares SmolLM2's tokenizer (vocab 49152).

    from tiny_models import FAMILIES, make_tiny_model, tiny_model_dir
    d = tiny_model_dir("qwen3")                  # cached per process, built once
    d = make_tiny_model("llama", tmp_path / "m", num_hidden_layers=3)   # fresh, with overrides

Families (all float32, hidden 64, 4 heads, 2 KV heads (GQA), intermediate 128,
max_position_embeddings 2048, bos 1, eos 2):
    llama   LlamaForCausalLM, tied embeddings, default RoPE
    llama3  LlamaForCausalLM, rope_type "llama3" scaling, untied embeddings
    mistral MistralForCausalLM (sliding_window 4096 > max_position_embeddings), untied
    qwen2   Qwen2ForCausalLM: q/k/v projections with bias, tied
    qwen3   Qwen3ForCausalLM: q/k RMSNorm, explicit head_dim 32 != hidden/heads (16), tied

Weights are deterministic (fixed seed per family) and drawn with a large std
(`initializer_range` 0.2), with every norm weight and bias randomised too, so the
greedy output of a random model is not one token repeated and every parameter
actually matters for the fidelity comparison.
"""

from __future__ import annotations

import functools
import shutil
import tempfile
import zlib
from pathlib import Path

FAMILIES: tuple[str, ...] = ("llama", "llama3", "mistral", "qwen2", "qwen3")

VOCAB_SIZE = 49152  # SmolLM2's tokenizer
BOS_TOKEN_ID = 1
EOS_TOKEN_ID = 2
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json")

_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    initializer_range=0.2,
    bos_token_id=BOS_TOKEN_ID,
    eos_token_id=EOS_TOKEN_ID,
    pad_token_id=EOS_TOKEN_ID,
    dtype="float32",
)


def _family_config(family: str, overrides: dict):
    """The transformers config of a tiny `family` model, `overrides` applied last."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    if family == "llama":
        cls, kw = LlamaConfig, dict(num_hidden_layers=3, head_dim=16, tie_word_embeddings=True,
                                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    elif family == "llama3":
        # original_max_position_embeddings 256 puts the head_dim-16 wavelengths (6 .. 2e4
        # tokens) on all three sides of the llama3 thresholds (64 and 256 tokens): some
        # frequencies unscaled, some smoothed, some divided by `factor`.
        cls, kw = LlamaConfig, dict(head_dim=16, tie_word_embeddings=False, rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 256})
    elif family == "mistral":
        cls, kw = MistralConfig, dict(head_dim=16, tie_word_embeddings=False, sliding_window=4096,
                                      rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    elif family == "qwen2":
        cls, kw = Qwen2Config, dict(tie_word_embeddings=True, use_sliding_window=False,
                                    rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    elif family == "qwen3":
        cls, kw = Qwen3Config, dict(head_dim=32, tie_word_embeddings=True, attention_bias=False,
                                    use_sliding_window=False,
                                    rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    else:
        raise ValueError(f"unknown family {family!r}; known: {FAMILIES}")
    return cls(**{**_COMMON, **kw, **overrides})


def default_model_dir() -> Path:
    """The default model's HF directory (SmolLM2-135M-Instruct; converted once, then cached)."""
    from pdserve.engine.loader import resolve_model

    return resolve_model("default")


def make_tiny_model(family: str, out_dir: Path, *, seed: int | None = None, **overrides) -> Path:
    """Write a random-weight float32 HF checkpoint of `family` into `out_dir`; return it.

    `overrides` are transformers config fields (e.g. num_hidden_layers=3,
    tie_word_embeddings=False, rope_parameters={...}). `seed` defaults to a fixed
    per-family value, so the same call always writes the same weights.

    Raises:
        ValueError: unknown family.
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    config = _family_config(family, overrides)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if seed is None:
        seed = zlib.crc32(family.encode())
    rng_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            # transformers initialises Linear/Embedding with N(0, initializer_range) but
            # norms to 1 and biases to 0; randomise those too so that a wrong norm or a
            # dropped bias shows up in the logits.
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.uniform_(0.5, 1.5)
                elif name.endswith(".bias"):
                    p.normal_(0.0, 0.1)
    finally:
        torch.random.set_rng_state(rng_state)
    model.eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    GenerationConfig(bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID,
                     pad_token_id=EOS_TOKEN_ID).save_pretrained(out_dir)
    src = default_model_dir()
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, out_dir / name)
    return out_dir


_tmp: tempfile.TemporaryDirectory | None = None  # removed at interpreter exit (its finalizer)


def _session_root() -> Path:
    global _tmp
    if _tmp is None:
        _tmp = tempfile.TemporaryDirectory(prefix="pdserve-tiny-models-")
    return Path(_tmp.name)


@functools.cache
def tiny_model_dir(family: str) -> Path:
    """The `family` checkpoint with default settings, written once per process."""
    return make_tiny_model(family, _session_root() / family)
