"""torch.compile (Inductor, CPU) of the decoder layer, one graph for all layers.

What is compiled: `DecoderLayer.forward`, with dynamic sizes (tokens, sequences, block
table width) and the layer's parameters and index as graph inputs, so layer 0 and the
29 others of SmolLM2 run the same compiled code (Dynamo guards on the module's structure,
not its identity: `inline_inbuilt_nn_modules`). The heavy parts are pdserve's C++ ops,
opaque to Inductor: the prepacked oneDNN GEMMs (`linear_prepacked`), the KV write and
paged attention of a layer in one op that finds the layer's cache by id outside the
graph (`attention_layer`, vLLM's "unified attention": the cache is never a mutated graph
input), RMSNorm, RoPE and SiLU-and-mul. The model loop stays in Python, so a prefill
worker still sends each layer's K/V as soon as it is written (`on_layer_done`).

Graphs: Dynamo specializes sizes 0 and 1, so a step of one token (a decode of one
sequence), of one sequence with several tokens, and of several sequences are three
graphs; `warm_up` runs each once at worker start, before `ready`, so no request waits
for a compile. Layer 0 gets a zero residual (x + 0 is exact: the same numbers as no
residual) rather than a graph of its own. Inductor caches compiled graphs on disk under
the model cache (`$PDSERVE_CACHE/inductor`, or $TORCHINDUCTOR_CACHE_DIR): a restart
loads them instead of compiling.

On this box the compiled step runs the same C++ kernels as the eager one, and compiling
removes only the Python between them, which the guards Dynamo checks on each of the 30
layer calls cost back: decode at batch 64 measured 6-13% slower compiled, and a graph of
the whole 30-layer forward (one guard check a step; 43 s to compile, 80 s with Inductor's
C++ wrapper) exactly as fast as eager (docs/performance.md). So it is opt-in
(WorkerConfig.compile, `serve --compile`), kept tested for token identity with HF.
"""

from __future__ import annotations

import functools
import logging
import os
import time

import torch

from .loader import cache_dir

logger = logging.getLogger(__name__)
progress = logging.getLogger("pdserve.progress")   # shown at the workers' default level
progress.setLevel(logging.INFO)


def inductor_cache_dir() -> str:
    """Where Inductor keeps compiled graphs and kernels: $TORCHINDUCTOR_CACHE_DIR as the
    user set it, else <model cache>/inductor (persistent, unlike Inductor's default
    under /tmp, which torch writes into the variable the first time it needs it)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    path = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if path is None or os.path.abspath(path) == os.path.abspath(default_cache_dir()):
        path = str(cache_dir() / "inductor")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    return path


def compile_layers(model) -> None:
    """Route every decoder layer of `model` (a CausalLM, prepacked, CPU kernels loaded)
    through one torch.compile'd DecoderLayer.forward. Compiling happens on first use
    (see warm_up)."""
    from .model import DecoderLayer

    inductor_cache_dir()
    # no duck sizing: sizes equal at trace time (two sequences of two tokens; a block
    # table as wide as cu_seqlens_q) must not become one symbol, and a guard
    import torch.fx.experimental._config as fx_config
    fx_config.use_duck_shape = False
    # each model compiled in this process (tests load several) adds its own graphs to
    # DecoderLayer.forward's code object: 8, the default, is two or three models
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    compiled = torch.compile(DecoderLayer.forward, dynamic=True, fullgraph=True)
    for layer in model.model.layers:
        layer.forward = functools.partial(compiled, layer)   # nn.Module.__call__ uses it
    model.compiled = True


def warm_up(runner) -> float:
    """Run the step shapes that are graphs of their own (one token; one sequence of
    several tokens; several sequences, decode and prefill) on scratch blocks, so they
    compile now, not at a request. Returns the seconds taken. The blocks' contents are
    garbage afterwards; nothing is cached or handed out yet when a worker starts."""
    from .model_runner import DecodeSeq, PrefillSeq

    bs = runner.block_size
    if runner.cache_config.num_blocks < 4:
        raise ValueError("warm-up needs at least 4 KV blocks")
    t0 = time.perf_counter()
    progress.info("compiling the model step with torch.compile (Inductor; cached in %s): "
                  "about a minute on a first start, seconds after", inductor_cache_dir())
    steps = [
        lambda: runner.decode([DecodeSeq(1, 0, [0])]),                        # 1 token
        lambda: runner.decode([DecodeSeq(1, bs, [0, 1]), DecodeSeq(2, 3, [2])]),   # 2 seqs
        lambda: runner.prefill([PrefillSeq([1] * (bs + 3), [0, 1])]),          # 1 seq, T > 1
        lambda: runner.prefill([PrefillSeq([1, 2, 3], [2]),                    # 2 seqs, with
                                PrefillSeq([1] * (bs + 2), [0, 1], num_computed_tokens=bs)]),  # a prefix
    ]
    for i, step in enumerate(steps, 1):
        step()
        logger.debug("warm-up step %d/%d done at %.1f s", i, len(steps), time.perf_counter() - t0)
    took = time.perf_counter() - t0
    progress.info("model step compiled in %.1f s", took)
    return took
