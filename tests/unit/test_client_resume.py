"""pdserve.client's stream resume over real gRPC servers: a router whose server goes
away mid-stream (its process died) and comes back on the same port gets the request
again with the tokens the client had (resume_token_ids), and the stream goes on; the
router's own errors, requests of several samples and requests that got nothing fail
as they are."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import grpc
import pytest

from pdserve.client import Client, make_request
from pdserve.config import RouterConfig
from pdserve.engine.sampling_params import InvalidRequestError
from pdserve.proto import pdserve_pb2 as pb
from pdserve.router.heap import HeapTrim
from pdserve.router.service import build_server

N = 6


class Router:
    """Streams tokens 10, 11, ... N of them, after the resumed ones. The first call of
    a request without resume_token_ids stops after `cut` tokens and sets `cut_event`
    (the test then kills the server)."""

    def __init__(self, cut: int | None = 2, refuse: bool = False):
        self.config = SimpleNamespace(router=RouterConfig(), num_routers=1)
        self.metrics = SimpleNamespace(request=lambda: SimpleNamespace(
            tokens=lambda n, sample=0: None, finish=lambda status, prompt_tokens: None))
        self.heap_trim = HeapTrim(trim=lambda pad: 0)
        self.calls: list[list[int]] = []
        self.cut, self.refuse = cut, refuse
        self.cut_event = threading.Event()

    async def generate(self, req, deadline_s):
        had = list(req.resume_token_ids)
        self.calls.append(had)
        if self.refuse and had:
            raise InvalidRequestError("resume_token_ids", "refused")
        for i in range(len(had), N):
            if not had and i == self.cut:
                self.cut_event.set()
                await asyncio.sleep(3600)        # until the server is killed
            yield pb.GenerateResponse(token_ids=[10 + i], finish_reason="length"
                                      if i == N - 1 else "")


class Serving:
    """`router` served on a fixed port from a thread's loop; kill() drops every call
    (grace 0), start() serves again on the same port."""

    def __init__(self, router: Router):
        self.router = router
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port = 0
        self.server = None
        self.start()

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def start(self) -> None:
        async def go():
            self.server, self.port = build_server(self.router, f"127.0.0.1:{self.port}")
            await self.server.start()
        self._run(go())

    def kill(self) -> None:
        self._run(self.server.stop(0))

    def close(self) -> None:
        self.kill()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def serving():
    made = []

    def make(router: Router) -> Serving:
        made.append(Serving(router))
        return made[-1]
    yield make
    for s in made:
        s.close()


def _kill_at_cut_and_restart(s: Serving, down_s: float) -> threading.Thread:
    def run():
        assert s.router.cut_event.wait(30)
        s.kill()
        threading.Event().wait(down_s)
        s.start()
    t = threading.Thread(target=run)
    t.start()
    return t


def test_a_stream_goes_on_after_its_router_came_back(serving):
    s = serving(Router())
    killer = _kill_at_cut_and_restart(s, down_s=1.0)
    with Client(f"127.0.0.1:{s.port}", timeout_s=30, resume_timeout_s=20) as c:
        ids, _, reason = c.generate(make_request("hi", max_tokens=N, temperature=0))
    killer.join()
    assert ids == [10 + i for i in range(N)] and reason == "length"
    assert s.router.calls[0] == [] and s.router.calls[-1] == [10, 11]


@pytest.mark.parametrize("client_kw, request_kw, router_kw", [
    ({"resume_timeout_s": 0}, {}, {}),                    # resume off
    ({"resume_timeout_s": 2}, {"n": 2}, {}),              # several samples
    ({"resume_timeout_s": 2}, {}, {"cut": 0}),            # nothing had arrived
], ids=["off", "n2", "nothing_arrived"])
def test_a_stream_that_cannot_resume_fails_unavailable(serving, client_kw, request_kw,
                                                       router_kw):
    s = serving(Router(**router_kw))
    killer = _kill_at_cut_and_restart(s, down_s=0.5)
    with Client(f"127.0.0.1:{s.port}", timeout_s=30, **client_kw) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.generate(make_request("hi", max_tokens=N, temperature=0, **request_kw))
    killer.join()
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert len(s.router.calls) == 1


def test_the_routers_own_status_is_not_resumed(serving):
    s = serving(Router(refuse=True))
    killer = _kill_at_cut_and_restart(s, down_s=0.2)
    with Client(f"127.0.0.1:{s.port}", timeout_s=30, resume_timeout_s=20) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.generate(make_request("hi", max_tokens=N, temperature=0))
    killer.join()
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert s.router.calls == [[], [10, 11]]                # refused once, not again
