"""router/router.py: a request survives a worker's death. Fake prefill and decode
workers run a deterministic toy "model" (the next token is a function of the whole
context), so the tokens of an uninterrupted run are known; a worker dies (raises Ray's
actor errors) part way, and the stream the client sees must be exactly that run's.

No model, no Ray: fake handles stand in for the actors (`handle.m.remote(...)` calls
the fake's coroutine), as in test_router_admission.py.
"""

import asyncio
import time
from types import SimpleNamespace

import grpc
import pytest
import ray.exceptions

from pdserve.client import make_request
from pdserve.engine.request import TokenEvent
from pdserve.engine.sampling_params import InvalidRequestError
from pdserve.router.errors import RequestError
from pdserve.router.router import Router
from router_fakes import EOS, EventsFromStreams, fake_router

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


@pytest.mark.parametrize("die_after", [1, 3, MAX_TOKENS - 2])
def test_decode_death_mid_stream_continues_on_the_restarted_worker(die_after):
    async def main():
        d = FakeDecode(die_after=die_after)
        p = FakePrefill([d])
        r = make_router([p], [d])
        msgs = await collect(r)
        assert tokens(msgs) == uninterrupted(PROMPT, MAX_TOKENS)   # none repeated or missing
        assert msgs[-1].finish_reason == "length"
        assert msgs[-1].usage.prompt_tokens == len(PROMPT)
        assert msgs[-1].usage.completion_tokens == MAX_TOKENS
        # the retry prefilled prompt + every token streamed so far, for the rest
        (_, first), (ids, again) = d.reserved.values()
        sent = die_after            # P's first token + those D streamed before dying
        assert ids == PROMPT + uninterrupted(PROMPT, sent)
        assert again.max_tokens == MAX_TOKENS - sent and again.step_offset == sent
        assert first.step_offset == 0
        assert retries(r, "decode") == 1 and r.decode[0].alive and r.decode[0].epoch == 2
        return r

    r = asyncio.run(main())
    assert r.admission.queued_requests == 0


def test_prefill_death_redispatches_to_another_prefill_worker():
    async def main():
        d = FakeDecode()
        p0, p1 = FakePrefill([d], die_on=1, restart_s=None), FakePrefill([d])
        r = make_router([p0, p1], [d])
        msgs = await collect(r)
        assert tokens(msgs) == uninterrupted(PROMPT, MAX_TOKENS)
        first_try, second_try = d.reserved
        assert p0.calls == [first_try] and p1.calls == [second_try]
        assert first_try in d.aborted        # D's reservation of the failed try released
        assert not r.prefill[0].alive and r.prefill[1].alive
        assert retries(r, "prefill") == 1
        return r

    asyncio.run(main())


def test_only_prefill_worker_dead_waits_for_its_restart():
    async def main():
        d = FakeDecode()
        p = FakePrefill([d], die_on=1, restart_s=0.3)
        r = make_router([p], [d])
        t0 = time.monotonic()
        msgs = await collect(r)
        assert time.monotonic() - t0 >= 0.3          # waited for Ray's restart
        assert tokens(msgs) == uninterrupted(PROMPT, MAX_TOKENS)
        assert r.prefill[0].alive and r.prefill[0].epoch == 2
        return r

    asyncio.run(main())


def test_no_worker_back_before_the_deadline_is_unavailable():
    async def main():
        d = FakeDecode()
        p = FakePrefill([d], die_on=1, restart_s=None)
        r = make_router([p], [d])
        t0 = time.monotonic()
        with pytest.raises(RequestError) as ei:
            await collect(r, deadline_s=0.5)
        assert time.monotonic() - t0 < 2
        assert ei.value.code == grpc.StatusCode.UNAVAILABLE
        assert "no prefill worker is available" in str(ei.value), ei.value
        assert list(d.reserved)[0] in d.aborted
        return r

    r = asyncio.run(main())
    assert r.admission.queued_requests == 0


