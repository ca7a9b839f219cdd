"""Helpers shared by the transport tests (TCP and NIXL run the same scenarios)."""

import itertools
import random
import threading
import time

import pytest
import torch

# Every scenario runs over each transport; NIXL's only where it imports (CI installs
# pdserve[nixl], so there it always does).
TRANSPORTS = ["tcp", pytest.param("nixl", marks=pytest.mark.skipif(
    __import__("pdserve.kv_transfer.nixl", fromlist=["x"]).find_module() is None,
    reason="NIXL (nixl-cu12) not installed"))]

MODEL = "cfg-test"
NUM_LAYERS, BLOCK_SIZE, HEADS, HEAD_DIM = 4, 4, 3, 8
EPOCH = 5
TIMEOUT_S = 5.0  # every wait in these modules is bounded by this
SRC_IDS, DST_IDS = [5, 1, 6], [7, 2, 9]  # non-contiguous, different order on each side
PER_LAYER = [(i, i + 1) for i in range(NUM_LAYERS)]


def make_cache(num_blocks, dtype=torch.float32, seed=0, block_size=BLOCK_SIZE):
    g = torch.Generator().manual_seed(seed)
    shape = (NUM_LAYERS, 2, num_blocks, HEADS, block_size, HEAD_DIM)
    return torch.randn(shape, generator=g).to(dtype)  # [L, 2, N, H, bs, D]


class TransportEnv:
    """Receivers and senders of one transport `kind` for a test (short timeouts);
    close() closes them all and checks that no receiver thread is left."""

    def __init__(self, kind):
        self.kind, self.made = kind, []

    def receiver(self, kv, epoch=EPOCH, kind=None, **kw):
        from pdserve.kv_transfer import KVLayout, make_receiver
        done = Completions()
        rx = make_receiver(kind or self.kind, kv, KVLayout.for_cache(kv, MODEL), epoch,
                           notify=done, io_timeout_s=2.0, **kw)
        self.made.append(rx)
        return rx, rx.start(), done.attach(rx)

    def sender(self, kv, kind=None, **kw):
        from pdserve.kv_transfer import KVLayout, make_sender
        tx = make_sender(kind or self.kind, kv, KVLayout.for_cache(kv, MODEL),
                         connect_timeout_s=2.0, io_timeout_s=2.0, **kw)
        self.made.append(tx)
        return tx

    def close(self):
        from pdserve.kv_transfer.control_server import THREAD_PREFIX
        for obj in self.made:
            obj.close()
        assert not [t for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX)]


class Completions:
    """A receiver's (or a ReservationTable's) get_finished(), polled as D's step loop
    polls it: records every completion and released request id, and lets a test wait.
    Pass it as the receiver's ``notify`` (it wakes the waits), then ``attach`` the
    receiver."""

    def __init__(self):
        self.lock = threading.Lock()
        self.calls = []         # KVCompletion, in the order polled
        self.released = []      # forgotten request ids whose blocks were released
        self.changed = threading.Event()
        self.source = None

    def attach(self, source):
        self.source = source
        return self

    def __call__(self):         # notify: something new to poll
        self.changed.set()

    def _poll(self):
        if self.source is not None:
            f = self.source.get_finished()
            with self.lock:
                self.calls += f.completions
                self.released += f.released

    def _until(self, found, timeout_s):
        deadline = time.monotonic() + timeout_s
        while True:
            self._poll()
            with self.lock:
                if found():
                    return True
            if time.monotonic() >= deadline:
                return False
            self.changed.wait(min(0.05, max(deadline - time.monotonic(), 0)))
            self.changed.clear()

    def wait(self, rid):
        """The one completion of ``rid`` (fails the test after TIMEOUT_S)."""
        got = lambda: [c for c in self.calls if c.request_id == rid]
        assert self._until(got, TIMEOUT_S), f"no completion for {rid}"
        assert len(got()) == 1, got()
        return got()[0]

    def none_within(self, rid, seconds):
        """No completion of ``rid`` comes within ``seconds``."""
        return not self._until(lambda: any(c.request_id == rid for c in self.calls), seconds)

    def released_within(self, rid, seconds):
        """``rid`` (forgotten) is released within ``seconds``."""
        return self._until(lambda: rid in self.released, seconds)

    def ids(self):
        self._poll()
        with self.lock:
            return [c.request_id for c in self.calls]


def send_request(tx, addr, rid, ranges, src_ids=SRC_IDS, epoch=EPOCH, first_token=42, done=True):
    """One frame per range: ``(layer_start, layer_end)`` sends every block of src_ids;
    ``(layer_start, layer_end, a, b)`` sends src_ids[a:b] to block-table positions a..b-1."""
    sent = 0
    for start, end, *blocks in ranges:
        if blocks:
            a, b = blocks
            sent += tx.send_layers(addr, rid, epoch, start, end, src_ids[a:b], block_start=a)
        else:
            sent += tx.send_layers(addr, rid, epoch, start, end, src_ids)
    if done:
        tx.send_done(addr, rid, epoch, first_token, NUM_LAYERS)
    return sent


