"""ReservationTable's bookkeeping: which (layer, block) pairs arrived, frames that
carry part of the block table (block_start), and for transports whose peer writes
straight into the reserved blocks unseen (NIXL's one-sided writes), the writer's lease
holding back forget's release."""

import itertools

import pytest
import torch

from pdserve.kv_transfer import KVLayout, TransferState, frames, host_io
from pdserve.kv_transfer.frames import FrameType
from pdserve.kv_transfer.reservations import ReservationTable

from kvtest import EPOCH, HEADS, MODEL, NUM_LAYERS, Completions, make_cache


@pytest.fixture
def table():
    kv = make_cache(10)
    done = Completions()
    table = ReservationTable(kv, KVLayout.for_cache(kv, MODEL), EPOCH, done)
    table.done = done.attach(table)
    return table


def kv_header(table, rid, num_blocks, layers=(0, NUM_LAYERS), block_start=0):
    header = frames.pack_header(
        FrameType.KV, rid, epoch=EPOCH, layer_start=layers[0], layer_end=layers[1],
        block_start=block_start, num_blocks=num_blocks,
        dtype_code=frames.dtype_code(table.layout.dtype),
        payload_len=table.layout.payload_bytes(layers[1] - layers[0], num_blocks),
    )
    return frames.unpack_header(memoryview(header), table.layout, table.kv.shape[2])


def admit(table, rid, num_blocks, layers=(0, NUM_LAYERS), block_start=0):
    h = kv_header(table, rid, num_blocks, layers, block_start)
    res = table.admit_kv(h, conn_id=0)
    assert res is not None
    return res, h


def done_header(rid, layers_sent=NUM_LAYERS):
    buf = frames.done_header(rid, EPOCH, first_token=7, num_layers_sent=layers_sent)
    return frames.unpack_header(memoryview(buf))


def test_forget_waits_for_the_writers_lease(table):
    table.expect("r", [4, 5, 6])
    res, h = admit(table, "r", 3)
    assert table.begin_writer(res)
    assert table.write(res, h)
    assert res.missing() is None
    table.forget("r")
    assert table.get_finished().released == []  # the writer may still write blocks 4..6
    assert not table.begin_writer(res)  # forgotten: no new lease
    table.end_writer(res)
    assert table.get_finished().released == ["r"]


def test_forget_after_the_lease_ended_releases_at_once(table):
    table.expect("r", [4, 5, 6])
    res, h = admit(table, "r", 3, layers=(0, 1))
    assert table.begin_writer(res)
    assert table.write(res, h)
    assert res.missing() is not None
    table.end_writer(res)
    table.forget("r")
    assert table.get_finished().released == ["r"]


def test_claimed_blocks_refuse_a_second_frame(table):
    done = table.done
    table.expect("r", [4, 5, 6])
    res, h = admit(table, "r", 3, layers=(0, 2))
    assert table.write(res, h)
    res2, h2 = admit(table, "r", 3, layers=(1, 3))
    assert not table.write(res2, h2)
    c = done.wait("r")
    assert not c.ok and "layer 1 block 0 received twice" in c.error


def test_runs_of_a_block_table_range_match_block_runs(table):
    ids = [4, 5, 6, 2, 3, 9, 0, 1]
    table.expect("r", ids)
    res, _ = admit(table, "r", len(ids))
    for first, end in itertools.combinations(range(len(ids) + 1), 2):
        assert res.runs_in(first, end - first) == host_io.block_runs(ids[first:end])


def test_chunks_fill_the_table_and_done_counts_every_pair(table):
    """Three chunks of blocks, layers interleaved: each claims its rectangle only; DONE
    before the last one names what is missing."""
    done = table.done
    table.expect("r", [4, 5, 6, 2, 3])
    res, h = admit(table, "r", 2, layers=(0, 2), block_start=3)
    assert table.write(res, h)
    per_head = [0, 0, 0, 1, 1] * 2 + [0] * 5 * (NUM_LAYERS - 2)   # head-major (arrival.py)
    assert res.arrived == bytearray(per_head * HEADS)
    assert table.state("r") == TransferState.TRANSFERRING
    for layers, block_start, n in [((2, NUM_LAYERS), 3, 2), ((0, NUM_LAYERS), 0, 1)]:
        res, h = admit(table, "r", n, layers, block_start)
        assert table.write(res, h)
    res, h = admit(table, "r", 2, layers=(1, NUM_LAYERS), block_start=1)
    assert table.write(res, h)
    assert res.missing() == (
        f"{(5 * NUM_LAYERS - 2) * HEADS} of {5 * NUM_LAYERS * HEADS} (KV head, layer, block) "
        "triples received; "
        "first missing: layer 0 block 1 (KV head 0)"
    )
    res, h = admit(table, "r", 2, layers=(0, 1), block_start=1)
    assert table.write(res, h)
    assert res.missing() is None
    table.on_done(done_header("r"))
    c = done.wait("r")
    assert (c.ok, c.first_token) == (True, 7)


