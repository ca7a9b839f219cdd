"""Admin.Scale under steady load: 1P+1D → 2P+2D → 1P+1D while client
threads keep sending ShareGPT prompts. No request is refused or lost, greedy outputs
equal HF's, the new workers take requests, the retired ones' Ray actors are gone, and
every KV pool is free at the end. Then a decode worker retired with long streams still
on it past timeout_s: they move to the other (stream migration); and a decode worker
started while they run takes half of them (rebalance_on_scale_up); their tokens, up to
where the test cancels them, equal HF's."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import ray
from serving import Served, hf_greedy, start_ray
from tiny_models import make_tiny_model, tiny_model_dir

from pdserve.client import make_request

pytestmark = pytest.mark.slow

NEW_TOKENS = 8


def test_scale_up_and_down_under_load_loses_nothing():
    from transformers import AutoTokenizer

    from pdserve.sharegpt import sample_prompts

    start_ray()
    model = str(tiny_model_dir("llama"))
    tok = AutoTokenizer.from_pretrained(model)
    prompts = [tok(p)["input_ids"][:48] for p in sample_prompts(12, max_chars=400)]
    served = Served(model, decode_blocks=128, prefill_blocks=128)
    stop, results, errors = threading.Event(), [], []

    def load(i):
        k = i
        while not stop.is_set():
            ids = prompts[k % len(prompts)]
            k += 3
            try:
                out = served.client.generate(make_request(ids, max_tokens=NEW_TOKENS,
                                                          temperature=0, ignore_eos=True))
                results.append((tuple(ids), tuple(out[0])))
            except Exception as e:          # grpc.RpcError: refused or lost
                errors.append(e)

    threads = [threading.Thread(target=load, args=(i,)) for i in range(3)]
    try:
        for t in threads:
            t.start()
        up = served.client.scale(2, 2, timeout_s=120)
        assert sorted(up.started) == ["decode-1", "prefill-1"], up
        assert (up.num_prefill_workers, up.num_decode_workers) == (2, 2)
        st = served.client.status()
        assert sorted((w.role, w.state) for w in st.workers) == [
            ("decode", "ready")] * 2 + [("prefill", "ready")] * 2
        served_before = len(results)
        deadline = time.monotonic() + 60      # the new workers take requests
        p1, d1 = ray.get_actor("prefill-1"), ray.get_actor("decode-1")
        while not (ray.get(p1.status.remote()).prefill_tokens_computed > 0 and
                   ray.get(d1.status.remote()).peak_batch_size > 0):
            assert time.monotonic() < deadline, "a new worker took no request"
            time.sleep(0.05)
        down = served.client.scale(1, 1, timeout_s=120)
        assert sorted(down.retired) == ["decode-1", "prefill-1"] and not down.migrated
        assert (down.num_prefill_workers, down.num_decode_workers) == (1, 1)
        assert len(results) > served_before
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    try:
        assert not errors, errors[:3]
        assert len(results) >= 12
        for ids, got in set(results):
            assert list(got) == hf_greedy(model, list(ids), NEW_TOKENS, ignore_eos=True)
        names = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}
        assert not {"prefill-1", "decode-1"} & names, names
        assert sorted(w.worker_id for w in served.client.status().workers) == [
            "decode-0", "prefill-0"]
    finally:
        served.stop()          # asserts every KV block on every worker is free


MAX_LEN = 32768      # the streams' context: they cannot end on their own before the test
                     # has seen the rebalance and cancels them (~4,000 tokens each by
                     # then here, ~100 s from their end)


def test_streams_move_off_a_retired_decode_worker_and_onto_one_that_joins(tmp_path):
    start_ray()
    model = str(make_tiny_model("llama", tmp_path / "m", max_position_embeddings=MAX_LEN))
    prompts = [[1, 500, 77], list(range(100, 117)), list(range(2000, 2030)), [5] * 9]
    n = MAX_LEN - max(map(len, prompts))
    # KV blocks of 16 tokens for every stream at its longest, on one worker; a prefill
    # worker recomputes a moved stream's prompt and tokens so far
    blocks = len(prompts) * MAX_LEN // 16 + 64
    served = Served(model, decode_blocks=blocks, prefill_blocks=blocks,
                    decode_workers=2, router_kw={"rebalance_on_scale_up": True})
    tokens = [[] for _ in prompts]
    calls, errors = [None] * len(prompts), []

    def run(i):
        calls[i] = served.client.stream(make_request(prompts[i], max_tokens=n, temperature=0,
                                                     ignore_eos=True))
        try:
            for msg in calls[i]:
                tokens[i] += msg.token_ids
        except grpc.RpcError as e:      # the test cancels the streams at its end
            if e.code() != grpc.StatusCode.CANCELLED:
                errors.append(e)

    def wait_for(what: str, cond, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():
            assert not errors, errors
            assert time.monotonic() < deadline, (f"no {what} in {timeout_s}s",
                                                 [len(t) for t in tokens])
            time.sleep(0.01)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    try:
        for i, t in enumerate(threads):   # one at a time: each goes to the less loaded D
            t.start()
            wait_for(f"token of stream {i}", lambda: len(tokens[i]) >= 4)
        d1 = ray.get(ray.get_actor("decode-1").status.remote())
        assert d1.running_requests > 0            # it has streams to move on
        r = served.client.scale(1, 1, timeout_s=0.2)
        assert r.migrated == ["decode-1"] and not r.retired, r
        # a decode worker joins while no request comes: it gets streams only by the
        # rebalance (those above the mean move off decode-0)
        r = served.client.scale(1, 2, timeout_s=60)
        assert r.started == ["decode-2"], r
        at_join = [len(t) for t in tokens]
        assert all(t.is_alive() for t in threads) and max(at_join) < n, at_join
        d2 = ray.get_actor("decode-2")
        wait_for("rebalance onto decode-2", lambda: ray.get(d2.status.remote()).peak_batch_size >= 2)
        moved = [len(t) for t in tokens]
        wait_for("tokens after the move", lambda: all(len(t) >= k + 32 for t, k in zip(tokens, moved)))
        for c in calls:
            c.cancel()
        for t in threads:
            t.join(60)
        assert not errors, errors
        for prompt, got in zip(prompts, tokens):
            assert got == hf_greedy(model, prompt, len(got), ignore_eos=True)
    finally:
        served.stop()
