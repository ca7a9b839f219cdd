"""KV pools sized from a memory budget (pdserve/kv_memory.py), as vLLM sizes its cache:
the flags' units, the weights' bytes against transformers' own count, the share of a
node each worker gets, and a pool's pages committed only as they are written."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_model, tiny_model_dir

from pdserve.config import ClusterConfig, PlannerConfig, WorkerConfig
from pdserve.engine.attention import allocate_kv_cache
from pdserve.engine.config import CacheConfig
from pdserve.kv_memory import (DECODE_WEIGHT, MIN_BLOCKS, NODE_RESERVE_BYTES, kv_cache_bytes,
                               node_memory_bytes, parse_bytes, resolve_kv_blocks, rss_bytes,
                               weight_bytes)
from pdserve.tp_group import model_config


@pytest.mark.parametrize("text, n", [("4294967296", 4 << 30), ("4GiB", 4 << 30), ("4G", 4 * 10**9),
                                     ("512MiB", 512 << 20), ("1.5gib", 3 << 29), ("64 KiB", 64 << 10),
                                     ("2gb", 2 * 10**9)])
def test_bytes_with_units(text, n):
    assert parse_bytes(text) == n


@pytest.mark.parametrize("text", ["", "-1", "0", "4 GiBs", "four", "4XB"])
def test_bytes_refused(text):
    with pytest.raises(ValueError, match="bytes"):
        parse_bytes(text)


@pytest.mark.parametrize("family, kw", [("llama", {}), ("qwen2", {}), ("qwen3", {}),
                                        ("llama3", {}), ("mistral", {})])
def test_weight_bytes_equal_the_checkpoints_parameters(family, kw, tmp_path):
    from transformers import AutoModelForCausalLM

    d = make_tiny_model(family, tmp_path / family, **kw)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    params = sum(p.numel() for p in hf.parameters())        # tied weights once
    assert weight_bytes(model_config(str(d)), torch.float32) == 4 * params
    assert weight_bytes(model_config(str(d)), torch.bfloat16) == 2 * params


def test_explicit_bytes_give_exactly_their_blocks():
    model = model_config(str(tiny_model_dir("llama")))
    per = CacheConfig(1, 16, torch.float32).bytes_per_block(model)
    cfg = resolve_kv_blocks(WorkerConfig(kv_cache_memory_bytes=100 * per + per // 2), model)
    assert cfg.num_kv_blocks == 100
    bf16 = resolve_kv_blocks(WorkerConfig(kv_cache_memory_bytes=100 * per, dtype="bfloat16"),
                             model)
    assert bf16.num_kv_blocks == 200
    # blocks given win over bytes
    assert resolve_kv_blocks(WorkerConfig(num_kv_blocks=7, kv_cache_memory_bytes=per * 100),
                             model).num_kv_blocks == 7


def test_tensor_parallel_blocks_count_every_ranks_heads():
    """4 query / 2 KV heads: at TP 2 each rank holds one KV head (the block's bytes
    split), at TP 4 each holds one too (replicated: twice the bytes of TP 1)."""
    model = model_config(str(tiny_model_dir("llama")))
    per = CacheConfig(1, 16, torch.float32).bytes_per_block(model)
    for tp, blocks in ((1, 100), (2, 100), (4, 50)):
        cfg = WorkerConfig(kv_cache_memory_bytes=100 * per, tensor_parallel_size=tp)
        assert resolve_kv_blocks(cfg, model).num_kv_blocks == blocks, tp


def test_a_share_of_the_node_less_weights_and_runtime():
    model = model_config(str(tiny_model_dir("llama")))
    cfg = WorkerConfig(memory_utilization=0.1)
    nbytes, how = kv_cache_bytes(cfg, model)
    share = int(0.1 * (node_memory_bytes("cpu") - NODE_RESERVE_BYTES))
    assert share - nbytes >= weight_bytes(model, torch.float32) + rss_bytes() // 2
    assert 0 < nbytes < share and "memory_utilization 0.100" in how
    per = CacheConfig(1, 16, torch.float32).bytes_per_block(model)
    assert resolve_kv_blocks(cfg, model).num_kv_blocks == nbytes // per


def test_a_share_too_small_names_the_flags():
    model = model_config(str(tiny_model_dir("llama")))
    with pytest.raises(ValueError, match="--gpu-memory-utilization"):
        resolve_kv_blocks(WorkerConfig(memory_utilization=1e-9), model)
    per = CacheConfig(1, 16, torch.float32).bytes_per_block(model)
    with pytest.raises(ValueError, match=f"need at least {MIN_BLOCKS}"):
        resolve_kv_blocks(WorkerConfig(kv_cache_memory_bytes=per * 3), model)


def test_one_box_shares_the_fraction_decode_heavier():
    cfg = ClusterConfig.local(prefill_workers=1, decode_workers=2)
    unit = 0.92 / (1 + 2 * DECODE_WEIGHT)
    assert cfg.prefill.memory_utilization == pytest.approx(unit)
    assert cfg.decode.memory_utilization == pytest.approx(DECODE_WEIGHT * unit)
    assert cfg.prefill.num_kv_blocks is None and cfg.decode.num_kv_blocks is None
    # the planner's heaviest mix within its budget: 1P + 3D of at most 4 workers
    planned = ClusterConfig.local(planner=PlannerConfig(1000, 100, 1, 3, 1, 3, max_workers=4),
                                  gpu_memory_utilization=0.5)
    assert planned.decode.memory_utilization == pytest.approx(0.5 * DECODE_WEIGHT / (1 + 9))
    blocks = ClusterConfig.local(prefill_blocks=3, decode_blocks=5, kv_cache_memory_bytes=1 << 20)
    assert (blocks.prefill.num_kv_blocks, blocks.decode.num_kv_blocks) == (3, 5)
    assert blocks.decode.kv_cache_memory_bytes == 1 << 20
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        ClusterConfig.local(gpu_memory_utilization=1.5)


def test_a_large_pool_costs_memory_only_as_it_fills():
    before = rss_bytes()
    cache = allocate_kv_cache((4, 2, 1024, 2, 16, 64), torch.float32, "cpu")    # 512 MiB
    assert rss_bytes() - before < 64 << 20
    assert not cache[:, :, ::97].any()                  # reads as zeros
    cache[:, :, :64].fill_(1.0)                          # 32 MiB written
    assert rss_bytes() - before < 128 << 20
    assert cache[:, :, :64].all() and not cache[:, :, 64:128].any()
