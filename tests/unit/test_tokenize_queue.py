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


def test_long_inputs_share_a_quarter_of_the_thread_and_short_ones_pass_meanwhile(
        monkeypatch):
    """Calls over long_chars spend a bucket of LONG_BURST_S seconds (0.2 here) refilled
    at LONG_SHARE a second: once spent, the next long one is refused
    (RESOURCE_EXHAUSTED, once its share would have refilled) without running, and a
    short one still runs at once."""
    from pdserve.router import tokenize_queue as tq
    monkeypatch.setattr(tq, "LONG_BURST_S", 0.2)

    async def main():
        q = TokenizeQueue(max_queued_chars=10_000, long_chars=100)
        ran = []

        def job(name, seconds):
            time.sleep(seconds)
            ran.append(name)
            return name

        # 0.2 s of credit, 0.4 s spent: -0.2, and +0.1 refilled meanwhile
        assert await q.run(500, job, "long-1", 0.4) == "long-1"
        t0 = time.monotonic()
        with pytest.raises(RequestError) as e:
            await q.run(500, job, "long-2", 0.0)
        waited = time.monotonic() - t0
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "share (25%)" in str(e.value) and "over 100 characters" in str(e.value)
        assert 0.2 < waited < 0.4 / tq.LONG_SHARE          # ~0.1 s of credit at 0.25/s
        assert await q.run(10, job, "short", 0.0) == "short"
        assert ran == ["long-1", "short"] and q.refused == 1
        assert await q.run(500, job, "long-3", 0.0) == "long-3"   # refilled while refused

    asyncio.run(main())
