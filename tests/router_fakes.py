"""A Router over fake worker handles, for unit tests of router/router.py with no model
and no Ray: `handle.m.remote(...)` calls the fake's method; __init__ is skipped (it loads
the model's config and tokenizer), so this sets what generate() reads.

    from router_fakes import EOS, VOCAB, TOKENIZER, EventsFromStreams, actor, fake_router
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import ray.exceptions
from tokenizers import Tokenizer, models

from pdserve.config import ClusterConfig, RouterConfig
from pdserve.core_share import CompileActivity
from pdserve.metrics import RouterMetrics
from pdserve.router.admission import Admission
from pdserve.router.attempt import Attempts
from pdserve.router.router import Router
from pdserve.router.placement import Placement
from pdserve.router.routing import PrefillRouter
from pdserve.router.streams import DecodeStreams
from pdserve.router.tokenize_queue import TokenizeQueue
from pdserve.router.workers import Worker

VOCAB = 64
EOS = 0                        # the fake model's end-of-sequence id
TOKENIZER = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))


def actor(fake) -> SimpleNamespace:
    """A Ray actor handle's surface: `handle.name.remote(*args)` calls `fake.name(*args)`."""
    names = [n for n in dir(fake) if not n.startswith("_") and callable(getattr(fake, n))]
    return SimpleNamespace(**{n: SimpleNamespace(remote=getattr(fake, n)) for n in names})


def fake_router(prefills: list, decodes: list, **router_kw) -> Router:
    """A Router whose workers are `prefills` / `decodes` (prefill-i / decode-i, 64 blocks,
    epoch 1); `router_kw` sets RouterConfig fields."""
    r = Router.__new__(Router)
    r.config = ClusterConfig(router=RouterConfig(port=0, **router_kw))
    r.index = 0
    r.model_config = SimpleNamespace(vocab_size=VOCAB, max_model_len=256, eos_token_ids=(EOS,))
    r.tokenizer = SimpleNamespace(backend_tokenizer=TOKENIZER)
    r.compile_flag = CompileActivity(None, "router")
    rc = r.config.router
    r.admission = Admission(rc.max_queued_requests, rc.max_queued_tokens)
    r.tokenize = TokenizeQueue(rc.max_tokenize_queue_chars)
    r.metrics = RouterMetrics(lambda: r.admission.queued_requests)
    r.streams = DecodeStreams(0)
    r.prefill_router = PrefillRouter.of(r.config)
    r.placement = Placement(
        r.config, r.prefill_router,
        prefill=[Worker(actor(p), f"prefill-{i}", 64, 1) for i, p in enumerate(prefills)],
        decode=[Worker(actor(d), f"decode-{i}", 64, 1, free_blocks=64)
                for i, d in enumerate(decodes)])
    r.attempts = Attempts(r.placement, r.streams, r.metrics)
    return r


class EventsFromStreams:
    """A fake decode worker's `events(epoch)` (DecodeWorker's one stream of every
    request's token events) made of the fake's per-request `stream(rid)` async
    generators, each yielding awaitables of event lists as a Ray generator yields refs:
    every request in `self.reserved` is read in its own task (once per fake) and the
    lists are merged in arrival order. A Ray error from any of them (the fake died)
    ends the merged stream with it, as a dead worker's stream ends; so does a call on
    a fake that is dead (`check()`) or at another epoch."""

    def events(self, epoch, router=0):
        async def merged():
            check = getattr(self, "check", None)
            if check is not None:
                check()
            if getattr(self, "epoch", epoch) != epoch:
                raise ray.exceptions.RayError(f"stale epoch {epoch}")
            started = self.__dict__.setdefault("_streamed", set())
            out: asyncio.Queue = asyncio.Queue()

            async def read(rid):
                try:
                    async for ref in self.stream(rid):
                        out.put_nowait(await ref)
                except BaseException as e:   # its death is the merged stream's
                    out.put_nowait(e)

            tasks = []
            get = asyncio.ensure_future(out.get())
            try:
                while True:
                    for rid in list(self.reserved):
                        if rid not in started:
                            started.add(rid)
                            tasks.append(asyncio.create_task(read(rid)))
                    # (asyncio.wait, not wait_for: 3.11's wait_for can swallow a
                    # cancellation that races its timeout, and the task never ends)
                    await asyncio.wait({get}, timeout=0.005)
                    if not get.done():
                        continue
                    item, get = get.result(), asyncio.ensure_future(out.get())
                    if isinstance(item, BaseException):
                        raise item

                    async def value(v=item):
                        return v
                    yield value()
            finally:
                for t in tasks + [get]:
                    t.cancel()
        return merged()
