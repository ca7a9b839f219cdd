"""`kill -9` of the router's process under steady load: Ray restarts the router actor,
the cluster starts it on the same gRPC and HTTP ports, it finds the workers and aborts
what the dead router had on them. For clients that do not resume, requests in flight
fail with UNAVAILABLE, the first request to succeed after the kill starts within 30 s
of it, and every request that starts after that one succeeds. Streams of pdserve's
client, which resumes (GenerateRequest.resume_token_ids), all complete. Every output
is HF's greedy one; every pool free after.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request

import grpc
import pytest
import ray
from serving import Served, hf_greedy_of, start_load_then_streams, start_ray, wait_until

from pdserve.client import Client, make_request

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "Write a long essay about the sea.",
           "Once upon a time, in a village by the river,", "Tell me about the moon."]
N = 16
LONG = ["Write a long essay about the sea.", "The history of the railway begins"]
N_LONG = 96
RESTART_S = 30.0     # from the kill to the start of the first request that succeeds


def _router_pid(served: Served) -> int:
    return ray.get(served.cluster.router.__ray_call__.remote(lambda _self: os.getpid()),
                   timeout=60)


def test_a_killed_router_serves_again_on_its_ports():
    expect = hf_greedy_of(PROMPTS, N)
    expect_long = hf_greedy_of(LONG, N_LONG, ignore_eos=True)
    start_ray()
    served = Served(prefill_workers=1, decode_workers=1, threads_per_worker=1,
                    router_kw={"http_port": 0})
    try:
        log: list[tuple[float, str, list[int] | None, grpc.StatusCode | None]] = []
        stop = threading.Event()

        plain = Client(served.address, timeout_s=120, resume_timeout_s=0)
        resumed: dict[str, list] = {p: [] for p in LONG}
        finals: dict[str, object] = {}

        def loop(prompt: str) -> None:     # one client of four, on one channel
            while not stop.is_set():
                t0 = time.monotonic()
                try:
                    ids, _, _ = plain.generate(
                        make_request(prompt, max_tokens=N, temperature=0))
                    log.append((t0, prompt, ids, None))
                except grpc.RpcError as e:
                    log.append((t0, prompt, None, e.code()))
                    time.sleep(0.05)

        def wait(cond, what: str, timeout_s: float = 120.0) -> None:
            wait_until(cond, what, log, timeout_s)

        def long_stream(prompt: str) -> None:    # pdserve's client: resumes
            req = make_request(prompt, max_tokens=N_LONG, temperature=0, ignore_eos=True)
            for msg in served.client.stream(req):
                resumed[prompt] += msg.token_ids
                if msg.finish_reason:
                    finals[prompt] = msg

        threads = [threading.Thread(target=loop, args=(p,)) for p in PROMPTS]
        streams = [threading.Thread(target=long_stream, args=(p,)) for p in LONG]
        try:
            start_load_then_streams(threads, streams, log, resumed)
            pid = _router_pid(served)
            assert all(len(v) < N_LONG for v in resumed.values()), "ended before the kill"
            killed_at = time.monotonic()
            os.kill(pid, signal.SIGKILL)      # this test's router, by its pid
            wait(lambda: sum(r[2] is not None and r[0] > killed_at for r in log) >= 12,
                 "no request succeeded after the kill")
        finally:
            stop.set()
            for t in threads + streams:
                t.join(120)
            plain.close()
        assert not any(t.is_alive() for t in threads + streams), "a client hung"
        for prompt in LONG:            # nothing lost, nothing repeated
            assert resumed[prompt] == expect_long[prompt], prompt
            assert finals[prompt].finish_reason == "length"
            assert finals[prompt].usage.completion_tokens == N_LONG

        after = [r for r in log if r[0] > killed_at]
        first_ok = min(r[0] for r in after if r[3] is None)
        assert first_ok - killed_at < RESTART_S, first_ok - killed_at
        late = [r for r in after if r[0] >= first_ok]
        assert all(r[3] is None for r in late), [r for r in late if r[3] is not None]
        failed = {r[3] for r in log if r[3] is not None}
        assert failed <= {grpc.StatusCode.UNAVAILABLE}, failed
        for _, prompt, ids, _ in (r for r in log if r[3] is None):
            assert ids == expect[prompt], prompt
        assert _router_pid(served) != pid

        # the HTTP API is back on its port too
        body = json.dumps({"model": "default", "prompt": PROMPTS[0], "max_tokens": N,
                           "temperature": 0}).encode()
        req = urllib.request.Request(served.http_url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            got = json.loads(r.read())
        _, text, _ = served.client.generate(make_request(PROMPTS[0], max_tokens=N,
                                                         temperature=0))
        assert got["choices"][0]["text"] == text and got["usage"]["completion_tokens"] == len(expect[PROMPTS[0]])
        served.assert_all_free(timeout_s=30)
    finally:
        served.stop()
