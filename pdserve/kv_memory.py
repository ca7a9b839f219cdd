"""A worker's KV pool from a memory budget, as vLLM sizes its KV cache.

vLLM gives one engine `--gpu-memory-utilization` (0.92 in 0.32) of its device's memory
(on its CPU backend: of the machine's, "despite its name") and makes the KV cache what
is left of that once the weights and the process are in, or exactly
`--kv-cache-memory-bytes` (`VLLM_CPU_KVCACHE_SPACE` GiB) when given
(vllm/v1/worker/cpu_worker.py, `determine_available_memory`). pdserve runs several
workers on a node, so the fraction is shared: each worker gets `memory_utilization`, its
share of the node's memory (ClusterConfig.local: decode workers DECODE_WEIGHT times a
prefill worker's, since the decode pool is what bounds the batch), and its pool is that
share less what the worker holds besides KV:

    kv_bytes   = memory_utilization x (node memory - NODE_RESERVE_BYTES) - non-KV
    non-KV     = weights + (this process's RSS now + activations) x TP ranks
    num_blocks = kv_bytes // bytes of one block over all ranks

On a CPU node the workers share the machine with Ray's own processes, the router, a
client and the OS, which NODE_RESERVE_BYTES keeps for them: vLLM 0.32 at its 0.92 of
this 24 GiB box was killed by the kernel's OOM killer in its first burst (its worker's
RSS reached 22.5 GiB against the 20.1 GiB it planned). On CUDA the node memory is the
device's, with no reserve, and the process's host RSS is replaced by CUDA_CONTEXT_BYTES.
The pool's pages are committed as blocks are first written (engine/attention.py
allocate_kv_cache), so a large pool costs nothing until it fills.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import replace

import torch

logger = logging.getLogger(__name__)

DECODE_WEIGHT = 3            # a decode worker's share of a node's memory, in prefill
                             # workers' shares
CUDA_CONTEXT_BYTES = 1 << 30  # CUDA context, cuBLAS/flash-attn workspaces (an estimate)
NODE_RESERVE_BYTES = 2 << 30  # a CPU node's memory kept from the workers: Ray's GCS,
                             # raylet and dashboard, the router, the OS (~1.5 GiB here)
MIN_BLOCKS = 16              # a budget that leaves fewer is refused

_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_bytes(text: str) -> int:
    """Bytes from "4294967296", "4GiB", "4G" or "512MiB" (decimal K/M/G/T, binary
    Ki/Mi/Gi/Ti; a trailing "B" optional), as `--kv-cache-memory-bytes` takes them.

    Raises:
        ValueError: not a positive amount of bytes.
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*", text.lower())
    if m is None or not float(m.group(1)) > 0:
        raise ValueError(f"{text!r}: give bytes as a number with an optional unit "
                         "(e.g. 4GiB, 512MiB, 4000000000)")
    return int(float(m.group(1)) * _UNITS[m.group(2) or ""])


def node_memory_bytes(device: str) -> int:
    """Memory of the device a worker's KV lives on: a CUDA device's total, or this
    machine's RAM, less where a cgroup limits this process to less (a Kubernetes pod's
    limits.memory)."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_properties(torch.device(device)).total_memory
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                limit = f.read().strip()
        except OSError:
            continue
        if limit.isdigit():
            total = min(total, int(limit))
    return total


def weight_bytes(model, dtype: torch.dtype) -> int:
    """Bytes of a LLaMA-family model's parameters (engine/config.py ModelConfig) at
    `dtype`, all ranks together."""
    h, hd = model.hidden_size, model.head_dim
    q, kv = model.num_heads * hd, model.num_kv_heads * hd
    layer = (h * (q + 2 * kv) + q * h + 3 * h * model.intermediate_size + 2 * h
             + (q + 2 * kv if model.attention_bias else 0) + (2 * hd if model.qk_norm else 0))
    embed = model.vocab_size * h * (1 if model.tie_word_embeddings else 2)
    elem = torch.empty((), dtype=dtype).element_size()
    return (model.num_layers * layer + embed + h) * elem


def activation_bytes(model, max_num_batched_tokens: int, max_batch_size: int) -> int:
    """Working memory of one step (an upper estimate): a prefill step's hidden states
    and MLP activations in float32, and float32 logits of a full decode batch."""
    per_token = 8 * model.hidden_size + 3 * model.intermediate_size
    return 4 * (max_num_batched_tokens * per_token + max_batch_size * model.vocab_size)


def rss_bytes() -> int:
    """This process's resident memory."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def kv_cache_bytes(config, model) -> tuple[int, str]:
    """The KV bytes of a worker (`config`: a WorkerConfig whose num_kv_blocks is None)
    and how they were found, for the log.

    Raises:
        ValueError: the share leaves no memory for KV after the weights.
    """
    if config.kv_cache_memory_bytes is not None:
        return config.kv_cache_memory_bytes, "kv_cache_memory_bytes"
    from .engine.config import torch_dtype

    dtype, tp = torch_dtype(config.dtype), config.tensor_parallel_size
    cuda = config.device.startswith("cuda")
    total = node_memory_bytes(config.device) - (0 if cuda else NODE_RESERVE_BYTES)
    process = CUDA_CONTEXT_BYTES if cuda else rss_bytes()
    non_kv = (weight_bytes(model, dtype)
              + tp * (process + activation_bytes(model, config.max_num_batched_tokens,
                                                 config.max_batch_size)))
    share = int(config.memory_utilization * total)
    how = (f"memory_utilization {config.memory_utilization:.3f} of {total / 2**30:.1f} GiB "
           f"(the node's less its reserve) less {non_kv / 2**30:.2f} GiB of weights, "
           "activations and process")
    if share <= non_kv:
        raise ValueError(f"memory_utilization={config.memory_utilization:.3f} of "
                         f"{total / 2**30:.1f} GiB leaves no KV memory after "
                         f"{non_kv / 2**30:.2f} GiB of weights and runtime: raise "
                         "--gpu-memory-utilization or give --kv-cache-memory-bytes")
    return share - non_kv, how


def resolve_kv_blocks(config, model):
    """`config` (a WorkerConfig) with num_kv_blocks set: as given, or from its KV bytes
    (kv_cache_bytes) over the bytes of one block on all of its TP ranks.

    Raises:
        ValueError: fewer than MIN_BLOCKS blocks fit.
    """
    if config.num_kv_blocks is not None:
        return config
    from .engine.config import CacheConfig, torch_dtype
    from .engine.parallel import kv_head_range

    nbytes, how = kv_cache_bytes(config, model)
    tp = config.tensor_parallel_size
    per_head = (CacheConfig(1, config.block_size, torch_dtype(config.dtype)).bytes_per_block(model)
                // model.num_kv_heads)
    per_block = per_head * sum(len(kv_head_range(model.num_kv_heads, tp, r)) for r in range(tp))
    blocks = nbytes // per_block
    if blocks < MIN_BLOCKS:
        raise ValueError(f"{nbytes / 2**20:.0f} MiB of KV ({how}) hold {blocks} blocks of "
                         f"{per_block / 2**20:.2f} MiB; need at least {MIN_BLOCKS}: raise "
                         "--gpu-memory-utilization or --kv-cache-memory-bytes")
    logger.info("KV pool: %d blocks x %d tokens = %.2f GiB (%s)", blocks, config.block_size,
                blocks * per_block / 2**30, how)
    return replace(config, num_kv_blocks=blocks)
