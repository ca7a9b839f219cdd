"""KV between tensor-parallel prefill and decode workers of different sizes, over TCP:
each P rank's cache holds its KV heads only, each D rank's its own; every P rank sends
the heads the plan gives it (kv_transfer/tp_plan.py) to each D rank, chunk by chunk,
then a DONE for those heads (the first token from P rank 0 only). Every D rank must end
with exactly the model's K/V of its heads in its reserved blocks."""

import threading
import time

import pytest
import torch

from pdserve.engine.parallel import kv_head_range
from pdserve.kv_transfer import KVLayout, KVLayoutMismatch, KVTransferError, make_receiver, make_sender
from pdserve.kv_transfer.tp_plan import transfer_plan

from kvtest import EPOCH, MODEL, Completions

LAYERS, BLOCK, DIM = 3, 4, 8
SRC = [5, 1, 6, 7, 8, 9, 2]            # P's blocks (every P rank holds the same ids)
DST = [3, 4, 11, 12, 13, 0, 9]         # D's reserved blocks, in block-table order
FIRST_TOKEN = 42
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])]


def model_cache(heads, num_blocks=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAYERS, 2, num_blocks, heads, BLOCK, DIM, generator=g)


def layout(kv, heads, size, rank):
    mine = kv_head_range(heads, size, rank)
    return KVLayout.for_cache(kv, MODEL, kv_head_start=mine.start, model_kv_heads=heads,
                              tp_size=size)


def rank_senders(full, heads, size, kind="tcp", checksum=False) -> list:
    """A sender per rank of a worker of `size` ranks, each over its heads of `full`."""
    out = []
    for rank in range(size):
        mine = kv_head_range(heads, size, rank)
        kv = full[:, :, :, mine.start:mine.stop].contiguous()
        out.append(make_sender(kind, kv, layout(kv, heads, size, rank), checksum=checksum,
                               connect_timeout_s=2.0, io_timeout_s=2.0))
    return out


class Workers:
    """P ranks (senders over their shares of `full`) and D ranks (receivers)."""

    def __init__(self, heads, p_size, d_size, checksum=False, device="cpu", kind="tcp"):
        self.heads, self.p_size, self.d_size = heads, p_size, d_size
        self.full = model_cache(heads).to(device)
        self.made, self.rx, self.addr, self.done, self.dst = [], [], [], [], []
        for d in range(d_size):
            mine = kv_head_range(heads, d_size, d)
            kv = torch.zeros(LAYERS, 2, 16, len(mine), BLOCK, DIM, device=device)
            done = Completions()
            rx = make_receiver(kind, kv, layout(kv, heads, d_size, d), EPOCH, notify=done,
                               io_timeout_s=2.0)
            self.made.append(rx)
            self.addr.append(rx.start())
            self.rx.append(rx)
            self.done.append(done.attach(rx))
            self.dst.append(kv)
        self.tx = rank_senders(self.full, heads, p_size, kind, checksum)
        self.made += self.tx

    def close(self):
        for obj in self.made:
            obj.close()


@pytest.mark.parametrize("heads,p_size,d_size", [
    (4, 1, 2), (4, 2, 1), (4, 2, 2), (2, 1, 4), (2, 4, 2), (2, 4, 1), (3, 3, 1), (4, 4, 2),
    (4, 1, 1),
    (1, 2, 2), (1, 2, 1), (1, 1, 2)])   # one KV head (MQA): every rank holds all of it
@pytest.mark.parametrize("frames", ["per-layer", "whole"])
@pytest.mark.parametrize("device", DEVICES)
def test_every_decode_rank_gets_exactly_its_heads(heads, p_size, d_size, frames, device):
    """On CUDA: P stages each slice through pinned memory, D copies into its heads."""
    _move(Workers(heads, p_size, d_size, checksum=frames == "whole", device=device),
          heads, p_size, d_size, frames, device)


@pytest.mark.parametrize("heads,p_size,d_size", [
    (4, 1, 2), (4, 2, 1), (4, 2, 2), (2, 1, 4), (2, 4, 2), (3, 3, 1), (1, 2, 2)])