def chunked(num_blocks, cuts, seed=0):
    """Frames ``(layer, layer + 1, a, b)`` covering every layer of blocks [0, num_blocks)
    cut into chunks at ``cuts`` (as chunked prefill sends them), shuffled: chunks and
    layers interleaved, later chunks before earlier ones."""
    edges = [0, *cuts, num_blocks]
    out = [(l, l + 1, a, b) for l in range(NUM_LAYERS) for a, b in itertools.pairwise(edges)]
    random.Random(seed).shuffle(out)
    return out


# A 7-block request sent in 3 chunks: P's blocks (gathered, then one run in the last
# chunk) into D's blocks, non-consecutive, consecutive (direct receive), or runs that
# the chunk edges cut through.
CHUNK_SRC_IDS = [6, 1, 7, 0, 2, 3, 4]
CHUNK_CUTS = [2, 5]
CHUNK_CASES = [  # "dst_ids, seed": D's blocks, and the seed of the frames' order
    pytest.param([10, 3, 7, 0, 5, 11, 1], 0, id="scattered"),
    pytest.param([2, 3, 4, 5, 6, 7, 8], 1, id="consecutive"),
    pytest.param([4, 5, 6, 0, 9, 10, 11], 2, id="runs"),
]


def check_chunked_round_trip(env, dst_ids, seed, rx_kw=None, tx_kw=None):
    """A request's KV as several frames per layer (one per chunk of blocks, shuffled)
    lands byte-identical in D's blocks; a negative block_start is refused on P."""
    src, dst = make_cache(8, seed=1), make_cache(12, seed=2)
    before = dst.clone()
    rx, addr, done = env.receiver(dst, **(rx_kw or {}))
    tx = env.sender(src, **(tx_kw or {}))
    with pytest.raises(ValueError, match="block_start"):
        tx.send_layers(addr, "r", EPOCH, 0, 1, [0], block_start=-1)
    rx.expect("r", dst_ids)
    frames = chunked(len(dst_ids), CHUNK_CUTS, seed)
    sent = send_request(tx, addr, "r", frames, src_ids=CHUNK_SRC_IDS)
    c = done.wait("r")
    assert (c.ok, c.first_token, c.error) == (True, 42, None)
    assert sent == rx.layout.payload_bytes(NUM_LAYERS, len(dst_ids))
    assert_copied(src, dst, before, CHUNK_SRC_IDS, dst_ids)


# "ranges, src_ids, match": frames as send_request takes them, and what the failure
# says; the reservation is DST_IDS (3 blocks, so 12 (layer, block) pairs).
INCONSISTENT_CASES = [
    pytest.param([(0, 1), (1, 2)], SRC_IDS,
                 f"DONE with {6 * HEADS} of {12 * HEADS} (KV head, layer, block) triples received; first missing: layer 2 block 0",
                 id="done-early"),
    pytest.param([(0, NUM_LAYERS, 0, 2)], SRC_IDS,
                 f"DONE with {8 * HEADS} of {12 * HEADS} (KV head, layer, block) triples received; first missing: layer 0 block 2",
                 id="blocks-omitted"),
    pytest.param([(0, 1, 2, 4)], SRC_IDS + [0],
                 "KV frame for layers [0, 1) carries blocks [2, 4), reservation has 3",
                 id="beyond-reservation"),
    pytest.param([(0, 2), (1, 2)], SRC_IDS, "layer 1 block 0 received twice", id="duplicate-layer"),
    pytest.param([(0, NUM_LAYERS, 0, 2), (1, 2, 1, 3)], SRC_IDS, "layer 1 block 1 received twice",
                 id="overlapping-chunk"),
]


def check_inconsistent_frames_fail(env, ranges, src_ids, match):
    src, dst = make_cache(8, seed=1), make_cache(10, seed=2)
    rx, addr, done = env.receiver(dst)
    rx.expect("r", DST_IDS)
    send_request(env.sender(src), addr, "r", ranges, src_ids=src_ids)
    c = done.wait("r")
    assert not c.ok and match in c.error, c.error
    assert done.ids() == ["r"]  # exactly once, though later frames kept coming


def assert_copied(src, dst, before, src_ids=SRC_IDS, dst_ids=DST_IDS):
    u8 = lambda t: t.contiguous().view(torch.uint8)  # bit equality, any dtype
    assert torch.equal(u8(dst[:, :, dst_ids]), u8(src[:, :, src_ids]))
    others = [b for b in range(dst.shape[2]) if b not in dst_ids]
    assert torch.equal(u8(dst[:, :, others]), u8(before[:, :, others]))
