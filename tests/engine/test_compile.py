"""engine/compile.py: the decoder layers through torch.compile. One graph per step
shape class (one token; one sequence of several; several sequences), all compiled by
the warm-up at start, so no request meets a compile; the same logits as the eager step,
bit for bit (the same C++ kernels run); Inductor's cache under the model cache."""

import os

import pytest
import torch
import torch._dynamo.utils

from pdserve.engine import compile as engine_compile
from pdserve.engine.config import CacheConfig
from pdserve.engine.model_runner import DecodeSeq, ModelRunner, PrefillSeq
from tiny_models import tiny_model_dir


def graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def test_no_step_compiles_after_the_warm_up_and_logits_equal_eager():
    eager = ModelRunner(tiny_model_dir("llama"), CacheConfig(num_blocks=40, block_size=16))
    compiled = ModelRunner(tiny_model_dir("llama"), CacheConfig(num_blocks=40, block_size=16),
                           compile_model=True)
    assert compiled.compiled and compiled.model.compiled
    after_warm_up = graphs()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(17, 1000, (n,), generator=g).tolist() for n in (1, 40, 7, 100)]
    tables = [[4 + 8 * i + j for j in range(8)] for i in range(len(prompts))]
    for runner in (eager, compiled):
        runner.kv_cache.zero_()
    steps = [   # shapes the warm-up did not run: other sizes, a prefix, one token
        lambda r: r.prefill([PrefillSeq(p, t) for p, t in zip(prompts, tables)]),
        lambda r: r.prefill([PrefillSeq(prompts[1] + [5, 6, 7], tables[1], num_computed_tokens=40)]),
        lambda r: r.decode([DecodeSeq(3, len(p), t) for p, t in zip(prompts, tables)]),
        lambda r: r.decode([DecodeSeq(9, 101, tables[3])]),
        lambda r: r.prefill([PrefillSeq([8, 9], tables[0][:1])]),
    ]
    for step in steps:
        torch.testing.assert_close(step(compiled), step(eager), rtol=0, atol=0)
    assert graphs() == after_warm_up, "a step shape compiled after the warm-up"
    assert torch.equal(compiled.kv_cache[:, :, 4:], eager.kv_cache[:, :, 4:])


def test_inductor_cache_goes_under_the_model_cache_unless_set(monkeypatch, tmp_path):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())   # torch's own
    assert engine_compile.inductor_cache_dir() == str(tmp_path / "inductor")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))  # the user's
    assert engine_compile.inductor_cache_dir() == str(tmp_path / "mine")


def test_compile_needs_the_cpu_kernels_else_stays_eager(monkeypatch):
    runner = ModelRunner(tiny_model_dir("llama"), CacheConfig(num_blocks=8, block_size=8),
                         compile_model=True)         # block_size 8: not the kernels'
    assert not runner.compiled and runner.kv_cache_id is None
    with pytest.raises(ValueError, match="4 KV blocks"):
        engine_compile.warm_up(ModelRunner(tiny_model_dir("llama"),
                                           CacheConfig(num_blocks=3, block_size=16)))
