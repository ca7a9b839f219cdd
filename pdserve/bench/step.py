"""`pdserve bench step`: time of one decode step (and one prefill step) of the engine,
per optimization, against the engine without it, in the same process.

Variants, each adding to the one before:
    eager           transformers' nn.Linear (F.linear, MKL), decode attention as gather +
                    SDPA per group of similar-length sequences (attention.py fallback)
    +prepacked      every linear a oneDNN-prepacked GEMM, q/k/v and gate/up fused
                    (engine/model.py PackedLinear)
    +paged_kernel   decode attention by the C++ kernel reading KV blocks in place
                    (engine/csrc/paged_attention.cpp)

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

from pdserve.engine import attention
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
def _paged_kernel(on: bool):
    saved = attention.use_cpu_kernel
    if not on:
        attention.use_cpu_kernel = lambda q: False
    try:
        yield
    finally:
        attention.use_cpu_kernel = saved


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
        repeats: int, threads: int, block_size: int = 16) -> list[StepTime]:
    """Step times per (dtype, variant); see the module docstring."""
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:threads])
    torch.set_num_threads(threads)
    per_seq = -(-(context + 1) // block_size)
    num_blocks = max(batch * per_seq, -(-prefill_tokens // block_size)) + 1
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
            prompt = PrefillSeq([rng.randrange(runner.config.vocab_size)
                                 for _ in range(prefill_tokens)],
                                ids[:-(-prefill_tokens // block_size)])
            for kernel in ((False, True) if prepack else (False,)):
                variant = ("eager" if not prepack else
                           "+paged_kernel" if kernel else "+prepacked")
                if kernel and not attention.cpu_ops.available():
                    continue
                with _paged_kernel(kernel):
                    dec = _median_s(lambda: runner.decode(seqs), repeats)
                    pre = _median_s(lambda: runner.prefill([prompt]), max(repeats // 3, 1))
                results.append(StepTime(name, variant, dec, dec / runner.config.num_layers * 1e3,
                                        pre, prefill_tokens / pre))
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
