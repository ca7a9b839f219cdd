"""The prefill worker in process (no Ray) on a tiny model: a fault of the model step
fails its batch's requests as PrefillFailed, not as a KV transfer error, counts no
transfer failure, and frees every block."""

import asyncio

import pytest
from tiny_models import tiny_model_dir

from pdserve.config import WorkerConfig
from pdserve.engine.sampling_params import SamplingParams
from pdserve.messages import PrefillOrder
from pdserve.prefill_worker.worker import PrefillFailed, PrefillWorker


def test_a_model_fault_fails_the_request_as_such_and_frees_its_blocks(monkeypatch):
    p = PrefillWorker("prefill-0", WorkerConfig(model=str(tiny_model_dir("llama")),
                                                num_kv_blocks=16, block_size=4))

    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    async def main():
        # nothing listens at the decode address: only the abort frame would go there
        order = PrefillOrder("r", [5, 6, 7, 8, 9], SamplingParams(max_tokens=4),
                             ("127.0.0.1", 9), epoch=1)
        with pytest.raises(PrefillFailed, match="prefill failed: RuntimeError: boom"):
            await asyncio.wait_for(p.prefill(order), 30)

    try:
        monkeypatch.setattr(p.runner, "prefill", boom)
        asyncio.run(main())
        assert p.connector.kv_send_failures == 0
        assert p.pool.num_free == p.pool.num_blocks
    finally:
        asyncio.run(p.shutdown())
