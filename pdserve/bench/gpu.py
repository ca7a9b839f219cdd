"""`pdserve bench gpu`: prefill MFU, decode bandwidth and device-to-device KV transfer on
the current CUDA device, each against a baseline measured on the same card in the same run.

| figure | measured | baseline (same run) | goal |
|---|---|---|---|
| bf16 GEMM peak | best of N `a @ b`, n x n bf16 | - | - |
| prefill TFLOP/s | `ModelRunner.prefill`: P prompts of T tokens, one varlen batch, bf16 | GEMM peak (MFU) | >= 0.50 at T = 4096 |
| decode GB/s | `ModelRunner.decode`: batch B at context C, bf16 | d2d copy | >= 0.60 at B >= 64 |
| KV transfer GB/s | bench/transfer.py's pdserve transport, both caches on the device, receiver in a spawned process | d2d copy (an in-process ceiling) | - |

Models: the default model and a random-weight model shaped as Llama-3.2-1B (its
config.json's sizes, built with transformers' LlamaConfig; no hub access).

FLOPs and bytes are counted as bench/flops.py says (Kaplan et al. 2020 for the FLOPs).

GEMM and copy are timed with CUDA events (kernels only, best of N); prefill and decode
by wall clock around a synchronised call (the host work a worker pays included), median.
"""

from __future__ import annotations

import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .flops import ModelShape, copy_gbps, decode_step_bytes, gemm_tflops, prefill_flops

LLAMA_1B = "llama-3.2-1b-random"   # --models name of the random Llama-3.2-1B-shaped model


def llama_1b_config(**overrides):
    """A transformers LlamaConfig with Llama-3.2-1B's sizes (meta-llama/Llama-3.2-1B
    config.json): 16 layers, hidden 2048, 32 heads, 8 KV heads, head_dim 64, MLP 8192,
    vocab 128256, tied embeddings, llama3 RoPE scaling. `overrides` go last (tests)."""
    from transformers import LlamaConfig

    kw = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
              num_attention_heads=32, num_key_value_heads=8, head_dim=64,
              max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
              bos_token_id=128000, eos_token_id=128001,
              rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192},
              architectures=["LlamaForCausalLM"])
    return LlamaConfig(**(kw | overrides))


def write_random_checkpoint(hf_config, out_dir: Path, seed: int = 0,
                            dtype: torch.dtype = torch.bfloat16) -> Path:
    """A random-weight HF checkpoint of `hf_config` in `out_dir` (transformers' init),
    with the default model's tokenizer files so ModelRunner loads it. Built on CUDA when
    there is one."""
    from transformers import AutoModelForCausalLM

    from ..engine.loader import resolve_model
    out_dir = Path(out_dir)
    torch.manual_seed(seed)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    model.save_pretrained(out_dir)
    del model
    src = resolve_model("default")
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copyfile(f, out_dir / f.name)
    return out_dir


# --- measurements (CUDA) ---------------------------------------------------------------

def _event_times(fn: Callable[[], object], repeats: int, warmup: int = 3) -> list[float]:
    """Seconds of each of `repeats` calls, by CUDA events (device time only)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / 1e3)
    return out


def wall_times(fn: Callable[[], object], repeats: int, warmup: int = 2) -> list[float]:
    """Seconds of each of `repeats` calls, wall clock, the device synchronised after each
    (CPU too, which only the tests use)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return out


def measure_gemm_tflops(n: int, repeats: int) -> float:
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    c = torch.empty_like(a)
    return gemm_tflops(n, min(_event_times(lambda: torch.matmul(a, b, out=c), repeats)))


def measure_copy_gbps(nbytes: int, repeats: int) -> float:
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return copy_gbps(nbytes, min(_event_times(lambda: dst.copy_(src), repeats)))


@dataclass(frozen=True)
class PrefillFigure:
    model: str
    num_prompts: int
    prompt_tokens: int
    flops: int                  # per batch (prefill_flops x num_prompts)
    seconds: float              # median
    tflops: float
    mfu: float                  # tflops / measured GEMM peak


