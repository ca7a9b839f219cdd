"""WorkerConfig's resolved defaults: the prefill step budget by device, and a prompt's
chunk never larger than one step."""

import pytest

from pdserve.config import WorkerConfig


def test_step_budget_defaults_by_device():
    assert WorkerConfig().max_num_batched_tokens == 512
    assert WorkerConfig(device="cuda").max_num_batched_tokens == 2048
    assert WorkerConfig(max_num_batched_tokens=300).max_num_batched_tokens == 300


def test_a_chunk_is_at_most_one_step_in_whole_blocks():
    # --max-num-batched-tokens 256: the default chunk of 512 would never fit a step
    assert WorkerConfig(max_num_batched_tokens=256).prefill_chunk_size == 256
    assert WorkerConfig(max_num_batched_tokens=300, block_size=16).prefill_chunk_size == 288
    assert WorkerConfig(max_num_batched_tokens=4096).prefill_chunk_size == 512   # untouched
    assert WorkerConfig(max_num_batched_tokens=256,
                        prefill_chunk_size=None).prefill_chunk_size is None  # no chunking


def test_schedule_policy_is_checked():
    assert WorkerConfig().schedule_policy == "fcfs"
    assert WorkerConfig(schedule_policy="sjf").schedule_policy == "sjf"
    with pytest.raises(ValueError, match="schedule_policy='lifo'"):
        WorkerConfig(schedule_policy="lifo")


def test_tensor_parallel_size_is_checked():
    with pytest.raises(ValueError, match="tensor_parallel_size=0"):
        WorkerConfig(tensor_parallel_size=0)