def test_nixl_writes_each_decode_rank_its_heads(heads, p_size, d_size):
    """One-sided writes of head runs (one descriptor per block and head where the two
    ranks hold different heads), several prefill ranks leasing one request's blocks on
    a decode rank, each DONE waiting for its own writes' notifications."""
    _need_nixl()
    _move(Workers(heads, p_size, d_size, kind="nixl"), heads, p_size, d_size, "per-layer",
          "cpu")


def _need_nixl() -> None:
    from pdserve.kv_transfer.nixl import find_module

    if find_module() is None:
        pytest.skip("NIXL (nixl-cu12) not installed")


def _move(w: Workers, heads, p_size, d_size, frames, device):
    """Every P rank sends its plan's heads, chunk by chunk; every D rank must hold
    exactly the model's K/V of its heads in its reserved blocks, and nothing else."""
    try:
        for rx in w.rx:
            rx.expect("r", DST)
        plan = transfer_plan(heads, p_size, d_size)
        errors = []

        def send(p):
            try:
                send_share(p)
            except Exception as e:     # fails the test below, naming the rank
                errors.append((p, e))

        def send_share(p):   # P rank p's share, as its step loop would send it (in parallel)
            mine = [s for s in plan if s.p_rank == p]
            chunks = [(0, 4), (4, len(SRC))]
            layer_runs = ([(i, i + 1) for i in range(LAYERS)] if frames == "per-layer"
                          else [(0, LAYERS)])
            for lo, hi in chunks:
                for a, b in layer_runs:
                    for s in mine:
                        w.tx[p].send_layers(w.addr[s.d_rank], "r", EPOCH, a, b, SRC[lo:hi],
                                            block_start=lo, heads=s.heads)
            for s in mine:
                w.tx[p].send_done(w.addr[s.d_rank], "r", EPOCH,
                                  FIRST_TOKEN if p == 0 else None, LAYERS, heads=s.heads)

        threads = [threading.Thread(target=send, args=(p,)) for p in range(p_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert not errors, errors
        idx = torch.tensor(DST, device=device)
        for d in range(d_size):
            c = w.done[d].wait("r")
            assert c.ok, c.error
            # the first token comes from P rank 0, which sampled it, to the D ranks it
            # sends to (D rank 0 always, tp_plan); the others' done frames carry none
            from_p0 = any(s.p_rank == 0 and s.d_rank == d for s in plan)
            assert d != 0 or from_p0
            assert c.first_token == (FIRST_TOKEN if from_p0 else None), (d, c.first_token)
            mine = kv_head_range(heads, d_size, d)
            want = w.full[:, :, torch.tensor(SRC, device=device)][:, :, :, mine.start:mine.stop]
            assert torch.equal(w.dst[d][:, :, idx], want), f"decode rank {d}"
            others = torch.ones(16, dtype=torch.bool, device=device)
            others[idx] = False
            assert not w.dst[d][:, :, others].any()      # nothing outside the reservation
    finally:
        w.close()


def _send_half(w: Workers, p: int, layers: int) -> None:
    """P rank p of 2 (4 KV heads) sends layers [0, layers) of its two heads to D rank 0,
    then its DONE (the first token from rank 0)."""
    heads = range(2 * p, 2 * p + 2)
    w.tx[p].send_layers(w.addr[0], "r", EPOCH, 0, layers, SRC, heads=heads)
    w.tx[p].send_done(w.addr[0], "r", EPOCH, FIRST_TOKEN if p == 0 else None, LAYERS,
                      heads=heads)


def test_a_done_before_its_heads_arrived_fails_naming_the_head():
    w = Workers(4, 2, 1)
    try:
        w.rx[0].expect("r", DST)
        _send_half(w, 0, LAYERS)
        _send_half(w, 1, 1)         # rank 1 sent one of its layers, then DONE
        c = w.done[0].wait("r")
        assert not c.ok and "first missing: layer 1 block 0 (KV head 2)" in c.error, c.error
    finally:
        w.close()


def test_one_rank_done_is_not_the_request_done():
    """P rank 0's DONE alone (its heads) leaves the request waiting for rank 1's."""
    w = Workers(4, 2, 1)
    try:
        w.rx[0].expect("r", DST)
        _send_half(w, 0, LAYERS)
        w.tx[0].connect(w.addr[0])                 # a round trip: the DONE was read
        assert w.done[0].calls == [] and w.rx[0].get_finished().completions == []
        _send_half(w, 1, LAYERS)
        c = w.done[0].wait("r")
        assert (c.ok, c.first_token) == (True, FIRST_TOKEN)
    finally:
        w.close()


def test_heads_a_decode_rank_does_not_hold_are_refused():
    w = Workers(4, 1, 2)
    try:
        w.rx[1].expect("r", DST)                   # D rank 1 holds heads 2-3
        with pytest.raises(KVTransferError):       # D drops the connection at the header
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                w.tx[0].send_layers(w.addr[1], "r", EPOCH, 0, LAYERS, SRC, heads=range(0, 2))
                time.sleep(0.05)
        assert not w.dst[1].any()                  # no byte of it reached the cache
    finally:
        w.close()


def test_partitions_that_cannot_pair_are_named():
    kv = model_cache(4)
    other = model_cache(2)
    tx = make_sender("tcp", kv, layout(kv, 4, 1, 0), connect_timeout_s=2.0)
    rx = make_receiver("tcp", other, layout(other, 2, 1, 0), EPOCH)
    try:
        with pytest.raises(KVLayoutMismatch, match=r"num_kv_heads \(the model's\): "
                                                   "prefill has 4, decode has 2"):
            tx.connect(rx.start())
    finally:
        tx.close()
        rx.close()
    assert "decode tensor-parallel size 3 cannot hold 4 KV heads" in (
        layout(kv, 4, 1, 0).mismatch(KVLayout(MODEL, LAYERS, 1, DIM, BLOCK, "float32",
                                              kv_head_start=3, model_kv_heads=4, tp_size=3)))


def test_the_staged_paths_of_a_device_cache_move_head_slices(monkeypatch):
    """The paths a CUDA cache takes, run on host memory: P gathers the slice into one
    tensor (index_select, then the heads), D copies a staged payload into its heads of
    the blocks (index_copy_ through a view of those heads)."""
    from pdserve.kv_transfer import host_io

    monkeypatch.setattr(host_io, "MAX_DIRECT_PIECES", 0)       # no zero-copy regions: P
    w = Workers(4, 1, 2, checksum=True)                        # checksummed: D stages
    try:
        for rx in w.rx:
            rx._table._host_view.usable = False                # D: as a device cache
            rx.expect("r", DST)
        for d, heads in ((0, range(0, 2)), (1, range(2, 4))):
            w.tx[0].send_layers(w.addr[d], "r", EPOCH, 0, LAYERS, SRC, heads=heads)
            w.tx[0].send_done(w.addr[d], "r", EPOCH, FIRST_TOKEN, LAYERS, heads=heads)
        idx = torch.tensor(DST)
        for d, heads in ((0, range(0, 2)), (1, range(2, 4))):
            c = w.done[d].wait("r")
            assert c.ok, c.error
            want = w.full[:, :, torch.tensor(SRC)][:, :, :, heads.start:heads.stop]
            assert torch.equal(w.dst[d][:, :, idx], want)
    finally:
        w.close()


def test_nixl_refuses_a_second_writer_of_the_same_heads():
    """Two prefill workers (or ranks) writing the same heads of one request: the second
    BEGIN is refused, the first goes on."""
    _need_nixl()
    w = Workers(4, 2, 1, kind="nixl")
    other = make_sender("nixl", w.tx[0].kv, w.tx[0].layout, connect_timeout_s=2.0,
                        io_timeout_s=2.0)
    w.made.append(other)
    try:
        w.rx[0].expect("r", DST)
        w.tx[0].send_layers(w.addr[0], "r", EPOCH, 0, 1, SRC, heads=range(0, 2))
        with pytest.raises(KVTransferError, match="another prefill worker is writing it"):
            other.send_layers(w.addr[0], "r", EPOCH, 1, 2, SRC, heads=range(0, 2))
        for p, heads in ((0, range(0, 2)), (1, range(2, 4))):
            w.tx[p].send_layers(w.addr[0], "r", EPOCH, 0 if p else 1, LAYERS, SRC,
                                heads=heads)
            w.tx[p].send_done(w.addr[0], "r", EPOCH, FIRST_TOKEN if p == 0 else None,
                              LAYERS, heads=heads)
        c = w.done[0].wait("r")
        assert c.ok and c.first_token == FIRST_TOKEN, c.error
    finally:
        w.close()
