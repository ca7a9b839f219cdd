"""pdserve/tp_group.py on a real Ray instance: a tensor-parallel worker's ranks 1..N-1
start as TPRank actors in the bundles of one STRICT_PACK placement group, join rank 0
(here the test process itself) in a gloo group, and follow its step orders: greedy
generation driven by rank 0 equals HF transformers. A rank killed with SIGKILL breaks
the group: rank 0's next step raises TPGroupBroken at once (the lost connection), long
before the group's collective timeout."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
import ray
import torch
from serving import start_ray

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from test_fidelity import PROMPTS, _engine_generate, _hf_model, _hf_reference, _make_pool  # noqa: E402,I001

from pdserve.config import WorkerConfig
from pdserve.engine.model_runner import ModelRunner, PrefillSeq
from pdserve.engine.tp_executor import TPGroupBroken, TPLeader
from pdserve.tp_group import GROUP_TIMEOUT_S, placement_group, start_ranks
from tiny_models import tiny_model_dir

pytestmark = pytest.mark.slow

NEW_TOKENS = 6


def test_ranks_on_ray_follow_rank_0_and_a_lost_rank_breaks_the_group():
    start_ray()
    model = tiny_model_dir("llama")                     # 4 query / 2 KV heads
    config = WorkerConfig(model=str(model), tensor_parallel_size=2, num_kv_blocks=64)
    pg = placement_group(2, name="tp-test")
    try:
        tp, (rank1,) = start_ranks("tp-test", config, pg)
        try:
            info = ray.get(rank1.ready.remote(), timeout=120)
            assert info["kv_heads"] == (1,) and info["kv_cache_shape"][3] == 1
            runner = ModelRunner(config.model, config.cache_config(), 1, tp=tp)
            leader = TPLeader(runner, tp)
            tokens, logits, _ = _engine_generate(leader, _make_pool(64), PROMPTS,
                                                 [NEW_TOKENS] * len(PROMPTS))
            hf = _hf_model(model)
            for got, prompt in zip(tokens, PROMPTS):
                assert got == _hf_reference(hf, prompt, NEW_TOKENS)[1]
            assert leader.num_calls == NEW_TOKENS          # 1 prefill + 5 decode steps

            assert ray.get(rank1.ready.remote(), timeout=10)["pid"] == info["pid"]  # alive
            os.kill(info["pid"], signal.SIGKILL)           # this test's own rank
            seq = PrefillSeq(list(PROMPTS[0]), _make_pool(64).allocate(1))
            t0 = time.monotonic()
            with pytest.raises(TPGroupBroken):
                for _ in range(3):
                    leader.prefill([seq])
            assert time.monotonic() - t0 < 10 < GROUP_TIMEOUT_S   # the lost connection
        finally:
            torch.distributed.destroy_process_group()
    finally:
        ray.util.remove_placement_group(pg)