@dataclass(frozen=True)
class DecodeFigure:
    model: str
    batch: int
    context_tokens: int         # per sequence, the new token included
    weight_bytes: int
    kv_bytes: int
    cuda_graphs: bool           # graphs replayed (else eager only)
    step_s: float               # median, graphs when cuda_graphs
    gbps: float
    copy_ratio: float           # gbps / measured copy GB/s
    eager_step_s: float
    eager_gbps: float


@dataclass(frozen=True)
class TransferFigure:
    transport: str
    bytes: int
    seconds: float | None       # median; None when it failed
    gbps: float | None
    copy_ratio: float | None
    error: str | None = None


@dataclass
class GpuReport:
    device: str
    torch_version: str
    attention: str
    block_size: int             # KV block tokens of every figure
    gemm_n: int
    gemm_tflops: float
    copy_bytes: int
    copy_gbps: float
    prefill: list[PrefillFigure] = field(default_factory=list)
    decode: list[DecodeFigure] = field(default_factory=list)
    transfer: list[TransferFigure] = field(default_factory=list)

    def goals(self) -> dict[str, bool]:
        """Each goal the run's sizes reach: prefill MFU >= 0.5 at 4k-token prompts,
        decode >= 0.6 of copy bandwidth at batch >= 64."""
        out = {}
        for p in self.prefill:
            if p.prompt_tokens >= 4096:
                out[f"prefill MFU >= 0.50 ({p.model}, {p.prompt_tokens} tokens)"] = p.mfu >= 0.5
        for d in self.decode:
            if d.batch >= 64:
                out[f"decode >= 0.60 copy bandwidth ({d.model}, batch {d.batch})"] = \
                    d.copy_ratio >= 0.6
        return out


def _runner(model_dir: Path, num_blocks: int, block_size: int, enforce_eager: bool,
            max_graph_batch_size: int, device: str):
    from ..engine.config import CacheConfig
    from ..engine.model_runner import ModelRunner
    return ModelRunner(model_dir, CacheConfig(num_blocks, block_size, torch.bfloat16, device),
                       enforce_eager=enforce_eager, max_graph_batch_size=max_graph_batch_size)


def measure_model(name: str, model_dir: Path, *, num_prompts: int, prompt_tokens: int,
                  decode_batch: int, decode_context: int, repeats: int, decode_steps: int,
                  block_size: int, enforce_eager: bool, peak_tflops: float,
                  copy_bw_gbps: float, device: str = "cuda") -> tuple[PrefillFigure, DecodeFigure]:
    """Prefill and decode figures of one model in bf16 (`device` "cpu": tests only)."""
    from ..engine.block_pool import blocks_needed
    from ..engine.model_runner import DecodeSeq, PrefillSeq

    per_prompt = blocks_needed(prompt_tokens, block_size)
    per_seq = blocks_needed(decode_context, block_size)
    runner = _runner(model_dir, max(num_prompts * per_prompt, decode_batch * per_seq),
                     block_size, enforce_eager, decode_batch, device)
    shape = ModelShape.of(runner.config)
    g = torch.Generator().manual_seed(0)
    prompts = [PrefillSeq(torch.randint(0, shape.vocab_size, (prompt_tokens,),
                                        generator=g).tolist(),
                          tuple(range(i * per_prompt, (i + 1) * per_prompt)))
               for i in range(num_prompts)]
    t = statistics.median(wall_times(lambda: runner.prefill(prompts), repeats))
    flops = num_prompts * prefill_flops(shape, prompt_tokens)
    prefill = PrefillFigure(name, num_prompts, prompt_tokens, flops, t, flops / t / 1e12,
                            flops / t / 1e12 / peak_tflops)

    # Decode rows reuse whatever K/V the blocks hold: the cost does not depend on values.
    seqs = [DecodeSeq(int(torch.randint(0, shape.vocab_size, (1,), generator=g)),
                      decode_context - 1, tuple(range(i * per_seq, (i + 1) * per_seq)))
            for i in range(decode_batch)]
    w, kv = decode_step_bytes(shape, [decode_context] * decode_batch, 2)
    graphs = runner.decode_graphs
    step = statistics.median(wall_times(lambda: runner.decode(seqs), decode_steps, warmup=3))
    runner.decode_graphs = None                   # the same steps, eagerly
    try:
        eager = statistics.median(wall_times(lambda: runner.decode(seqs), decode_steps, warmup=3))
    finally:
        runner.decode_graphs = graphs
    gbps = (w + kv) / step / 1e9
    decode = DecodeFigure(name, decode_batch, decode_context, w, kv, graphs is not None, step,
                          gbps, gbps / copy_bw_gbps, eager, (w + kv) / eager / 1e9)
    return prefill, decode


