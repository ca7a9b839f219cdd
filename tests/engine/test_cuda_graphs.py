"""DecodeGraphs' bookkeeping on CPU: the real tiny model behind a fake graph backend that
"replays" by calling the captured function, so batch-size choice, padding, static-buffer
copies, output slicing, eager fallback, capture order and pool sharing are all checked
against ModelRunner.decode's eager logits without a GPU (tests/engine/test_gpu.py replays
real CUDA graphs where there is one)."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.block_pool import BlockPool, blocks_needed
from pdserve.engine.config import CacheConfig
from pdserve.engine.cuda_graphs import DecodeGraphs, batch_sizes
from pdserve.engine.model_runner import DecodeSeq, ModelRunner, PrefillSeq
from tiny_models import tiny_model_dir

BLOCK_SIZE = 4        # many blocks per sequence: non-trivial block tables
NUM_BLOCKS = 480      # the pool's; the runner's cache has one more, the pad block
MAX_BS = 32           # graphs of 1, 2, 4, 8, 16, 32
# Padded rows change GEMM shapes, and CPU kernels round by shape: eager decode of the same
# 3 sequences alone and with a 4th differs by 1.3e-5 here (logits up to 8). A batch that
# fills its graph exactly must match bit for bit.
ATOL = 1e-4


class FakeGraph:
    def __init__(self, fn):
        self.fn = fn


class FakeBackend:
    """Records captures (and the pool each got); replay calls the captured function."""

    def __init__(self):
        self.pools_given: list[object | None] = []
        self.replayed: list[FakeGraph] = []

    def capture(self, fn, pool):
        self.pools_given.append(pool)
        fn()                                    # the CUDA backend's warm-up run
        return FakeGraph(fn), pool if pool is not None else object()

    def replay(self, graph):
        self.replayed.append(graph)
        graph.fn()


@pytest.fixture(scope="module")
def setup():
    runner = ModelRunner(tiny_model_dir("llama"), CacheConfig(NUM_BLOCKS + 1, BLOCK_SIZE))
    calls: list[int] = []

    def forward(input_ids, positions, meta):
        calls.append(input_ids.shape[0])
        return runner._decode_forward(input_ids, positions, meta)

    before = runner.kv_cache.clone()
    backend = FakeBackend()
    graphs = DecodeGraphs(forward, max_batch_size=MAX_BS,
                          max_blocks_per_seq=-(-runner.config.max_model_len // BLOCK_SIZE),
                          block_size=BLOCK_SIZE, pad_block=NUM_BLOCKS,
                          vocab_size=runner.config.vocab_size, device="cpu", backend=backend)
    capture_calls = list(calls)
    assert torch.equal(runner.kv_cache[:, :, :NUM_BLOCKS], before[:, :, :NUM_BLOCKS]), \
        "capture wrote outside the pad block"
    return runner, graphs, backend, capture_calls


def _sequences(runner: ModelRunner, pool: BlockPool, n: int, seed: int) -> list[DecodeSeq]:
    """n prefilled sequences of 1 .. 40 prompt tokens, each about to decode its next token."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(17, 49152, (int(torch.randint(1, 41, (1,), generator=g)),),
                             generator=g).tolist() for _ in range(n)]
    # one block more than the prompt needs when the decode position opens a new one
    tables = [pool.allocate(blocks_needed(len(p) + 1, BLOCK_SIZE)) for p in prompts]
    logits = runner.prefill([PrefillSeq(p, tuple(t)) for p, t in zip(prompts, tables)])
    return [DecodeSeq(int(row.argmax()), len(p), tuple(t))
            for row, p, t in zip(logits, prompts, tables)]


def test_batch_sizes():
    assert batch_sizes(1) == [1]
    assert batch_sizes(5) == [1, 2, 4]
    assert batch_sizes(32) == [1, 2, 4, 8, 16, 32]
    assert batch_sizes(40) == [1, 2, 4, 8, 16, 32]
    assert batch_sizes(512) == [1, 2, 4, 8] + list(range(16, 513, 16))


def test_capture_largest_first_one_shared_pool(setup):
    _, graphs, backend, capture_calls = setup
    assert graphs.batch_sizes == [1, 2, 4, 8, 16, 32]
    assert capture_calls == [32, 16, 8, 4, 2, 1]
    first_pool = graphs.pool
    assert backend.pools_given[0] is None
    assert all(p is first_pool for p in backend.pools_given[1:])
    assert [graphs.graph_size(n) for n in (1, 2, 3, 5, 8, 9, 16, 17, 32, 33)] == \
        [1, 2, 4, 8, 8, 16, 16, 32, 32, None]


@pytest.mark.parametrize("n", [1, 3, 8, 17, MAX_BS + 1])
def test_logits_equal_eager(setup, n):
    runner, graphs, backend, _ = setup
    pool = BlockPool(NUM_BLOCKS)
    seqs = _sequences(runner, pool, n, seed=n)
    eager = runner.decode(seqs)
    assert runner.decode_graphs is None            # CPU: ModelRunner itself stays eager
    replays = len(backend.replayed)
    out = graphs.run(runner.decode_batch(seqs))
    assert out.shape == (n, runner.config.vocab_size) and out.dtype == torch.float32
    size = graphs.graph_size(n)
    if size is None:                               # beyond the largest graph: eager
        assert len(backend.replayed) == replays
        assert torch.equal(out, eager)
    else:
        assert backend.replayed[replays:] == [graphs.graphs[size]]
        torch.testing.assert_close(out, eager, atol=0 if size == n else ATOL, rtol=0)
        assert out.data_ptr() != graphs.logits.data_ptr()   # not a view of the static buffer
    for s in seqs:
        pool.free(list(s.block_table))
    assert pool.all_free()


def test_padding_touches_only_the_pad_block(setup):
    """A batch of 17 (graph 32) leaves real slots in rows 3 .. 31; a batch of 3 (graph 4)
    after it must reset row 3 to the pad slot, or it would overwrite a sequence's K/V."""
    runner, graphs, _, _ = setup
    pool = BlockPool(NUM_BLOCKS)
    big = _sequences(runner, pool, 17, seed=100)
    graphs.run(runner.decode_batch(big))
    small = _sequences(runner, pool, 3, seed=101)
    eager = runner.decode(small)
    before = runner.kv_cache.clone()
    out = graphs.run(runner.decode_batch(small))
    torch.testing.assert_close(out, eager, atol=ATOL, rtol=0)
    h, d = runner.config.num_kv_heads, runner.config.head_dim
    flat_before = before.view(runner.config.num_layers, 2, -1, h, d)
    flat_after = runner.kv_cache.view(runner.config.num_layers, 2, -1, h, d)
    written = [s.block_table[s.position // BLOCK_SIZE] * BLOCK_SIZE + s.position % BLOCK_SIZE
               for s in small]
    keep = torch.ones(flat_before.shape[2], dtype=torch.bool)
    keep[written] = False
    keep[NUM_BLOCKS * BLOCK_SIZE:] = False         # the pad block
    assert torch.equal(flat_after[:, :, keep], flat_before[:, :, keep])
    torch.testing.assert_close(flat_after[:, :, written], flat_before[:, :, written],
                               atol=ATOL, rtol=0)  # the same K/V eager wrote
    for s in big + small:
        pool.free(list(s.block_table))
    assert pool.all_free()


def test_cpu_runner_ignores_enforce_eager_false():
    runner = ModelRunner(tiny_model_dir("llama"), CacheConfig(8, 16), enforce_eager=False)
    assert runner.decode_graphs is None
    assert runner.kv_cache.shape[2] == 8           # no pad block on CPU
