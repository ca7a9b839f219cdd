"""engine/sampler.py: greedy, top-k, top-p, seeds, mixed batches, distribution (CPU, no model)."""

import math

import pytest
import torch

from pdserve.engine import cpu_ops, sampler
from pdserve.engine.sampler import sample
from pdserve.engine.sampling_params import SamplingParams


@pytest.fixture(autouse=True)
def _fixed_global_rng():
    """Rows with seed=None draw from torch's global generator: pin it so no test flakes,
    and give it back unchanged to whatever runs next."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(20240601)
        yield


@pytest.fixture(params=["kernel", "torch"])
def path(request, monkeypatch):
    """The draw through the C++ kernel (CPU, built by make) or through torch (softmax,
    float64 cumsum, searchsorted: every other device)."""
    if request.param == "kernel":
        assert cpu_ops.available(), "CPU kernels not built: run make"
    else:
        monkeypatch.setattr(sampler.cpu_ops, "available", lambda: False)
    return request.param


def _logits(batch: int, vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, vocab, generator=g)  # [batch, vocab] float32


def _log_probs(probs) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float32).log()  # [vocab]


def test_greedy_is_argmax():
    logits = _logits(7, 50)
    out = sample(logits, [SamplingParams(temperature=0.0)] * 7, [0] * 7)
    assert out == logits.argmax(dim=-1).tolist()
    assert all(isinstance(t, int) for t in out)


@pytest.mark.parametrize("temperature", [0.01, 0.5, 1.0, 2.0, 100.0])
@pytest.mark.parametrize("seed", [None, 3])
def test_top_k_1_is_greedy_at_any_temperature(temperature, seed):
    logits = _logits(9, 64, seed=1)
    params = [SamplingParams(temperature=temperature, top_k=1, seed=seed)] * 9
    assert sample(logits, params, list(range(9))) == logits.argmax(dim=-1).tolist()


def test_top_k_restricts_support():
    vocab, k, n = 20, 3, 600
    row = torch.linspace(1.0, 0.0, vocab)[torch.randperm(vocab, generator=torch.Generator().manual_seed(5))]
    allowed = set(row.topk(k).indices.tolist())
    logits = row.expand(n, vocab).clone()
    params = [SamplingParams(temperature=1.0, top_k=k, seed=i) for i in range(n)]
    out = sample(logits, params, [i % 7 for i in range(n)])
    assert set(out) == allowed  # only the top k, and (near-flat top) each of them appears


def test_top_k_larger_than_vocab_is_no_filter():
    vocab, n = 4, 2000
    logits = torch.zeros(n, vocab)
    out = sample(logits, [SamplingParams(top_k=50)] * n, [0] * n)
    assert set(out) == set(range(vocab))


# Probabilities deliberately out of order, so the sort/scatter back is exercised.
TOP_P_PROBS = [0.05, 0.5, 0.15, 0.3]   # ranks: 1 (0.5), 3 (0.3), 2 (0.15), 0 (0.05)


@pytest.mark.parametrize("top_p, allowed", [
    (0.4, {1}),            # 0.5 alone reaches 0.4
    (0.6, {1, 3}),         # 0.5 < 0.6 <= 0.8
    (0.9, {1, 3, 2}),      # 0.8 < 0.9 <= 0.95
    (0.99, {1, 3, 2, 0}),
    (1.0, {1, 3, 2, 0}),
])
def test_top_p_restricts_support(top_p, allowed):
    n = 3000
    logits = _log_probs(TOP_P_PROBS).expand(n, 4).clone()
    params = [SamplingParams(top_p=top_p, seed=i) for i in range(n)]
    out = sample(logits, params, [0] * n)
    assert set(out) == allowed


def test_top_k_then_top_p_combine():
    n = 2000
    logits = _log_probs(TOP_P_PROBS).expand(n, 4).clone()
    # top_k=3 leaves {1,3,2} renormalised to 0.526/0.316/0.158; top_p=0.8 then keeps {1,3}
    out = sample(logits, [SamplingParams(top_k=3, top_p=0.8)] * n, [0] * n)
    assert set(out) == {1, 3}


def test_seeded_sampling_is_reproducible_per_seed_and_step():
    vocab, steps = 1000, 32
    logits = torch.zeros(1, vocab)       # uniform: every draw is informative
    p = SamplingParams(seed=1234)

    def run(seed_params):
        return [sample(logits, [seed_params], [s])[0] for s in range(steps)]

    first = run(p)
    assert run(p) == first                       # same (seed, step) -> same token
    assert len(set(first)) > steps // 2          # differs across steps
    assert run(SamplingParams(seed=1235)) != first  # and across seeds


def test_step_offset_continues_a_moved_requests_seeded_draws():
    """After the router retries a request elsewhere (step_offset = tokens already sent),
    step s of the new worker draws exactly what step offset + s drew before."""
    logits = torch.zeros(1, 1000)
    before = SamplingParams(seed=7)
    moved = SamplingParams(seed=7, step_offset=5)
    assert [sample(logits, [moved], [s])[0] for s in range(10)] == \
           [sample(logits, [before], [5 + s])[0] for s in range(10)]


def test_seeded_row_ignores_batch_position_and_neighbours():
    vocab = 500
    row = _logits(1, vocab, seed=2)[0]
    seeded = SamplingParams(seed=99, temperature=0.8, top_p=0.95)
    alone = sample(row[None].clone(), [seeded], [5])[0]
    others = _logits(4, vocab, seed=3)
    batch = torch.cat([others[:2], row[None], others[2:]])   # [5, vocab]
    params = [SamplingParams(), SamplingParams(temperature=0.0), seeded,
              SamplingParams(seed=1, top_k=10), SamplingParams(temperature=0.3)]
    for _ in range(3):
        assert sample(batch, params, [0, 1, 5, 2, 3])[2] == alone


def test_mixed_batch_keeps_greedy_rows_argmax():
    vocab, n = 32, 64
    logits = _logits(n, vocab, seed=4)
    params, greedy_rows = [], []
    for i in range(n):
        if i % 3 == 0:
            params.append(SamplingParams(temperature=0.0))
            greedy_rows.append(i)
        elif i % 3 == 1:
            params.append(SamplingParams(temperature=1.5, seed=i))
        else:
            params.append(SamplingParams(temperature=1.5, top_k=1))  # greedy via top_k
            greedy_rows.append(i)
    out = sample(logits, params, list(range(n)))
    argmax = logits.argmax(dim=-1).tolist()
    assert [out[i] for i in greedy_rows] == [argmax[i] for i in greedy_rows]
    random_rows = [i for i in range(n) if i % 3 == 1]
    # temperature 1.5 over 32 tokens: the random rows are not all argmax
    assert any(out[i] != argmax[i] for i in random_rows)


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_distribution_matches_softmax(temperature, path):
    n, probs = 4000, [0.1, 0.2, 0.3, 0.4]
    logits = _log_probs(probs).expand(n, 4).clone()
    out = sample(logits, [SamplingParams(temperature=temperature)] * n, [0] * n)
    expected = (_log_probs(probs) / temperature).softmax(-1).tolist()
    counts = [out.count(t) for t in range(4)]
    chi2 = sum((c - n * e) ** 2 / (n * e) for c, e in zip(counts, expected))
    # 3 degrees of freedom: P(chi2 > 16.27) = 0.001 for a correct sampler
    assert chi2 < 16.27, (counts, [round(n * e) for e in expected])


def test_filtered_token_is_never_sampled_even_with_huge_temperature(path):
    n = 1000
    logits = torch.tensor([10.0, 9.0, -math.inf, 0.0]).expand(n, 4).clone()
    out = sample(logits, [SamplingParams(temperature=50.0, seed=i) for i in range(n)], [0] * n)
    assert 2 not in out and set(out) == {0, 1, 3}


def test_batch_size_mismatch_asserts():
    with pytest.raises(AssertionError):
        sample(torch.zeros(2, 4), [SamplingParams()], [0, 0])


def test_candidate_top_k_top_p_equals_a_full_sort():
    """The candidates path (topk of 256, then a full sort only for rows whose top-p
    prefix reaches past them) keeps exactly the tokens a full sort keeps."""
    from pdserve.engine.sampler import _sorted_top_k_top_p, _top_k_top_p
    vocab = 5000
    g = torch.Generator().manual_seed(11)
    peaked = torch.randn(4, vocab, generator=g) * 6        # top-p prefix: a few tokens
    flat = torch.randn(4, vocab, generator=g) * 0.1        # top-p prefix: most of the row
    logits = torch.cat([peaked, flat])
    ks = torch.tensor([vocab, 40, vocab, 300, vocab, 20, vocab, vocab])
    ps = torch.tensor([0.9, 1.0, 1.0, 0.95, 0.9, 0.5, 1.0, 0.999])
    fast = _top_k_top_p(logits, ks, ps)
    filtered = (ks < vocab) | (ps < 1.0)
    full = _sorted_top_k_top_p(logits[filtered], ks[filtered], ps[filtered])
    assert torch.equal(fast[filtered].isfinite(), full.isfinite())
    assert torch.equal(fast[fast.isfinite()], logits[fast.isfinite()])   # kept values as is
    kept = fast.isfinite().sum(dim=-1).tolist()
    # rows without top-k / top-p keep every token (a full sort's fp32 cumsum reaching 1.0
    # would cut a peaked row's tail even at top_p=1)
    assert kept[2] == kept[6] == vocab and kept[1] == 40 and kept[5] <= 20
    assert kept[4] > 256                                   # the full-sort fallback ran


@pytest.mark.parametrize("vocab", [5, 256, 1000, 49152 + 7])
def test_kernel_and_torch_pick_the_same_token_for_the_same_draw(vocab):
    """Both paths invert the same CDF: for one uniform draw they agree, but for a draw
    within float rounding of a boundary between two tokens."""
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(64, vocab, generator=g) * 3
    logits[::5, vocab // 2:] = -math.inf                  # filtered tails
    temps = torch.rand(64, generator=g).float() + 0.3
    u = torch.rand(64, dtype=torch.float64, generator=g)
    got = cpu_ops.sample_from_logits(logits, temps, u)
    cdf = (logits / temps[:, None]).softmax(-1).double().cumsum(-1)
    want = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(1)
    assert (got == want).sum() >= 63, (got, want)
    assert bool((logits.gather(1, got[:, None]) > -math.inf).all())   # never a filtered one


def test_nan_logits_give_a_valid_token_on_both_paths(monkeypatch):
    logits = torch.randn(3, 50)
    logits[1, 7] = math.nan
    logits[2] = -math.inf
    params = [SamplingParams(temperature=1.0)] * 3
    for kernel in (True, False):
        if not kernel:
            monkeypatch.setattr(sampler.cpu_ops, "available", lambda: False)
        out = sample(logits.clone(), params, [0, 0, 0])
        assert all(0 <= t < 50 for t in out), (kernel, out)


def test_kernel_refuses_bad_draws():
    with pytest.raises(RuntimeError, match="uniforms"):
        cpu_ops.sample_from_logits(torch.zeros(1, 4), torch.ones(1), torch.tensor([1.0], dtype=torch.float64))
    with pytest.raises(RuntimeError, match="temperatures"):
        cpu_ops.sample_from_logits(torch.zeros(1, 4), torch.zeros(1), torch.tensor([0.5], dtype=torch.float64))
