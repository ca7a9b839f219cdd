"""16 clients looping the largest prompts the router takes to its tokenizer (the most
characters the model's context allows, far more tokens than it holds), each refused,
do not raise a short probe request's time to first token above twice its unloaded
value: the router tokenizes shortest first and by prefixes (a refused prompt costs
about one context's tokens), and refuses what its tokenizer queue cannot hold before
any work. Every pool free after."""

from __future__ import annotations

import statistics
import threading
import time

import grpc
import pytest
from serving import Served, start_ray

from pdserve.client import Client, make_request
from pdserve.router.validation import max_prompt_chars

pytestmark = pytest.mark.slow

FLOOD_CLIENTS = 16
PROBES = 7
PROBE = "The capital of France is"


def _ttft(client: Client) -> float:
    t0 = time.perf_counter()
    for _ in client.stream(make_request(PROBE, max_tokens=2, temperature=0)):
        return time.perf_counter() - t0
    raise AssertionError("the probe got no token")


def test_a_flood_of_refused_maximum_size_prompts_leaves_other_requests_fast():
    start_ray()
    served = Served(prefill_workers=1, decode_workers=1, threads_per_worker=1)
    stop = threading.Event()
    refused: dict[grpc.StatusCode, int] = {}

    def flood(text: str) -> None:
        c = Client(served.address, timeout_s=120, resume_timeout_s=0)
        try:
            while not stop.is_set():
                try:
                    c.generate(make_request(text, max_tokens=1))
                    raise AssertionError("a prompt over the context was served")
                except grpc.RpcError as e:
                    refused[e.code()] = refused.get(e.code(), 0) + 1
        finally:
            c.close()

    try:
        from transformers import AutoConfig

        from pdserve.engine.config import ModelConfig
        from pdserve.engine.loader import resolve_model

        max_len = ModelConfig.from_hf(AutoConfig.from_pretrained(resolve_model("default"))
                                      ).max_model_len
        words = "the quick brown fox jumps over the lazy dog and keeps running far away "
        text = (words * (max_prompt_chars(max_len) // len(words) + 1))[:max_prompt_chars(max_len)]
        for _ in range(2):                               # warm: first-call costs
            _ttft(served.client)
        unloaded = statistics.median(_ttft(served.client) for _ in range(PROBES))
        threads = [threading.Thread(target=flood, args=(text,)) for _ in range(FLOOD_CLIENTS)]
        for t in threads:
            t.start()
        while sum(refused.values()) < 2 * FLOOD_CLIENTS:          # the flood is on
            time.sleep(0.05)
        loaded = statistics.median(_ttft(served.client) for _ in range(PROBES))
        stop.set()
        for t in threads:
            t.join(60)
        assert set(refused) <= {grpc.StatusCode.INVALID_ARGUMENT,
                                grpc.StatusCode.RESOURCE_EXHAUSTED}, refused
        assert loaded <= 2 * unloaded, (f"probe TTFT {loaded * 1e3:.0f} ms under the flood, "
                                        f"{unloaded * 1e3:.0f} ms unloaded; refused {refused}")
        served.assert_all_free(timeout_s=30)
    finally:
        stop.set()
        served.stop()
