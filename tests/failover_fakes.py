"""Fake prefill and decode workers running a toy model, dying and restarting as Ray actors do."""

import asyncio

import ray.exceptions

from pdserve.client import make_request
from pdserve.engine.request import TokenEvent
from pdserve.router.router import Router
from router_fakes import EventsFromStreams, fake_router

from pdserve.messages import DecodeReservation, PrefillResult, WorkerInfo

PROMPT = [1, 2, 3, 4]
MAX_TOKENS = 8


def next_token(context: list[int]) -> int:
    """The toy model's greedy choice after `context` (never EOS-like: ids 5..54)."""
    return 5 + (sum(context) * 31 + len(context)) % 50


def uninterrupted(prompt: list[int], n: int) -> list[int]:
    ctx = list(prompt)
    for _ in range(n):
        ctx.append(next_token(ctx))
    return ctx[len(prompt):]


class Restartable:
    """Dead between die() and the restart `restart_s` later (Ray's restart of the actor,
    with a new epoch); calls meanwhile raise ActorUnavailableError."""

    def __init__(self, restart_s: float | None = 0.1):
        self.dead, self.epoch, self.restart_s = False, 1, restart_s
        self.draining = False

    def die(self) -> None:
        self.dead = True
        if self.restart_s is not None:
            asyncio.get_running_loop().call_later(self.restart_s, self._restart)

    def _restart(self) -> None:
        self.dead, self.epoch, self.draining = False, self.epoch + 1, False

    async def drain(self) -> None:
        self.check()
        self.draining = True

    def check(self) -> None:
        if self.dead:
            raise ray.exceptions.ActorUnavailableError("restarting", None)

    async def ready(self) -> WorkerInfo:
        self.check()
        return WorkerInfo("fake", "fake", self.epoch, 64, 4, "127.0.0.1")


class FakePrefill(Restartable):
    """Returns the toy model's first token and hands it to the decode fake (the KV
    transfer); dies instead on its first `die_on` calls."""

    def __init__(self, decodes: list, die_on: int = 0, fail_with: Exception | None = None,
                 first_token: int | None = None, **kw):
        super().__init__(**kw)
        self.decodes, self.die_on, self.fail_with = decodes, die_on, fail_with
        self.first_token = first_token      # on the first call, instead of the toy model's
        self.calls: list[str] = []
        self.aborted: list[str] = []

    async def prefill(self, order):
        self.check()
        rid, ids = order.request_id, order.token_ids
        self.calls.append(rid)
        await asyncio.sleep(0.01)
        if len(self.calls) <= self.die_on:
            self.die()
            raise ray.exceptions.ActorDiedError()
        if self.fail_with is not None:
            raise self.fail_with
        first = next_token(list(ids))
        if self.first_token is not None:
            first, self.first_token = self.first_token, None
        for d in self.decodes:
            if rid in d.reserved:
                d.first[rid].set_result(first)
        return PrefillResult(first)

    def abort(self, rid):
        self.aborted.append(rid)


class FakeDecode(EventsFromStreams, Restartable):
    """Reserves, waits for the prefill fake's first token, then streams the rest one
    token per event; on its first attempt it dies after `die_after` streamed tokens."""

    def __init__(self, die_after: int | None = None, **kw):
        super().__init__(**kw)
        self.die_after = die_after
        self.reserved: dict[str, tuple[list[int], object]] = {}
        self.first: dict[str, asyncio.Future] = {}
        self.aborted: list[str] = []

    async def reserve(self, rid, prompt_len, params, ids, lease_s=None, prefill_locally=False):
        self.check()
        assert len(ids) == prompt_len and 0 < lease_s <= 60
        self.reserved[rid] = (list(ids), params)
        self.first[rid] = asyncio.get_running_loop().create_future()
        return DecodeReservation(("127.0.0.1", 1), self.epoch, num_blocks=1,
                                 num_cached_blocks=0, local_prefill=False, free_blocks=60)

    def stream(self, rid):
        async def value(v):
            return v

        async def refs():
            ids, params = self.reserved[rid]
            ctx = ids + [await self.first[rid]]
            for i in range(params.max_tokens - 1):
                if self.die_after is not None and i == self.die_after - 1:
                    self.die_after = None
                    self.die()
                    raise ray.exceptions.ActorDiedError()
                ctx.append(next_token(ctx))
                done = i == params.max_tokens - 2
                yield value([TokenEvent(rid, (ctx[-1],), "length" if done else None)])
                await asyncio.sleep(0.005)
        return refs()

    def abort(self, rid, reason, group=False):
        self.aborted.append(rid)


def make_router(prefills: list, decodes: list, **router_kw) -> Router:
    """A Router over the fakes (__init__ skipped: it loads the model's config)."""
    return fake_router(prefills, decodes, **router_kw)


async def collect(r: Router, deadline_s: float | None = 10.0, **kw) -> list:
    req = make_request(PROMPT, max_tokens=MAX_TOKENS, temperature=0, **kw)
    return [m async for m in r.generate(req, deadline_s)]


def tokens(msgs) -> list[int]:
    return [t for m in msgs for t in m.token_ids]


def retries(r: Router, reason: str) -> float:
    return r.metrics.retries.labels(reason=reason)._value.get()
