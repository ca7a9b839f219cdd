"""`pdserve bench transfer`: KV transfer throughput of each transport against its raw
baseline, measured in the same run.

For each transport, the KV of `num_requests` prompts of `prompt_tokens` tokens (the
default model's geometry: layers, KV heads, head_dim, dtype) moves from this process
(sender) to a spawned receiver process, layer by layer as prefill sends it: pdserve's
transport (framing, handshake done beforehand, gather from the paged cache, scatter into
reserved blocks) against the same bytes in the same message sizes through
a raw blocking socket (`sendall` from / `recv_into` into buffers of the full size, so
both sides touch as much distinct memory as a real transfer): the baseline of both tcp
and nixl, since a socket is what a transfer without RDMA falls back to. A run is timed
from the first send to the receiver's report that everything arrived (every done frame
for pdserve; every byte for raw). Repeats are interleaved (raw, pdserve, raw, ...) and
the median is reported. Afterwards the receiver, paired and idle, reports the CPU time
it used over `idle_s` seconds (a transport whose progress loop spins shows ~1.0).
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import statistics
import time
import uuid
from dataclasses import asdict, dataclass

import torch

from ..engine.block_pool import blocks_needed

_CTX = mp.get_context("spawn")       # the receiver must not inherit torch/ray state
_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Geometry:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    model_id: str
    device: str = "cpu"              # where both sides' caches live ("cuda": `bench gpu`)

    @classmethod
    def of_model(cls, model: str, block_size: int, dtype: str = "float32",
                 device: str = "cpu") -> "Geometry":
        from ..engine.config import ModelConfig
        from ..engine.loader import resolve_model
        c = ModelConfig.of(resolve_model(model))
        return cls(c.num_layers, c.num_kv_heads, c.head_dim, block_size, dtype, c.model_id,
                   device)

    def cache(self, num_blocks: int, fill: bool) -> torch.Tensor:
        """KV cache [num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim]."""
        shape = (self.num_layers, 2, num_blocks, self.num_kv_heads, self.block_size, self.head_dim)
        from ..engine.attention import allocate_kv_cache

        kv = allocate_kv_cache(shape, getattr(torch, self.dtype), self.device)
        if fill:
            kv.normal_()
        return kv

    def layout(self):
        from ..kv_transfer import KVLayout
        return KVLayout(self.model_id, self.num_layers, self.num_kv_heads, self.head_dim,
                        self.block_size, self.dtype)

    def layer_bytes(self, num_blocks: int) -> int:
        """Bytes of K and V of one layer for `num_blocks` blocks."""
        return self.layout().payload_bytes(1, num_blocks)


@dataclass(frozen=True)
class Result:
    transport: str          # "tcp" | "nixl"
    bytes: int              # KV payload bytes moved per run
    seconds: float          # median over repeats
    gbps: float             # GB/s (1e9 bytes/s)
    baseline_gbps: float    # raw baseline, same bytes, same run
    ratio: float            # gbps / baseline_gbps
    per_request_mib: float
    seconds_all: list[float]            # every timed run, in order
    baseline_seconds_all: list[float]
    idle_s: float = 0.0                 # idle window after the runs (0: not measured)
    idle_cpu_fraction: float | None = None  # receiver CPU seconds / idle_s (1.0 = a core)


# --- receiver process ---------------------------------------------------------------------

def _pdserve_receiver(kind: str, geo: Geometry, num_blocks: int, ctl, out) -> None:
    import threading

    # One torch thread, like a worker on a shared box: idle OpenMP threads of two
    # processes spin and starve each other on 2 cores (measured 8x slower).
    torch.set_num_threads(1)

    from ..kv_transfer import make_receiver

    kv = geo.cache(num_blocks, fill=False)
    news = threading.Event()
    rx = make_receiver(kind, kv, geo.layout(), epoch=7, notify=news.set)
    out.put(rx.start())
    while (cmd := ctl.get()) is not None:
        if cmd[0] == "idle":     # CPU seconds over an idle window, every thread included
            t0 = time.process_time()
            time.sleep(cmd[1])
            out.put(("idle", time.process_time() - t0))
            continue
        rids, tables = cmd
        for rid, table in zip(rids, tables):
            rx.expect(rid, table)
        out.put("ready")
        # the receiver polled as D's step loop polls it, woken by its notify
        pending, failed = set(rids), []
        deadline = time.monotonic() + _TIMEOUT_S
        while pending and time.monotonic() < deadline:
            news.wait(0.05)
            news.clear()
            for c in rx.get_finished().completions:
                pending.discard(c.request_id)
                if not c.ok:
                    failed.append(c.error)
        out.put(("done", not pending, failed))
        for rid in rids:
            rx.forget(rid)
    rx.close()


def _host_buffer(nbytes: int, fill: bool = False) -> memoryview:
    """``nbytes`` of host memory allocated as a KV cache is (huge pages where the kernel
    allows), so the baseline's buffers get what pdserve's caches get."""
    from ..engine.attention import allocate_kv_cache

    t = allocate_kv_cache((-(-nbytes // 4),), torch.float32, "cpu")
    if fill:
        t.normal_()
    return memoryview(t.numpy()).cast("B")


def _raw_socket_receiver(sizes: list[int], out) -> None:
    srv = socket.create_server(("127.0.0.1", 0))
    out.put(srv.getsockname()[:2])
    conn, _ = srv.accept()
    # Distinct destination bytes, like a real transfer (one reused small buffer would stay
    # in CPU cache and flatter the baseline), in memory allocated as a KV cache is.
    buf = _host_buffer(sum(sizes))
    go = bytearray(1)
    while conn.recv_into(go, 1) == 1:              # b"g": go; EOF: stop
        off = 0
        for n in sizes:
            view, got = buf[off:off + n], 0
            off += n
            while got < n:
                r = conn.recv_into(view[got:], n - got)
                if not r:
                    raise ConnectionError("raw sender closed early")
                got += r
        conn.sendall(b"k")                  # delivery acknowledged on the same socket
    conn.close()
    srv.close()


# --- sender side ----------------------------------------------------------------------------

def _plan(geo: Geometry, num_requests: int, prompt_tokens: int):
    per_req = blocks_needed(prompt_tokens, geo.block_size)
    # Requests take consecutive block ranges, as a fresh block pool hands them out.
    tables = [list(range(i * per_req, (i + 1) * per_req)) for i in range(num_requests)]
    return per_req, tables


class _RawTcp:
    """Raw blocking socket: the same message sizes, no framing, no cache."""

    def __init__(self, sizes: list[int]):
        self.sizes, self.out = sizes, _CTX.Queue()
        self.proc = _CTX.Process(target=_raw_socket_receiver, args=(sizes, self.out), daemon=True)
        self.proc.start()
        self.sock = socket.create_connection(tuple(self.out.get(timeout=_TIMEOUT_S)))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.payload = _host_buffer(sum(sizes), fill=True)

    def once(self) -> float:
        self.sock.sendall(b"g")
        t0 = time.perf_counter()
        off = 0
        for n in self.sizes:
            self.sock.sendall(self.payload[off:off + n])
            off += n
        assert self.sock.recv(1) == b"k"
        return time.perf_counter() - t0

    def close(self) -> None:
        self.sock.close()
        self.proc.join(_TIMEOUT_S)


class _Pdserve:
    """pdserve's transport: handshake once, then per run every layer of every request
    (layer-major, as a prefill batch sends) and a done frame each."""

    def __init__(self, kind: str, geo: Geometry, num_requests: int, prompt_tokens: int):
        from ..kv_transfer import make_sender

        self.kind, self.geo = kind, geo
        per_req, self.tables = _plan(geo, num_requests, prompt_tokens)
        num_blocks = per_req * num_requests
        self.ctl, self.out = _CTX.Queue(), _CTX.Queue()
        self.proc = _CTX.Process(target=_pdserve_receiver,
                                 args=(kind, geo, num_blocks, self.ctl, self.out), daemon=True)
        self.proc.start()
        self.addr = tuple(self.out.get(timeout=_TIMEOUT_S))
        self.tx = make_sender(kind, geo.cache(num_blocks, fill=True), geo.layout())
        self.epoch = self.tx.connect(self.addr)     # pairing handshake: not timed

    def once(self) -> float:
        rids = [uuid.uuid4().hex for _ in self.tables]
        self.ctl.put((rids, self.tables))
        assert self.out.get(timeout=_TIMEOUT_S) == "ready"
        t0 = time.perf_counter()
        for layer in range(self.geo.num_layers):
            for rid, table in zip(rids, self.tables):
                self.tx.send_layers(self.addr, rid, self.epoch, layer, layer + 1, table)
        for rid in rids:
            self.tx.send_done(self.addr, rid, self.epoch, first_token=1,
                              num_layers_sent=self.geo.num_layers)
        _, ok, failed = self.out.get(timeout=_TIMEOUT_S)
        elapsed = time.perf_counter() - t0
        if not ok or failed:
            raise RuntimeError(f"{self.kind} transfer failed: {failed or 'timed out'}")
        return elapsed

    def idle_cpu(self, seconds: float) -> float:
        """Receiver CPU seconds over ``seconds`` of idling, paired."""
        self.ctl.put(("idle", seconds))
        tag, cpu_s = self.out.get(timeout=_TIMEOUT_S + seconds)
        assert tag == "idle", tag
        return cpu_s

    def close(self) -> None:
        self.ctl.put(None)
        self.tx.close()
        self.proc.join(_TIMEOUT_S)


def run(transports: list[str], model: str = "default", num_requests: int = 4,
        prompt_tokens: int = 512, block_size: int = 16, repeats: int = 5,
        dtype: str = "float32", idle_s: float = 0.0) -> list[Result]:
    """Measure each transport and its raw baseline; returns one Result per transport.

    Both sides keep one receiver process for all runs and do one untimed warm-up run,
    then runs alternate raw / pdserve so drift hits both alike; medians are reported.
    idle_s > 0: then the receiver's CPU time over that many idle seconds.
    """
    geo = Geometry.of_model(model, block_size, dtype)
    per_req, _ = _plan(geo, num_requests, prompt_tokens)
    sizes = [geo.layer_bytes(per_req)] * (geo.num_layers * num_requests)
    total = sum(sizes)
    results = []
    for kind in transports:
        raw, ours = _RawTcp(sizes), _Pdserve(kind, geo, num_requests, prompt_tokens)
        idle_cpu = None
        try:
            raw.once(), ours.once()                      # warm-up, not counted
            base_t, ours_t = [], []
            for _ in range(repeats):
                base_t.append(raw.once())
                ours_t.append(ours.once())
            if idle_s > 0:
                idle_cpu = ours.idle_cpu(idle_s) / idle_s
        finally:
            raw.close()
            ours.close()
        base, mine = statistics.median(base_t), statistics.median(ours_t)
        results.append(Result(kind, total, mine, total / mine / 1e9, total / base / 1e9,
                              base / mine, total / num_requests / 2**20, ours_t, base_t,
                              idle_s, idle_cpu))
    return results


def table(results: list[Result]) -> str:
    rows = [("transport", "bytes", "seconds", "GB/s", "raw GB/s", "ratio", "MiB/request",
             "idle CPU")]
    rows += [(r.transport, f"{r.bytes:,}", f"{r.seconds:.4f}", f"{r.gbps:.2f}",
              f"{r.baseline_gbps:.2f}", f"{r.ratio:.2f}", f"{r.per_request_mib:.1f}",
              "-" if r.idle_cpu_fraction is None else f"{100 * r.idle_cpu_fraction:.1f}%")
             for r in results]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in rows)


def as_json(results: list[Result], config: dict) -> dict:
    return {"config": config, "results": [asdict(r) for r in results]}
