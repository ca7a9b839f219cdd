"""Chaos over TCP: `kill -9` of the decode worker right after the client got a first
token that ended the stream (the default model). Its own module: the scenario needs
P's KV to wait in a frozen D's socket buffer, which only the TCP transport does (the
test's docstring), and test_chaos.py's cluster runs every transport."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import ray
from serving import Served, hf_greedy, start_ray

from pdserve.client import make_request

pytestmark = pytest.mark.slow

TIMEOUT_S = 180


@pytest.fixture(scope="module")
def served():
    start_ray()
    s = Served(prefill_workers=2, decode_workers=1, threads_per_worker=1, transport="tcp")
    yield s
    s.stop()           # every KV pool free, the router's queue empty


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from pdserve.engine.loader import resolve_model
    return AutoTokenizer.from_pretrained(resolve_model("default"))


def _kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)     # this test's own worker process, by its pid


@pytest.mark.parametrize("prompt, sampling", [
    # HF's greedy first token is EOS (as for about a third of ShareGPT first turns)
    ("can you design a referral system similar on how dropbox did?", {}),
    ("The capital of France is", {"stop_token_ids": [7042]}),   # " Paris", the first token
    ("The capital of France is", {"stop": ["Paris"]}),
], ids=["eos", "stop_token_id", "stop_string"])
def test_kill_decode_worker_after_a_first_token_that_ended_the_stream(served, tok, prompt,
                                                                      sampling):
    """D is killed right after the client got a first token that ended the
    stream. The stream ends exactly as an uninterrupted run does (same tokens, same
    finish_reason): the router never resumes it as `prompt + [that token]`.

    TCP only: the scenario freezes D between its reservation and the KV's arrival, and
    needs P to finish the prefill meanwhile. Over TCP, P's frames wait in D's socket
    buffer; over NIXL, P may not write into D's blocks before D grants it the lease
    (BEGIN, kv_transfer/nixl.py), so a frozen D holds the first token back until the
    transfer times out. What is tested here is the router's resume rule, the same for
    every transport."""
    def run(kill: bool):
        """The stream's (tokens, finish_reason, text). With `kill`, D is frozen once it
        holds the reservation and before P's KV and first token reach it (so D cannot
        finish the request itself), and killed once the client has the first token."""
        req = make_request(prompt, max_tokens=16, temperature=0, **sampling)
        msgs, first = [], threading.Event()

        def consume():
            for msg in served.client.generator.Generate(req, timeout=TIMEOUT_S):
                msgs.append(msg)
                first.set()

        prefill_pids = [ray.get(w.status.remote(), timeout=10).pid
                        for w in served.cluster.prefill]
        decode_pid = served.decode_status()[0].pid
        if kill:
            for pid in prefill_pids:
                os.kill(pid, signal.SIGSTOP)
        client = threading.Thread(target=consume)
        client.start()
        try:
            if kill:
                deadline = time.monotonic() + 60
                while served.decode_status()[0].kv_reservations_leased == 0:
                    assert time.monotonic() < deadline, "D never reserved the request"
                    time.sleep(0.01)
                os.kill(decode_pid, signal.SIGSTOP)
        finally:
            for pid in prefill_pids if kill else ():
                os.kill(pid, signal.SIGCONT)
        if kill:
            try:
                assert first.wait(60), "no first token"
            finally:
                _kill(decode_pid)     # the frozen D, even when no first token came
        client.join(TIMEOUT_S)
        assert not client.is_alive(), "the stream hung"
        return [t for m in msgs for t in m.token_ids], msgs[-1].finish_reason, msgs[-1].text

    expected = run(kill=False)
    assert expected[:2] == (hf_greedy("default", tok(prompt)["input_ids"], 16)[:1], "stop")
    before = served.decode_status()[0]
    assert run(kill=True) == expected
    served.assert_all_free(timeout_s=60)      # Ray restarted D, with nothing left on it
    after = served.decode_status()[0]
    assert after.pid != before.pid and after.epoch != before.epoch
