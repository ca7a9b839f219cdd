"""router/router.py + admission.py: Router.generate admits before it waits, and releases
the request's queue share exactly once, at its first token or on any failure.

Fake worker handles stand in for the Ray actors (`handle.method.remote(...)` calls the
fake's coroutine), and a word-level tokenizer built in memory for the model's: no model,
no Ray. Every test ends with the router's queue empty.
"""

import asyncio
from dataclasses import replace

import grpc
import pytest
import ray.exceptions

from pdserve.client import make_request
from pdserve.engine.request import TokenEvent
from pdserve.router.errors import RequestError
from pdserve.router.router import Router
from pdserve.router.workers import Worker
from router_fakes import EventsFromStreams, fake_router

from pdserve.messages import DecodeReservation, PrefillResult

PROMPT = [1, 2, 3, 4]          # token ids
FIRST_TOKEN = 10               # what the fake prefill worker samples


class FakeDecode(EventsFromStreams):
    """Reserves at once when it has room (else answers None, as a full worker does), then
    streams `tokens` as one finishing event."""

    def __init__(self, room: bool = True, tokens: tuple[int, ...] = (11, 12),
                 local: bool = False):
        self.room, self.tokens, self.local = room, tokens, local
        self.asked = asyncio.Event()
        self.reserved: list[str] = []
        self.aborted: list[str] = []

    async def reserve(self, rid, prompt_len, params, prompt_token_ids, lease_s=None,
                      prefill_locally=False):
        assert list(prompt_token_ids) == PROMPT and prompt_len == len(PROMPT)  # kept for recompute
        self.asked.set()
        if not self.room:
            return None
        self.reserved.append(rid)
        return DecodeReservation(("127.0.0.1", 1), 1, num_blocks=1, num_cached_blocks=0,
                                 local_prefill=self.local, free_blocks=60)

    def stream(self, rid):
        async def value(v):
            return v

        async def refs():
            yield value([TokenEvent(rid, self.tokens, finish_reason="length")])
        return refs()

    def abort(self, rid, reason, group=False):
        self.aborted.append(rid)


class FakePrefill:
    """Prefills once `go` is set: returns FIRST_TOKEN, or raises `error` when set."""

    def __init__(self, error: Exception | None = None):
        self.started, self.go = asyncio.Event(), asyncio.Event()
        self.error = error
        self.aborted: list[str] = []

    async def prefill(self, order):
        assert order.num_cached_blocks == 0
        self.started.set()
        await self.go.wait()
        if self.error is not None:
            raise self.error
        return PrefillResult(FIRST_TOKEN)

    def abort(self, rid):
        self.aborted.append(rid)


def make_router(decode: FakeDecode, prefill: FakePrefill, **router_kw) -> Router:
    """A Router over the fakes (router_fakes.fake_router)."""
    return fake_router([prefill], [decode], **router_kw)


def queue(r: Router) -> tuple[int, int]:
    return r.admission.queued_requests, r.admission.queued_tokens


def generate(r: Router, prompt=PROMPT, deadline_s=None):
    return r.generate(make_request(prompt, max_tokens=3, temperature=0), deadline_s)


async def first_message(r: Router, **kw):
    gen = generate(r, **kw)
    try:
        return await gen.__anext__()
    finally:
        await gen.aclose()


async def until(cond, what: str, timeout_s: float = 10.0) -> None:
    """Poll `cond` on the event loop until it holds; fail naming `what` after timeout_s."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not cond():
        assert loop.time() < deadline, f"not within {timeout_s:.0f} s: {what}"
        await asyncio.sleep(0.001)


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


def test_local_prefill_on_decode_skips_the_prefill_worker():
    async def main():
        d, p = FakeDecode(local=True), FakePrefill()
        r = make_router(d, p)
        msgs = [m async for m in generate(r)]
        # D's stream carries the first token; P is never asked, never aborted
        assert [t for m in msgs for t in m.token_ids] == [11, 12]
        assert msgs[-1].finish_reason == "length"
        assert not p.started.is_set() and not p.aborted and not d.aborted
        return r

    assert queue(asyncio.run(main())) == (0, 0)


class HeldDecode(FakeDecode):
    """Prefills locally when the router asks it to (recording each ask), and streams only
    once `go` is set, so the router's queues stay as built."""

    def __init__(self):
        super().__init__()
        self.asks: list[bool] = []
        self.go = asyncio.Event()

    async def reserve(self, rid, prompt_len, params, prompt_token_ids, lease_s=None,
                      prefill_locally=False):
        self.asks.append(prefill_locally)
        self.local = prefill_locally
        return await super().reserve(rid, prompt_len, params, prompt_token_ids, lease_s)

    def stream(self, rid):
        async def value(v):
            return v

        async def refs():
            await self.go.wait()
            yield value([TokenEvent(rid, self.tokens, finish_reason="length")])
        return refs()


