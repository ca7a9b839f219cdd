"""kv_transfer/tp_plan.py: for every pair of prefill and decode TP sizes a model's KV
heads allow (split or replicated on either side), each decode rank receives each KV
head it holds exactly once, from a prefill rank holding it, at the right local offsets;
sizes that cannot pair are named."""

import itertools

import pytest

from pdserve.engine.parallel import kv_head_range
from pdserve.kv_transfer.tp_plan import HeadSlice, partition_mismatch, transfer_plan

SIZES = (1, 2, 3, 4, 6, 8)


def _valid(kv: int, n: int) -> bool:
    return (kv % n == 0) if kv >= n else (n % kv == 0)


@pytest.mark.parametrize("kv", [1, 2, 3, 4, 8])
def test_every_decode_head_arrives_once_from_a_holder(kv):
    pairs = [(p, d) for p, d in itertools.product(SIZES, SIZES) if _valid(kv, p) and _valid(kv, d)]
    assert len(pairs) >= 4
    for p_size, d_size in pairs:
        plan = transfer_plan(kv, p_size, d_size)
        got = {}
        for s in plan:
            p_heads = kv_head_range(kv, p_size, s.p_rank)
            d_heads = kv_head_range(kv, d_size, s.d_rank)
            for i, h in enumerate(s.heads):
                assert h in p_heads and h in d_heads, (p_size, d_size, s)
                assert p_heads[s.p_offset + i] == h and d_heads[s.d_offset + i] == h
                assert (s.d_rank, h) not in got, (p_size, d_size, s)
                got[(s.d_rank, h)] = s.p_rank
        want = {(d, h) for d in range(d_size) for h in kv_head_range(kv, d_size, d)}
        assert set(got) == want, (p_size, d_size)


def test_examples_of_the_docstring():
    assert transfer_plan(4, 2, 1) == [HeadSlice(0, 0, range(0, 2), 0, 0),
                                      HeadSlice(1, 0, range(2, 4), 0, 2)]
    assert transfer_plan(4, 1, 2) == [HeadSlice(0, 0, range(0, 2), 0, 0),
                                      HeadSlice(0, 1, range(2, 4), 2, 0)]
    assert transfer_plan(2, 4, 2) == [HeadSlice(0, 0, range(0, 1), 0, 0),
                                      HeadSlice(3, 1, range(1, 2), 0, 0)]
    assert [s.p_rank for s in transfer_plan(2, 1, 4)] == [0, 0, 0, 0]


def test_replicas_share_the_sending():
    """8 decode ranks over 2 KV heads from 4 prefill ranks (each head on 2): every
    prefill rank sends to 2 decode ranks, none to more."""
    plan = transfer_plan(2, 4, 8)
    sends = [sum(s.p_rank == p for s in plan) for p in range(4)]
    assert sends == [2, 2, 2, 2]


def test_sizes_that_cannot_pair_are_named():
    assert partition_mismatch(3, 2, 1) == ("prefill tensor-parallel size 2 cannot hold 3 KV "
                                           "heads: one must divide the other")
    assert "decode tensor-parallel size 4" in partition_mismatch(6, 3, 4)
    assert "num_kv_heads: prefill has 4, decode has 2" in partition_mismatch(4, 2, 2, 2)
    with pytest.raises(ValueError, match="size 3"):
        transfer_plan(4, 3, 1)