def test_done_before_every_pair_arrived_fails(table):
    done = table.done
    table.expect("r", [4, 5, 6])
    res, h = admit(table, "r", 2)  # blocks 0, 1 of every layer; block 2 never comes
    assert table.write(res, h)
    table.on_done(done_header("r"))
    c = done.wait("r")
    assert not c.ok and (
        f"DONE with {2 * NUM_LAYERS * HEADS} of {3 * NUM_LAYERS * HEADS} (KV head, layer, "
        "block) triples received; "
        "first missing: layer 0 block 2" in c.error
    ), c.error


def test_done_claiming_fewer_layers_fails_even_when_all_arrived(table):
    done = table.done
    table.expect("r", [4, 5])
    res, h = admit(table, "r", 2)
    assert table.write(res, h)
    table.on_done(done_header("r", layers_sent=NUM_LAYERS - 1))
    c = done.wait("r")
    assert not c.ok and f"DONE claims {NUM_LAYERS - 1} layers sent" in c.error, c.error


def test_frame_beyond_the_reservation_fails_and_is_discarded(table):
    done = table.done
    table.expect("r", [4, 5, 6])
    assert table.admit_kv(kv_header(table, "r", 3, (0, 1), block_start=2), conn_id=0) is None
    c = done.wait("r")
    assert not c.ok and "carries blocks [2, 5), reservation has 3" in c.error, c.error


def fill_from(payload):
    """A ``fill`` for ReservationTable.write: the payload tensor's bytes, in order."""
    return lambda regions: host_io.copy_into(regions, frames.tensor_bytes(payload))


@pytest.mark.parametrize("source", ["fill", "payload"])
@pytest.mark.parametrize("cache", ["host", "device"])
def test_write_fills_the_chunk_positions_once(table, cache, source):
    """Host cache: fill gets the blocks' own runs. "device": the path of a CUDA cache
    (no host views: one staging buffer, then index_copy_), run here on the CPU cache.
    A payload already staged (a checked CRC frame) is copied in either way."""
    kv = table.kv
    if cache == "device":
        table._host_view.usable = False
    before = kv.clone()
    table.expect("r", [4, 8, 6, 2, 3, 9])
    res, h = admit(table, "r", 3, layers=(1, 3), block_start=2)   # blocks 6 | 2, 3
    staged = torch.randn(2, 2, 3, *kv.shape[3:])  # [n_layers, 2, n_blocks, bs, H, D]
    if source == "fill":
        pieces, fill = [], fill_from(staged)
        assert table.write(res, h, lambda regions: (pieces.append(len(regions)), fill(regions)))
        assert pieces == [1 if cache == "device" else 2 * 2 * 2]   # layers x (K, V) x runs
    else:
        assert table.write(res, h, payload=staged.reshape(-1).view(torch.uint8))
    assert torch.equal(kv[1:3, :, [6, 2, 3]], staged)
    touched = torch.zeros_like(kv, dtype=torch.bool)
    touched[1:3, :, [6, 2, 3]] = True
    assert torch.equal(kv[~touched], before[~touched])
    dup = kv_header(table, "r", 1, (2, 3), block_start=3)
    assert not table.write(res, dup, fill_from(staged[:1, :, :1]))   # not filled
    c = table.done.wait("r")
    assert not c.ok and "layer 2 block 3 received twice" in c.error
    assert torch.equal(kv[1:3, :, [6, 2, 3]], staged)


def test_a_request_failed_while_leased_is_released_only_when_its_writer_ends(table):
    """A one-sided writer's lease outlives the request's failure (a duplicate frame, a
    lost connection): forget() must still wait for that writer."""
    table.expect("r", [4, 5, 6])
    res, h = admit(table, "r", 3)
    assert table.begin_writer(res)
    table.fail(res, "layer 0 block 0 received twice")
    assert not table.done.wait("r").ok
    table.forget("r")
    assert table.get_finished().released == []   # the writer may still write blocks 4..6
    table.end_writer(res)
    assert table.get_finished().released == ["r"]
