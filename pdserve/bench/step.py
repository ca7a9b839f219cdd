"""`pdserve bench step`: time of one decode step (and one prefill step) of the engine,
per optimization, against the engine without it, in the same process.

Variants, each adding to the one before:
    eager           transformers' nn.Linear (F.linear, MKL), decode attention as gather +
                    SDPA per group of similar-length sequences (attention.py fallback)
    +prepacked      every linear a oneDNN-prepacked GEMM, q/k/v and gate/up fused
                    (engine/model.py PackedLinear)
    +paged_kernel   attention (prefill and decode) and the KV write by the C++ kernels
                    reading KV blocks in place (engine/csrc/paged_attention.cpp)
    +fused_ops      RMSNorm with the residual add, RoPE and SiLU-and-mul by the C++
                    kernels of engine/csrc/fused_ops.cpp (one pass each): the serving path
    +torch.compile  the same, the decoder layers through torch.compile (Inductor, one
                    graph for every layer: engine/compile.py), a runner of its own

Decode: `batch` sequences of `context` tokens each (random ids; a step's cost does not
depend on the values), blocks shuffled over the pool as a running server's are. Times
are the median over `repeats` steps after 2 warm-up steps, on `threads` torch threads
pinned to the first CPUs of this process.
"""

from __future__ import annotations

import contextlib
import os
import random
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from pdserve.engine import attention, model as model_module
from pdserve.engine.config import CacheConfig
from pdserve.engine.model_runner import DecodeSeq, ModelRunner, PrefillSeq


@dataclass(frozen=True)
class StepTime:
    dtype: str
    variant: str
    decode_step_s: float       # one decode step of `batch` sequences
    decode_per_layer_ms: float
    prefill_step_s: float      # one prefill step of `prefill_tokens` tokens
    prefill_tokens_per_s: float


@contextlib.contextmanager
def _kernels(paged: bool, fused: bool):
    """The C++ decode attention and fused elementwise ops on or off."""
    saved = attention.use_cpu_kernel, model_module.use_fused_ops
    if not paged:
        attention.use_cpu_kernel = lambda *args: False
    if not fused:
        model_module.use_fused_ops = lambda x: False
    try:
        yield
    finally:
        attention.use_cpu_kernel, model_module.use_fused_ops = saved


def _median_s(fn, repeats: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def run(model: str, dtypes: list[str], batch: int, context: int, prefill_tokens: int,
        repeats: int, threads: int, block_size: int = 16,
        prefill_prompts: int = 1) -> list[StepTime]:
    """Step times per (dtype, variant); see the module docstring. The prefill step is
    one varlen batch of `prefill_prompts` prompts, `prefill_tokens` tokens in all (a
    prefill worker batches ShareGPT prompts of ~200 tokens up to 2048 tokens)."""
    cpus, torch_threads = os.sched_getaffinity(0), torch.get_num_threads()
    os.sched_setaffinity(0, sorted(cpus)[:threads])
    torch.set_num_threads(threads)
    try:
        return _run(model, dtypes, batch, context, prefill_tokens, repeats, threads,
                    block_size, prefill_prompts)
    finally:                  # the caller's process as it was (tests run in one process)
        os.sched_setaffinity(0, cpus)
        torch.set_num_threads(torch_threads)


def _run(model, dtypes, batch, context, prefill_tokens, repeats, threads, block_size,
         prefill_prompts) -> list[StepTime]:
    per_seq = -(-(context + 1) // block_size)
    num_blocks = max(batch * per_seq, -(-prefill_tokens // block_size) + prefill_prompts, 3) + 1
    rng = random.Random(0)
    results = []
    for name in dtypes:
        dtype = getattr(torch, name)
        for prepack in (False, True):
            runner = ModelRunner(model, CacheConfig(num_blocks, block_size, dtype),
                                 num_threads=threads, prepack_linears=prepack)
            ids = list(range(num_blocks))
            rng.shuffle(ids)
            seqs = [DecodeSeq(rng.randrange(runner.config.vocab_size), context,
                              ids[i * per_seq:(i + 1) * per_seq]) for i in range(batch)]
            prompts, first_block = [], 0
            for i in range(prefill_prompts):
                n = prefill_tokens // prefill_prompts + (i < prefill_tokens % prefill_prompts)
                blocks = -(-n // block_size)
                prompts.append(PrefillSeq([rng.randrange(runner.config.vocab_size)
                                           for _ in range(n)],
                                          ids[first_block:first_block + blocks]))
                first_block += blocks
            for kernels in (((False, False), (True, False), (True, True)) if prepack
                            else ((False, False),)):
                variant = ("eager" if not prepack else
                           {(False, False): "+prepacked", (True, False): "+paged_kernel",
                            (True, True): "+fused_ops"}[kernels])
                if any(kernels) and not attention.cpu_ops.available():
                    continue
                runner.attention_kernel = kernels[0] and runner.kv_cache_id is not None
                with _kernels(*kernels):
                    dec = _median_s(lambda: runner.decode(seqs), repeats)
                    pre = _median_s(lambda: runner.prefill(prompts), max(repeats // 3, 1))
                results.append(StepTime(name, variant, dec, dec / runner.config.num_layers * 1e3,
                                        pre, prefill_tokens / pre))
            del runner
        if attention.cpu_ops.available():
            runner = ModelRunner(model, CacheConfig(num_blocks, block_size, dtype),
                                 num_threads=threads, compile_model=True)
            if runner.compiled:
                dec = _median_s(lambda: runner.decode(seqs), repeats)
                pre = _median_s(lambda: runner.prefill(prompts), max(repeats // 3, 1))
                results.append(StepTime(name, "+torch.compile", dec,
                                        dec / runner.config.num_layers * 1e3, pre,
                                        prefill_tokens / pre))
            del runner
    return results


def table(results: list[StepTime]) -> str:
    rows = [f"{'dtype':9} {'variant':14} {'decode step':>12} {'per layer':>10} "
            f"{'vs eager':>9} {'prefill tok/s':>14} {'vs eager':>9}"]
    base = {r.dtype: r for r in results if r.variant == "eager"}
    for r in results:
        b = base[r.dtype]
        rows.append(f"{r.dtype:9} {r.variant:14} {r.decode_step_s * 1e3:10.1f}ms "
                    f"{r.decode_per_layer_ms:8.2f}ms {b.decode_step_s / r.decode_step_s:8.2f}x "
                    f"{r.prefill_tokens_per_s:14.0f} "
                    f"{r.prefill_tokens_per_s / b.prefill_tokens_per_s:8.2f}x")
    return "\n".join(rows)


def as_json(results: list[StepTime], args: dict) -> dict:
    return {"args": args, "results": [asdict(r) for r in results]}
