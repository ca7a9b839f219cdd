"""router/router.py: Router.drain sends a node no new requests, waits for its own, and a
worker Ray restarts after it takes requests again.

Fake prefill and decode workers (tests/failover_fakes.py) run a deterministic toy "model"
(the next token is a function of the whole context), so the tokens of an uninterrupted run
are known. No model, no Ray.
"""

import asyncio
from types import SimpleNamespace

import pytest

from failover_fakes import (MAX_TOKENS, PROMPT, FakeDecode, FakePrefill, collect, make_router,
                            tokens, uninterrupted)
from pdserve.engine.sampling_params import InvalidRequestError


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
