"""ModelRunner: owns the weights and the paged KV cache of one worker; runs one step.

The workers' schedulers decide *what* runs; the runner turns that into flat tensors
(input_ids, positions, slot_mapping, cu_seqlens / block_table, context_lens), runs
the model and returns logits for one position per sequence (the last prompt token in
prefill, the new token in decode): only those rows reach the LM head.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable

import torch

from . import cpu_ops, logprobs
from .attention import (AttentionMetadata, allocate_kv_cache, attention_backend, cpu_kernels_fit,
                        decode_on_device)
from .config import CacheConfig
from .input_batch import DecodeSeq, InputBatch, PrefillSeq
from .loader import load_model
from .logprobs import TokenLogprobs
from .model import can_prepack
from .outputs import ModelRunnerOutput, SchedulerOutput
from .parallel import SINGLE, TensorParallel
from .sampler import sample_requests
from .structured_output import Grammars, StructuredOutput

__all__ = ["DecodeSeq", "InputBatch", "ModelRunner", "PrefillSeq", "load_model"]

logger = logging.getLogger(__name__)


class ModelRunner:
    """Weights + KV cache `[num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim]`."""

    def __init__(self, model: str | Path | None, cache: CacheConfig, num_threads: int | None = None,
                 cpus: Sequence[int] | None = None, *, enforce_eager: bool = True,
                 max_graph_batch_size: int = 256, prepack_linears: bool = True,
                 compile_model: bool = False, tp: TensorParallel = SINGLE):
        """num_threads: torch intra-op threads of this process; cpus: CPU ids to pin this
        process to (os.sched_setaffinity), so co-located workers do not share cores.
        enforce_eager=False on CUDA (flash-attn or Triton decode): batches of up to
        max_graph_batch_size sequences replay CUDA graphs captured here (DecodeGraphs,
        engine/cuda_graphs.py). compile_model on CPU (prepacked linears, C++ kernels
        built): the decoder layers run one torch.compile'd graph (engine/compile.py),
        compiled here before the first step (warm_up); elsewhere it is ignored, with a
        log line. prepack_linears: on CPU, every linear runs as a oneDNN-prepacked GEMM
        with q/k/v and gate/up fused (CausalLM.prepack); False keeps transformers'
        nn.Linear modules (F.linear). tp: this process's rank in its worker's
        tensor-parallel group (engine/parallel.py): its shard of the weights, a KV cache
        of its KV heads; eager (no CUDA graphs or torch.compile across collectives yet).

        Raises:
            ValueError: a CPU id this process may not run on.
        """
        _pin(cpus, num_threads)
        self.cache_config = cache
        self.device = torch.device(cache.device)
        if (self.device.type == "cpu" and cache.dtype == torch.bfloat16
                and cpu_ops.native_bf16() is False):
            logger.warning("bfloat16 on a CPU without avx512_bf16 or AMX: oneDNN emulates its "
                           "GEMMs in float32 arithmetic, slower than --dtype float32 (which "
                           "is also what HF's fidelity is checked on)")
        self.tp = tp
        self.config, self.model, self.model_dir = load_model(
            model, cache.dtype, self.device, tp)
        if tp.size > 1 and (compile_model or (not enforce_eager and self.device.type == "cuda")):
            logger.warning("tensor-parallel rank: eager (CUDA graphs and torch.compile are "
                           "not captured across its all-reduces yet)")
            compile_model, enforce_eager = False, True
        self.prepacked = prepack_linears and can_prepack(self.device, cache.dtype)
        if self.prepacked:
            self.model.prepack()
        graphs = self._graphs_wanted(enforce_eager)
        self._allocate_cache(graphs)
        self.decode_graphs = None
        if graphs:
            from .cuda_graphs import DecodeGraphs
            c = self.config
            self.decode_graphs = DecodeGraphs(
                self._decode_forward, max_batch_size=max_graph_batch_size,
                max_blocks_per_seq=-(-c.max_model_len // cache.block_size),
                block_size=cache.block_size, pad_block=cache.num_blocks,
                vocab_size=c.vocab_size, device=self.device)
        self.compiled = compile_model and self._compile()
        c = self.config
        logger.info("%s on %s (%s attention%s%s): %d KV blocks x %d tokens, %.1f MiB",
                    c.architecture, self.device, attention_backend(self.device),
                    ", oneDNN-prepacked linears" if self.prepacked else "",
                    ", torch.compile" if self.compiled else "",
                    cache.num_blocks, cache.block_size, self.kv_cache.numel() * self.kv_cache.element_size() / 2**20)

    def _graphs_wanted(self, enforce_eager: bool) -> bool:
        """Whether decode steps replay CUDA graphs (not eager, on CUDA, and a decode
        attention that keeps its work on the device)."""
        graphs = not enforce_eager and self.device.type == "cuda"
        if graphs and not decode_on_device(self.device, self.cache_config.block_size):
            # The SDPA decode path groups sequences by context length on the host, which
            # a graph would freeze at its capture-time values.
            logger.warning("enforce_eager=False: CUDA graphs need flash-attn (block_size a "
                           "multiple of 256) or triton for decode attention; decoding eagerly")
            graphs = False
        return graphs

    def _allocate_cache(self, graphs: bool) -> None:
        """The KV cache, and on CPU with the C++ kernels its registration (each layer's KV
        write and attention are one op that finds the cache by id, cpu_ops.attention_layer;
        the registry lets go of it when the runner goes). With graphs, one block past the
        pool's (never handed out) takes the K/V that padded graph rows write: write_kv
        has no "skip this row" slot value."""
        c, cache = self.config, self.cache_config
        self.kv_cache = allocate_kv_cache(
            (c.num_layers, 2, cache.num_blocks + graphs, self.tp.num_kv_heads(c),
             cache.block_size, c.head_dim), cache.dtype, self.device)
        self.block_size = cache.block_size
        self.kv_cache_id: int | None = None
        if self.device.type == "cpu" and cpu_ops.available() and cpu_kernels_fit(
                self.device, cache.dtype, c.head_dim, cache.block_size):
            self.kv_cache_id = cpu_ops.register_kv_cache(self.kv_cache)
            weakref.finalize(self, cpu_ops.unregister_kv_cache, self.kv_cache_id)
        self.attention_kernel = self.kv_cache_id is not None   # (pdserve bench step: off)

    def _compile(self) -> bool:
        """torch.compile the decoder layers and warm them up (engine/compile.py); on CPU
        with prepacked linears and the C++ kernels only. Returns whether it did."""
        if not (self.prepacked and self.attention_kernel):
            logger.warning("torch.compile of the model step runs on CPU with the C++ "
                           "kernels built (make) and prepacked linears; running eagerly")
            return False
        from .compile import compile_layers, warm_up
        compile_layers(self.model)
        self.compiled = True
        warm_up(self)
        return True

    def _block_table(self, tables: Sequence[Sequence[int]], num_tokens: Sequence[int]) -> torch.Tensor:
        """[len(tables), widest (at least 2)] int32 (host): each row the blocks covering
        its tokens, padded with 0 (never read). Two columns at least: a width of 1 would
        be a compiled graph of its own (torch.compile specializes sizes 0 and 1)."""
        bs = self.block_size
        rows = [t[:-(-n // bs)] for t, n in zip(tables, num_tokens)]
        width = max(2, max(len(r) for r in rows))
        return torch.tensor([list(r) + [0] * (width - len(r)) for r in rows], dtype=torch.int32)

    @functools.cached_property
    def tokenizer(self):
        """transformers' tokenizer of the model, loaded on first use (the step never
        needs it; only `grammars` does)."""
        from .loader import load_tokenizer
        return load_tokenizer(self.model_dir)

    @functools.cached_property
    def grammars(self) -> Grammars:
        """xgrammar's state for this model's tokenizer (engine/structured_output.py),
        built when the first request with structured_outputs arrives."""
        return Grammars(self.tokenizer, self.config.vocab_size, self.config.eos_token_ids)

    async def compile_grammar(self, so: StructuredOutput) -> Any:
        """`so` compiled (Grammars.compile) on this process's low-priority grammar thread
        (structured_output.compile_executor), the first call building `grammars` there
        too: the caller's loop and the step thread go on meanwhile (xgrammar releases the
        GIL while it compiles). Raises ValueError
        naming what xgrammar refused."""
        from .structured_output import compile_executor
        return await asyncio.get_running_loop().run_in_executor(
            compile_executor(), lambda: self.grammars.compile(so))

    @torch.inference_mode()
    def prefill(self, seqs: Sequence[PrefillSeq],
                on_layer_done: Callable[[int], None] | None = None) -> torch.Tensor:
        """Prefill a varlen batch: each sequence's tokens from `num_computed_tokens` on; returns
        logits [len(seqs), vocab] float32 of each prompt's last token. K/V of every
        computed token land in its blocks; `on_layer_done(i)` runs once layer i's are in.

        Raises:
            ValueError: a sequence has nothing to compute (num_computed_tokens >= its length) or
                a block table too short for its tokens.
        """
        assert seqs, "empty prefill batch"
        return self._varlen(seqs, (), on_layer_done)[0]

    @torch.inference_mode()
    def prefill_with_prompt_logprobs(
            self, seqs: Sequence[PrefillSeq],
            prompt_logprobs: Sequence[tuple[Sequence[int], int] | None],
            on_layer_done: Callable[[int], None] | None = None
    ) -> tuple[torch.Tensor, list[list[TokenLogprobs] | None]]:
        """prefill(), and for each sequence i with prompt_logprobs[i] = (its whole prompt's
        token ids, k), the TokenLogprobs (engine/logprobs.py, k top ones) of the prompt
        token after each position this step computes (a chunk's last position: the next
        chunk's first token; the prompt's last position predicts no prompt token and
        gives none). None for the other sequences."""
        assert seqs and len(prompt_logprobs) == len(seqs), (len(seqs), len(prompt_logprobs))
        keep = [i for i, a in enumerate(prompt_logprobs) if a is not None]
        logits, hidden = self._varlen(seqs, (), on_layer_done, keep)
        entries: list[list[TokenLogprobs] | None] = [None] * len(seqs)
        for i in keep:
            (prompt, k), s = prompt_logprobs[i], seqs[i]
            targets = prompt[s.num_computed_tokens + 1:len(s.token_ids) + 1]
            entries[i] = logprobs.of_targets(self.model.compute_logits,
                                             hidden[i][:len(targets)], targets, k)
        return logits, entries

    @torch.inference_mode()
    def mixed(self, prefill: Sequence[PrefillSeq], decode: Sequence[DecodeSeq],
              on_layer_done: Callable[[int], None] | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill chunks and decode rows in one varlen forward (each decode row a
        one-token sequence after its context), as vLLM's chunked prefill runs a step:
        the weights are read once and the decode rows ride in the prefill's large GEMMs
        instead of a second pass at M = len(decode). Returns (logits [len(prefill),
        vocab] of each prompt's last computed token, logits [len(decode), vocab]),
        float32; `on_layer_done(i)` runs after layer i. Raises ValueError as prefill()
        does."""
        assert prefill and decode, "mixed() needs prefill and decode rows"
        logits = self._varlen(prefill, decode, on_layer_done)[0]
        return logits[:len(prefill)], logits[len(prefill):]

    def execute(self, out: SchedulerOutput,
                on_layer_done: Callable[[int], None] | None = None) -> ModelRunnerOutput:
        """One engine step of `out` (engine/outputs.py), as vLLM's model runner runs a
        SchedulerOutput: its blocks_to_copy copied; one forward of its rows (a row of
        one token past its prompt on the paged decode path, the others as prefills, in
        one varlen forward where the C++ paged kernel takes both: mixed()); then each
        row that reaches num_tokens sampled (sampler.sample_requests: grammar mask,
        logprobs, penalties). `on_layer_done(i)` runs after layer i of each forward.

        Raises what the forward raises (ValueError: a row with nothing to compute, or a
        block table too short for its tokens; TPGroupBroken on a tensor-parallel leader)."""
        return execute(self, out, on_layer_done)

    def _varlen(self, seqs: Sequence[PrefillSeq], decode: Sequence[DecodeSeq],
                on_layer_done: Callable[[int], None] | None, keep: Sequence[int] = ()
                ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """(logits of each sequence's last computed token, the final hidden states
        [computed tokens, hidden_size] of the sequences in ``keep``)."""
        bs = self.block_size
        for s in seqs:
            if not 0 <= s.num_computed_tokens < len(s.token_ids):
                raise ValueError(f"num_computed_tokens={s.num_computed_tokens} must be in [0, "
                                 f"{len(s.token_ids)}) (prompt tokens)")
            if len(s.block_table) * bs < len(s.token_ids):
                raise ValueError(f"block_table of {len(s.block_table)} blocks cannot hold "
                                 f"{len(s.token_ids)} tokens (block_size {bs})")
        lens = [len(s.token_ids) - s.num_computed_tokens for s in seqs] + [1] * len(decode)
        totals = [len(s.token_ids) for s in seqs] + [d.position + 1 for d in decode]
        cached = [s.num_computed_tokens for s in seqs] + [d.position for d in decode]
        ids = [t for s in seqs for t in s.token_ids[s.num_computed_tokens:]] + [d.token_id for d in decode]
        table = self._block_table([s.block_table for s in seqs] + [d.block_table for d in decode],
                                  totals)                                   # (batch, width)
        cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(lens).cumsum(0)
        # each new token's position and cache slot, from the table (no per-token loop)
        row = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
        positions = torch.arange(len(ids)) - cu[:-1].long()[row] + torch.tensor(cached)[row]
        slots = table[row, positions // bs].long() * bs + positions % bs
        dev = self.device
        paged = {}
        if any(cached):
            cu_k = torch.zeros(len(lens) + 1, dtype=torch.int32)
            cu_k[1:] = torch.tensor(totals).cumsum(0)
            paged = dict(cached_lens=tuple(cached),
                         cu_seqlens_k=cu_k.to(dev), max_seqlen_k=max(totals))
        meta = AttentionMetadata(
            is_prefill=True, slot_mapping=slots.to(dev), cu_seqlens_q=cu.to(dev),
            max_seqlen_q=max(lens), seq_lens=tuple(lens), block_table=table.to(dev),
            context_lens=torch.tensor(totals, dtype=torch.int32, device=dev),
            kv_cache_id=self.kv_cache_id if self.attention_kernel else None, **paged)
        hidden = self.model(torch.tensor(ids, dtype=torch.long, device=dev), positions.to(dev),
                            meta, self.kv_cache, on_layer_done)
        last = (cu[1:] - 1).to(dev).long()
        kept = {i: hidden[int(cu[i]):int(cu[i + 1])] for i in keep}
        return self.model.compute_logits(hidden[last]), kept

    @torch.inference_mode()
    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy the K and V of every layer from block `src` to block `dst`, for each
        (src, dst) of `pairs` (block ids of this runner's cache; one indexed copy on its
        device). A forked sample's own copy of a shared block (decode_worker/fork.py)."""
        if pairs:
            src, dst = (torch.tensor(x, dtype=torch.long, device=self.device)
                        for x in zip(*pairs))
            self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

    @torch.inference_mode()
    def decode(self, seqs: Sequence[DecodeSeq],
               on_layer_done: Callable[[int], None] | None = None) -> torch.Tensor:
        """One decode step for a batch; returns logits [len(seqs), vocab] float32.
        `on_layer_done(i)` runs after layer i (not when a CUDA graph replays the step)."""
        batch = self.decode_batch(seqs)
        if self.decode_graphs is not None:
            return self.decode_graphs.run(batch)
        return self._decode_forward(batch.input_ids, batch.positions, batch.metadata(
            self.kv_cache_id if self.attention_kernel else None), on_layer_done)

    def decode_batch(self, seqs: Sequence[DecodeSeq]) -> InputBatch:
        """The flat tensors of a decode step over `seqs`, on the runner's device."""
        assert seqs, "empty decode batch"
        dev, bs = self.device, self.block_size
        ctx = [s.position + 1 for s in seqs]
        table = self._block_table([s.block_table for s in seqs], ctx)
        slots = [s.block_table[s.position // bs] * bs + s.position % bs for s in seqs]
        return InputBatch(
            input_ids=torch.tensor([s.token_id for s in seqs], dtype=torch.long, device=dev),
            positions=torch.tensor([s.position for s in seqs], dtype=torch.long, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            block_table=table.to(dev), context_lens=torch.tensor(ctx, dtype=torch.int32, device=dev),
            context_lens_host=tuple(ctx))

    def _decode_forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                        meta: AttentionMetadata,
                        on_layer_done: Callable[[int], None] | None = None) -> torch.Tensor:
        """The model's decode forward over flat [batch] tensors -> logits [batch, vocab]
        float32 (what DecodeGraphs captures)."""
        return self.model.compute_logits(self.model(input_ids, positions, meta, self.kv_cache,
                                                    on_layer_done))


def execute(runner, out: SchedulerOutput,
            on_layer_done: Callable[[int], None] | None = None) -> ModelRunnerOutput:
    """ModelRunner.execute on `runner`: a ModelRunner, or a tensor-parallel TPLeader
    whose step calls (prefill, mixed, decode, ...) broadcast to its ranks first."""
    if out.blocks_to_copy:
        runner.copy_blocks(out.blocks_to_copy)
    groups, prompt_logprobs = _forward(runner, out, on_layer_done)
    n = len(out.requests)
    tokens, lps, errors = [None] * n, [None] * n, [None] * n
    for rows, logits in groups:
        hit = [k for k, i in enumerate(rows) if out.samples(i)]
        if not hit:
            continue
        if len(hit) < len(rows):
            logits = logits[hit]
        drawn = sample_requests(logits, [out.requests[rows[k]] for k in hit],
                                lambda: runner.grammars, runner.config.eos_token_ids)
        for k, t, lp, e in zip(hit, *drawn):
            tokens[rows[k]], lps[rows[k]], errors[rows[k]] = t, lp, e
    return ModelRunnerOutput(tuple(tokens), tuple(lps), tuple(prompt_logprobs), tuple(errors))


def _forward(runner, out: SchedulerOutput, on_layer_done: Callable[[int], None] | None
             ) -> tuple[tuple[tuple[list[int], torch.Tensor | None], ...], list]:
    """The forward(s) of `out`'s rows: ((decode rows, their logits), (prefill rows, their
    logits)) and each row's prompt logprobs (None where not asked)."""
    reqs, counts = out.requests, out.num_scheduled_tokens
    drows = [i for i, (r, n) in enumerate(zip(reqs, counts))
             if n == 1 and r.num_computed_tokens >= r.prompt_len]
    prows = sorted(set(range(len(reqs))) - set(drows))
    dseqs = [DecodeSeq(reqs[i].token_id(reqs[i].num_computed_tokens),
                       reqs[i].num_computed_tokens, reqs[i].block_table) for i in drows]
    pseqs = [PrefillSeq(reqs[i].token_ids(reqs[i].num_computed_tokens + counts[i]),
                        reqs[i].block_table, reqs[i].num_computed_tokens) for i in prows]
    prompt: list = [None] * len(reqs)
    asks = [reqs[i].params.prompt_logprobs for i in prows]
    plogits = dlogits = None
    if any(k is not None for k in asks):
        plogits, entries = runner.prefill_with_prompt_logprobs(pseqs, [
            None if k is None else (reqs[i].token_ids(reqs[i].prompt_len), k)
            for i, k in zip(prows, asks)], on_layer_done)
        for i, e in zip(prows, entries):
            prompt[i] = e
    elif pseqs and dseqs and runner.attention_kernel:   # CUDA keeps its decode path
        plogits, dlogits = runner.mixed(pseqs, dseqs, on_layer_done)
    elif pseqs:
        plogits = runner.prefill(pseqs, on_layer_done)
    if dseqs and dlogits is None:
        dlogits = runner.decode(dseqs, on_layer_done)
    return ((drows, dlogits), (prows, plogits)), prompt


def _pin(cpus: Sequence[int] | None, num_threads: int | None) -> None:
    """This process pinned to `cpus` and its torch intra-op threads set.
    Raises ValueError: a CPU id this process may not run on."""
    if cpus is not None:
        try:
            os.sched_setaffinity(0, cpus)
        except OSError as e:
            raise ValueError(f"cpus={tuple(cpus)}: cannot pin to them ({e}); this "
                             f"process may run on {sorted(os.sched_getaffinity(0))}") from e
    if num_threads:
        torch.set_num_threads(num_threads)