@pytest.mark.parametrize("limit, asks", [
    (len(PROMPT) - 1, [False, False, True, False, True]),   # P's queue past the limit and
                                                           # past D's own: balanced
    (0, [False] * 5),                                      # 0: always a prefill worker
    (10 * len(PROMPT), [False] * 5),                       # never that deep
])
def test_a_long_prefill_queue_sends_prompts_to_the_decode_worker(limit, asks):
    n = len(PROMPT)

    async def main():
        d, p = HeldDecode(), FakePrefill()
        r = make_router(d, p, max_prefill_queue_tokens=limit)
        tasks = []
        for i in range(len(asks)):
            tasks.append(asyncio.create_task(first_message(r)))
            await until(lambda: r.prefill[0].queued_tokens + r.decode[0].queued_tokens
                        >= n * (i + 1), f"request {i} reserved, and queued on P or on D")
        assert d.asks == asks
        assert r.decode[0].queued_tokens == n * sum(asks)
        p.go.set()
        d.go.set()
        firsts = [list(m.token_ids) for m in await asyncio.gather(*tasks)]
        assert firsts == [[11, 12] if local else [FIRST_TOKEN] for local in asks]
        assert r.prefill[0].queued_tokens == 0 and r.decode[0].queued_tokens == 0
        return r

    assert queue(asyncio.run(main())) == (0, 0)


class SlowReserveDecode(HeldDecode):
    """Its reservations are in flight until `release` is set, as a burst's are on a
    real cluster while the router decides for the next requests."""

    def __init__(self):
        super().__init__()
        self.release = asyncio.Event()

    async def reserve(self, *args, **kw):
        await self.release.wait()
        return await super().reserve(*args, **kw)


def test_a_burst_splits_between_prefill_and_decode_as_one_by_one():
    """Five requests at once: each one's choice (P or D) sees the prompt tokens the
    earlier ones were charged, although none of their reservations has returned yet;
    the split is the one of the same requests arriving one by one (above)."""
    n = len(PROMPT)

    async def main():
        d, p = SlowReserveDecode(), FakePrefill()
        r = make_router(d, p, max_prefill_queue_tokens=n - 1)
        tasks = [asyncio.create_task(first_message(r)) for _ in range(5)]
        await until(lambda: r.prefill[0].queued_tokens + r.decode[0].queued_tokens >= 5 * n,
                    "all five chosen and charged")
        assert d.asks == []                     # none reserved yet
        assert (r.prefill[0].queued_tokens, r.decode[0].queued_tokens) == (3 * n, 2 * n)
        d.release.set()
        await until(lambda: len(d.asks) == 5, "all five reserved")
        assert sorted(d.asks) == sorted([False, False, True, False, True])
        p.go.set()
        d.go.set()
        await asyncio.gather(*tasks)
        assert r.prefill[0].queued_tokens == 0 and r.decode[0].queued_tokens == 0
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


def test_the_default_limit_is_one_prefill_step():
    """max_prefill_queue_tokens unset: D prefills a prompt itself once every prefill
    worker has more than a step's budget queued (its max_num_batched_tokens)."""
    r = make_router(FakeDecode(), FakePrefill())
    step = r.config.prefill.max_num_batched_tokens
    assert r.config.router.max_prefill_queue_tokens is None and step == 512
    d, p = r.decode[0], r.prefill[0]
    p.queued_tokens = step
    assert not r.placement.prefill_on_decode(d, 100)          # a step's worth: P keeps it
    p.queued_tokens = step + 1
    assert r.placement.prefill_on_decode(d, 100)
    d.queued_tokens = step                       # D's own queue would be longer
    assert not r.placement.prefill_on_decode(d, 100)


def test_a_prompt_no_prefill_pool_holds_is_prefilled_on_decode():
    """A retry's prompt (the original + the tokens streamed) may outgrow every prefill
    worker's pool while D's holds it: D prefills it rather than failing each retry."""
    r = make_router(FakeDecode(), FakePrefill())
    d, p = r.decode[0], r.prefill[0]
    fits = p.num_blocks * r.config.prefill.block_size
    assert not r.placement.prefill_on_decode(d, fits)
    assert r.placement.prefill_on_decode(d, fits + 1)


def test_a_decode_worker_prefills_while_a_prefill_worker_of_its_node_is_idle():
    """local_prefill_when_prefill_idle: D takes a prompt when it has none of its own
    queued and a live prefill worker on its node has none (that worker's threads are
    then lent to D); only with core lending on (a core_share_dir)."""
    r = make_router(FakeDecode(), FakePrefill(), local_prefill_when_prefill_idle=True)
    d, p = r.decode[0], r.prefill[0]
    d.node_ip = p.node_ip = "10.0.0.1"
    assert not r.placement.prefill_on_decode(d, 100)                  # no lending: P's path
    lending = replace(r.config, decode=replace(r.config.decode, core_share_dir="/dev/shm/x"))
    r.config = r.placement.config = lending
    assert r.placement.prefill_on_decode(d, 100)
    d.queued_tokens = 1                                  # D prefills one already
    assert not r.placement.prefill_on_decode(d, 100)
    d.queued_tokens, p.queued_tokens = 0, 1                       # P has one queued
    assert not r.placement.prefill_on_decode(d, 100)
    p.queued_tokens, p.node_ip = 0, "10.0.0.2"                         # P idle on another node
    assert not r.placement.prefill_on_decode(d, 100)
    p.node_ip, p.draining = d.node_ip, True                   # draining: lends nothing
    assert not r.placement.prefill_on_decode(d, 100)
    p.draining = False
    r.decode.append(Worker(None, "decode-1", 64, 1, node_ip=d.node_ip))
    assert not r.placement.prefill_on_decode(d, 100)          # 2 decode workers share 1 idle P
    r.decode.pop()
    r.config = r.placement.config = replace(
        lending, router=replace(lending.router, local_prefill_when_prefill_idle=False))
    assert not r.placement.prefill_on_decode(d, 100)


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


async def collect(gen) -> list[int]:
    return [t async for m in gen for t in m.token_ids]
