"""router/router.py: a request survives a worker's death. A worker dies (raises Ray's actor
errors) part way, and the stream the client sees must be exactly the uninterrupted run's.

Fake prefill and decode workers (tests/failover_fakes.py) run a deterministic toy "model"
(the next token is a function of the whole context), so the tokens of an uninterrupted run
are known. No model, no Ray.
"""

import asyncio
import time

import grpc
import pytest
import ray.exceptions

from failover_fakes import (MAX_TOKENS, PROMPT, FakeDecode, FakePrefill, collect, make_router,
                            next_token, retries, tokens, uninterrupted)
from pdserve.client import make_request
from pdserve.engine.request import TokenEvent
from pdserve.router.errors import RequestError
from router_fakes import EOS


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
