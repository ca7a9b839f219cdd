"""router/membership.py sync_members: a router replica takes the worker set as Ray names it
after another replica scaled or drained: a ready worker it did not know joins its lists,
a retired one (no longer named) leaves them, a drained one is marked draining; a
worker that does not answer stays as it was. Fake actor handles, no Ray."""

import asyncio

from pdserve.messages import WorkerInfo
from pdserve.router import membership
from router_fakes import fake_router


class FakeHandle:
    def __init__(self, worker_id: str, draining: bool = False, answers: bool = True,
                 epoch: int = 1):
        self.info = WorkerInfo(worker_id, worker_id.split("-")[0], epoch, 64, 16, "10.0.0.1",
                               draining=draining)
        self.answers = answers
        self.ready = self

    def remote(self):
        async def call():
            if not self.answers:
                await asyncio.sleep(3600)
            return self.info
        return call()


def test_another_replica_s_scaling_and_draining_reach_this_one(monkeypatch):
    r = fake_router([object(), object()], [object()])          # prefill-0, -1; decode-0
    named = {"prefill": [("prefill-0", FakeHandle("prefill-0", draining=True)),
                         ("prefill-2", FakeHandle("prefill-2")),
                         ("prefill-3", FakeHandle("prefill-3", answers=False))],
             "decode": [("decode-0", FakeHandle("decode-0")),
                        ("decode-1", FakeHandle("decode-1"))]}
    monkeypatch.setattr(membership, "named_workers", lambda: named)
    monkeypatch.setattr(membership, "SYNC_READY_TIMEOUT_S", 0.2)
    joined, left = asyncio.run(membership.sync_members(r.placement))
    assert joined == ["prefill-2", "decode-1"] and left == ["prefill-1"]
    assert [w.worker_id for w in r.prefill] == ["prefill-0", "prefill-2"]
    assert [w.worker_id for w in r.decode] == ["decode-0", "decode-1"]
    assert r.prefill[0].draining and not r.prefill[1].draining     # drained by the other
    assert r.decode[1].free_blocks == 64 and r.decode[1].available
    assert asyncio.run(membership.sync_members(r.placement)) == ([], [])           # nothing changed since


def test_a_replica_places_by_its_own_load_and_what_the_workers_report_of_the_others():
    """Two decode workers this replica loaded alike: the one whose last reservation
    reply counted more requests (the other replicas') gets the next; a prefill
    worker's reported queue counts likewise."""
    from admission_fakes import FakeDecode, FakePrefill

    async def main():
        d0, d1 = FakeDecode(), FakeDecode()
        r = fake_router([FakePrefill(), FakePrefill()], [d0, d1])
        w0, w1 = r.decode
        w0.reported_streams(5)              # 5 requests there, none of them this replica's
        assert (w0.total_streams, w1.total_streams) == (5, 0)
        with await r.placement.reserve("a", 4, _params(), 60.0, [1, 2, 3, 4]) as held:
            assert held.d is w1
        p0, p1 = r.prefill
        p1.queued_tokens = 100              # this replica's own queue on p1 ...
        p0.reported_queue(400)              # ... and the others' on p0
        assert r.prefill_router.pick(r.prefill, [1, 2, 3])[0] is p1
        return r

    asyncio.run(main())


def _params():
    from pdserve.engine.sampling_params import SamplingParams
    return SamplingParams(max_tokens=3)
