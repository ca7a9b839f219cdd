"""router/placement.py as Router.generate meets it: which prompts a decode worker prefills
itself rather than a prefill worker (conditional disaggregation), charged as they are chosen.

Fake worker handles stand in for the Ray actors (tests/admission_fakes.py): no model, no
Ray. Every test that serves requests ends with the router's queue empty.
"""

import asyncio
from dataclasses import replace

import pytest

from admission_fakes import (FIRST_TOKEN, PROMPT, FakeDecode, FakePrefill, first_message,
                             generate, make_router, queue, until)
from pdserve.engine.request import TokenEvent
from pdserve.router.workers import Worker


def test_local_prefill_on_decode_skips_the_prefill_worker():
    async def main():
        d, p = FakeDecode(local=True), FakePrefill()
        r = make_router(d, p)
        msgs = [m async for m in generate(r)]
        # D's stream carries the first token; P is never asked, never aborted
        assert [t for m in msgs for t in m.token_ids] == [11, 12]
        assert msgs[-1].finish_reason == "length"
        assert not p.started.is_set() and not p.aborted and not d.aborted
        return r

    assert queue(asyncio.run(main())) == (0, 0)


class HeldDecode(FakeDecode):
    """Prefills locally when the router asks it to (recording each ask), and streams only
    once `go` is set, so the router's queues stay as built."""

    def __init__(self):
        super().__init__()
        self.asks: list[bool] = []
        self.go = asyncio.Event()

    async def reserve(self, rid, prompt_len, params, prompt_token_ids, lease_s=None,
                      prefill_locally=False):
        self.asks.append(prefill_locally)
        self.local = prefill_locally
        return await super().reserve(rid, prompt_len, params, prompt_token_ids, lease_s)

    def stream(self, rid):
        async def value(v):
            return v

        async def refs():
            await self.go.wait()
            yield value([TokenEvent(rid, self.tokens, finish_reason="length")])
        return refs()


@pytest.mark.parametrize("limit, asks", [
    (len(PROMPT) - 1, [False, False, True, False, True]),   # P's queue past the limit and
                                                           # past D's own: balanced
    (0, [False] * 5),                                      # 0: always a prefill worker
    (10 * len(PROMPT), [False] * 5),                       # never that deep
])
def test_a_long_prefill_queue_sends_prompts_to_the_decode_worker(limit, asks):
    n = len(PROMPT)

    async def main():
        d, p = HeldDecode(), FakePrefill()
        r = make_router(d, p, max_prefill_queue_tokens=limit)
        tasks = []
        for i in range(len(asks)):
            tasks.append(asyncio.create_task(first_message(r)))
            await until(lambda: r.prefill[0].queued_tokens + r.decode[0].queued_tokens
                        >= n * (i + 1), f"request {i} reserved, and queued on P or on D")
        assert d.asks == asks
        assert r.decode[0].queued_tokens == n * sum(asks)
        p.go.set()
        d.go.set()
        firsts = [list(m.token_ids) for m in await asyncio.gather(*tasks)]
        assert firsts == [[11, 12] if local else [FIRST_TOKEN] for local in asks]
        assert r.prefill[0].queued_tokens == 0 and r.decode[0].queued_tokens == 0
        return r

    assert queue(asyncio.run(main())) == (0, 0)


class SlowReserveDecode(HeldDecode):
    """Its reservations are in flight until `release` is set, as a burst's are on a
    real cluster while the router decides for the next requests."""

    def __init__(self):
        super().__init__()
        self.release = asyncio.Event()

    async def reserve(self, *args, **kw):
        await self.release.wait()
        return await super().reserve(*args, **kw)


