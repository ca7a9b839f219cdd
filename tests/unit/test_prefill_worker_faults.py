"""The prefill worker in process (no Ray) on a tiny model: a fault of the model step
fails its batch's requests as PrefillFailed, not as a KV transfer error, counts no
transfer failure, and frees every block."""

import asyncio
import time

import pytest
from tiny_models import tiny_model_dir

from pdserve.config import WorkerConfig
from pdserve.engine.sampling_params import SamplingParams
from pdserve.messages import PrefillOrder
from pdserve.prefill_worker.worker import PrefillFailed, PrefillWorker


async def _prefill_fails_with_boom(p: PrefillWorker) -> None:
    """A 5-token prompt whose model step raises "boom" fails as PrefillFailed (nothing
    listens at the decode address: only an abort frame would go there)."""
    order = PrefillOrder("r", [5, 6, 7, 8, 9], SamplingParams(max_tokens=4),
                         ("127.0.0.1", 9), epoch=1)
    with pytest.raises(PrefillFailed, match="prefill failed: RuntimeError: boom"):
        await asyncio.wait_for(p.prefill(order), 30)


def test_a_model_fault_fails_the_request_as_such_and_frees_its_blocks(monkeypatch):
    p = PrefillWorker("prefill-0", WorkerConfig(model=str(tiny_model_dir("llama")),
                                                num_kv_blocks=16, block_size=4))

    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    try:
        monkeypatch.setattr(p.runner, "prefill", boom)
        asyncio.run(_prefill_fails_with_boom(p))
        assert p.connector.kv_send_failures == 0
        assert p.pool.num_free == p.pool.num_blocks
    finally:
        asyncio.run(p.shutdown())


def test_a_sampling_fault_beside_a_chunked_prompt_leaves_nothing_queued(monkeypatch):
    """A step fails after its forward (here: the sampler raises) while a longer prompt
    was mid-chunk in the same batch: both requests fail, no chunk of the failed one runs
    later, every block is free, and the next request is served."""
    import pdserve.engine.sampler as sampler_module

    p = PrefillWorker("prefill-0", WorkerConfig(model=str(tiny_model_dir("llama")),
                                                num_kv_blocks=16, block_size=4,
                                                prefill_chunk_size=8))
    real_sample = sampler_module.sample

    def boom(*args, **kwargs):
        raise RuntimeError("sampler boom")

    def order(rid, n):
        return PrefillOrder(rid, list(range(5, 5 + n)), SamplingParams(max_tokens=4),
                            ("127.0.0.1", 9), epoch=1)

    async def main():
        monkeypatch.setattr(sampler_module, "sample", boom)
        got = await asyncio.wait_for(asyncio.gather(   # one batch: 3 tokens + 5 of 20
            p.prefill(order("short", 3)), p.prefill(order("long", 20)),
            return_exceptions=True), 30)
        assert [type(g) for g in got] == [PrefillFailed] * 2, got
        assert all("sampler boom" in str(g) for g in got)
        assert p.scheduler.counts() == (0, 0)
        monkeypatch.setattr(sampler_module, "sample", real_sample)
        # nothing listens at D: the transfer fails, but the step itself runs
        with pytest.raises(Exception) as e:
            await asyncio.wait_for(p.prefill(order("next", 6)), 30)
        assert "prefill failed" not in str(e.value)

    try:
        asyncio.run(main())
        assert p.pool.num_free == p.pool.num_blocks
    finally:
        asyncio.run(p.shutdown())


def test_a_model_fault_outranks_a_transfer_failure_that_lands_after_it(monkeypatch):
    """The send thread's failure of a layer send, landing after the step set the model
    fault (the race CI once hit), does not turn the request's PrefillFailed into the
    transfer's message."""
    from pdserve.kv_transfer import KVTransferError

    p = PrefillWorker("prefill-0", WorkerConfig(model=str(tiny_model_dir("llama")),
                                                num_kv_blocks=16, block_size=4))
    faulted = []                                  # requests the step has failed
    request_finished = p.connector.request_finished

    def boom(seqs, on_layer_done):
        on_layer_done(0)                          # layer 0 queued for the send thread
        raise RuntimeError("boom")

    def finished(req, first_token):               # called once the step set req.finish
        faulted.append(req)
        request_finished(req, first_token)

    def send_layers(*args, **kwargs):
        while not faulted:                        # fail only once the step has faulted
            time.sleep(0.001)
        raise KVTransferError("peer gone")

    try:
        monkeypatch.setattr(p.runner, "prefill", boom)
        monkeypatch.setattr(p.sender, "send_layers", send_layers)
        monkeypatch.setattr(p.connector, "request_finished", finished)
        asyncio.run(_prefill_fails_with_boom(p))
        assert faulted
        assert p.pool.num_free == p.pool.num_blocks
    finally:
        asyncio.run(p.shutdown())
