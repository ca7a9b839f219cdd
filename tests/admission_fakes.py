"""Fake prefill and decode workers, and the helpers that drive a Router's admission over them."""

import asyncio

from pdserve.client import make_request
from pdserve.engine.request import TokenEvent
from pdserve.router.router import Router
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
        self.extended: list[tuple[str, float]] = []   # extend_lease calls

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

    async def extend_lease(self, rid, lease_s):
        self.extended.append((rid, lease_s))
        return rid in self.reserved


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


async def collect(gen) -> list[int]:
    return [t async for m in gen for t in m.token_ids]
