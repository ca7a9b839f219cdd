"""router/router.py + admission.py: Router.generate admits before it waits, and releases
the request's queue share exactly once, at its first token or on any failure.

Fake worker handles stand in for the Ray actors (tests/admission_fakes.py): no model, no
Ray. Every test ends with the router's queue empty.
"""

import asyncio

import grpc
import pytest
import ray.exceptions

from admission_fakes import (FIRST_TOKEN, PROMPT, FakeDecode, FakePrefill, first_message,
                             generate, make_router, queue)
from pdserve.router.errors import RequestError


def test_queued_from_admission_until_the_first_token():
    async def main():
        d, p = FakeDecode(), FakePrefill()
        r = make_router(d, p)
        gen = generate(r)
        first = asyncio.create_task(gen.__anext__())
        await asyncio.wait_for(p.started.wait(), 10)
        assert queue(r) == (1, len(PROMPT))      # reserved on D, prefilling on P
        p.go.set()
        msg = await first
        assert list(msg.token_ids) == [FIRST_TOKEN]
        assert queue(r) == (0, 0)                # released at TTFT while D still streams
        rest = [m async for m in gen]
        assert [t for m in rest for t in m.token_ids] == [11, 12]
        assert rest[-1].finish_reason == "length"
        return r

    assert queue(asyncio.run(main())) == (0, 0)


def test_over_max_queued_requests_is_refused_before_reserving():
    async def main():
        d, p = FakeDecode(), FakePrefill()
        r = make_router(d, p, max_queued_requests=1)
        admitted = asyncio.create_task(first_message(r))
        await asyncio.wait_for(p.started.wait(), 10)
        with pytest.raises(RequestError) as ei:
            await first_message(r)
        assert ei.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_queued_requests=1" in str(ei.value), str(ei.value)
        assert len(d.reserved) == 1              # the refused one never asked D
        p.go.set()
        assert list((await admitted).token_ids) == [FIRST_TOKEN]
        assert list((await first_message(r)).token_ids) == [FIRST_TOKEN]   # room again
        return r

    assert queue(asyncio.run(main())) == (0, 0)


def test_prompt_over_max_queued_tokens_is_refused_at_once():
    async def main():
        d, p = FakeDecode(), FakePrefill()
        r = make_router(d, p, max_queued_tokens=len(PROMPT) - 1)
        with pytest.raises(RequestError) as ei:
            await first_message(r)
        assert ei.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"exceeds max_queued_tokens={len(PROMPT) - 1}" in str(ei.value), str(ei.value)
        assert not d.asked.is_set() and not p.started.is_set()
        return r

    assert queue(asyncio.run(main())) == (0, 0)


@pytest.mark.parametrize("case, code", [
    ("no decode room", grpc.StatusCode.RESOURCE_EXHAUSTED),   # reserve_timeout_s runs out
    ("prefill error", grpc.StatusCode.UNAVAILABLE),
    ("deadline in prefill", grpc.StatusCode.DEADLINE_EXCEEDED),
])
def test_failure_before_first_token_releases_the_queue(case, code):
    async def main():
        d = FakeDecode(room=case != "no decode room")
        # A worker-side failure reaches the router as a Ray error; retried max_migrations
        # times, then UNAVAILABLE.
        p = FakePrefill(error=ray.exceptions.RaySystemError("KV transfer failed")
                        if case == "prefill error" else None)
        if case == "prefill error":
            p.go.set()
        r = make_router(d, p, reserve_timeout_s=0.05)
        with pytest.raises(RequestError) as ei:
            await first_message(r, deadline_s=0.05 if case == "deadline in prefill" else None)
        assert ei.value.code == code, ei.value
        return r

    assert queue(asyncio.run(main())) == (0, 0)


@pytest.mark.parametrize("stage", ["waiting for decode room", "prefill"])
def test_client_cancel_releases_the_queue(stage):
    async def main():
        d, p = FakeDecode(room=stage == "prefill"), FakePrefill()
        r = make_router(d, p)
        task = asyncio.create_task(first_message(r))
        await (p.started if stage == "prefill" else d.asked).wait()
        assert queue(r) == (1, len(PROMPT))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return r

    assert queue(asyncio.run(main())) == (0, 0)
