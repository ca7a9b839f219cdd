"""router/stalls.py: a stream whose consumer leaves it parked at a response past the
stall timeout or its deadline is closed (its `finally`, which aborts the request on the
workers, runs at once) and its consumer gets the error when it comes back; over real
gRPC, a client that reads nothing parks the stream and gets RESOURCE_EXHAUSTED."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import grpc
import pytest

from pdserve.client import Client, make_request
from pdserve.config import RouterConfig
from pdserve.proto import pdserve_pb2 as pb
from pdserve.router.errors import RequestError
from pdserve.router.heap import HeapTrim
from pdserve.router.service import build_server
from pdserve.router.stalls import StallWatch, watched


class Source:
    """An endless stream of items whose `finally` (the router's abort) is recorded."""

    def __init__(self):
        self.closed = asyncio.Event()
        self.sent = 0

    async def stream(self):
        try:
            while True:
                self.sent += 1
                yield self.sent
                await asyncio.sleep(0)
        finally:
            self.closed.set()


@pytest.mark.parametrize("deadline_s, code, says", [
    (600, grpc.StatusCode.RESOURCE_EXHAUSTED, "stream_stall_timeout_s"),   # stalled
    (8, grpc.StatusCode.DEADLINE_EXCEEDED, "deadline"),                   # deadline first
])
def test_a_parked_stream_is_closed_and_its_consumer_gets_the_error(deadline_s, code, says):
    async def main():
        stalls = []
        watch = StallWatch(10.0, lambda: stalls.append(1))
        src = Source()
        it = watched(watch, src.stream(), time.monotonic() + deadline_s)
        assert await anext(it) == 1                 # the consumer took one, then parks
        watch.sweep(time.monotonic() + 5)           # under both bounds: kept
        assert not src.closed.is_set()
        watch.sweep(time.monotonic() + 11)
        await asyncio.wait_for(src.closed.wait(), 5)   # aborted while parked
        assert src.sent == 1 and stalls == ([1] if deadline_s > 11 else [])
        with pytest.raises(RequestError) as e:
            await anext(it)
        assert e.value.code == code and says in str(e.value)

    asyncio.run(main())


def test_a_reading_consumer_is_never_closed_and_closing_it_releases_the_watch():
    async def main():
        watch = StallWatch(0.05)
        src = Source()
        it = watched(watch, src.stream(), time.monotonic() + 600)
        for _ in range(50):
            await anext(it)
            watch.sweep()                  # right after each pull: not parked long
        assert not src.closed.is_set()
        await it.aclose()
        assert src.closed.is_set() and not watch._held

    asyncio.run(main())


class Endless:
    """What GeneratorService uses of the Router: a stream of 64 KiB messages, with a
    StallWatch; records when its generator's `finally` ran."""

    def __init__(self, timeout_s: float):
        self.config = SimpleNamespace(router=RouterConfig(request_timeout_s=600), num_routers=1)
        self.metrics = SimpleNamespace(request=lambda: SimpleNamespace(
            tokens=lambda n, sample=0: None, finish=lambda status, prompt_tokens: None))
        self.stalls = StallWatch(timeout_s)
        self.heap_trim = HeapTrim(trim=lambda pad: 0)
        self.aborted = threading.Event()
        self.sent = 0

    async def generate(self, req, deadline_s):
        try:
            while True:
                self.sent += 1
                yield pb.GenerateResponse(text="x" * 65536)
        finally:
            self.aborted.set()


def test_a_grpc_client_that_reads_nothing_is_cut():
    router = Endless(timeout_s=0.5)
    got = {}

    async def main():
        server, port = build_server(router, "127.0.0.1:0")
        await server.start()
        sweep = asyncio.get_running_loop().create_task(router.stalls.run())

        def client():
            with Client(f"127.0.0.1:{port}", timeout_s=60) as c:
                call = c.generator.Generate(make_request("hi"), timeout=60)
                assert router.aborted.wait(30), "never aborted"
                got["sent"] = router.sent
                with pytest.raises(grpc.RpcError) as e:
                    for _ in call:              # what the buffers held, then the status
                        pass
                got["code"] = e.value.code()

        try:
            await asyncio.to_thread(client)
        finally:
            sweep.cancel()
            await server.stop(0)

    asyncio.run(main())
    assert got["code"] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert got["sent"] < 2000        # parked by flow control: < 128 MiB produced
