"""One tensor-parallel rank of tests/engine/test_tensor_parallel.py, run as its own
process: joins a gloo group of `size` ranks (a file rendezvous) and loads its shard of
the model. Rank 0 generates greedily for the prompts (test_fidelity's engine loop: one
prefill batch, then decode steps) through a TPLeader and saves the tokens, logits and
step orders sent; the other ranks follow its orders (engine/tp_executor.py) and save
how many they ran.

    python tp_rank.py RANK SIZE INIT_FILE MODEL_DIR PROMPTS_AND_OUT.pt NEW_TOKENS
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent)]        # test_fidelity, tiny_models

from test_fidelity import _engine_generate, _make_pool  # noqa: E402

from pdserve.engine.config import CacheConfig  # noqa: E402
from pdserve.engine.model_runner import ModelRunner  # noqa: E402
from pdserve.engine.parallel import TensorParallel  # noqa: E402
from pdserve.engine.tp_executor import TPLeader, follow  # noqa: E402


def main(rank: int, size: int, init_file: str, model_dir: str, io: str, new_tokens: int):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=size)
    try:
        tp = TensorParallel(rank, size, dist.group.WORLD)
        prompts = torch.load(io)["prompts"]
        runner = ModelRunner(model_dir, CacheConfig(num_blocks=64, block_size=16),
                             num_threads=1, tp=tp)
        if rank > 0:
            torch.save({"calls": follow(runner, tp)}, f"{io}.rank{rank}")
            return
        leader = TPLeader(runner, tp)
        tokens, logits, _ = _engine_generate(leader, _make_pool(64), prompts,
                                             [new_tokens] * len(prompts))
        leader.stop()
        torch.save({"tokens": tokens, "logits": logits, "calls": leader.num_calls,
                    "kv_cache_shape": tuple(runner.kv_cache.shape)}, io + ".out")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    r, n, init, model, io, new = sys.argv[1:]
    main(int(r), int(n), init, model, io, int(new))
