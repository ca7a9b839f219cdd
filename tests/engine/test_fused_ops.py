"""engine/csrc/fused_ops.cpp (engine/cpu_ops.py): the decoder layer's fused elementwise
ops against the torch ops they replace (transformers' arithmetic, engine/model.py's
fallback path), in fp32 and bf16. RoPE and the residual add do the same roundings as
torch, so they are compared bit for bit; the RMS sum's order and SiLU's exp differ, so
those are compared to about one ulp. `make` builds the kernels; a missing build fails."""

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine import cpu_ops, model
from pdserve.engine.model import RMSNorm, _rotate_half

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module", autouse=True)
def built():
    assert cpu_ops.available(), f"CPU kernels not built ({cpu_ops.library_path()}): run make"


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def torch_norm(hidden: int, weight: torch.Tensor, monkeypatch) -> RMSNorm:
    """An RMSNorm module forced onto its torch path."""
    monkeypatch.setattr(model, "use_fused_ops", lambda x: False)
    norm = RMSNorm(hidden, 1e-5)
    norm.weight.data = weight.clone()
    return norm


def close_to_ulp(got: torch.Tensor, ref: torch.Tensor, ulps: int) -> bool:
    """Within `ulps` units in the last place of the dtype, relative to the magnitude (or
    1e-30 absolute: SiLU of a very negative gate is 0 in torch, ~1e-36 here)."""
    eps = torch.finfo(ref.dtype).eps
    tol = (ulps * eps * ref.float().abs()).clamp_min(1e-30)
    return bool(((got.float() - ref.float()).abs() <= tol).all())


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_fused_residual_add_match_llama_rmsnorm(dtype, monkeypatch):
    tokens, hidden = 37, 576                       # hidden not a multiple of 16 * 37
    x = (torch.randn(tokens, hidden, generator=gen(0)) * 3).to(dtype)
    residual = torch.randn(tokens, hidden, generator=gen(1)).to(dtype)
    w = (torch.rand(hidden, generator=gen(2)) + 0.5).to(dtype)
    got = cpu_ops.rms_norm(x, w, 1e-5)
    norm = torch_norm(hidden, w, monkeypatch)
    assert got.dtype == dtype and close_to_ulp(got, norm(x), ulps=4)

    x2, r2 = x.clone(), residual.clone()
    cpu_ops.fused_add_rms_norm(x2, r2, w, 1e-5)
    assert torch.equal(r2, x + residual)           # the add rounds as torch's does
    assert close_to_ulp(x2, norm(x + residual), ulps=4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_embedding_in_place_equals_rotate_half_bit_for_bit(dtype):
    tokens, h, h_kv, d = 29, 9, 3, 64
    qkv = torch.randn(tokens, (h + 2 * h_kv) * d, generator=gen(3)).to(dtype)
    q = qkv[:, :h * d].view(tokens, h, d)          # strided rows, as the fused QKV's views
    k = qkv[:, h * d:(h + h_kv) * d].view(tokens, h_kv, d)
    v_before = qkv[:, (h + h_kv) * d:].clone()
    positions = torch.randint(0, 500, (tokens,), generator=gen(4))
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)
    emb = torch.outer(torch.arange(512).float(), inv).repeat(1, 2)
    cos, sin = emb.cos(), emb.sin()
    c = cos[positions].unsqueeze(1).to(dtype)
    s = sin[positions].unsqueeze(1).to(dtype)
    q_ref, k_ref = q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s
    cpu_ops.rotary_embedding(q, k, positions, cos, sin)
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)
    assert torch.equal(qkv[:, (h + h_kv) * d:], v_before)     # v untouched


def test_silu_and_mul_fp32_is_within_16_ulp_of_exact():
    """fp32: against float64 truth (the polynomial exp is ~10 ulp off at worst, for very
    negative gates whose output is tiny; torch's own silu is ~2 ulp off)."""
    gate_up = torch.randn(41, 2 * 1536, generator=gen(5)) * 4
    gate_up[0, :4] = torch.tensor([-100.0, -30.0, 30.0, 0.0])  # clamp, both signs, 0
    gate, up = gate_up.chunk(2, dim=-1)
    got = cpu_ops.silu_and_mul(gate_up)
    exact = (F.silu(gate.double()) * up.double()).float()
    assert got.shape == (41, 1536) and got.dtype == torch.float32
    assert close_to_ulp(got, exact, ulps=16)


def test_silu_and_mul_bf16_rounds_as_torch():
    gate_up = (torch.randn(41, 2 * 1536, generator=gen(6)) * 4).to(torch.bfloat16)
    gate, up = gate_up.chunk(2, dim=-1)
    assert close_to_ulp(cpu_ops.silu_and_mul(gate_up), F.silu(gate) * up, ulps=1)


def test_model_takes_the_fused_path_on_cpu():
    assert model.use_fused_ops(torch.zeros(2, dtype=torch.float32))
    assert model.use_fused_ops(torch.zeros(2, dtype=torch.bfloat16))
    assert not model.use_fused_ops(torch.zeros(2, dtype=torch.float16))   # torch ops


def test_bad_input_is_refused_with_the_reason():
    q, k = torch.zeros(2, 9, 64), torch.zeros(2, 3, 64)
    cos = sin = torch.zeros(16, 64)
    with pytest.raises(RuntimeError, match=r"positions\[1\]=16 is outside the table's 16"):
        cpu_ops.rotary_embedding(q, k, torch.tensor([0, 16]), cos, sin)
    with pytest.raises(RuntimeError, match="cos and sin must be contiguous float32"):
        cpu_ops.rotary_embedding(q, k, torch.tensor([0, 1]), cos.double(), sin.double())
    with pytest.raises(RuntimeError, match="weight must be"):
        cpu_ops.rms_norm(torch.zeros(2, 8), torch.zeros(7), 1e-5)
    with pytest.raises(RuntimeError, match="gate_up must be"):
        cpu_ops.silu_and_mul(torch.zeros(2, 7))
