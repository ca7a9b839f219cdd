"""router/heap.py: the router trims glibc's heap once large requests have ended (HTTP
bodies here; gRPC requests in e2e/test_serve_tracing.py's flood), never for small ones."""

from __future__ import annotations

import asyncio

from pdserve.router.heap import LARGE_REQUEST_BYTES, HeapTrim, _malloc_trim
from test_http_api import FakeRouter, client, script


def trims_of(events) -> list[int]:
    """Run HeapTrim (quiet_s 0.2) over `events`, (delay s, request bytes) each; the
    trims' pads, 1 s after the last event."""
    calls = []
    heap = HeapTrim(quiet_s=0.2, trim=lambda pad: calls.append(pad) or 1)

    async def main():
        task = asyncio.get_running_loop().create_task(heap.run())
        for delay, nbytes in events:
            await asyncio.sleep(delay)
            heap.ended(nbytes)
        await asyncio.sleep(1.0)
        task.cancel()
    asyncio.run(main())
    assert heap.trims == len(calls) and not heap.pending
    return calls


def test_small_requests_never_trim():
    assert trims_of([(0.0, LARGE_REQUEST_BYTES - 1)] * 5) == []


def test_large_requests_in_a_burst_trim_once_when_it_is_quiet():
    assert trims_of([(0.02, LARGE_REQUEST_BYTES)] * 10) == [0]


def test_bursts_apart_trim_once_each():
    assert trims_of([(0.0, 8 << 20), (0.6, 8 << 20)]) == [0, 0]


def test_glibc_malloc_trim_is_found_and_runs():
    trim = _malloc_trim()
    assert trim is not None and trim(0) in (0, 1)


def test_http_bodies_over_a_mib_trim_and_small_ones_do_not():
    r = FakeRouter(max_request_bytes=2 * LARGE_REQUEST_BYTES, messages=script("ok"))
    c = client(r)
    assert c.post("/v1/completions", json={"prompt": "x"}).status_code == 200
    assert not r.heap_trim.pending
    resp = c.post("/v1/completions", json={"prompt": "x" * LARGE_REQUEST_BYTES,
                                           "max_tokens": 1})
    assert resp.status_code == 200 and r.heap_trim.pending
    assert r.all_closed()
