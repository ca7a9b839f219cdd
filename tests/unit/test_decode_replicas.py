"""The decode worker in process (no Ray) on a tiny model, serving two router replicas:
each replica's event stream carries its own requests' tokens only, and abort_all of one
replica (restarted after its death) aborts its requests and ends its stream while the
other's go on. Every pool free after."""

import asyncio

from tiny_models import tiny_model_dir

from pdserve.config import WorkerConfig
from pdserve.decode_worker.worker import DecodeWorker
from pdserve.engine.sampling_params import SamplingParams
from pdserve.request_ids import attempt_id


def test_each_replica_streams_its_own_requests_and_is_aborted_alone():
    d = DecodeWorker("decode-0", WorkerConfig(model=str(tiny_model_dir("llama")),
                                              num_kv_blocks=256, block_size=4, transport="tcp"))
    ids = {r: attempt_id(f"req-{r}", r) for r in (0, 1)}

    async def collect(router: int, got: dict) -> None:
        async for events in d.events(d.epoch, router):
            for e in events:
                got.setdefault(e.request_id, []).append(e)

    async def main():
        got = {0: {}, 1: {}}
        pumps = [asyncio.create_task(collect(r, got[r])) for r in (0, 1)]
        for r, rid in ids.items():
            res = await d.reserve(rid, 5, SamplingParams(max_tokens=400, temperature=0,
                                                         ignore_eos=True),
                                  [5, 6, 7, 8, 9], prefill_locally=True)
            assert res.local_prefill
        while not all(ids[r] in got[r] for r in (0, 1)):       # both decoding
            await asyncio.sleep(0.01)
        assert set(got[0]) == {ids[0]} and set(got[1]) == {ids[1]}
        assert await d.abort_all("router restarted", router=1) == 1
        await asyncio.wait_for(pumps[1], 10)                    # its stream ended
        while not (got[0][ids[0]][-1].finish_reason):
            await asyncio.sleep(0.01)
        assert got[0][ids[0]][-1].finish_reason == "length"     # untouched: all 400
        assert sum(len(e.token_ids) for e in got[0][ids[0]]) == 400
        assert all(e.finish_reason is None for e in got[1].get(ids[1], [])[:-1])
        pumps[0].cancel()
        while d.pool.num_free != d.pool.num_blocks:
            await asyncio.sleep(0.01)

    try:
        asyncio.run(asyncio.wait_for(main(), 120))
        assert d.pool.num_free == d.pool.num_blocks
    finally:
        asyncio.run(d.shutdown())