def measure_kv_transfer(model_dir: Path, transports: list[str], num_requests: int,
                        prompt_tokens: int, block_size: int, repeats: int,
                        copy_bw_gbps: float, device: str = "cuda") -> list[TransferFigure]:
    """pdserve's transport between this process and a spawned one, both caches on the
    device (bench/transfer.py's pdserve side; its raw baselines are host memory, so the
    in-process copy bandwidth stands in as the ceiling)."""
    from . import transfer

    geo = transfer.Geometry.of_model(str(model_dir), block_size, "bfloat16", device=device)
    per_req, _ = transfer._plan(geo, num_requests, prompt_tokens)
    total = geo.layer_bytes(per_req) * geo.num_layers * num_requests
    out = []
    for kind in transports:
        try:
            ours = transfer._Pdserve(kind, geo, num_requests, prompt_tokens)
            try:
                ours.once()                                      # warm-up
                t = statistics.median([ours.once() for _ in range(repeats)])
            finally:
                ours.close()
        except Exception as e:  # noqa: BLE001  (reported in the table and JSON; the rest stands)
            out.append(TransferFigure(kind, total, None, None, None, f"{type(e).__name__}: {e}"))
            continue
        gbps = total / t / 1e9
        out.append(TransferFigure(kind, total, t, gbps, gbps / copy_bw_gbps))
    return out


