"""router/streams.py: one event stream per decode worker incarnation, fanned out to the
attempts bound to it; a failed stream fails exactly those attempts. A fake handle
stands in for the actor (`events.remote(epoch)` yields awaitables of event lists, as a
Ray generator yields refs)."""

import asyncio
import time
from types import SimpleNamespace

import pytest
import ray.exceptions

from pdserve.engine.request import TokenEvent
from pdserve.router.streams import DecodeStreams, StreamEnded
from pdserve.router.workers import Worker


class FakeEvents:
    """events(epoch): yields what `push` queues; `fail(e)` ends the stream with e. A call
    for another epoch fails at once (the real worker raises StaleEpochError)."""

    def __init__(self, epoch=1):
        self.epoch, self.calls = epoch, []
        self.items: asyncio.Queue = asyncio.Queue()

    def push(self, *events):
        self.items.put_nowait(list(events))

    def fail(self, error):
        self.items.put_nowait(error)

    def end(self):
        self.items.put_nowait(None)

    def events(self, epoch, router=0):
        self.calls.append(epoch)

        async def gen():
            if epoch != self.epoch:
                raise ray.exceptions.RayTaskError("events", "", RuntimeError("stale epoch"))
            while (item := await self.items.get()) is not None:
                if isinstance(item, BaseException):
                    raise item

                async def value(v=item):
                    return v
                yield value()
        return gen()


def worker(fake, name="decode-0"):
    return Worker(SimpleNamespace(events=SimpleNamespace(remote=fake.events)), name, 64, 1)


async def take(streams, rid, n=1, timeout_s=2.0):
    """The first n batches of attempt rid, as lists of (token ids, finish_reason)."""
    out = []
    async for batch in streams.batches(rid, time.monotonic() + timeout_s):
        out.append([(e.token_ids, e.finish_reason) for e in batch])
        if len(out) == n:
            return out
    return out


def test_events_reach_their_attempt_including_those_before_bind():
    async def main():
        fake, s = FakeEvents(), DecodeStreams()
        d = worker(fake)
        s.open("a")
        s.open("b")
        s.bind("a", d, 1)
        fake.push(TokenEvent("a", (5,)), TokenEvent("b", (7,)), TokenEvent("x", (9,)))
        assert await take(s, "a") == [[((5,), None)]]
        s.bind("b", d, 1)                  # its event came before: kept, not dropped
        assert await take(s, "b") == [[((7,), None)]]
        assert fake.calls == [1]           # one stream for both
        fake.push(TokenEvent("a", (6,)), TokenEvent("a", (), "length"))
        await asyncio.sleep(0.01)
        assert await take(s, "a") == [[((6,), None), ((), "length")]]   # piled up: one list
        s.close("a")
        s.close("b")
        fake.end()
        await s.stop()
    asyncio.run(main())


def test_a_failed_stream_fails_the_attempts_bound_to_it_only():
    async def main():
        f0, f1, s = FakeEvents(), FakeEvents(), DecodeStreams()
        d0, d1 = worker(f0, "decode-0"), worker(f1, "decode-1")
        for rid, d in (("a", d0), ("b", d0), ("c", d1)):
            s.open(rid)
            s.bind(rid, d, 1)
        f0.push(TokenEvent("a", (1,)))
        f0.fail(ray.exceptions.ActorDiedError())
        assert await take(s, "a") == [[((1,), None)]]    # what came first, then the error
        for rid in ("a", "b"):
            with pytest.raises(ray.exceptions.ActorDiedError):
                await take(s, rid)
        f1.push(TokenEvent("c", (3,)))
        assert await take(s, "c") == [[((3,), None)]]    # the other worker's: untouched
        s.open("d")                                      # after Ray's restart: a new stream
        f0.epoch = 2
        f0.items = asyncio.Queue()
        s.bind("d", d0, 2)
        f0.push(TokenEvent("d", (4,)))
        assert await take(s, "d") == [[((4,), None)]]
        assert f0.calls == [1, 2]
        for f in (f0, f1):
            f.end()
        await s.stop()
    asyncio.run(main())


def test_a_reservation_on_an_incarnation_that_is_gone_fails_at_once():
    async def main():
        fake, s = FakeEvents(epoch=3), DecodeStreams()
        s.open("a")
        s.bind("a", worker(fake), 2)       # reserved at epoch 2; the worker is at 3
        with pytest.raises(ray.exceptions.RayTaskError):
            await take(s, "a")
        await s.stop()
    asyncio.run(main())


