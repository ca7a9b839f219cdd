"""pdserve/bench/tp.py: the tensor-parallel step bench runs its ranks (spawned, gloo),
times a TP-2 step against TP 1 in the same run, and measures the all-reduces."""

import pytest
from tiny_models import tiny_model_dir

from pdserve.bench import tp


def test_tp2_against_tp1_with_the_all_reduce_cost():
    results = tp.run(str(tiny_model_dir("llama")), [1, 2], batch=4, context=20,
                     prefill_tokens=32, repeats=2)
    one, two = results
    assert (one.size, two.size) == (1, 2) and one.threads >= two.threads
    assert one.allreduce_decode_s == 0 and two.allreduce_decode_s > 0
    assert 0 < two.decode_allreduce_share and two.prefill_step_s > 0
    lines = tp.table(results).splitlines()
    assert len(lines) == 3 and lines[2].split()[0] == "2"


def test_sizes_the_box_cannot_hold_are_refused():
    with pytest.raises(ValueError, match="TP size 64"):
        tp.run(str(tiny_model_dir("llama")), [64], 1, 4, 4, 1)
