"""engine/attention.py's choice of back end per device, without CUDA: flash-attn's and
triton's presence are monkeypatched, and the Triton ops are stand-ins (no kernel runs)."""

import pytest
import torch

from pdserve.engine import attention
from pdserve.engine.attention import AttentionMetadata

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


class FakeOps:
    """Stands in for engine/triton_attention.py; records what each entry point got."""

    def __init__(self):
        self.calls = []
        self.cache_shapes = []   # the Triton kernels take [blocks, block_size, kv_heads, d]

    def paged_decode_attention(self, q, k_cache, v_cache, block_table, context_lens, scale):
        self.calls.append(("decode", block_table, context_lens, scale))
        self.cache_shapes.append(tuple(k_cache.shape))
        return torch.zeros_like(q)

    def store_kvcache(self, k, v, k_cache, v_cache, slot_mapping):
        self.calls.append(("store", slot_mapping))
        self.cache_shapes.append(tuple(k_cache.shape))


@pytest.fixture
def ops(monkeypatch):
    fake = FakeOps()
    monkeypatch.setattr(attention, "_flash_attn", lambda: None)
    monkeypatch.setattr(attention, "_triton_ops", lambda: fake)
    return fake


def test_cuda_without_flash_attn_picks_triton(ops):
    assert attention.use_triton(CUDA) and not attention.use_flash_attn(CUDA)
    assert attention.attention_backend(CUDA) == "SDPA prefill, Triton decode"
    assert not attention.use_triton(CPU)
    assert attention.attention_backend(CPU) == "C++ paged attention"  # make built it


def test_flash_attn_or_no_triton_keeps_the_other_paths(ops, monkeypatch):
    monkeypatch.setattr(attention, "_flash_attn", lambda: object())
    assert not attention.use_triton(CUDA) and attention.attention_backend(CUDA) == "flash-attn"
    monkeypatch.setattr(attention, "_flash_attn", lambda: None)
    monkeypatch.setattr(attention, "_triton_ops", lambda: None)   # triton not importable
    assert not attention.use_triton(CUDA) and attention.attention_backend(CUDA) == "SDPA"


def test_cpu_never_imports_triton(monkeypatch):
    def boom():
        raise AssertionError("CPU asked for the Triton ops")

    monkeypatch.setattr(attention, "_triton_ops", boom)
    assert not attention.use_triton(CPU)


def test_decode_and_kv_write_route_to_triton_ops(ops, monkeypatch):
    # CPU tensors stand in for CUDA ones: only the device predicate is forced
    monkeypatch.setattr(attention, "use_triton", lambda device: True)
    k_cache = torch.zeros(4, 1, 2, 8)     # [blocks, kv_heads, block_size, head_dim]
    v_cache = torch.zeros(4, 1, 2, 8)
    table = torch.tensor([[3, 1]], dtype=torch.int32)
    ctx = torch.tensor([3], dtype=torch.int32)
    slots = torch.tensor([3])
    meta = AttentionMetadata(is_prefill=False, slot_mapping=slots, block_table=table,
                             context_lens=ctx, max_context_len=3, context_lens_host=(3,))
    attention.write_kv(torch.ones(1, 1, 8), torch.ones(1, 1, 8), k_cache, v_cache, slots)
    out = attention.decode_attention(torch.ones(1, 2, 8), k_cache, v_cache, meta, 0.5)
    assert ops.calls == [("store", slots), ("decode", table, ctx, 0.5)]
    assert ops.cache_shapes == [(4, 2, 1, 8)] * 2   # flash-attn's layout, a view of pdserve's
    assert not k_cache.any()                      # the stand-in wrote nothing: no CPU fallback
    assert out.shape == (1, 2, 8)


def test_flash_attn_with_a_block_size_it_refuses_decodes_with_triton(ops, monkeypatch):
    """flash-attn's paged decode takes block sizes in multiples of 256 only: with 16-token
    blocks (the default) decode goes to the Triton kernel even when flash-attn is there."""
    monkeypatch.setattr(attention, "use_flash_attn", lambda device: True)
    k_cache = torch.zeros(4, 1, 16, 8)
    table = torch.tensor([[3]], dtype=torch.int32)
    ctx = torch.tensor([3], dtype=torch.int32)
    meta = AttentionMetadata(is_prefill=False, slot_mapping=torch.tensor([3]), block_table=table,
                             context_lens=ctx, max_context_len=3, context_lens_host=(3,))
    attention.decode_attention(torch.ones(1, 2, 8), k_cache, k_cache.clone(), meta, 0.5)
    assert ops.calls == [("decode", table, ctx, 0.5)]


def test_decode_on_device_says_when_cuda_graphs_can_capture(ops, monkeypatch):
    assert attention.decode_on_device(CUDA, 16)                  # Triton, no flash-attn
    assert not attention.decode_on_device(CPU, 16)
    monkeypatch.setattr(attention, "_flash_attn", lambda: object())
    assert attention.decode_on_device(CUDA, 256)                 # flash-attn's paged decode
    assert attention.decode_on_device(CUDA, 16)                  # Triton for small blocks
    monkeypatch.setattr(attention, "_triton_ops", lambda: None)
    assert not attention.decode_on_device(CUDA, 16)              # SDPA: host-side lengths


def _thp_mode():
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return None
    return text[text.index("[") + 1:text.index("]")]


def _huge_kib_of(ptr):
    """AnonHugePages (KiB) of the mapping of this process holding address ``ptr``."""
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            if lo <= ptr < hi:
                for field in lines[i + 1:]:
                    if field.startswith("AnonHugePages:"):
                        return int(field.split()[1])
    return 0


def test_the_kv_cache_reads_zero_and_its_written_blocks_are_on_huge_pages():
    shape = (4, 2, 64, 3, 16, 64)            # 12 MiB of fp32
    kv = attention.allocate_kv_cache(shape, torch.float32, "cpu")
    assert kv.shape == shape and kv.dtype == torch.float32 and kv.is_contiguous()
    assert not kv.any()
    if _thp_mode() not in ("madvise", "always"):
        pytest.skip("transparent huge pages are off on this kernel")
    kv[1].fill_(1.0)                         # layer 1's K and V (3 MiB): a block written
    assert _huge_kib_of(kv[1].data_ptr() + kv[1].nbytes // 2) >= 2048
