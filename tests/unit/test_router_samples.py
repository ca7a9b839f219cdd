"""router/router.py with sampling n > 1 and best_of, over fakes that fork as a decode
worker does (decode_worker/fork.py): one reservation and one prefill; sample 0 takes the
prefill's first token, sample k computes its own, each with seed + k; their events come
under the ids "<request>/<k>". The toy model's next token is a function of the context
and the seed, so every sample's uninterrupted run is known, and a run the router
recovers after a decode worker's death must equal it, sample by sample.
"""

import asyncio

import pytest

from failover_fakes import PROMPT, FakeDecode, FakePrefill, make_router, retries
from pdserve.client import make_request
from pdserve.decode_worker.fork import sample_id
from pdserve.engine.logprobs import TokenLogprobs
from pdserve.engine.request import TokenEvent
from pdserve.messages import PrefillResult

MAX_TOKENS = 6


def next_token(context: list[int], seed: int | None) -> int:
    return 5 + (sum(context) * 31 + len(context) + 13 * (seed or 0)) % 50


def logprob(token: int) -> TokenLogprobs:
    return TokenLogprobs(-token / 10, 1)


def uninterrupted(seed: int, n: int = MAX_TOKENS) -> list[int]:
    ctx = list(PROMPT)
    for _ in range(n):
        ctx.append(next_token(ctx, seed))
    return ctx[len(PROMPT):]


class SeededPrefill(FakePrefill):
    async def prefill(self, order):
        self.check()
        self.calls.append(order.request_id)
        await asyncio.sleep(0.01)
        first = next_token(list(order.token_ids), order.params.seed)
        for d in self.decodes:
            if order.request_id in d.reserved:
                d.first[order.request_id].set_result(first)
        return PrefillResult(first, logprob(first) if order.params.logprobs is not None
                             else None)


class ForkingDecode(FakeDecode):
    """Streams every sample of a reservation, one token each per step; on its first
    attempt it dies after `die_after` steps, or (`fail_at`) fails every sample's row
    that step with an error event (a decode step that raised). Records each abort
    with the steps streamed by then."""

    def __init__(self, fail_at: int | None = None, **kw):
        super().__init__(**kw)
        self.fail_at, self.steps, self.aborts = fail_at, 0, []

    def abort(self, rid, reason, group=False):
        self.aborts.append((rid, group, self.steps))

    def stream(self, rid):
        async def value(v):
            return v

        async def refs():
            ids, params = self.reserved[rid]
            first = await self.first[rid]
            samples = [(sample_id(rid, k), params.sample(k), ids + [first] * (k == 0))
                       for k in range(params.num_samples)]
            for step in range(params.max_tokens):
                if self.die_after is not None and step == self.die_after:
                    self.die_after = None
                    self.die()
                    raise __import__("ray").exceptions.ActorDiedError()
                if self.fail_at is not None and step == self.fail_at:
                    self.fail_at = None
                    yield value([TokenEvent(sid, (), "error", "decode step failed: boom")
                                 for sid, _, _ in samples])
                    return
                self.steps += 1
                events = []
                for sid, p, ctx in samples:
                    if len(ctx) - len(ids) < p.max_tokens:
                        ctx.append(next_token(ctx, p.seed))
                        done = len(ctx) - len(ids) == p.max_tokens
                        events.append(TokenEvent(sid, (ctx[-1],), "length" if done else None,
                                                 logprobs=(logprob(ctx[-1]),)))
                if not events:
                    return
                yield value(events)
                await asyncio.sleep(0.005)
        return refs()


async def collect(r, **kw):
    req = make_request(PROMPT, max_tokens=MAX_TOKENS, temperature=1.0, seed=5, **kw)
    return [m async for m in r.generate(req, 10.0)]


def by_sample(msgs) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for m in msgs:
        out.setdefault(m.index, []).extend(m.token_ids)
    return out


