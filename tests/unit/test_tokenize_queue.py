"""router/tokenize_queue.py: the router's tokenizer calls run one at a time, shortest
input first; a call that would find more characters ahead of it than the bound is
refused before any work (answered once that work would have run), while a short one is
let in past long ones waiting; a caller
gone while waiting is skipped; and the router refuses a request when its queue of
requests is full before tokenizing it."""

import asyncio
import threading
import time

import grpc
import pytest

from admission_fakes import FakeDecode, FakePrefill, collect, generate, queue
from pdserve.router.errors import RequestError
from pdserve.router.tokenize_queue import TokenizeQueue
from router_fakes import fake_router


def test_shortest_first_one_at_a_time_and_bounded():
    async def main():
        q = TokenizeQueue(max_queued_chars=1000)
        gate, order, threads = threading.Event(), [], set()

        def job(name):
            threads.add(threading.current_thread().name)
            if name == "first":
                gate.wait(10)
            order.append(name)
            return name

        first = asyncio.create_task(q.run(400, job, "first"))      # runs at once, blocks
        await asyncio.sleep(0.05)
        big = asyncio.create_task(q.run(300, job, "big"))
        small = asyncio.create_task(q.run(10, job, "small"))
        gone = asyncio.create_task(q.run(20, job, "gone"))
        await asyncio.sleep(0.05)
        assert q.queued_chars == 730
        q.seconds_per_char = 1e-3                             # as if learned
        t0 = time.monotonic()
        with pytest.raises(RequestError) as ei:               # 730 ahead + 300 > 1000:
            await q.run(300, job, "refused")                  # refused, never run, once
        assert time.monotonic() - t0 >= 0.73                  # the 730 ahead would have run
        assert ei.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_tokenize_queue_chars=1000" in str(ei.value) and q.refused == 1
        short = asyncio.create_task(q.run(5, job, "short"))   # 400 ahead of it: let in
        await asyncio.sleep(0.05)
        gone.cancel()
        gate.set()
        assert await asyncio.gather(first, big, small, short) == ["first", "big", "small",
                                                                 "short"]
        assert order == ["first", "short", "small", "big"] and q.queued_chars == 0
        assert len(threads) == 1
        assert await q.run(5000, job, "alone") == "alone"     # an empty queue takes any one
        with pytest.raises(ZeroDivisionError):
            await q.run(1, lambda: 1 / 0)
        assert q.queued_chars == 0

    asyncio.run(main())


def test_a_full_router_refuses_before_tokenizing():
    async def main():
        d, p = FakeDecode(), FakePrefill()
        r = fake_router([p], [d], max_queued_requests=1)
        held = asyncio.create_task(collect(generate(r)))     # holds the one queue place
        await asyncio.wait_for(p.started.wait(), 10)
        calls = []
        real = r.tokenize.run
        r.tokenize.run = lambda *a: calls.append(a) or real(*a)
        with pytest.raises(RequestError) as ei:
            await collect(generate(r))
        assert ei.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and not calls
        p.go.set()
        assert await asyncio.wait_for(held, 10) == [10, 11, 12]
        return r

    assert queue(asyncio.run(main())) == (0, 0)
