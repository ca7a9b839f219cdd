"""Clients that open streamed completions and never read them (4 KiB receive buffers):
once their responses fill the connections' buffers, each stream is parked (before half
its tokens), and after stream_stall_timeout_s the router aborts it: every one within
ABORTED_WITHIN_S past the stall timeout of its parking (the router's StallWatch says
when), the decode worker stops generating for it, every KV block comes back, the
connection is closed, the router counts it, and the router's memory grows by less than
ROUTER_GROWTH_BYTES. How soon the buffers fill depends on the machine's decode speed, so
only the parking is timed; a hang guard bounds the whole."""

from __future__ import annotations

import json
import os
import socket
import time
import urllib.request

import pytest
from serving import Served, start_ray

pytestmark = pytest.mark.slow

STREAMS = 24
MAX_TOKENS = 4000
STALL_S = 3.0
ABORTED_WITHIN_S = 2.0         # beyond STALL_S, from a stream's parking (StallWatch sweeps
                               # every STALL_S / 4; the test polls every 0.2 s)
HANG_GUARD_S = 300.0
ROUTER_GROWTH_BYTES = 100 << 20


def _router_rss(served: Served) -> int:
    import psutil
    import ray

    pid = ray.get(served.cluster.router.__ray_call__.remote(lambda _self: os.getpid()),
                  timeout=60)
    return psutil.Process(pid).memory_info().rss


def _held(served: Served) -> dict[int, float | None]:
    """The streams the router's StallWatch holds now: id -> since when parked
    (time.monotonic(), one clock for every process of this machine), None while the
    front end is pulling its next item (a stream flips between the two while its
    connection's buffer has room)."""
    import ray

    return dict(ray.get(served.cluster.router.__ray_call__.remote(
        lambda router: [(id(h), h.since) for h in router.stalls._held]), timeout=60))


def _metric(address: str, name: str) -> float:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


def _open_unread(port: int, i: int) -> socket.socket:
    """A streamed completion over a socket that never reads (4 KiB receive buffer)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    body = json.dumps({"model": "default", "prompt": f"Story {i}: once upon a time,",
                       "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True}).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    return s


def test_streams_whose_clients_read_nothing_are_aborted():
    start_ray()
    served = Served(decode_blocks=STREAMS * (MAX_TOKENS // 16 + 4),
                    router_kw={"http_port": 0, "stream_stall_timeout_s": STALL_S})
    socks = []
    try:
        router_metrics = served.client.status().metrics_address
        rss0 = _router_rss(served)
        opened = time.monotonic()
        socks = [_open_unread(served.cluster.http_port, i) for i in range(STREAMS)]
        # each stream held: when it was last seen parked (None: not yet); one no longer
        # held was closed, within ABORTED_WITHIN_S past the stall timeout of its parking
        # (closed only after STALL_S parked, so the polls saw that parking)
        peak, parked, aborted = rss0, {}, 0

        def closed(now: float, held: dict) -> int:
            gone = [since for h, since in parked.items() if h not in held]
            for since in gone:
                assert since is not None and now - since < STALL_S + ABORTED_WITHIN_S, (
                    since, now - (since or now))
            return len(gone)

        while (stalled := _metric(router_metrics, "pdserve_streams_stalled_total")) < STREAMS:
            now, held = time.monotonic(), _held(served)
            aborted += closed(now, held)
            parked = {h: parked.get(h) if since is None else since for h, since in held.items()}
            assert now - opened < HANG_GUARD_S, f"{stalled:.0f} of {STREAMS} aborted"
            peak = max(peak, _router_rss(served))
            time.sleep(0.2)
        now, held = time.monotonic(), _held(served)
        assert not held, held
        aborted += closed(now, held)
        assert aborted == STREAMS, f"{aborted} of {STREAMS} streams seen parked, then closed"
        assert peak - rss0 < ROUTER_GROWTH_BYTES, (rss0, peak)
        served.assert_all_free(timeout_s=10)        # D stopped; every block back
        generated = _metric(router_metrics, "pdserve_generation_tokens_total")
        assert generated < STREAMS * MAX_TOKENS / 2, generated
        for s in socks:                             # what was buffered, then closed
            s.settimeout(30)
            while s.recv(65536):
                pass
    finally:
        for s in socks:
            s.close()
        served.stop()
