"""`pdserve bench tp`: a tensor-parallel worker's model step against one process's, in
the same run, and what its all-reduces cost.

Model: `llama-3.2-1b-random` (default; random weights of Llama-3.2-1B's shape, whose 32
query and 8 KV heads 2, 4 and 8 ranks divide; the default model's 9 / 3 heads take TP 3
or 9), or any model name the engine loads. For each TP size N (1, the baseline, first): N processes (spawned), joined by a gloo
group on CPU (NCCL on CUDA, one device per rank), each with the box's CPUs split
evenly (`threads` each, pinned), load their shards of the model (engine/parallel.py);
rank 0 leads and the others follow its step orders (engine/tp_executor.py), as in a
worker. Timed, median of `repeats` after 2 warm-ups:

    decode step    `batch` sequences of `context` tokens each, blocks shuffled
    prefill step   one prompt of `prefill_tokens` tokens
    all-reduce     alone, of the shapes the layers reduce: [batch, hidden] (decode) and
                   [prefill_tokens, hidden] (prefill) in the model's dtype; a step has
                   two per layer (after o_proj and down_proj)
    logits gather  the gather of a decode step's logits to rank 0, [batch, vocab / N]
                   fp32 per rank, once per step
Each collective is timed alone, every rank entering it together (a barrier first), so
the figure is the collective's and not the ranks' skew.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .gpu import LLAMA_1B, llama_1b_config, wall_times, write_random_checkpoint


@dataclass(frozen=True)
class TPStep:
    size: int
    threads: int                  # per rank
    device: str
    decode_step_s: float
    prefill_step_s: float
    allreduce_decode_s: float     # one all-reduce of [batch, hidden]
    allreduce_prefill_s: float    # one of [prefill_tokens, hidden]
    gather_decode_s: float        # the gather of a decode step's logits to rank 0
    num_layers: int

    @property
    def decode_allreduce_share(self) -> float:
        """The decode step's collectives (all-reduces and the logits' gather), as a
        share of the step."""
        return ((2 * self.num_layers * self.allreduce_decode_s + self.gather_decode_s)
                / self.decode_step_s)

    @property
    def prefill_allreduce_share(self) -> float:
        return 2 * self.num_layers * self.allreduce_prefill_s / self.prefill_step_s


def _median_s(fn, repeats: int) -> float:
    return statistics.median(wall_times(fn, repeats))


def _collective_s(op, repeats: int, group, sync) -> float:
    """Median seconds of `op` (a collective every rank runs), each call entered by
    every rank together (a barrier first), after 2 warm-ups."""
    times = []
    for i in range(repeats + 2):
        torch.distributed.barrier(group=group)
        sync()
        t = time.perf_counter()
        op()
        sync()
        if i >= 2:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def _rank(rank: int, size: int, init_file: str, cfg: dict, out) -> None:
    """One rank of a TP-`size` run (a spawned process); rank 0 puts its TPStep in `out`."""
    import torch.distributed as dist

    from pdserve.engine.config import CacheConfig
    from pdserve.engine.model_runner import DecodeSeq, ModelRunner, PrefillSeq
    from pdserve.engine.parallel import TensorParallel, exit_process
    from pdserve.engine.tp_executor import TPLeader, follow

    cuda = cfg["device"] == "cuda"
    cpus = sorted(os.sched_getaffinity(0))
    threads = cfg["threads"]
    os.sched_setaffinity(0, cpus[rank * threads % len(cpus):][:threads] or cpus[:threads])
    torch.set_num_threads(threads)
    device = f"cuda:{rank}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(rank)
    tp = TensorParallel()
    if size > 1:
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{init_file}",
                                rank=rank, world_size=size)
        tp = TensorParallel(rank, size, dist.group.WORLD)
    bs, batch, context, n_prefill = 16, cfg["batch"], cfg["context"], cfg["prefill_tokens"]
    per_seq = -(-(context + 1) // bs)
    num_blocks = batch * per_seq + -(-n_prefill // bs) + 1
    dtype = getattr(torch, cfg["dtype"])
    runner = ModelRunner(cfg["model"], CacheConfig(num_blocks, bs, dtype, device=device),
                         num_threads=threads, tp=tp)
    hidden, vocab = runner.config.hidden_size, runner.config.vocab_size
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    comm_s = []
    for op in ((lambda x: tp.all_reduce(x), (batch, hidden), dtype),
               (lambda x: tp.all_reduce(x), (n_prefill, hidden), dtype),
               (lambda x: tp.gather_to_leader(x), (batch, vocab // size), torch.float32)):
        fn, shape, dt = op
        x = torch.randn(*shape, dtype=dt, device=device)
        comm_s.append(_collective_s(lambda: fn(x), cfg["repeats"], tp.group, sync)
                      if size > 1 else 0.0)
    if rank > 0:
        follow(runner, tp)
        dist.destroy_process_group()
        exit_process(0)
    rng = random.Random(0)
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    vocab = runner.config.vocab_size
    seqs = [DecodeSeq(rng.randrange(vocab), context, ids[i * per_seq:(i + 1) * per_seq])
            for i in range(batch)]
    prompt = [PrefillSeq([rng.randrange(vocab) for _ in range(n_prefill)],
                         ids[batch * per_seq:batch * per_seq + -(-n_prefill // bs)])]
    leader = TPLeader(runner, tp)
    dec = _median_s(lambda: leader.decode(seqs), cfg["repeats"])
    pre = _median_s(lambda: leader.prefill(prompt), max(cfg["repeats"] // 3, 1))
    leader.stop()
    out.put(TPStep(size, threads, cfg["device"], dec, pre, *comm_s,
                   runner.config.num_layers))
    if size > 1:
        dist.destroy_process_group()
        exit_process(0)


def run(model: str, sizes: list[int], batch: int, context: int, prefill_tokens: int,
        repeats: int, dtype: str = "float32", device: str = "cpu") -> list[TPStep]:
    """A TPStep per size, each run with the box's CPUs split over its ranks (on CUDA,
    one device per rank).

    Raises:
        ValueError: a size the box cannot hold (more ranks than CPUs, or devices).
    """
    import tempfile

    import torch.multiprocessing as mp

    if model == LLAMA_1B:        # heads (32 / 8 KV) that 2, 4 and 8 ranks divide
        with tempfile.TemporaryDirectory(prefix="pdserve-bench-tp-") as tmp:
            print("writing the random Llama-3.2-1B-shaped checkpoint ...", flush=True)
            path = write_random_checkpoint(llama_1b_config(), Path(tmp) / LLAMA_1B)
            return run(str(path), sizes, batch, context, prefill_tokens, repeats, dtype,
                       device)
    cpus = len(os.sched_getaffinity(0))
    limit = torch.cuda.device_count() if device == "cuda" else cpus
    results = []
    for size in sizes:
        if not 1 <= size <= limit:
            raise ValueError(f"TP size {size}: this box has {limit} "
                             f"{'CUDA devices' if device == 'cuda' else 'CPUs'}")
        ctx = mp.get_context("spawn")
        out = ctx.SimpleQueue()
        cfg = dict(model=model, batch=batch, context=context, prefill_tokens=prefill_tokens,
                   repeats=repeats, dtype=dtype, device=device, threads=max(cpus // size, 1))
        with tempfile.TemporaryDirectory(prefix="pdserve-bench-tp-") as tmp:
            # a file rendezvous: nothing to bind, so no port another process can take
            mp.start_processes(_rank, args=(size, f"{tmp}/rendezvous", cfg, out),
                               nprocs=size, start_method="spawn")
        results.append(out.get())
    return results


def table(results: list[TPStep]) -> str:
    base = results[0]
    rows = [f"{'TP':>3} {'threads':>7} {'decode step':>12} {'vs TP1':>7} {'all-reduce':>11} "
            f"{'gather':>9} {'share':>6} {'prefill step':>13} {'vs TP1':>7} {'all-reduce':>11} "
            f"{'share':>6}"]
    for r in results:
        rows.append(
            f"{r.size:>3} {r.threads:>7} {r.decode_step_s * 1e3:10.1f}ms "
            f"{base.decode_step_s / r.decode_step_s:6.2f}x {r.allreduce_decode_s * 1e6:9.0f}us "
            f"{r.gather_decode_s * 1e6:7.0f}us "
            f"{r.decode_allreduce_share:6.1%} {r.prefill_step_s * 1e3:11.1f}ms "
            f"{base.prefill_step_s / r.prefill_step_s:6.2f}x "
            f"{r.allreduce_prefill_s * 1e6:9.0f}us {r.prefill_allreduce_share:6.1%}")
    return "\n".join(rows)


def as_json(results: list[TPStep], args: dict) -> dict:
    return {"args": args, "results": [asdict(r) | {
        "decode_allreduce_share": r.decode_allreduce_share,
        "prefill_allreduce_share": r.prefill_allreduce_share} for r in results]}
