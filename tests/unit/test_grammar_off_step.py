"""Structured outputs are compiled off the workers' step threads: the decode worker in
process (no Ray) on a tiny model compiles a request's grammar in reserve(), before the
request can join a step, and the step thread only builds a matcher of what the request
holds; and xgrammar releases the GIL while it compiles a large schema, so a thread
compiling one does not hold up another's Python (a step loop's)."""

import asyncio
import threading
import time

from schemas import large_schema
from tiny_models import VOCAB_SIZE, tiny_model_dir

from pdserve.config import WorkerConfig
from pdserve.decode_worker.worker import DecodeWorker
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.structured_output import Grammars, StructuredOutput


def test_the_decode_worker_compiles_a_grammar_before_the_step_thread_sees_the_request(
        monkeypatch):
    d = DecodeWorker("decode-0", WorkerConfig(model=str(tiny_model_dir("llama")),
                                              num_kv_blocks=16, block_size=4, transport="tcp"))
    compiled_on: list[str] = []
    real_compile = Grammars.compile

    def recording(self, so):
        compiled_on.append(threading.current_thread().name)
        return real_compile(self, so)

    monkeypatch.setattr(Grammars, "compile", recording)
    so = StructuredOutput("choice", '["yes", "no"]')

    async def main() -> list:
        stream = d.events(d.epoch)
        res = await d.reserve("a", 5, SamplingParams(max_tokens=6, temperature=0,
                                                     structured_outputs=so),
                              [5, 6, 7, 8, 9], prefill_locally=True)
        assert res.local_prefill
        got = []
        async for events in stream:
            got += [e for e in events if e.request_id == "a"]
            if got and got[-1].finish_reason:
                return got

    try:
        events = asyncio.run(asyncio.wait_for(main(), 60))
        tokens = [t for e in events for t in e.token_ids]
        text = d.runner.tokenizer.decode(tokens, skip_special_tokens=True)
        assert text in ("yes", "no") and events[-1].finish_reason == "stop", (text, events)
        assert compiled_on and "decode-step" not in compiled_on, compiled_on
        assert d.pool.num_free == d.pool.num_blocks
    finally:
        asyncio.run(d.shutdown())


def test_compiling_a_large_schema_leaves_other_threads_running():
    """The main thread's Python loop, timed while another thread compiles a ~64 KB
    schema: no gap beyond 50 ms (a held GIL would stop it for the whole compile, which
    is longer than that, as the test checks)."""
    from transformers import AutoTokenizer
    g = Grammars(AutoTokenizer.from_pretrained(tiny_model_dir("llama")), VOCAB_SIZE)
    so = StructuredOutput("json", large_schema())
    done = threading.Event()
    took: list[float] = []

    def compile_it():
        t0 = time.perf_counter()
        g.compile(so)
        took.append(time.perf_counter() - t0)
        done.set()

    worst, last = 0.0, time.perf_counter()
    threading.Thread(target=compile_it, name="compile").start()
    while not done.is_set():
        now = time.perf_counter()
        worst, last = max(worst, now - last), now
        sum(range(200))               # a little Python work per turn, as a step loop does
    assert took[0] > 0.1, f"the schema compiled in {took[0] * 1e3:.0f} ms: too small to tell"
    assert worst < 0.05, f"a {worst * 1e3:.0f} ms gap while compiling for {took[0] * 1e3:.0f} ms"
