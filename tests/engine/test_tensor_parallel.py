"""engine/parallel.py and tp_executor.py: a model sharded over N tensor-parallel ranks,
each its own process (tests/engine/tp_rank.py) in a gloo group, rank 0 driving and the
others following its step orders, generates greedily what HF transformers
generates, with every step's logits within float32 noise of HF's, for the layouts the
sharding has: KV heads split across ranks (4 query / 2 KV heads at TP 2), KV heads
replicated (TP 4 over 2 KV heads: 4/2 and 8/2), q/k/v biases (Qwen2), q/k norms with a
head_dim apart from hidden/heads (Qwen3), and the default model at TP 3 (9/3 heads).

Greedy tokens must be equal; where they are not, the test requires the first divergence
to be a near-tie in HF's logits (the all-reduce sums the ranks' partial products in
another order than one GEMM does), and stops comparing there.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from pdserve.engine import cpu_ops
from pdserve.engine.config import ModelConfig
from pdserve.engine.parallel import TensorParallel
from test_fidelity import PROMPTS, _hf_model, _hf_reference
from tiny_models import default_model_dir, make_tiny_model, tiny_model_dir

RANK_SCRIPT = Path(__file__).with_name("tp_rank.py")
NEAR_TIE = 1e-4          # HF's top-2 logit gap where a summation order may flip the argmax


def run_ranks(model_dir: Path, size: int, prompts, new_tokens: int, tmp: Path,
              device: str = "cpu") -> dict:
    """Run `size` rank processes (every one on `device`); rank 0's tokens, logits and KV
    cache shape, on the CPU."""
    io = tmp / f"tp{size}.pt"
    torch.save({"prompts": [list(p) for p in prompts]}, io)
    rdzv = tmp / f"rdzv{size}"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1", PDSERVE_TP_TEST_DEVICE=device)
    procs = [subprocess.Popen([sys.executable, str(RANK_SCRIPT), str(r), str(size), str(rdzv),
                               str(model_dir), str(io), str(new_tokens)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(size)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=300)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{out[-3000:]}"
    got = torch.load(str(io) + ".out", map_location="cpu")
    for r in range(1, size):       # every follower ran every step order rank 0 sent
        assert torch.load(f"{io}.rank{r}")["calls"] == got["calls"] > 1, r
    return got


def assert_equals_hf(got: dict, refs, atol: float) -> None:
    for i, (toks, logits, (_, ref_toks, ref_logits)) in enumerate(
            zip(got["tokens"], got["logits"], refs)):
        n = next((k for k, (a, b) in enumerate(zip(toks, ref_toks)) if a != b), len(toks))
        if n < len(toks):               # must be a near-tie in HF's logits, shown here
            top2 = ref_logits[n].topk(2).values
            assert float(top2[0] - top2[1]) < NEAR_TIE, (
                f"prompt {i}: tokens diverge at step {n} without a near-tie: {toks} vs "
                f"HF {ref_toks}")
        diff = (logits[:n + 1] - ref_logits[:n + 1]).abs().amax(dim=-1)
        assert float(diff.max()) <= atol, (i, diff.tolist())


@pytest.mark.parametrize("family, size, overrides", [
    ("llama", 2, {}),                                    # 4 q / 2 KV heads: KV split
    ("llama", 4, {}),                                    # KV heads replicated, 1 q head each
    ("llama", 4, {"num_attention_heads": 8}),            # 8 / 2 at TP 4: 2 q heads per rank
    ("qwen2", 2, {}),                                    # q/k/v biases sliced
    ("qwen3", 2, {}),                                    # q/k norms, head_dim 32
    ("llama3", 2, {}),                                   # an LM head of its own (untied)
])
def test_tiny_models_sharded_equal_hf(family, size, overrides, tmp_path):
    """Greedy generation, then the other step calls through the leader: prompt logprobs
    (HF's log-softmax), a decode from a copied block (copy_blocks) and a mixed step."""
    model_dir = (make_tiny_model(family, tmp_path / "m", **overrides) if overrides
                 else tiny_model_dir(family))
    hf = _hf_model(model_dir)
    refs = [_hf_reference(hf, p, 8) for p in PROMPTS]
    got = run_ranks(model_dir, size, PROMPTS, 8, tmp_path)
    assert_equals_hf(got, refs, atol=1e-4)
    assert got["kv_cache_shape"][3] == max(1, 2 // size)   # rank 0's KV heads of the 2
    a = list(PROMPTS[0])
    with torch.inference_mode():
        want = torch.log_softmax(hf(torch.tensor([a])).logits[0].float(), dim=-1)
    for pos, (logprob, top) in enumerate(got["prompt_logprobs"]):
        assert logprob == pytest.approx(want[pos, a[pos + 1]].item(), abs=1e-4)
        assert [t for t, _ in top] == want[pos].topk(2).indices.tolist()
    from_copy, from_source = got["copy"]
    assert torch.equal(from_copy, from_source)
    assert ("mixed" in got) == cpu_ops.available()        # the C++ kernels are built
    if "mixed" in got:
        (p_mixed, d_mixed), (p_apart, d_apart) = got["mixed"]
        torch.testing.assert_close(p_mixed, p_apart, atol=1e-4, rtol=0)
        torch.testing.assert_close(d_mixed, d_apart, atol=1e-4, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("size", [2, 4])
def test_sharded_on_cuda_equals_hf(size, tmp_path):
    """The same sharded model code on CUDA tensors (Triton decode attention, the KV
    write kernel), every rank on the one device, joined by gloo; fp32 against HF's fp32
    on the CPU. A decode from a copied block and a mixed step too."""
    model_dir = tiny_model_dir("llama")
    refs = [_hf_reference(_hf_model(model_dir), p, 8) for p in PROMPTS]
    got = run_ranks(model_dir, size, PROMPTS, 8, tmp_path, device="cuda")
    assert_equals_hf(got, refs, atol=1e-3)
    from_copy, from_source = got["copy"]
    torch.testing.assert_close(from_copy, from_source, atol=1e-5, rtol=0)
    if "mixed" in got:
        (p_mixed, d_mixed), (p_apart, d_apart) = got["mixed"]
        torch.testing.assert_close(p_mixed, p_apart, atol=1e-3, rtol=0)
        torch.testing.assert_close(d_mixed, d_apart, atol=1e-3, rtol=0)


@pytest.mark.slow
def test_default_model_at_tp3_equals_hf(tmp_path):
    """SmolLM2-135M (9 query / 3 KV heads, intermediate 1536, vocab 49152) over 3 ranks:
    one KV head each."""
    model_dir = default_model_dir()
    prompts = PROMPTS[:3]
    refs = [_hf_reference(_hf_model(model_dir), p, 6) for p in prompts]
    got = run_ranks(model_dir, 3, prompts, 6, tmp_path)
    assert_equals_hf(got, refs, atol=1e-3)
    assert got["kv_cache_shape"][3] == 1


def test_each_rank_reads_only_its_slices_of_the_checkpoint(monkeypatch):
    """load_model at TP 2 reads whole tensors only where nothing is sharded (norms);
    every projection, the embedding and the LM head through lazy slices."""
    import safetensors

    from pdserve.engine.model_runner import load_model
    whole, sliced = [], []
    real = safetensors.safe_open

    class Recording:
        def __init__(self, *args, **kw):
            self.f = real(*args, **kw)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_tensor(self, name):
            whole.append(name)
            return self.f.get_tensor(name)

        def get_slice(self, name):
            sliced.append(name)
            return self.f.get_slice(name)

    monkeypatch.setattr(safetensors, "safe_open", Recording)
    cfg, net, _ = load_model(tiny_model_dir("qwen2"), tp=TensorParallel(1, 2, object()))
    assert whole and all(n.endswith("norm.weight") for n in whole), whole
    assert any("q_proj.bias" in n for n in sliced) and "model.embed_tokens.weight" in sliced
    layer = net.model.layers[0]
    assert layer.self_attn.q_proj.weight.shape == (2 * cfg.head_dim, cfg.hidden_size)
    assert layer.mlp.down_proj.weight.shape == (cfg.hidden_size, cfg.intermediate_size // 2)
    assert net.model.embed_tokens.weight.shape[0] == cfg.vocab_size // 2


def test_sizes_that_do_not_divide_the_model_are_refused():
    from transformers import AutoConfig
    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(tiny_model_dir("llama")))
    group = object()               # check() needs no collective
    with pytest.raises(ValueError, match="num_attention_heads=4"):
        TensorParallel(0, 3, group).check(cfg)
    with pytest.raises(ValueError, match="num_key_value_heads=3"):   # 24 / 3 heads at TP 8
        TensorParallel(0, 8, group).check(replace(cfg, num_heads=24, num_kv_heads=3))
    TensorParallel(0, 4, group).check(cfg)              # 2 KV heads replicated on 4 ranks


def test_each_rank_holds_its_heads_and_the_kv_heads_they_read():
    from transformers import AutoConfig
    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(tiny_model_dir("llama")))
    g = object()
    group = cfg.num_heads // cfg.num_kv_heads            # query heads per KV head
    for size in (1, 2, 4):
        for rank in range(size):
            tp = TensorParallel(rank, size, g if size > 1 else None)
            q = range(rank * tp.num_heads(cfg), (rank + 1) * tp.num_heads(cfg))
            assert {h // group for h in q} <= set(tp.kv_heads(cfg)), (size, rank)
    assert [TensorParallel(r, 4, g).kv_heads(cfg) for r in range(4)] == [
        range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
