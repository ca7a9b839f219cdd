"""Chaos: `kill -9` of a worker process with several streams in flight (the default
model, over each KV transport: TCP frames and NIXL's one-sided writes). Ray restarts the worker (a new epoch); the router retries each
affected request on live workers, resuming after the tokens already streamed. Every
stream must complete with greedy tokens identical to HF transformers' `generate` (so
nothing repeated, nothing missing), and every KV pool must be free afterwards.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import pytest
import ray
from serving import TRANSPORTS, OpenAIPenalties, Served, hf_greedy, start_ray

from pdserve.client import make_request

pytestmark = pytest.mark.slow

TIMEOUT_S = 180


@pytest.fixture(scope="module", params=TRANSPORTS)
def served(request):
    start_ray()
    s = Served(prefill_workers=2, decode_workers=1, threads_per_worker=1,
               transport=request.param)
    yield s
    s.stop()           # every KV pool free, the router's queue empty


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from pdserve.engine.loader import resolve_model
    return AutoTokenizer.from_pretrained(resolve_model("default"))


class Streams:
    """Generate calls in threads, each recording the tokens as they arrive: `tokens`
    and `final` sample 0's, `samples` every sample's by index (sampling.n)."""

    def __init__(self, served: Served, prompts: list[str], max_tokens: int,
                 sampling: list[dict] | None = None):
        self.tokens = [[] for _ in prompts]
        self.samples = [{} for _ in prompts]
        self.final = [None] * len(prompts)
        self.errors: list[grpc.RpcError] = []
        sampling = sampling or [{}] * len(prompts)
        self.threads = [threading.Thread(target=self._run, args=(served, i, p, max_tokens, kw))
                        for i, (p, kw) in enumerate(zip(prompts, sampling))]
        for t in self.threads:
            t.start()

    def _run(self, served, i, prompt, max_tokens, sampling):
        req = make_request(prompt, max_tokens=max_tokens, **({"temperature": 0} | sampling))
        try:
            ended = set()
            for msg in served.client.generator.Generate(req, timeout=TIMEOUT_S):
                assert msg.index not in ended, "a message after the final one"
                self.samples[i].setdefault(msg.index, []).extend(msg.token_ids)
                if msg.finish_reason:
                    ended.add(msg.index)
                if msg.index == 0:
                    self.tokens[i] += msg.token_ids
                    self.final[i] = msg if msg.finish_reason else None
        except grpc.RpcError as e:
            self.errors.append(e)

    def wait_until(self, cond, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():
            assert time.monotonic() < deadline, f"timed out; tokens so far {self.tokens}"
            assert not self.errors, self.errors
            time.sleep(0.01)

    def join(self) -> None:
        for t in self.threads:
            t.join(TIMEOUT_S)
        assert not any(t.is_alive() for t in self.threads), "a stream hung"
        assert not self.errors, [(e.code(), e.details()) for e in self.errors]


def _kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)     # this test's own worker process, by its pid


def test_kill_decode_worker_mid_stream(served, tok):
    """Greedy streams, one with penalties (the retry resends the streamed tokens as the
    tail of the prompt: they still count as output), a seeded sampled one with
    penalties whose draws continue where they stopped, and n=2 seeded samples of one
    prefill (each retried on its own): all as without the kill."""
    # HF's greedy output of each runs past 40 tokens without EOS
    prompts = ["Write a long essay about the sea.", "Once upon a time, in a village by the river,",
               "The history of the railway begins", "Tell me about the moon.",
               "Describe a walk in the forest."]
    penalties = dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.5)
    sampling = [{}, penalties, {}, dict(temperature=0.8, top_p=0.9, seed=7, ignore_eos=True,
                                       **penalties),
                dict(temperature=0.8, top_p=0.9, seed=11, ignore_eos=True, n=2)]
    n = 40
    unkilled = Streams(served, prompts[3:], n, sampling[3:])
    unkilled.join()
    before = served.decode_status()[0]
    streams = Streams(served, prompts, n, sampling)
    # every stream has tokens on the client and is still decoding: kill D
    streams.wait_until(lambda: all(len(t) >= 4 for t in streams.tokens))
    assert all(len(t) < n for t in streams.tokens), "finished before the kill"
    _kill(before.pid)
    streams.join()
    for p, got, final, kw in zip(prompts[:3], streams.tokens, streams.final, sampling):
        ids = tok(p)["input_ids"]
        hf_kw = {} if not kw else dict(repetition_penalty=1.3, logits_processor=[
            OpenAIPenalties(len(ids), presence=0.5, frequency=0.5)])
        assert got == hf_greedy("default", ids, n, **hf_kw), p
        assert final.finish_reason == "length" and final.usage.completion_tokens == n
    assert streams.tokens[3] == unkilled.tokens[0]
    assert streams.samples[4] == unkilled.samples[1] and len(unkilled.samples[1][1]) == n
    after = served.decode_status()[0]
    assert after.pid != before.pid and after.epoch != before.epoch  # restarted
    served.assert_all_free()


def test_kill_prefill_worker_mid_transfer(served, tok):
    # ~300-token prompts: each takes long enough to prefill that P dies while sending
    prompts = [f"Story {i}. " + " ".join(f"On day {j} the traveller {i} walked {j + i} miles."
                                         for j in range(30)) for i in range(4)]
    n = 8
    streams = Streams(served, prompts, n)
    victim = None
    deadline = time.monotonic() + 60
    while victim is None:
        assert time.monotonic() < deadline, "no prefill worker started sending KV"
        for w in served.cluster.prefill:
            st = ray.get(w.status.remote(), timeout=10)
            if st.kv_bytes_sent > 0 and st.running_requests > 0:
                victim = st
                break
        time.sleep(0.005)
    _kill(victim.pid)
    streams.join()
    for p, got in zip(prompts, streams.tokens):
        assert got == hf_greedy("default", tok(p)["input_ids"], n), p
    served.assert_all_free(timeout_s=30)   # the killed worker is back (restarted), empty
    st = served.client.status()
    assert all(not w.state.startswith("dead") for w in st.workers), st
    assert all(w.kv_reservations_leased == 0 for w in st.workers if w.role == "decode")
