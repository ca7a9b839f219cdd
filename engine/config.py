"""Model and cache configuration: frozen dataclasses read off a transformers config."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:          # torch is imported where a dtype is built: the router reads
    import torch           # ModelConfig and CacheConfig's geometry without it

# Architectures the paged model implements (engine/model.py) and what differs among them.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or config is outside what engine/model.py implements."""


@dataclass(frozen=True)
class ModelConfig:
    """What engine/model.py needs to build a LLaMA-family decoder.

    Read from the HF config with `from_hf`, or from a model directory with `of` (which
    keeps what transformers parsed, so a process that needs no tokenizer starts
    without importing transformers). `rope_parameters` is the config's RoPE dict
    (`rope_type`, `rope_theta`, any scaling's own keys); `hf()` is the transformers
    config itself, for RoPE scaling through transformers (llama3, linear, yarn, ...).
    """

    architecture: str            # key of SUPPORTED_ARCHITECTURES' values: llama|mistral|qwen2|qwen3
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int            # GQA: num_heads % num_kv_heads == 0
    head_dim: int
    rms_norm_eps: float
    max_model_len: int           # tokens: prompt + generated must fit
    attention_bias: bool         # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool                # RMSNorm on q and k per head before RoPE (Qwen3)
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None   # tokens; only checked, see from_hf
    model_id: str                # sha256 of the config JSON: pairs P and D on one model
    rope_parameters: dict = field(repr=False, compare=False, hash=False)
    model_dir: str | None = field(default=None, repr=False, compare=False, hash=False)
    hf_config: object = field(default=None, repr=False, compare=False, hash=False)

    @classmethod
    def of(cls, model_dir: str | os.PathLike) -> "ModelConfig":
        """The ModelConfig of HF model directory `model_dir` (its config.json), parsed by
        transformers (`from_hf`) once per config content, transformers version and
        version of this module; its fields are then kept as JSON under the cache dir
        (engine/loader.cache_dir, `model-configs/`), which later calls read without
        importing transformers (~1.7 s of CPU in each worker process's start).

        Raises:
            UnsupportedModelError: as from_hf.
            OSError: config.json is unreadable.
        """
        from .loader import cache_dir, write_whole

        model_dir = Path(model_dir)
        raw = (model_dir / "config.json").read_bytes()
        # what parsed it: transformers' version and this file (from_hf, the fields)
        key = hashlib.sha256(raw + importlib.metadata.version("transformers").encode()
                             + Path(__file__).read_bytes())
        path = cache_dir() / "model-configs" / f"{key.hexdigest()[:24]}.json"
        try:
            kept = json.loads(path.read_text())
        except (OSError, ValueError):
            kept = None
        if kept is not None:
            kept["eos_token_ids"] = tuple(kept["eos_token_ids"])
            return cls(**kept, model_dir=str(model_dir))
        from transformers import AutoConfig

        cfg = cls.from_hf(AutoConfig.from_pretrained(model_dir), model_dir)
        fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls)
                  if f.name not in ("model_dir", "hf_config")}
        write_whole(path, json.dumps(fields))     # workers of one start race to write it
        return cfg

    def hf(self):
        """The transformers config (`transformers.PretrainedConfig`): the one parsed, or
        read again from `model_dir` (importing transformers) when built by `of` from
        its kept fields.

        Raises:
            ValueError: neither is there.
        """
        if self.hf_config is None:
            if self.model_dir is None:
                raise ValueError("ModelConfig without its transformers config or directory")
            from transformers import AutoConfig
            object.__setattr__(self, "hf_config", AutoConfig.from_pretrained(self.model_dir))
        return self.hf_config

    @classmethod
    def from_hf(cls, hf_config, model_dir: Path | None = None) -> "ModelConfig":
        """Build from a `transformers.PretrainedConfig`.

        Raises:
            UnsupportedModelError: an architecture or feature engine/model.py lacks.
        """
        archs = getattr(hf_config, "architectures", None) or []
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedModelError(
                f"architectures={archs}: supported are {sorted(SUPPORTED_ARCHITECTURES)}")
        num_heads = hf_config.num_attention_heads
        num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        if num_heads % num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}")
        sliding = getattr(hf_config, "sliding_window", None)
        if arch in ("qwen2", "qwen3") and not getattr(hf_config, "use_sliding_window", False):
            sliding = None  # Qwen configs carry a window they do not use
        max_len = hf_config.max_position_embeddings
        if sliding is not None and sliding < max_len:
            # Attention over the full context would differ from the reference past the
            # window; cap the context instead of silently computing something else.
            max_len = sliding
        eos = getattr(hf_config, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        blob = json.dumps(hf_config.to_dict(), sort_keys=True, default=str)
        rope = dict(getattr(hf_config, "rope_parameters", None) or {})
        rope.setdefault("rope_type", "default")
        rope.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        return cls(
            architecture=arch,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=hf_config.rms_norm_eps,
            max_model_len=max_len,
            attention_bias=bool(getattr(hf_config, "attention_bias", arch == "qwen2")),
            qk_norm=arch == "qwen3",
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            eos_token_ids=eos_ids,
            sliding_window=sliding,
            model_id=hashlib.sha256(blob.encode()).hexdigest()[:16],
            rope_parameters=json.loads(json.dumps(rope, default=str)),
            model_dir=None if model_dir is None else str(model_dir),
            hf_config=hf_config,
        )


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache geometry of one worker.

    block_size 16 tokens matches vLLM's default and flash-attn's paged kernels (which
    need a multiple of 16 for bf16 block tables on CUDA when paged).
    """

    num_blocks: int
    block_size: int = 16         # tokens per block
    dtype: torch.dtype = field(default_factory=lambda: torch_dtype("float32"))
    device: str = "cpu"

    def __post_init__(self):
        if self.num_blocks < 1:
            raise ValueError(f"num_blocks={self.num_blocks}: need at least 1 block")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size={self.block_size}: use a power of two (16 is typical)")

    def bytes_per_block(self, model: ModelConfig) -> int:
        """KV bytes of one block across all layers (K and V)."""
        elem = self.dtype.itemsize
        return model.num_layers * 2 * self.block_size * model.num_kv_heads * model.head_dim * elem

    @staticmethod
    def blocks_for_bytes(model: ModelConfig, nbytes: int, block_size: int = 16,
                         dtype: torch.dtype | None = None) -> int:
        """Blocks of `block_size` tokens (dtype: float32 when None) in `nbytes` bytes,
        at least 1."""
        per = CacheConfig(1, block_size, dtype or torch_dtype("float32")).bytes_per_block(model)
        return max(1, nbytes // per)


def torch_dtype(name: str) -> torch.dtype:
    """The torch.dtype named `name` ("float32", "bfloat16", "float16": WorkerConfig.dtype's
    choices). torch is imported here, not at this module's import: the router and the
    CLI read configs without it.

    Raises:
        AttributeError: torch has no dtype of that name."""
    import torch

    return getattr(torch, name)
