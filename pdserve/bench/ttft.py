"""`pdserve bench ttft`: time to first token through the disaggregated path (gRPC →
router → decode reserve → prefill with layer-wise KV streaming → first token) against
the prefill step alone on the same prefill worker (same process and threads, nothing
sent), in the same run, as a ratio.

Each repeat measures both back to back (baseline, then a Generate of the same prompt
length with max_tokens=1); medians are reported. A ratio near 1 means the KV transfer
is hidden behind compute (layer i is sent while layer i+1 computes) and the serving
hops (gRPC, Ray calls, reservation) are small next to prefill.
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


@dataclass(frozen=True)
class TTFTResult:
    prompt_tokens: int
    transport: str
    repeats: int
    prefill_s: float          # median prefill step alone
    ttft_s: float             # median client-side TTFT, disaggregated
    ratio: float              # ttft_s / prefill_s
    prefill_all_s: list[float]
    ttft_all_s: list[float]


def run(prompt_tokens: int = 1024, repeats: int = 5, transport: str = "tcp",
        model: str = "default") -> TTFTResult:
    # every prompt through the prefill worker, whose step is the baseline
    cfg = ClusterConfig.local(model, port=0, transport=transport, prefill_blocks=256,
                              decode_blocks=256,
                              router_kw={"local_prefill_when_prefill_idle": False})
    with Cluster(cfg) as cluster, Client(f"127.0.0.1:{cluster.port}") as client:
        prefill = cluster.prefill[0]
        vocab = _vocab_size(model)
        g = torch.Generator().manual_seed(0)
        warm = make_request(torch.randint(0, vocab, (64,), generator=g).tolist(), max_tokens=1)
        client.generate(warm)                                   # connect, warm caches
        ray.get(prefill.bench_prefill.remote(64))
        base, ttft = [], []
        for i in range(repeats):
            base.append(ray.get(prefill.bench_prefill.remote(prompt_tokens, seed=i)))
            ids = torch.randint(0, vocab, (prompt_tokens,), generator=g).tolist()
            t0 = time.perf_counter()
            stream = client.stream(make_request(ids, max_tokens=1, temperature=0))
            next(iter(stream))
            ttft.append(time.perf_counter() - t0)
            for _ in stream:                                     # drain to the finish
                pass
    p, t = statistics.median(base), statistics.median(ttft)
    return TTFTResult(prompt_tokens, cfg.prefill.transport, repeats, p, t, t / p, base, ttft)


def _vocab_size(model: str) -> int:
    from transformers import AutoConfig

    from ..engine.loader import resolve_model
    return AutoConfig.from_pretrained(resolve_model(model)).vocab_size


def as_json(r: TTFTResult) -> dict:
    return asdict(r)
