"""router/router.py: a request short of decode room waits for it, in arrival order, until
its deadline or reserve_timeout_s.

Fake worker handles stand in for the Ray actors (tests/admission_fakes.py): no model, no
Ray. Every test ends with the router's queue empty.
"""

import asyncio

import grpc
import pytest

from admission_fakes import (PROMPT, FakeDecode, FakePrefill, collect, first_message,
                             make_router, queue, until)
from pdserve.client import make_request
from pdserve.engine.request import TokenEvent
from pdserve.router.errors import RequestError

from pdserve.messages import DecodeReservation


class OneAtATimeDecode(FakeDecode):
    """Room for one request at a time: a reservation holds it until that request's
    stream ends (set `go[rid]`), as one request filling a worker's KV pool would."""

    def __init__(self):
        super().__init__(local=True)
        self.holder: str | None = None
        self.go: dict[str, asyncio.Event] = {}
        self.order: list[str] = []          # requests in the order they got room
        self.num_asks = 0

    async def reserve(self, rid, prompt_len, params, prompt_token_ids, lease_s=None,
                      prefill_locally=False):
        self.asked.set()
        self.num_asks += 1
        if self.holder is not None:
            return None
        self.holder = rid
        self.reserved.append(rid)
        self.order.append(rid.split("#")[0])
        self.go[rid] = asyncio.Event()
        return DecodeReservation(("127.0.0.1", 1), 1, num_blocks=1, num_cached_blocks=0,
                                 local_prefill=True, free_blocks=0)

    def stream(self, rid):
        async def value(v):
            return v

        async def refs():
            await self.go[rid].wait()
            self.holder = None
            yield value([TokenEvent(rid, self.tokens, finish_reason="length")])
        return refs()


def test_requests_short_of_decode_room_wait_their_turn_in_arrival_order():
    """Three requests, room for one: the others wait (no RESOURCE_EXHAUSTED however
    long the first runs), asking D nothing while they wait, and get room in the order
    they came, each as soon as the one before it ended (woken by its end, not a poll)."""
    async def main():
        d, p = OneAtATimeDecode(), FakePrefill()
        r = make_router(d, p)
        r.placement.room.POLL_S = 60.0           # only an end can wake the next
        ids = ["a", "b", "c"]
        tasks = {}
        for rid in ids:
            tasks[rid] = asyncio.create_task(collect(r.generate(
                make_request(PROMPT, max_tokens=3, temperature=0, request_id=rid), None)))
            await until(lambda: len(r.placement.room) + (d.holder is not None) == len(tasks),
                        f"{rid} holds D's room or waits for it")
        assert d.order == ["a"] and len(r.placement.room) == 2
        assert queue(r) == (3, 3 * len(PROMPT))
        asks = d.num_asks
        await asyncio.sleep(0.3)
        assert d.num_asks == asks                # the waiting ones do not poll D
        for k, rid in enumerate(ids):
            holder = d.holder
            assert holder.startswith(rid), (holder, d.order)
            d.go[holder].set()
            assert await asyncio.wait_for(tasks[rid], 5) == [11, 12]
            if k + 1 < len(ids):
                await until(lambda: d.holder not in (None, holder), f"{ids[k + 1]} took the room")
        assert d.order == ids and len(r.placement.room) == 0
        return r

    assert queue(asyncio.run(main())) == (0, 0)


@pytest.mark.parametrize("timeout_s, code", [(None, grpc.StatusCode.DEADLINE_EXCEEDED),
                                             (0.05, grpc.StatusCode.RESOURCE_EXHAUSTED)])
def test_a_request_waits_for_decode_room_until_its_deadline(timeout_s, code):
    """By default it waits until its own deadline (DEADLINE_EXCEEDED then); with
    reserve_timeout_s set, at most that long (RESOURCE_EXHAUSTED)."""
    async def main():
        d, p = FakeDecode(room=False), FakePrefill()
        r = make_router(d, p, reserve_timeout_s=timeout_s)
        with pytest.raises(RequestError) as ei:
            await first_message(r, deadline_s=0.3)
        assert ei.value.code == code, ei.value
        assert len(r.placement.room) == 0
        return r

    assert queue(asyncio.run(main())) == (0, 0)


def test_the_router_renews_d_s_lease_while_the_prefill_worker_has_the_prompt():
    """A prompt queued on P past D's lease (decode.lease_s, 0.1 s here): the router
    renews the lease every half lease until P's first token, then stops; the request
    completes and nothing stays queued."""
    from dataclasses import replace

    async def main():
        d, p = FakeDecode(), FakePrefill()
        r = make_router(d, p)
        r.config = r.placement.config = replace(
            r.config, decode=replace(r.config.decode, lease_s=0.1))
        task = asyncio.ensure_future(collect(r.generate(make_request(
            PROMPT, max_tokens=3, temperature=0), None)))
        await until(lambda: len(d.extended) >= 3, "three renewals while P holds the prompt")
        assert {rid for rid, _ in d.extended} == set(d.reserved)
        assert all(0 < lease <= 0.1 for _, lease in d.extended)
        p.go.set()
        assert await asyncio.wait_for(task, 10) == [10, 11, 12]
        renewed = len(d.extended)
        await asyncio.sleep(0.2)                      # two half leases: none more
        assert len(d.extended) == renewed
        return r

    assert queue(asyncio.run(main())) == (0, 0)