@dataclass(frozen=True)
class GpuBenchConfig:
    models: tuple[str, ...] = (LLAMA_1B, "default")
    num_prompts: int = 4
    prompt_tokens: int = 4096
    decode_batch: int = 64
    decode_context: int = 1024
    gemm_n: int = 8192
    copy_mib: int = 1024
    repeats: int = 10
    decode_steps: int = 50
    block_size: int | None = None     # tokens; None: default_block_size() on the device
    enforce_eager: bool = False       # decode replays CUDA graphs where they can be captured
    transports: tuple[str, ...] = ("nixl", "tcp")
    kv_requests: int = 4
    kv_prompt_tokens: int = 4096

    def __post_init__(self):
        if not self.models:
            raise ValueError("models: name at least one (a HF dir, a .gguf, 'default' or "
                             f"{LLAMA_1B!r})")
        for name in ("num_prompts", "prompt_tokens", "decode_batch", "decode_context", "gemm_n",
                     "copy_mib", "repeats", "decode_steps", "kv_requests", "kv_prompt_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"block_size={self.block_size}: must be >= 1 (or None)")
        if unknown := set(self.transports) - {"tcp", "nixl"}:
            raise ValueError(f"transports: {sorted(unknown)} unknown; choose from tcp, nixl")


def default_block_size(device: torch.device) -> int:
    """KV block size (tokens) the device's decode kernel takes: flash-attn 2's paged
    kernels need a multiple of 256 (Dao-AILab/flash-attention#828; nano-vllm uses 256);
    Triton and SDPA take any, and 16 is vLLM's default."""
    from ..engine.attention import use_flash_attn
    return 256 if use_flash_attn(device) else 16


def run(cfg: GpuBenchConfig, workdir: Path, log: Callable[[str], None] = print) -> GpuReport:
    """Every measurement of the module docstring on torch.cuda.current_device().
    `workdir` holds the random model's checkpoint."""
    from ..engine.attention import attention_backend
    from ..engine.loader import resolve_model

    dev = torch.device("cuda")
    block_size = cfg.block_size or default_block_size(dev)
    log(f"bf16 GEMM {cfg.gemm_n}^3 and a {cfg.copy_mib} MiB device copy ...")
    report = GpuReport(torch.cuda.get_device_name(dev), torch.__version__, attention_backend(dev),
                       block_size, cfg.gemm_n, measure_gemm_tflops(cfg.gemm_n, cfg.repeats),
                       cfg.copy_mib << 20, measure_copy_gbps(cfg.copy_mib << 20, cfg.repeats))
    dirs = {}
    for name in cfg.models:
        if name == LLAMA_1B:
            log("writing the random Llama-3.2-1B-shaped checkpoint ...")
            dirs[name] = write_random_checkpoint(llama_1b_config(), workdir / LLAMA_1B)
        else:
            dirs[name] = resolve_model(name)
        log(f"{name}: prefill {cfg.num_prompts} x {cfg.prompt_tokens} tokens, decode batch "
            f"{cfg.decode_batch} at context {cfg.decode_context} ...")
        p, d = measure_model(
            name, dirs[name], num_prompts=cfg.num_prompts, prompt_tokens=cfg.prompt_tokens,
            decode_batch=cfg.decode_batch, decode_context=cfg.decode_context,
            repeats=cfg.repeats, decode_steps=cfg.decode_steps, block_size=block_size,
            enforce_eager=cfg.enforce_eager, peak_tflops=report.gemm_tflops,
            copy_bw_gbps=report.copy_gbps)
        report.prefill.append(p)
        report.decode.append(d)
        torch.cuda.empty_cache()                      # that model's runner is gone
    if cfg.transports:
        log(f"KV transfer ({', '.join(cfg.transports)}), {cfg.kv_requests} x "
            f"{cfg.kv_prompt_tokens}-token prompts of {cfg.models[0]}, device to device ...")
        report.transfer = measure_kv_transfer(
            dirs[cfg.models[0]], list(cfg.transports), cfg.kv_requests, cfg.kv_prompt_tokens,
            block_size, cfg.repeats, report.copy_gbps)
    return report


def _rows(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows)


def table(r: GpuReport) -> str:
    head = (f"{r.device}, torch {r.torch_version}, attention: {r.attention}, KV blocks of "
            f"{r.block_size} tokens\n"
            f"bf16 GEMM {r.gemm_n}^3 (best of N): {r.gemm_tflops:.1f} TFLOP/s; device copy "
            f"{r.copy_bytes >> 20} MiB (best of N, read + write): {r.copy_gbps:.1f} GB/s\n")
    rows = [("prefill", "prompts", "tokens", "seconds", "TFLOP/s", "MFU", "goal")]
    rows += [(p.model, str(p.num_prompts), str(p.prompt_tokens), f"{p.seconds:.4f}",
              f"{p.tflops:.1f}", f"{p.mfu:.3f}",
              ("met" if p.mfu >= 0.5 else "missed") + " (>= 0.50)" if p.prompt_tokens >= 4096
              else "n/a (< 4096 tokens)") for p in r.prefill]
    out = head + "\n" + _rows(rows) + "\n\n"
    rows = [("decode", "batch", "context", "GB/step", "graphs", "step ms", "GB/s", "vs copy",
             "eager ms", "eager GB/s", "goal")]
    rows += [(d.model, str(d.batch), str(d.context_tokens),
              f"{(d.weight_bytes + d.kv_bytes) / 1e9:.3f}", "yes" if d.cuda_graphs else "no",
              f"{d.step_s * 1e3:.2f}", f"{d.gbps:.0f}", f"{d.copy_ratio:.3f}",
              f"{d.eager_step_s * 1e3:.2f}", f"{d.eager_gbps:.0f}",
              ("met" if d.copy_ratio >= 0.6 else "missed") + " (>= 0.60)" if d.batch >= 64
              else "n/a (batch < 64)") for d in r.decode]
    out += _rows(rows)
    if r.transfer:
        rows = [("KV transfer (device to device)", "bytes", "seconds", "GB/s", "vs copy")]
        rows += [(t.transport, f"{t.bytes:,}", *(("failed: " + (t.error or ""), "", "")
                                                  if t.gbps is None else
                                                  (f"{t.seconds:.4f}", f"{t.gbps:.2f}",
                                                   f"{t.copy_ratio:.3f}")))
                 for t in r.transfer]
        out += "\n\n" + _rows(rows)
    return out


def as_json(r: GpuReport, config: GpuBenchConfig) -> dict:
    return {"config": asdict(config), "report": asdict(r), "goals": r.goals()}
