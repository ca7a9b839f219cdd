"""Helpers shared by the transport tests (TCP and UCX run the same scenarios)."""

import threading

import torch

MODEL = "cfg-test"
NUM_LAYERS, BLOCK_SIZE, HEADS, HEAD_DIM = 4, 4, 3, 8
EPOCH = 5
TIMEOUT_S = 5.0  # every wait in these modules is bounded by this
SRC_IDS, DST_IDS = [5, 1, 6], [7, 2, 9]  # non-contiguous, different order on each side
PER_LAYER = [(i, i + 1) for i in range(NUM_LAYERS)]


def make_cache(num_blocks, dtype=torch.float32, seed=0, block_size=BLOCK_SIZE):
    g = torch.Generator().manual_seed(seed)
    shape = (NUM_LAYERS, 2, num_blocks, block_size, HEADS, HEAD_DIM)
    return torch.randn(shape, generator=g).to(dtype)  # [L, 2, N, bs, H, D]


class Completions:
    """on_complete callback that records every call and lets a test wait for one."""

    def __init__(self):
        self.lock = threading.Lock()
        self.calls = []
        self.events = {}

    def _event(self, rid):
        with self.lock:
            return self.events.setdefault(rid, threading.Event())

    def __call__(self, c):
        with self.lock:
            self.calls.append(c)
        self._event(c.request_id).set()

    def wait(self, rid):
        assert self._event(rid).wait(TIMEOUT_S), f"no completion for {rid}"
        with self.lock:
            got = [c for c in self.calls if c.request_id == rid]
        assert len(got) == 1, got
        return got[0]

    def ids(self):
        with self.lock:
            return [c.request_id for c in self.calls]


def send_request(tx, addr, rid, ranges, src_ids=SRC_IDS, epoch=EPOCH, first_token=42, done=True):
    sent = 0
    for start, end in ranges:
        sent += tx.send_layers(addr, rid, epoch, start, end, src_ids)
    if done:
        tx.send_done(addr, rid, epoch, first_token, NUM_LAYERS)
    return sent


def assert_copied(src, dst, before, src_ids=SRC_IDS, dst_ids=DST_IDS):
    u8 = lambda t: t.contiguous().view(torch.uint8)  # bit equality, any dtype
    assert torch.equal(u8(dst[:, :, dst_ids]), u8(src[:, :, src_ids]))
    others = [b for b in range(dst.shape[2]) if b not in dst_ids]
    assert torch.equal(u8(dst[:, :, others]), u8(before[:, :, others]))
