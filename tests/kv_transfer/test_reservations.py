"""ReservationTable's bookkeeping for transports that receive asynchronously straight
into the reserved blocks (UCX): writes in flight hold back forget's release."""

import threading

import pytest

from pdserve.kv_transfer import KVLayout, frames
from pdserve.kv_transfer.frames import FrameType
from pdserve.kv_transfer.reservations import ReservationTable

from kvtest import EPOCH, MODEL, NUM_LAYERS, Completions, make_cache


@pytest.fixture
def table():
    kv = make_cache(10)
    return ReservationTable(kv, KVLayout.for_cache(kv, MODEL), EPOCH, Completions())


def admit(table, rid, num_blocks, layers=(0, NUM_LAYERS)):
    header = frames.pack_header(
        FrameType.KV, rid, epoch=EPOCH, layer_start=layers[0], layer_end=layers[1],
        num_blocks=num_blocks, dtype_code=frames.dtype_code(table.layout.dtype),
        payload_len=table.layout.payload_bytes(layers[1] - layers[0], num_blocks),
    )
    h = frames.unpack_header(memoryview(header), table.layout, table.kv.shape[2])
    res = table.admit_kv(h, conn_id=0)
    assert res is not None
    return res, h


def test_consecutive_blocks_by_table_position(table):
    table.expect("r", [4, 5, 6, 2, 3, 9])
    res, _ = admit(table, "r", 6)
    assert [res.consecutive(0, n) for n in (1, 3, 4)] == [4, 4, None]
    assert (res.consecutive(1, 2), res.consecutive(2, 2), res.consecutive(3, 2)) == (5, None, 2)
    assert (res.consecutive(5, 1), res.consecutive(4, 2)) == (9, None)


def test_forget_waits_for_direct_receives_in_flight(table):
    table.expect("r", [4, 5, 6])
    res, h = admit(table, "r", 3)
    assert table.claim_layers(res, h)
    assert table.begin_direct(res, 0, 3) == 4
    assert table.begin_direct(res, 1, 2) == 5
    released = threading.Event()
    table.forget("r", released.set)
    assert not released.is_set()  # two receives may still write into blocks 4..6
    assert table.begin_direct(res, 0, 1) is None  # forgotten: nothing new goes direct
    table.end_direct(res)
    assert not released.is_set()
    table.end_direct(res)
    assert released.is_set()


def test_forget_without_receives_in_flight_releases_at_once(table):
    table.expect("r", [4, 5, 6])
    res, h = admit(table, "r", 3)
    assert table.claim_layers(res, h)
    assert table.begin_direct(res, 0, 2) is not None
    table.end_direct(res)
    released = threading.Event()
    table.forget("r", released.set)
    assert released.is_set()


def test_claimed_layers_refuse_a_second_frame(table):
    done = table._on_complete
    table.expect("r", [4, 5, 6])
    res, h = admit(table, "r", 3, layers=(0, 2))
    assert table.claim_layers(res, h)
    res2, h2 = admit(table, "r", 3, layers=(1, 3))
    assert not table.claim_layers(res2, h2)
    c = done.wait("r")
    assert not c.ok and "layer 1 received twice" in c.error
