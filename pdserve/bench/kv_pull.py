"""`pdserve bench pull`: a next turn's TTFT when the prefill worker reads the history from
the decode worker (`--kv-pull`) against computing it, in the same run, per history length,
and the rates the pull cost model starts from (prefill_worker/kv_pull.py PullCost).

One `--kv-pull` cluster per history length H, its prefill worker's pool just large enough
for one turn, so each prompt it computes pushes the last one out of its cache. Per repeat:
two fresh prompts A and B of H tokens are prefilled on the prefill worker (their TTFT is
the baseline: the history computed) and their K/V cached on the decode worker; then A's
next turn (A + 10 tokens) and B's: the prefill worker lacks each history and reads it
from the decode worker, computing the 10 tokens only (their TTFT). Each pull's seconds
(asked to done) and bytes come from the prefill worker's status; the prefill rate from
`bench_prefill` steps of H tokens. Medians are reported.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import ray
import torch

from ..client import Client, make_request
from ..cluster import Cluster
from ..config import ClusterConfig
from ..engine.block_pool import blocks_needed

NEW_TOKENS = 10      # a next turn's tokens after the history


@dataclass(frozen=True)
class PullPoint:
    history_tokens: int
    repeats: int
    compute_ttft_s: float       # median TTFT of a history computed on the prefill worker
    pull_ttft_s: float          # median TTFT of its next turn, the history read from D
    ratio: float                # pull_ttft_s / compute_ttft_s
    pull_s: float               # median seconds of one pull, asked to done
    pull_bytes: int             # K/V bytes of one pull
    prefill_tokens_per_s: float  # median bench_prefill step of history_tokens
    blocks_pulled: int          # every pull's blocks, all repeats
    pull_failures: int


def run(lengths: list[int], repeats: int = 3, model: str = "default",
        transport: str = "tcp", progress=print) -> list[PullPoint]:
    """One PullPoint per history length (tokens, each a multiple of 16 and >= 32)."""
    from .ttft import _vocab_size

    vocab, g = _vocab_size(model), torch.Generator().manual_seed(0)
    points = []
    for n in lengths:
        progress(f"history {n} tokens ...")
        cfg = ClusterConfig.local(model, port=0, transport=transport, kv_pull=True,
                                  prefill_blocks=blocks_needed(n + NEW_TOKENS, 16) + 1,
                                  decode_blocks=4 * repeats * blocks_needed(n + 64, 16) + 64,
                                  router_kw={"local_prefill_when_prefill_idle": False})
        with Cluster(cfg) as cluster, Client(f"127.0.0.1:{cluster.port}") as client:
            p = cluster.prefill[0]

            def ttft(ids: list[int]) -> float:
                t0 = time.perf_counter()
                client.generate(make_request(ids, max_tokens=1, temperature=0))
                return time.perf_counter() - t0

            def pulled():
                st = ray.get(p.status.remote(), timeout=60)
                return st.kv_pulled_blocks, st.kv_pull_bytes, st.kv_pull_seconds, st.kv_pull_failures

            ttft(torch.randint(0, vocab, (64,), generator=g).tolist())      # warm up
            compute, pull, pull_s, pull_bytes, steps = [], [], [], [], []
            first = pulled()
            for i in range(repeats):
                steps.append(ray.get(p.bench_prefill.remote(n, seed=i)))
                a, b = (torch.randint(0, vocab, (n,), generator=g).tolist() for _ in "ab")
                compute += [ttft(a), ttft(b)]
                for h in (a, b):
                    before = pulled()
                    pull.append(ttft(h + torch.randint(0, vocab, (NEW_TOKENS,),
                                                       generator=g).tolist()))
                    after = pulled()
                    pull_bytes.append(after[1] - before[1])
                    pull_s.append(after[2] - before[2])
            last = pulled()
        c, t = statistics.median(compute), statistics.median(pull)
        points.append(PullPoint(n, repeats, c, t, t / c, statistics.median(pull_s),
                                int(statistics.median(pull_bytes)),
                                n / statistics.median(steps), last[0] - first[0],
                                last[3] - first[3]))
        progress(table(points[-1:]))
    return points


def fit(points: list[PullPoint]) -> tuple[float, float]:
    """(latency_s, bytes_per_s) of the least-squares line seconds = a + bytes / rate over
    the points' pulls (PullCost's start values)."""
    xs = [p.pull_bytes for p in points]
    ys = [p.pull_s for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return max(my - slope * mx, 0.0), (1 / slope if slope > 0 else float("inf"))


def table(points: list[PullPoint]) -> str:
    head = ["history", "TTFT computed", "TTFT pulled", "ratio", "pull", "pull MB",
            "prefill tok/s", "failures"]
    rows = [head] + [[f"{p.history_tokens}", f"{p.compute_ttft_s * 1e3:.0f} ms",
                      f"{p.pull_ttft_s * 1e3:.0f} ms", f"{p.ratio:.3f}",
                      f"{p.pull_s * 1e3:.1f} ms", f"{p.pull_bytes / 1e6:.1f}",
                      f"{p.prefill_tokens_per_s:.0f}", str(p.pull_failures)] for p in points]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows)


def as_json(points: list[PullPoint], args: dict) -> dict:
    latency_s, bytes_per_s = fit(points)
    return {"args": args, "points": [asdict(p) for p in points],
            "fit": {"latency_s": latency_s, "bytes_per_s": bytes_per_s}}