def test_a_burst_splits_between_prefill_and_decode_as_one_by_one():
    """Five requests at once: each one's choice (P or D) sees the prompt tokens the
    earlier ones were charged, although none of their reservations has returned yet;
    the split is the one of the same requests arriving one by one (above)."""
    n = len(PROMPT)

    async def main():
        d, p = SlowReserveDecode(), FakePrefill()
        r = make_router(d, p, max_prefill_queue_tokens=n - 1)
        tasks = [asyncio.create_task(first_message(r)) for _ in range(5)]
        await until(lambda: r.prefill[0].queued_tokens + r.decode[0].queued_tokens >= 5 * n,
                    "all five chosen and charged")
        assert d.asks == []                     # none reserved yet
        assert (r.prefill[0].queued_tokens, r.decode[0].queued_tokens) == (3 * n, 2 * n)
        d.release.set()
        await until(lambda: len(d.asks) == 5, "all five reserved")
        assert sorted(d.asks) == sorted([False, False, True, False, True])
        p.go.set()
        d.go.set()
        await asyncio.gather(*tasks)
        assert r.prefill[0].queued_tokens == 0 and r.decode[0].queued_tokens == 0
        return r

    assert queue(asyncio.run(main())) == (0, 0)


def test_the_default_limit_is_one_prefill_step():
    """max_prefill_queue_tokens unset: D prefills a prompt itself once every prefill
    worker has more than a step's budget queued (its max_num_batched_tokens)."""
    r = make_router(FakeDecode(), FakePrefill())
    step = r.config.prefill.max_num_batched_tokens
    assert r.config.router.max_prefill_queue_tokens is None and step == 512
    d, p = r.decode[0], r.prefill[0]
    p.queued_tokens = step
    assert not r.placement.prefill_on_decode(d, 100)          # a step's worth: P keeps it
    p.queued_tokens = step + 1
    assert r.placement.prefill_on_decode(d, 100)
    d.queued_tokens = step                       # D's own queue would be longer
    assert not r.placement.prefill_on_decode(d, 100)


def test_a_prompt_no_prefill_pool_holds_is_prefilled_on_decode():
    """A retry's prompt (the original + the tokens streamed) may outgrow every prefill
    worker's pool while D's holds it: D prefills it rather than failing each retry."""
    r = make_router(FakeDecode(), FakePrefill())
    d, p = r.decode[0], r.prefill[0]
    fits = p.num_blocks * r.config.prefill.block_size
    assert not r.placement.prefill_on_decode(d, fits)
    assert r.placement.prefill_on_decode(d, fits + 1)


def test_a_decode_worker_prefills_while_a_prefill_worker_of_its_node_is_idle():
    """local_prefill_when_prefill_idle: D takes a prompt when it has none of its own
    queued and a live prefill worker on its node has none (that worker's threads are
    then lent to D); only with core lending on (a core_share_dir)."""
    r = make_router(FakeDecode(), FakePrefill(), local_prefill_when_prefill_idle=True)
    d, p = r.decode[0], r.prefill[0]
    d.node_ip = p.node_ip = "10.0.0.1"
    assert not r.placement.prefill_on_decode(d, 100)                  # no lending: P's path
    lending = replace(r.config, decode=replace(r.config.decode, core_share_dir="/dev/shm/x"))
    r.config = r.placement.config = lending
    assert r.placement.prefill_on_decode(d, 100)
    d.queued_tokens = 1                                  # D prefills one already
    assert not r.placement.prefill_on_decode(d, 100)
    d.queued_tokens, p.queued_tokens = 0, 1                       # P has one queued
    assert not r.placement.prefill_on_decode(d, 100)
    p.queued_tokens, p.node_ip = 0, "10.0.0.2"                         # P idle on another node
    assert not r.placement.prefill_on_decode(d, 100)
    p.node_ip, p.draining = d.node_ip, True                   # draining: lends nothing
    assert not r.placement.prefill_on_decode(d, 100)
    p.draining = False
    r.decode.append(Worker(None, "decode-1", 64, 1, node_ip=d.node_ip))
    assert not r.placement.prefill_on_decode(d, 100)          # 2 decode workers share 1 idle P
    r.decode.pop()
    r.config = r.placement.config = replace(
        lending, router=replace(lending.router, local_prefill_when_prefill_idle=False))
    assert not r.placement.prefill_on_decode(d, 100)
