"""`pdserve bench gpu`: the FLOP and byte accounting (bench/flops.py) against hand-computed
figures, the
checkpoint and measurement plumbing on CPU, the refusal without CUDA, and (gpu marker)
a quick run of the command itself."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from pdserve.bench import flops, gpu
from pdserve.bench.flops import ModelShape, decode_step_bytes, prefill_flops
from pdserve.bench.gpu import GpuBenchConfig, GpuReport
from pdserve.engine.config import ModelConfig
from pdserve.engine.model_runner import load_model
from tiny_models import FAMILIES, tiny_model_dir

# vocab 10, d 4, d_ff 8, 2 layers, 2 heads, 1 KV head, head_dim 2: d_attn 4, d_kv 2
TINY = ModelShape(vocab_size=10, hidden_size=4, intermediate_size=8, num_layers=2, num_heads=2,
                  num_kv_heads=1, head_dim=2)


def test_prefill_flops_by_hand():
    # per layer matmul params: q 4*4 + k,v 2*4*2 + o 4*4 + mlp 3*4*8 = 16 + 16 + 16 + 96 = 144
    assert TINY.layer_matmul_params == 144
    # T=3, C=0: matmuls 2*3*2*144 = 1728; attention 4*2*4*(1+2+3) = 192; LM head 2*4*10 = 80
    assert prefill_flops(TINY, 3) == 1728 + 192 + 80 == 2000
    # T=1 after C=2 cached: 2*1*2*144 = 576; 4*2*4*3 = 96 (three keys); 80
    assert prefill_flops(TINY, 1, cached_tokens=2) == 576 + 96 + 80


def test_decode_bytes_by_hand():
    # layer params 144 + two norms 2*4 = 152; x2 layers + final norm 4 + LM head 10*4 = 348
    assert TINY.decode_weight_params == 348
    # KV per token: 2 layers * (K, V) * d_kv 2 * 2 bytes = 16; contexts 3 + 5 = 8 tokens
    assert decode_step_bytes(TINY, [3, 5], dtype_bytes=2) == (348 * 2, 8 * 16)
    bias = ModelShape(10, 4, 8, 2, 2, 1, 2, attention_bias=True, qk_norm=True)
    # + biases (4 + 2*2) and q/k norms (2*2) per layer
    assert bias.decode_weight_params == 348 + 2 * (8 + 4)


def test_units():
    assert flops.gemm_tflops(1000, 1e-3) == pytest.approx(2.0)     # 2e9 FLOPs in 1 ms
    assert flops.copy_gbps(10**9, 1.0) == pytest.approx(2.0)        # read + write


@pytest.mark.parametrize("family", FAMILIES)
def test_weight_params_match_the_real_model(family):
    """decode_weight_params is every parameter but an untied input embedding."""
    cfg, net, _ = load_model(tiny_model_dir(family))
    shape = ModelShape.of(cfg)
    total = sum(p.numel() for p in net.parameters())                # tied counted once
    embedding = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    assert shape.decode_weight_params == total - embedding
    linear = sum(m.weight.numel() for m in net.model.layers.modules()
                 if isinstance(m, torch.nn.Linear))
    assert shape.num_layers * shape.layer_matmul_params == linear


def test_llama_1b_shape():
    """Llama-3.2-1B has 1,235,814,400 parameters (tied embeddings)."""
    shape = ModelShape.of(ModelConfig.from_hf(gpu.llama_1b_config()))
    assert (shape.num_layers, shape.hidden_size, shape.num_heads, shape.num_kv_heads,
            shape.head_dim, shape.vocab_size) == (16, 2048, 32, 8, 64, 128256)
    assert shape.decode_weight_params == 1_235_814_400


def test_measure_model_plumbing_on_cpu(tmp_path):
    """The random checkpoint loads through ModelRunner and measure_model's figures follow
    from its own accounting (timings on CPU mean nothing; only the plumbing is checked)."""
    hf = gpu.llama_1b_config(vocab_size=1000, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=16, max_position_embeddings=256)
    d = gpu.write_random_checkpoint(hf, tmp_path / "m")
    p, dec = gpu.measure_model("tiny", d, num_prompts=2, prompt_tokens=40, decode_batch=3,
                               decode_context=20, repeats=1, decode_steps=1, block_size=16,
                               enforce_eager=False, peak_tflops=1.0, copy_bw_gbps=1.0,
                               device="cpu")
    shape = ModelShape(1000, 64, 128, 2, 4, 2, 16)
    assert p.flops == 2 * prefill_flops(shape, 40)
    assert p.tflops == pytest.approx(p.flops / p.seconds / 1e12)
    assert p.mfu == pytest.approx(p.tflops)                         # peak 1 TFLOP/s
    assert (dec.weight_bytes, dec.kv_bytes) == decode_step_bytes(shape, [20] * 3, 2)
    assert not dec.cuda_graphs                       # CPU: eager, whatever enforce_eager says
    assert dec.gbps == pytest.approx((dec.weight_bytes + dec.kv_bytes) / dec.step_s / 1e9)


def test_table_and_json_of_a_report():
    """Formatting only: the figures are made up for the test."""
    r = GpuReport("dev", "t", "flash-attn", 256, 8192, 100.0, 1 << 30, 1000.0)
    r.prefill.append(gpu.PrefillFigure("m", 4, 4096, 10**15, 2.0, 0.5 * 1e3, 0.6))
    r.prefill.append(gpu.PrefillFigure("m", 1, 512, 10**12, 1.0, 1.0, 0.01))
    r.decode.append(gpu.DecodeFigure("m", 64, 1024, 10**9, 10**9, True, 0.004, 500.0, 0.5,
                                     0.008, 250.0))
    r.transfer.append(gpu.TransferFigure("tcp", 10**9, 0.5, 2.0, 0.002))
    r.transfer.append(gpu.TransferFigure("ucx", 10**9, None, None, None, "ImportError: x"))
    text = gpu.table(r)
    assert "met (>= 0.50)" in text and "n/a (< 4096 tokens)" in text
    assert "missed (>= 0.60)" in text and "failed: ImportError: x" in text
    assert list(r.goals().values()) == [True, False]
    json.dumps(gpu.as_json(r, GpuBenchConfig()))


def test_config_validation():
    with pytest.raises(ValueError, match="transports"):
        GpuBenchConfig(transports=("rdma",))
    with pytest.raises(ValueError, match="decode_batch"):
        GpuBenchConfig(decode_batch=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_cli_refuses_without_cuda(capsys):
    from pdserve.cli import main

    assert main(["bench", "gpu"]) == 2
    assert ("pdserve bench gpu needs a CUDA device: torch.cuda.is_available() is False"
            in capsys.readouterr().err)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bench_gpu_runs_small(tmp_path):
    out = tmp_path / "g.json"
    r = subprocess.run([sys.executable, "-m", "pdserve.cli", "bench", "gpu", "--models", "default",
                        "--num-prompts", "1", "--prompt-tokens", "256", "--decode-batch", "64",
                        "--decode-context", "64", "--gemm-n", "2048", "--copy-mib", "64",
                        "--repeats", "2", "--decode-steps", "3", "--transports", "tcp",
                        "--kv-requests", "1", "--kv-prompt-tokens", "64", "--json", str(out)],
                       check=False, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    rep = res["report"]
    assert rep["gemm_tflops"] > 0 and rep["copy_gbps"] > 0
    (p,), (d,), (t,) = rep["prefill"], rep["decode"], rep["transfer"]
    assert p["mfu"] == pytest.approx(p["tflops"] / rep["gemm_tflops"], rel=1e-6)
    assert d["copy_ratio"] == pytest.approx(d["gbps"] / rep["copy_gbps"], rel=1e-6)
    assert t["error"] is None and t["gbps"] > 0
    assert "decode >= 0.60 copy bandwidth (default, batch 64)" in res["goals"]