def test_n_samples_share_one_reservation_and_prefill_and_use_seed_plus_index():
    async def main():
        d = ForkingDecode()
        p = SeededPrefill([d])
        r = make_router([p], [d])
        msgs = await collect(r, n=3)
        assert by_sample(msgs) == {i: uninterrupted(5 + i) for i in range(3)}
        assert len(set(map(tuple, by_sample(msgs).values()))) == 3        # they differ
        (reserved,) = d.reserved.values()
        assert reserved[1].n == 3 and len(p.calls) == 1
        ends = [m for m in msgs if m.finish_reason]
        assert sorted(m.index for m in ends) == [0, 1, 2]
        assert all(m.usage.completion_tokens == MAX_TOKENS for m in ends)
        assert not any(m.logprobs for m in msgs)                  # not asked for
        return r

    r = asyncio.run(main())
    assert r.admission.queued_requests == 0


@pytest.mark.parametrize("die_after", [0, 2])
def test_samples_that_diverged_are_retried_each_on_its_own(die_after):
    """D dies mid-stream: each sample that streamed tokens resumes alone as prompt + its
    own tokens, with its own seed and step offset; those with none yet (D died before
    their first token) are forked again together, seeds kept; the stream equals the
    uninterrupted runs."""
    async def main():
        d = ForkingDecode(die_after=die_after)
        r = make_router([SeededPrefill([d])], [d])
        msgs = await collect(r, n=3)
        assert by_sample(msgs) == {i: uninterrupted(5 + i) for i in range(3)}
        first, *retries = d.reserved.values()
        assert first[1].n == 3
        sent = {0: die_after + 1, 1: die_after, 2: die_after}
        want = ({(5, 1, 1), (6, 2, 0)} if die_after == 0 else     # sample 0; samples 1-2
                {(5 + i, 1, sent[i]) for i in range(3)})
        assert {(p.seed, p.n, p.step_offset) for _, p in retries} == want
        for ids, params in retries:
            i = params.seed - 5
            assert ids == PROMPT + uninterrupted(5 + i, sent[i])
        return r

    asyncio.run(main())


def test_best_of_returns_the_samples_of_highest_cumulative_logprob_renumbered():
    async def main():
        d = ForkingDecode()
        r = make_router([SeededPrefill([d])], [d])
        msgs = await collect(r, n=2, best_of=4)
        runs = {i: uninterrupted(5 + i) for i in range(4)}
        best = sorted(runs, key=lambda i: -sum(logprob(t).logprob for t in runs[i]))[:2]
        assert by_sample(msgs) == {0: runs[best[0]], 1: runs[best[1]]}
        (reserved,) = d.reserved.values()
        assert reserved[1].logprobs == 0 and reserved[1].num_samples == 4  # asked to rank
        assert not any(m.logprobs for m in msgs)          # ... but the client did not
        return r

    asyncio.run(main())


def test_samples_failed_by_a_decode_step_are_retried_once_each():
    """Every sample's row fails in one step (error events for all): each is retried on
    its own, once; none fails again on the others' stale errors."""
    async def main():
        d = ForkingDecode(fail_at=2)
        r = make_router([SeededPrefill([d])], [d], max_migrations=1)
        msgs = await collect(r, n=2)
        assert by_sample(msgs) == {i: uninterrupted(5 + i) for i in range(2)}
        assert retries(r, "decode") == 1 and len(d.reserved) == 3

    asyncio.run(main())


def test_a_sample_stopped_at_the_prefill_token_is_aborted_once_d_has_forked():
    """Sample 0 ends at P's token (a stop token id): D learns it only once a sibling's
    event shows the fork happened (an earlier abort would have cancelled the fork), and
    as a single sample, not the group; the sibling runs to its end."""
    first = next_token(PROMPT, 5)

    async def main():
        d = ForkingDecode()
        r = make_router([SeededPrefill([d])], [d])
        msgs = await collect(r, n=2, stop_token_ids=[first])
        got = by_sample(msgs)
        assert got[0] == [first] and len(got[1]) >= 1
        (rid,) = d.reserved
        early = [(g, at) for a, g, at in d.aborts if a == rid]
        assert early[0][0] is False and early[0][1] <= 2        # at the first D events
        assert early[-1][0] is True                               # the attempt's end

    asyncio.run(main())
