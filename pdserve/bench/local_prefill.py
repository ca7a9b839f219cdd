"""`pdserve bench local-prefill`: the sweep that picks the default of
`local_prefill_max_tokens` (WorkerConfig), the prompt length up to which a decode worker
prefills a prompt itself instead of sending it to a prefill worker.

Two clusters run the same workload one after the other: `remote` (threshold 0: every
prompt goes to the prefill worker, KV over the transport) and `local` (threshold above
every swept length: every prompt is prefilled on the decode worker). For each swept
uncached length L, `repeats` fresh random prompts (no prefix-cache hit anywhere) are sent
one at a time with max_tokens=1 and their client-side TTFT taken, while `background`
long streams keep the decode worker busy; the gaps between those streams' tokens
during the phase give the inter-token latency (ITL) the running requests see.

Local prefill saves the prefill worker round trip and the transfer, but stalls every
running request's next token for as long as it computes. The rule that picks the
threshold (stated in the report):

    the largest swept L such that, for it and every shorter length, local TTFT (median)
    is below remote TTFT (median) and the background's p90 ITL under local prefill is
    at most `itl_tolerance` times its p90 ITL under remote prefill.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import asdict, dataclass

import torch

from ..client import Client, make_request
from ..cluster import Cluster
from ..config import ClusterConfig


@dataclass(frozen=True)
class Point:
    prompt_tokens: int
    remote_ttft_s: float        # medians over repeats
    local_ttft_s: float
    remote_itl_p90_s: float     # background streams' p90 inter-token gap during the phase
    local_itl_p90_s: float

    @property
    def ttft_ratio(self) -> float:
        """local / remote TTFT: below 1, local prefill answers sooner."""
        return self.local_ttft_s / self.remote_ttft_s

    @property
    def itl_ratio(self) -> float:
        return self.local_itl_p90_s / self.remote_itl_p90_s if self.remote_itl_p90_s else 1.0


class _Background:
    """`n` long greedy streams (ignore_eos) kept running; records each token's arrival."""

    def __init__(self, client: Client, n: int, vocab: int, prompt_tokens: int = 32,
                 max_tokens: int = 4000):
        self.client, self.vocab, self.prompt_tokens = client, vocab, prompt_tokens
        self.max_tokens = max_tokens
        self.stop = threading.Event()
        self.arrivals: list[list[float]] = [[] for _ in range(n)]
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                        for i in range(n)]

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(60)

    def _run(self, i: int) -> None:
        g = torch.Generator().manual_seed(10_000 + i)
        while not self.stop.is_set():
            ids = torch.randint(0, self.vocab, (self.prompt_tokens,), generator=g).tolist()
            stream = self.client.stream(make_request(ids, max_tokens=self.max_tokens,
                                                     temperature=0, ignore_eos=True))
            try:
                for msg in stream:
                    now = time.perf_counter()
                    self.arrivals[i] += [now] * len(msg.token_ids)
                    if self.stop.is_set():
                        stream.cancel()
                        return
            except Exception:   # cancelled at stop: the generator raises on cancel
                if not self.stop.is_set():
                    raise

    def gaps(self, t0: float, t1: float) -> list[float]:
        """Inter-token gaps of every stream whose later token arrived in [t0, t1]."""
        out = []
        for times in self.arrivals:
            out += [b - a for a, b in zip(times, times[1:]) if t0 <= b <= t1 and b > a]
        return out


def _p90(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=10)[-1] if len(xs) >= 2 else (xs[0] if xs else 0.0)


def _measure(threshold: int, lengths: list[int], repeats: int, background: int,
             model: str, transport: str, vocab: int) -> dict[int, tuple[float, float]]:
    """{length: (median TTFT s, p90 background ITL s)} on a fresh cluster."""
    # only the threshold decides where a prompt is prefilled (not whether P is idle)
    cfg = ClusterConfig.local(model, port=0, transport=transport, prefill_blocks=256,
                              decode_blocks=512, local_prefill_max_tokens=threshold,
                              router_kw={"local_prefill_when_prefill_idle": False})
    out = {}
    with Cluster(cfg) as cluster, Client(f"127.0.0.1:{cluster.port}") as client:
        g = torch.Generator().manual_seed(0)
        client.generate(make_request(torch.randint(0, vocab, (64,), generator=g).tolist(),
                                     max_tokens=2))                      # connect, warm up
        with _Background(client, background, vocab) as bg:
            time.sleep(1.0 if background else 0)                          # streams running
            for n in lengths:
                ttfts = []
                t0 = time.perf_counter()
                for _ in range(repeats):
                    ids = torch.randint(0, vocab, (n,), generator=g).tolist()
                    s = time.perf_counter()
                    stream = client.stream(make_request(ids, max_tokens=1, temperature=0))
                    next(iter(stream))
                    ttfts.append(time.perf_counter() - s)
                    for _ in stream:
                        pass
                out[n] = (statistics.median(ttfts), _p90(bg.gaps(t0, time.perf_counter())))
    return out


def run(lengths: list[int], repeats: int = 5, background: int = 4, model: str = "default",
        transport: str = "tcp") -> list[Point]:
    """Sweep `lengths` (uncached prompt tokens) under both policies; see the module
    docstring. Each length's figures come from the same prompts' lengths in both runs."""
    from transformers import AutoConfig

    from ..engine.loader import resolve_model
    vocab = AutoConfig.from_pretrained(resolve_model(model)).vocab_size
    remote = _measure(0, lengths, repeats, background, model, transport, vocab)
    local = _measure(max(lengths) + 1, lengths, repeats, background, model, transport, vocab)
    return [Point(n, remote[n][0], local[n][0], remote[n][1], local[n][1]) for n in lengths]


def pick_threshold(points: list[Point], itl_tolerance: float = 1.5) -> int:
    """The rule of the module docstring; 0 when even the shortest length fails it."""
    best = 0
    for p in sorted(points, key=lambda p: p.prompt_tokens):
        if p.ttft_ratio >= 1.0 or p.itl_ratio > itl_tolerance:
            break
        best = p.prompt_tokens
    return best


def table(points: list[Point], threshold: int) -> str:
    rows = ["uncached tokens  TTFT remote  TTFT local  local/remote  ITL p90 remote  "
            "ITL p90 local  local/remote"]
    for p in points:
        rows.append(f"{p.prompt_tokens:>15}  {p.remote_ttft_s * 1e3:>9.1f}ms  "
                    f"{p.local_ttft_s * 1e3:>8.1f}ms  {p.ttft_ratio:>12.2f}  "
                    f"{p.remote_itl_p90_s * 1e3:>12.1f}ms  {p.local_itl_p90_s * 1e3:>11.1f}ms  "
                    f"{p.itl_ratio:>12.2f}")
    rows.append(f"picked local_prefill_max_tokens = {threshold}")
    return "\n".join(rows)


def as_json(points: list[Point], threshold: int, config: dict) -> dict:
    return {"config": config, "local_prefill_max_tokens": threshold,
            "points": [asdict(p) | {"ttft_ratio": p.ttft_ratio, "itl_ratio": p.itl_ratio}
                       for p in points]}
