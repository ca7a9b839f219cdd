"""One tensor-parallel rank of tests/engine/test_tensor_parallel.py, run as its own
process: joins a gloo group of `size` ranks (a file rendezvous) and loads its shard of
the model. Rank 0 drives, through a TPLeader, and saves what it got; the other ranks follow
its orders (engine/tp_executor.py) and save how many they ran. Rank 0's calls:

    generate   test_fidelity's engine loop: one prefill batch, then decode steps; then
               a second idle, heartbeats every 0.2 s
    logprobs   prefill_with_prompt_logprobs of the first prompt (top 2 per position)
    copy       a block copied (copy_blocks), then one decode step from the copy and one
               from the original: their logits
    mixed      where the C++ kernels run: one mixed step (a prompt's prefill beside a
               decode row) and the same rows as a prefill and a decode step apart

    python tp_rank.py RANK SIZE INIT_FILE MODEL_DIR PROMPTS_AND_OUT.pt NEW_TOKENS

$PDSERVE_TP_TEST_DEVICE=cuda puts every rank's shard and cache on the one CUDA device
(gloo still joins them: NCCL refuses two ranks on one device, ncclInvalidUsage).
"""

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent)]        # test_fidelity, tiny_models

from test_fidelity import _engine_generate, _make_pool  # noqa: E402

from pdserve.engine.config import CacheConfig  # noqa: E402
from pdserve.engine.model_runner import DecodeSeq, ModelRunner, PrefillSeq  # noqa: E402
from pdserve.engine.parallel import TensorParallel, exit_process  # noqa: E402
from pdserve.engine.tp_executor import TPLeader, follow  # noqa: E402


def main(rank: int, size: int, init_file: str, model_dir: str, io: str, new_tokens: int):
    torch.set_num_threads(1)
    device = os.environ.get("PDSERVE_TP_TEST_DEVICE", "cpu")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=size)
    try:
        tp = TensorParallel(rank, size, dist.group.WORLD)
        prompts = torch.load(io)["prompts"]
        runner = ModelRunner(model_dir, CacheConfig(num_blocks=64, block_size=16,
                                                    device=device), num_threads=1, tp=tp)
        if rank > 0:
            torch.save({"calls": follow(runner, tp)}, f"{io}.rank{rank}")
            dist.barrier()     # every rank's last collective: none tears its pairs down first
            return
        leader = TPLeader(runner, tp, heartbeat_s=0.2)
        tokens, logits, _ = _engine_generate(leader, _make_pool(64), prompts,
                                             [new_tokens] * len(prompts))
        time.sleep(1.0)        # idle: heartbeats reach the followers, not counted as calls
        out = {"tokens": tokens, "logits": logits,
               "kv_cache_shape": tuple(runner.kv_cache.shape)}
        out.update(_other_calls(leader, prompts, tokens))
        leader.stop()
        out["calls"] = leader.num_calls
        torch.save(out, io + ".out")
        dist.barrier()         # every rank's last collective: none tears its pairs down first
    finally:
        dist.destroy_process_group()


def _other_calls(leader, prompts, tokens) -> dict:
    """The other step calls through the leader (see the module docstring)."""
    a, b = list(prompts[0]), list(prompts[1])              # 3 and 16 tokens: one block each
    _, entries = leader.prefill_with_prompt_logprobs([PrefillSeq(a, [0])], [(a, 2)])
    out = {"prompt_logprobs": [(e.logprob, e.top) for e in entries[0]]}
    leader.copy_blocks([(0, 1)])
    t = tokens[0][0]
    out["copy"] = (leader.decode([DecodeSeq(t, len(a), [1])]),
                   leader.decode([DecodeSeq(t, len(a), [0])]))
    if leader.attention_kernel:
        mixed = leader.mixed([PrefillSeq(b, [2])], [DecodeSeq(t, len(a), [0])])
        apart = (leader.prefill([PrefillSeq(b, [3])]), leader.decode([DecodeSeq(t, len(a), [0])]))
        out["mixed"] = (mixed, apart)
    return out


if __name__ == "__main__":
    r, n, init, model, io, new = sys.argv[1:]
    main(int(r), int(n), init, model, io, int(new))
    exit_process(0)     # not the interpreter's exit: see exit_process