def test_a_stream_that_ends_fails_its_attempts_and_nothing_waits_past_the_deadline():
    async def main():
        fake, s = FakeEvents(), DecodeStreams()
        d = worker(fake)
        s.open("a")
        s.bind("a", d, 1)
        fake.end()
        with pytest.raises(StreamEnded):
            await take(s, "a")
        s.close("a")
        s.open("b")                        # bound to a live stream that sends nothing
        s.bind("b", d, 1)
        t0 = time.monotonic()
        with pytest.raises(asyncio.TimeoutError):
            await take(s, "b", timeout_s=0.05)
        assert time.monotonic() - t0 < 1.0
        s.close("b")
        assert not s._queues and not any(s._bound.values())
        fake.end()
        await s.stop()
    asyncio.run(main())


def test_rebalance_moves_the_streams_above_the_mean_off_the_busy_worker():
    """A decode worker joins: Scaler.rebalance fails decoding attempts of the busiest
    worker with Moved (the router retries them on the least loaded one, the new worker)
    until it holds no more than the mean; attempts not yet decoding (no event) and
    sampling groups (n > 1) stay; one moved or closed is not moved (again)."""
    from pdserve.router.scaling import Scaler
    from pdserve.router.workers import AttemptFailed, Moved, attempt_failed

    async def main():
        f0, f1, s = FakeEvents(), FakeEvents(), DecodeStreams()
        busy, new = worker(f0, "decode-0"), worker(f1, "decode-1")
        rids = ["a", "b", "c", "d", "e"]
        for rid in rids:
            s.open(rid)
            s.bind(rid, busy, 1)
        s.open("g", ("g#1",))                           # a sampling group (n = 2)
        s.bind("g", busy, 1)
        f0.push(*(TokenEvent(r, (1,)) for r in rids[:4] + ["g"]))   # "e": still prefilling
        for rid in rids[:4] + ["g"]:
            await take(s, rid)
        busy.streams, new.streams = 7, 0                      # 5 streams + the group's 2
        assert sorted(s.decoding_on("decode-0")) == ["a", "b", "c", "d"]
        assert Scaler(None, SimpleNamespace(decode=[busy, new]), s).rebalance() == 3          # 7 -> the mean, 4 (rounded up)
        moved = [r for r in "abcd" if r not in s.decoding_on("decode-0")]
        assert len(moved) == 3
        assert not s.move(moved[0])                     # moved once: never twice,
        for rid in moved:
            with pytest.raises(Moved) as e:
                await take(s, rid)
            failed = attempt_failed("decode", busy, e.value)
            assert isinstance(failed, AttemptFailed) and failed.reason == "rebalance"
            assert busy.alive                           # moved, not found dead
        assert not s.move(moved[0])                     # ... not after its Moved either
        f0.push(TokenEvent(moved[1], (2,)))             # an event that came after the move
        assert await take(s, moved[1]) == [[((2,), None)]]
        assert moved[1] not in s.decoding_on("decode-0")
        s.close(moved[0])
        assert not s.move(moved[0])                     # gone: nothing to move
        f0.end()
        f1.end()
        await s.stop()
    asyncio.run(main())


def test_an_unread_attempt_s_events_are_bounded_then_it_fails(monkeypatch):
    """An attempt whose reader takes nothing holds at most MAX_QUEUED_EVENTS events; the
    next fails it with RESOURCE_EXHAUSTED after those, later ones are dropped, and the
    other attempts on the same stream are served as before."""
    import grpc

    from pdserve.router.errors import RequestError

    monkeypatch.setattr(DecodeStreams, "MAX_QUEUED_EVENTS", 5)

    async def main():
        f, s = FakeEvents(), DecodeStreams()
        d = worker(f)
        for rid in ("idle", "read"):
            s.open(rid)
            s.bind(rid, d, 1)
        for i in range(9):
            f.push(TokenEvent("idle", (i,)), TokenEvent("read", (i,)))
            assert await take(s, "read") == [[((i,), None)]]
        assert s._queues["idle"].qsize() == 6           # 5 events and the failure
        got = []
        with pytest.raises(RequestError) as raised:
            async for batch in s.batches("idle", time.monotonic() + 2):
                got += [ev.token_ids for ev in batch]
        assert got == [(i,) for i in range(5)]
        assert raised.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        s.close("idle")
        s.close("read")
        assert not s._overflowed
        await s.stop()

    asyncio.run(main())
