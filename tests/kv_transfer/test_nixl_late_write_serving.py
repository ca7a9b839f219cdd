"""A late NIXL WRITE cannot change another request's output: a prefill and a decode
worker in process (no Ray) on a tiny model, over NIXL. Request A's KV WRITE is posted
`delay_s` late (test_nixl_late_write.DelayedAgent), so P gives A up after io_timeout_s
and drops its connection to D; D hands A's blocks on, and request B, prefilled by P
into the very same blocks, decodes while A's WRITE would land. B's tokens must be HF's
greedy ones: no byte of A's WRITE may reach B's blocks.

Without the ordering of nixl_sender.NixlKVSender._drop (end every WRITE to that D, then
close), A's delayed WRITE lands mid-way through B's decode, over B's prompt KV: with
Lane.kill made a no-op, the WRITE that cannot be cancelled lands there and B's second
token is not HF's."""

import asyncio
import time

import pytest
from serving import hf_greedy
from test_nixl_late_write import DelayedAgent
from tiny_models import tiny_model_dir

from pdserve.config import WorkerConfig
from pdserve.decode_worker.worker import DecodeWorker
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kv_transfer import KVTransferError
from pdserve.kv_transfer.nixl import find_module
from pdserve.messages import PrefillOrder
from pdserve.prefill_worker.worker import PrefillWorker

pytestmark = pytest.mark.skipif(find_module() is None, reason="NIXL (nixl-cu12) not installed")

BLOCK_SIZE, PROMPT, MAX_TOKENS = 4, 12, 4
# one request fills D's pool: A's prompt takes blocks 0-2, and B's (never-used blocks
# first, then freed ones in order) 3, 0 and 1
D_BLOCKS = (PROMPT + MAX_TOKENS) // BLOCK_SIZE
STEP_S = 0.8                     # B's decode steps, slowed: A's WRITE is due meanwhile
IO_TIMEOUT_S = 2.0


async def _serve(p: PrefillWorker, d: DecodeWorker, rid: str, prompt: list[int]) -> list[int]:
    """One request through P and D, as the router sends it: its tokens, P's first and
    D's after it (KVTransferError when P gives its KV up)."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    res = await d.reserve(rid, len(prompt), params, prompt)
    assert res is not None and not res.local_prefill
    stream = d.events(d.epoch)
    try:
        result = await p.prefill(PrefillOrder(rid, prompt, params, res.kv_address, res.epoch,
                                              res.num_cached_blocks))
    except KVTransferError:
        await d.abort(rid, "KV transfer failed")      # what the router does
        raise
    tokens = [result.first_token]                     # P's; D streams the rest
    async for events in stream:
        for e in events:
            if e.request_id == rid:
                tokens += e.token_ids
                if e.finish_reason:
                    return tokens


async def _until(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("delay_s, cancellable", [
    pytest.param(4.0, True, id="cancelled-before-d-frees"),
    pytest.param(3.5, False, id="landed-before-d-frees"),
])
def test_a_request_reusing_a_lost_writers_blocks_decodes_as_hf(monkeypatch, delay_s,
                                                                 cancellable):
    model = str(tiny_model_dir("llama"))
    cfg = dict(model=model, block_size=BLOCK_SIZE, transport="nixl",
               enable_prefix_caching=False)    # freed blocks go back in order
    d = DecodeWorker("decode-0", WorkerConfig(num_kv_blocks=D_BLOCKS, **cfg))
    p = PrefillWorker("prefill-0", WorkerConfig(num_kv_blocks=32, **cfg))
    decode = d.runner.decode

    def slow_decode(*a, **kw):           # B is still decoding when A's WRITE would land
        time.sleep(STEP_S)
        return decode(*a, **kw)

    monkeypatch.setattr(d.runner, "decode", slow_decode)
    allocated = []                      # D's allocations in order: A's prompt blocks first
    allocate = d.pool.allocate
    monkeypatch.setattr(d.pool, "allocate", lambda n: allocated.append(allocate(n)) or
                        allocated[-1])
    prompt_a, prompt_b = list(range(7, 7 + PROMPT)), list(range(40, 40 + PROMPT))

    proxies: list[DelayedAgent] = []

    async def main() -> tuple[list[int], float]:
        await p.pair([d.kv_address])
        p.sender.io_timeout_s = IO_TIMEOUT_S
        for lane in p.sender._lanes:        # a tiny request's WRITE takes one of them
            lane.agent = DelayedAgent(lane, delay_s, cancellable)
            proxies.append(lane.agent)
        posted = time.monotonic()
        with pytest.raises(KVTransferError):
            await _serve(p, d, "a", prompt_a)
        for lane, proxy in zip(p.sender._lanes, proxies):
            lane.agent = proxy.agent
        await _until(lambda: d.pool.num_free == D_BLOCKS, 30, "D never freed A's blocks")
        tokens = await _serve(p, d, "b", prompt_b)
        assert set(allocated[1]) & set(allocated[0]), allocated   # B's prompt in A's blocks
        return tokens, posted

    try:
        tokens, posted = asyncio.run(asyncio.wait_for(main(), 120))
        done = time.monotonic()
        # B decoded past the time A's WRITE was due (had it been left to land)
        assert done > posted + delay_s, (done - posted, delay_s)
        used = [a for a in proxies if a.handles]
        assert len(used) == 1, "A's WRITE went over one lane"
        if cancellable:
            assert used[0].cancelled_at is not None and used[0].landed_at is None
        else:
            assert used[0].landed_at is not None
        assert tokens == hf_greedy(model, prompt_b, MAX_TOKENS, ignore_eos=True)
        assert d.pool.num_free == d.pool.num_blocks and p.pool.num_free == p.pool.num_blocks
    finally:
        for a in proxies:
            a.stop()
        asyncio.run(p.shutdown())
        asyncio.run(d.shutdown())