def test_migration_limit_bounds_the_retries():
    async def main():
        d = FakeDecode()
        p = FakePrefill([d], fail_with=ray.exceptions.RaySystemError("KV transfer failed"))
        r = make_router([p], [d], max_migrations=1)
        with pytest.raises(RequestError) as ei:
            await collect(r)
        assert ei.value.code == grpc.StatusCode.UNAVAILABLE
        assert "failed 2 times (router.max_migrations=1)" in str(ei.value), ei.value
        assert "KV transfer failed" in str(ei.value)
        assert len(p.calls) == 2 and sorted(d.aborted) == sorted(d.reserved)
        return r

    asyncio.run(main())


def test_decode_error_event_is_retried_after_the_tokens_sent():
    """D reports a failed KV arrival (e.g. a checksum mismatch) as an error event after
    P already returned the first token: the retry resumes after that token."""
    async def main():
        d = FakeDecode()
        p = FakePrefill([d])
        r = make_router([p], [d])
        stream = d.stream
        calls = []

        def failing_once(rid):
            calls.append(rid)
            if len(calls) > 1:
                return stream(rid)

            async def refs():
                async def value(v):
                    return v
                yield value([TokenEvent(rid, (), "error", "KV checksum mismatch")])
            return refs()

        d.stream = failing_once
        msgs = await collect(r)
        assert tokens(msgs) == uninterrupted(PROMPT, MAX_TOKENS)
        _, (ids, params) = d.reserved.values()
        assert ids == PROMPT + uninterrupted(PROMPT, 1) and params.max_tokens == MAX_TOKENS - 1
        assert retries(r, "decode") == 1
        return r

    asyncio.run(main())


def test_death_after_the_last_token_still_finishes_the_stream():
    """D streams every token, then dies before its finish event: the relay has already
    ended the stream at the max_tokens-th token (the same stop rule as D's), so the
    death is never taken for a failed attempt and nothing is retried."""
    async def main():
        d = FakeDecode()
        p = FakePrefill([d])
        r = make_router([p], [d])
        stream = d.stream

        def dies_before_finishing(rid):
            async def refs():
                async for ref in stream(rid):
                    events = [TokenEvent(e.request_id, e.token_ids) for e in await ref]

                    async def value(v=events):
                        return v
                    yield value()
                raise ray.exceptions.ActorDiedError()
            return refs()

        d.stream = dies_before_finishing
        msgs = await collect(r)
        assert tokens(msgs) == uninterrupted(PROMPT, MAX_TOKENS)
        assert msgs[-1].finish_reason == "length" and msgs[-1].token_ids   # with the last
        assert msgs[-1].usage.completion_tokens == MAX_TOKENS
        assert len(d.reserved) == 1 and retries(r, "decode") == 0   # no second attempt
        assert list(d.reserved) == d.aborted     # D may still hold it: released at once
        return r

    asyncio.run(main())


FIRST = next_token(PROMPT)     # the toy model's first token after PROMPT


@pytest.mark.parametrize("first, finish, kw", [
    (EOS, "stop", {}),                                  # EOS as the first token
    (FIRST, "stop", {"stop_token_ids": [FIRST]}),
    (FIRST, "stop", {"stop": [f"w{FIRST}"]}),           # the first token's text
    (FIRST, "length", {"max_tokens": 1}),
])
def test_decode_death_after_a_first_token_that_ended_the_stream_is_not_retried(first, finish, kw):
    """P's first token already ended the stream (EOS, a stop token id, a stop
    string, max_tokens) and D dies before it says so. The stream ends exactly as an
    uninterrupted run does; the router never resumes it as `prompt + [first]`."""
    async def main():
        d = FakeDecode(die_after=1)          # dies before streaming anything of its own
        p = FakePrefill([d], first_token=first)
        r = make_router([p], [d])
        req = make_request(PROMPT, temperature=0, **{"max_tokens": MAX_TOKENS} | kw)
        msgs = [m async for m in r.generate(req, 10.0)]
        assert tokens(msgs) == [first] and len(msgs) == 1
        assert msgs[-1].finish_reason == finish and msgs[-1].usage.completion_tokens == 1
        assert retries(r, "decode") == 0 and len(d.reserved) == 1
        assert list(d.reserved) == d.aborted == p.aborted   # both released at once
        return r

    r = asyncio.run(main())
    assert r.admission.queued_requests == 0


