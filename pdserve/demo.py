"""`make demo`: start a one-box cluster on the default model, send 8 real ShareGPT
prompts at once as chat messages, stream the answers live, print TTFT and tokens/s per
request, and shut down.

    python -m pdserve.demo [--num-prompts 8] [--max-tokens 96] [--model default]
"""

from __future__ import annotations

import argparse
import threading
import time
from dataclasses import dataclass, field

from rich.console import Console
from rich.live import Live
from rich.table import Table

from .client import Client, make_request
from .cluster import Cluster
from .config import ClusterConfig
from .sharegpt import sample_prompts


@dataclass
class _Stream:
    prompt: str
    text: str = ""
    tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    finish: str = ""
    error: str = ""
    start: float = field(default_factory=time.perf_counter)

    @property
    def decode_tok_s(self) -> float:
        """Tokens per second after the first token (the decode worker's rate for it)."""
        if self.e2e_s is None or self.ttft_s is None or self.tokens < 2:
            return 0.0
        return (self.tokens - 1) / max(self.e2e_s - self.ttft_s, 1e-9)


def _run(client: Client, s: _Stream, max_tokens: int) -> None:
    req = make_request([{"role": "user", "content": s.prompt}], max_tokens=max_tokens,
                       temperature=0)
    try:
        for msg in client.stream(req):
            if s.ttft_s is None:
                s.ttft_s = time.perf_counter() - s.start
            s.tokens += len(msg.token_ids)
            s.text += msg.text
            s.finish = msg.finish_reason or s.finish
    except Exception as e:  # shown in the table; the demo goes on with the others
        s.error = str(e)
    s.e2e_s = time.perf_counter() - s.start


def _table(streams: list[_Stream], final: bool) -> Table:
    """Live view while streaming (answer tails); per-request figures when final."""
    t = Table(title=None if final else "streaming 8 ShareGPT prompts (disaggregated, TCP KV)")
    t.add_column("#", min_width=1)
    t.add_column("prompt", no_wrap=True, overflow="ellipsis", max_width=36)
    if not final:
        t.add_column("answer (tail)", no_wrap=True, overflow="ellipsis", ratio=1)
    for col in ("tokens", "TTFT s", "tok/s", "finish"):
        t.add_column(col, no_wrap=True, min_width=len(col))
    for i, s in enumerate(streams):
        tail = [] if final else [s.error or s.text.replace("\n", " ")[-60:]]
        t.add_row(str(i), s.prompt.replace("\n", " ")[:36], *tail, str(s.tokens),
                  f"{s.ttft_s:.2f}" if s.ttft_s is not None else "…",
                  f"{s.decode_tok_s:.1f}" if s.e2e_s else "…", s.error[:30] or s.finish)
    return t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args(argv)
    console = Console()
    prompts = sample_prompts(args.num_prompts, max_chars=300)
    with console.status("starting Ray, 1 prefill worker, 1 decode worker, router "
                        "(first run converts the GGUF model, ~15 s)"):
        cluster = Cluster(ClusterConfig.local(args.model, port=0))
        port = cluster.start()
    console.print(f"pdserve ready: gRPC on 127.0.0.1:{port}")
    try:
        with Client(f"127.0.0.1:{port}", timeout_s=600) as client:
            streams = [_Stream(p) for p in prompts]
            threads = [threading.Thread(target=_run, args=(client, s, args.max_tokens))
                       for s in streams]
            t0 = time.perf_counter()
            for th in threads:
                th.start()
            with Live(_table(streams, False), console=console, refresh_per_second=8,
                      transient=True) as live:
                while any(th.is_alive() for th in threads):
                    time.sleep(0.125)
                    live.update(_table(streams, False))
            wall = time.perf_counter() - t0
            for i, s in enumerate(streams):
                console.rule(f"[{i}] {s.prompt.replace(chr(10), ' ')[:70]}")
                console.print(s.error or s.text, markup=False, highlight=False)
            console.rule()
            console.print(_table(streams, True))
            total = sum(s.tokens for s in streams)
            console.print(f"{total} tokens in {wall:.1f} s: {total / wall:.1f} tok/s across "
                          f"{len(streams)} concurrent requests; mean TTFT "
                          f"{sum(s.ttft_s or 0 for s in streams) / len(streams):.2f} s")
            st = client.status()
            for w in st.workers:
                console.print(f"  {w.worker_id}: {w.kv_blocks_free}/{w.kv_blocks_total} KV blocks free")
            failed = [s for s in streams if s.error]
    finally:
        with console.status("shutting down"):
            cluster.stop()
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
