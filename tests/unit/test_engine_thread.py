"""A worker's model runs on one thread (engine/engine_thread.py): EngineThread's calls
and loop, and the decode and prefill workers in process (no Ray) on a tiny model,
whose runner is built, stepped and benchmarked on the worker's step thread only (two
threads opening OpenMP regions slow every step: the module's docstring)."""

import asyncio
import threading

import pytest
from tiny_models import tiny_model_dir

from pdserve.config import WorkerConfig
from pdserve.decode_worker.worker import DecodeWorker
from pdserve.engine import model_runner
from pdserve.engine.engine_thread import EngineThread
from pdserve.engine.sampling_params import SamplingParams
from pdserve.prefill_worker.worker import PrefillWorker


def test_calls_run_on_the_thread_in_order_and_raise_where_they_were_made():
    e = EngineThread("engine-test")
    try:
        assert e.call(lambda: threading.current_thread().name) == "engine-test"
        with pytest.raises(KeyError, match="nope"):
            e.call(lambda: {}["nope"])
        order: list[int] = []
        futs = [e.submit(order.append, i) for i in range(5)]
        assert [f.result(5) for f in futs] == [None] * 5 and order == [0, 1, 2, 3, 4]
        assert e.call(lambda: e.call(lambda: 7)) == 7     # from the thread itself: inline
    finally:
        e.close(5)
    assert not e._thread.is_alive()


def test_the_loop_runs_calls_between_its_iterations_and_close_waits_for_it():
    woken = threading.Event()
    stop = threading.Event()
    e = EngineThread("engine-test", wake=woken.set)
    turns = []

    def loop():
        while not stop.is_set():
            e.run_calls()
            turns.append(1)
            woken.wait(0.05)
            woken.clear()

    e.start(loop)
    assert e.call(lambda: threading.current_thread().name) == "engine-test"
    assert turns, "the call ran before the loop's first turn"
    with pytest.raises(AssertionError, match="off the engine thread"):
        e.run_calls()
    stop.set()
    e.close(5)
    assert not e._thread.is_alive()


@pytest.fixture
def runner_threads(monkeypatch) -> list[tuple[str, str]]:
    """(method, thread name) of every ModelRunner construction, prefill and decode."""
    seen: list[tuple[str, str]] = []
    for name in ("__init__", "prefill", "decode", "mixed"):
        real = getattr(model_runner.ModelRunner, name)

        def recording(self, *a, _real=real, _name=name, **kw):
            seen.append((_name, threading.current_thread().name))
            return _real(self, *a, **kw)

        monkeypatch.setattr(model_runner.ModelRunner, name, recording)
    return seen


def test_the_decode_worker_builds_and_steps_its_runner_on_its_step_thread(runner_threads):
    d = DecodeWorker("decode-0", WorkerConfig(model=str(tiny_model_dir("llama")),
                                              num_kv_blocks=16, block_size=4, transport="tcp"))

    async def main() -> list:
        stream = d.events(d.epoch)
        res = await d.reserve("a", 5, SamplingParams(max_tokens=4, temperature=0),
                              [5, 6, 7, 8, 9], prefill_locally=True)
        assert res.local_prefill
        async for events in stream:
            if any(e.request_id == "a" and e.finish_reason for e in events):
                return

    try:
        asyncio.run(asyncio.wait_for(main(), 60))
        methods = {m for m, _ in runner_threads}
        assert {"__init__", "prefill", "decode"} <= methods, runner_threads
        assert {t for _, t in runner_threads} == {"decode-step"}, runner_threads
        assert d.pool.num_free == d.pool.num_blocks
    finally:
        asyncio.run(d.shutdown())


def test_the_prefill_worker_builds_and_benchmarks_its_runner_on_its_step_thread(
        runner_threads):
    p = PrefillWorker("prefill-0", WorkerConfig(model=str(tiny_model_dir("llama")),
                                                num_kv_blocks=16, block_size=4,
                                                transport="tcp"))
    try:
        assert asyncio.run(asyncio.wait_for(p.bench_prefill(12), 60)) > 0
        assert [m for m, _ in runner_threads] == ["__init__", "prefill"], runner_threads
        assert {t for _, t in runner_threads} == {"prefill-step"}, runner_threads
        assert p.pool.num_free == p.pool.num_blocks
    finally:
        asyncio.run(p.shutdown())