def test_ignore_eos_resumes_past_an_eos_first_token():
    """With ignore_eos an EOS first token ends nothing: D's death after it is retried as
    `prompt + [EOS]` for the rest of max_tokens."""
    async def main():
        d = FakeDecode(die_after=1)
        p = FakePrefill([d], first_token=EOS)
        r = make_router([p], [d])
        msgs = await collect(r, ignore_eos=True)
        assert tokens(msgs)[0] == EOS and len(tokens(msgs)) == MAX_TOKENS
        assert msgs[-1].finish_reason == "length"
        (_, first), (ids, again) = d.reserved.values()
        assert ids == PROMPT + [EOS] and again.max_tokens == MAX_TOKENS - 1
        assert retries(r, "decode") == 1

    asyncio.run(main())


def test_drain_sends_no_new_requests_to_the_node_and_waits_for_its_own():
    async def main():
        d0, d1 = FakeDecode(), FakeDecode()
        p = FakePrefill([d0, d1])
        r = make_router([p], [d0, d1])
        r.prefill[0].node_ip, r.decode[0].node_ip, r.decode[1].node_ip = \
            "10.0.0.1", "10.0.0.2", "10.0.0.3"
        busy = {"decode-0": 1}

        def status_of(name):
            async def status():
                return SimpleNamespace(running_requests=busy.get(name, 0), waiting_requests=0)
            return SimpleNamespace(remote=status)
        for w in r.decode:
            w.handle.status = status_of(w.worker_id)

        reply = await r.drain("10.0.0.2", timeout_s=0.3)       # decode-0 still busy
        assert list(reply.worker_ids) == ["decode-0"]
        assert not reply.drained and reply.running_requests == 1
        assert d0.draining and not d1.draining        # on the worker: other replicas see it
        assert tokens(await collect(r)) == uninterrupted(PROMPT, MAX_TOKENS)
        assert not d0.reserved and len(d1.reserved) == 1       # new work went elsewhere
        busy.clear()
        assert (await r.drain("10.0.0.2", timeout_s=5)).drained
        with pytest.raises(InvalidRequestError, match="^node_ip: no worker runs on '10.9.9.9'"):
            await r.drain("10.9.9.9", timeout_s=1)
        # Ray restarts the drained worker (a new epoch, elsewhere): it takes requests again
        d0.die()
        r.decode[0].alive = False
        await asyncio.sleep(0.2)
        await r.placement.probe(r.decode[0])
        assert r.decode[0].available
        return r

    asyncio.run(main())


@pytest.mark.parametrize("had", [1, 3, MAX_TOKENS - 1])
def test_a_client_resumes_a_stream_after_the_tokens_it_had(had):
    """GenerateRequest.resume_token_ids (a client whose router died): the request goes
    on as the router's own retry does, and the stream carries only what follows."""
    async def main():
        d = FakeDecode()
        r = make_router([FakePrefill([d])], [d])
        whole = uninterrupted(PROMPT, MAX_TOKENS)
        msgs = [m async for m in r.generate(_resuming(whole[:had]), 10.0)]
        assert tokens(msgs) == whole[had:]
        assert msgs[-1].finish_reason == "length"
        assert msgs[-1].usage.completion_tokens == MAX_TOKENS
        (ids, params), = d.reserved.values()
        assert ids == PROMPT + whole[:had]
        assert params.max_tokens == MAX_TOKENS - had and params.step_offset == had
        return r

    r = asyncio.run(main())
    assert r.admission.queued_requests == 0


def _resuming(had: list[int], **kw):
    req = make_request(PROMPT, max_tokens=MAX_TOKENS, temperature=0, **kw)
    req.resume_token_ids.extend(had)
    return req


@pytest.mark.parametrize("had, kw, message", [
    ([5] * MAX_TOKENS, {}, "at most max_tokens - 1"),
    ([5, 64], {}, "token id 64 is out of range"),
    ([5], {"n": 2}, "n = 1"),
    ([5, EOS], {}, "already ended at them (stop)"),
])
def test_a_resume_that_cannot_go_on_is_refused(had, kw, message):
    async def main():
        d = FakeDecode()
        r = make_router([FakePrefill([d])], [d])
        with pytest.raises(InvalidRequestError, match="resume_token_ids") as e:
            [m async for m in r.generate(_resuming(had, **kw), 10.0)]
        assert message in str(e.value)
        assert not d.reserved and r.admission.queued_requests == 0

    asyncio.run(main())
