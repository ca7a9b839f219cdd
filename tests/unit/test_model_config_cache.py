"""engine/config.ModelConfig.of: transformers parses a model's config once per content
(and transformers and module version); later reads of the kept fields, in any process,
equal that parse and import no transformers."""

import json
import os
import subprocess
import sys

import pytest
from tiny_models import FAMILIES, make_tiny_model, tiny_model_dir
from transformers import AutoConfig

from pdserve.engine import loader
from pdserve.engine.config import ModelConfig


def _same(a: ModelConfig, b: ModelConfig) -> None:
    assert a == b                              # every compared field, model_id included
    assert a.rope_parameters == b.rope_parameters


@pytest.mark.parametrize("family", FAMILIES)
def test_a_kept_config_equals_the_transformers_parse(family, tmp_path, monkeypatch):
    d = tiny_model_dir(family)       # before the cache moves: it reads the default model's
    monkeypatch.setattr(loader, "cache_dir", lambda: tmp_path)     # conversion there
    parsed = ModelConfig.from_hf(AutoConfig.from_pretrained(d))
    first = ModelConfig.of(d)                  # parsed by transformers, then kept
    kept = ModelConfig.of(d)                   # read from what was kept
    assert first.hf_config is not None and kept.hf_config is None
    _same(first, parsed)
    _same(kept, parsed)
    assert kept.hf().to_dict() == parsed.hf_config.to_dict()
    assert len(list((tmp_path / "model-configs").iterdir())) == 1


def test_another_process_reads_the_kept_config_without_transformers(tmp_path):
    d = tiny_model_dir("llama3")               # RoPE scaling: its tables need hf() later
    env = os.environ | {"PDSERVE_CACHE": str(tmp_path)}
    code = ("import sys; from pdserve.engine.config import ModelConfig; "
            f"c = ModelConfig.of({str(d)!r}); "
            "print(c.model_id, 'transformers' in sys.modules)")
    runs = [subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                           text=True, check=True).stdout.split() for _ in range(2)]
    model_id = ModelConfig.from_hf(AutoConfig.from_pretrained(d)).model_id
    assert runs == [[model_id, "True"], [model_id, "False"]]


def test_a_changed_config_is_parsed_again(tmp_path, monkeypatch):
    d = make_tiny_model("llama", tmp_path / "m")
    monkeypatch.setattr(loader, "cache_dir", lambda: tmp_path / "cache")
    before = ModelConfig.of(d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-3
    (d / "config.json").write_text(json.dumps(cfg))
    after = ModelConfig.of(d)
    assert after.hf_config is not None         # a parse, not the kept fields
    assert after.rms_norm_eps == 1e-3 and after.model_id != before.model_id
