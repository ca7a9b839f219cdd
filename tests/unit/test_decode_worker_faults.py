"""The decode worker in process (no Ray) on a tiny model: a fault of the decode step
(the model or the sampler) fails that step's requests with an error event naming it,
frees their blocks, and the worker goes on serving."""

import asyncio

from tiny_models import tiny_model_dir

from pdserve.config import WorkerConfig
from pdserve.decode_worker.worker import DecodeWorker
from pdserve.engine.sampling_params import SamplingParams


def test_a_step_fault_fails_its_requests_and_the_worker_goes_on(monkeypatch):
    d = DecodeWorker("decode-0", WorkerConfig(model=str(tiny_model_dir("llama")),
                                              num_kv_blocks=16, block_size=4, transport="tcp"))
    real_prefill = d.runner.prefill

    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    async def run(rid: str) -> list:
        """A local prefill of 5 tokens, then its events until it finishes."""
        stream = d.events(d.epoch)
        res = await d.reserve(rid, 5, SamplingParams(max_tokens=3, temperature=0),
                              [5, 6, 7, 8, 9], prefill_locally=True)
        assert res.local_prefill
        got = []
        async for events in stream:
            got += [e for e in events if e.request_id == rid]
            if got and got[-1].finish_reason:
                return got

    async def main():
        monkeypatch.setattr(d.runner, "prefill", boom)
        (failed,) = await asyncio.wait_for(run("a"), 30)
        assert failed.finish_reason == "error"
        assert failed.error == "decode step failed: RuntimeError: boom"
        monkeypatch.setattr(d.runner, "prefill", real_prefill)
        served = await asyncio.wait_for(run("b"), 30)
        assert sum(len(e.token_ids) for e in served) == 3
        assert served[-1].finish_reason == "length"

    try:
        asyncio.run(main())
        assert d.pool.num_free == d.pool.num_blocks
    finally:
        asyncio.run(d.shutdown())
