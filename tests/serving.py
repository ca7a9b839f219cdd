"""Test helpers for serving end to end: start a real cluster, call it, check for leaks,
and compute the HF transformers reference (the correctness oracle)."""

from __future__ import annotations

import functools
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import ray
import torch

from pdserve.client import Client, make_request
from pdserve.cluster import Cluster
from pdserve.config import ClusterConfig
from pdserve.engine.loader import resolve_model
from pdserve.kv_transfer.nixl import find_module
from pdserve.messages import WorkerStatus

# KV transports an e2e module runs over (a module-scoped `served` fixture takes them as
# params): NIXL where it imports (`make test` installs pdserve[nixl], so in CI it does).
TRANSPORTS = ["tcp", pytest.param("nixl", marks=pytest.mark.skipif(
    find_module() is None, reason="NIXL (nixl-cu12) not installed"))]


def start_ray() -> None:
    """One local Ray instance for the test session (clusters reuse it: ~5 s saved each)."""
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, namespace="pdserve-tests",
                 configure_logging=False, log_to_driver=True)


class Served:
    """A running cluster with a client; `stop()` checks every KV pool is free first."""

    def __init__(self, model: str = "default", client_kw: dict | None = None,
                 num_routers: int = 1, decode_kw: dict | None = None, **kw):
        """`client_kw` goes to the Client (TLS files, api_key of a secured cluster);
        `num_routers` to ClusterConfig; `decode_kw` overrides the decode workers'
        WorkerConfig fields (ClusterConfig.local gives both roles the same); the rest of
        the keywords to ClusterConfig.local."""
        kw.setdefault("prefill_blocks", 256)
        kw.setdefault("decode_blocks", 256)
        # Tests follow the prefill worker's path (its transfers, its faults) unless they
        # ask for D's own prefill of a prompt that arrives while P is idle (router
        # local_prefill_when_prefill_idle, on for `pdserve serve`; tested in
        # tests/e2e/test_serve_local_prefill.py and by the CLI tests).
        kw["router_kw"] = {"local_prefill_when_prefill_idle": False} | (kw.get("router_kw") or {})
        config = ClusterConfig.local(model, port=0, **kw)
        self.cluster = Cluster(replace(config, num_routers=num_routers,
                                       decode=replace(config.decode, **(decode_kw or {}))))
        self.port = self.cluster.start()
        self.address = f"127.0.0.1:{self.port}"
        # the OpenAI-compatible HTTP API's base URL, with router_kw={"http_port": 0}
        self.http_url = (f"http://127.0.0.1:{self.cluster.http_port}"
                         if self.cluster.http_port is not None else None)
        self.client = Client(self.address, timeout_s=300, **(client_kw or {}))

    def generate(self, prompt, **kw):
        return self.client.generate(make_request(prompt, **kw))

    def samples(self, prompt, **kw) -> dict[int, list[int]]:
        """Each sample's tokens (sampling.n > 1), by GenerateResponse.index; checks that
        every sample finished once."""
        out: dict[int, list[int]] = {}
        ends = []
        for m in self.client.stream(make_request(prompt, **kw)):
            out.setdefault(m.index, []).extend(m.token_ids)
            ends += [m.index] if m.finish_reason else []
        assert sorted(ends) == sorted(out), ends
        return out

    def generate_many(self, prompts, **kw):
        """Send all prompts at once (so they share prefill and decode batches)."""
        with ThreadPoolExecutor(len(prompts)) as ex:
            return list(ex.map(lambda p: self.generate(p, **kw), prompts))

    def decode_status(self) -> list[WorkerStatus]:
        return ray.get([d.status.remote() for d in self.cluster.decode])

    def assert_all_free(self, timeout_s: float = 5.0) -> None:
        """Every worker's KV blocks are free and the router's admission queue is empty
        (polled: frees land asynchronously)."""
        deadline = time.monotonic() + timeout_s
        while True:
            st = self.client.status()
            workers = st.workers
            busy = [f"{w.worker_id}: {w.kv_blocks_free}/{w.kv_blocks_total} free, "
                    f"{w.running_requests} running, {w.waiting_requests} waiting"
                    for w in workers if w.kv_blocks_free != w.kv_blocks_total
                    or w.running_requests or w.waiting_requests]
            if st.queued_requests or st.queued_tokens:
                busy.append(f"router: {st.queued_requests} requests, {st.queued_tokens} prompt "
                            "tokens still queued")
            if not busy and workers:
                return
            if time.monotonic() > deadline:
                raise AssertionError("KV blocks or queue counts leaked: " + "; ".join(busy))
            time.sleep(0.05)

    def stop(self) -> None:
        share = self.cluster._core_share_dir    # pdserve/core_share.py flags, this start's
        try:
            self.assert_all_free()
        finally:
            self.client.close()
            self.cluster.stop()
        assert share is None or not os.path.exists(share), f"{share} left behind"


@functools.cache
def _hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


class OpenAIPenalties:
    """OpenAI's presence / frequency penalties over the generated tokens, as a
    transformers logits processor (transformers has none): the oracle's side."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        for row, ids in enumerate(input_ids[:, self.prompt_len:]):
            counts = torch.bincount(ids, minlength=scores.shape[-1]).to(scores.dtype)
            scores[row] -= counts * self.frequency + (counts > 0) * self.presence
        return scores


def hf_greedy(model: str, prompt_ids: list[int], max_new_tokens: int,
              ignore_eos: bool = False, **kw) -> list[int]:
    """HF transformers greedy `generate` on the same weights (fp32, CPU): the oracle.
    ``kw`` goes to `generate` (repetition_penalty=, logits_processor=, ...). Without
    ``kw``, computed once per session for each (model, prompt, length, ignore_eos): a
    module's tests over each KV transport ask for the same references."""
    if not kw:
        return list(_hf_greedy_once(model, tuple(prompt_ids), max_new_tokens, ignore_eos))
    return _hf_greedy(model, prompt_ids, max_new_tokens, ignore_eos, **kw)


@functools.cache
def _hf_greedy_once(model: str, prompt_ids: tuple[int, ...], max_new_tokens: int,
                    ignore_eos: bool) -> tuple[int, ...]:
    return tuple(_hf_greedy(model, list(prompt_ids), max_new_tokens, ignore_eos))


def _hf_greedy(model: str, prompt_ids: list[int], max_new_tokens: int,
               ignore_eos: bool = False, **kw) -> list[int]:
    hf = _hf_model(str(resolve_model(model)))
    if ignore_eos:
        kw["min_new_tokens"] = max_new_tokens
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens,
                          do_sample=False, pad_token_id=hf.config.eos_token_id, **kw)
    return out[0, len(prompt_ids):].tolist()


NEAR_TIE = 1e-4   # HF's top-2 logprob gap where a summation order may flip the argmax


def assert_greedy_equals_hf(model: str, prompt_ids: list[int], got: list[int]) -> int:
    """`got` equals HF's greedy tokens, or differs first where HF's top two are within
    NEAR_TIE (a tensor-parallel all-reduce sums in another order than one GEMM; shown
    here, not assumed) and is one of those two. Returns the tokens compared equal."""
    ref, logprobs = hf_greedy_logprobs(model, prompt_ids, len(got))
    n = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), len(got))
    if n < len(got):
        top2 = logprobs[n].topk(2)
        gap = float(top2.values[0] - top2.values[1])
        assert gap < NEAR_TIE and got[n] in top2.indices.tolist(), (
            f"diverges from HF at token {n} without a near-tie (gap {gap}): {got} vs {ref}")
    return n


def hf_greedy_of(prompts, max_new_tokens: int, ignore_eos: bool = False) -> dict[str, list[int]]:
    """hf_greedy of each text prompt on the default model, by prompt."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model("default"))
    return {p: hf_greedy("default", tok(p)["input_ids"], max_new_tokens, ignore_eos=ignore_eos)
            for p in prompts}


def wait_until(cond, what: str, log: list, timeout_s: float = 120.0) -> None:
    """Poll `cond` every 50 ms until true; past `timeout_s`, fail naming `what` with
    the last entries of `log`."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"{what}: {log[-8:]}"
        time.sleep(0.05)


def start_load_then_streams(loops: list, streams: list, log: list, streamed: dict) -> None:
    """Start the `loops` threads (clients looping requests, logging (t0, prompt, ids or
    None, ...)), and once 8 of their requests succeeded the `streams` threads, then
    wait until every stream (tokens in `streamed`, by prompt) has 4 tokens."""
    for t in loops:
        t.start()
    wait_until(lambda: sum(r[2] is not None for r in log) >= 8, "no steady load", log)
    for t in streams:
        t.start()
    wait_until(lambda: all(len(v) >= 4 for v in streamed.values()), "no stream began", log)


def hf_greedy_logprobs(model: str, prompt_ids: list[int], max_new_tokens: int):
    """HF greedy `generate` with each step's raw logits: (tokens, log_softmax [n, vocab]),
    computed once per session for each (model, prompt, length)."""
    tokens, logprobs = _hf_greedy_logprobs(model, tuple(prompt_ids), max_new_tokens)
    return list(tokens), logprobs.clone()


@functools.cache
def _hf_greedy_logprobs(model: str, prompt_ids: tuple[int, ...], max_new_tokens: int):
    hf = _hf_model(str(resolve_model(model)))
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens,
                          do_sample=False, pad_token_id=hf.config.eos_token_id,
                          output_logits=True, return_dict_in_generate=True)
    logprobs = torch.log_softmax(torch.cat(out.logits).float(), dim=-1)
    return out.sequences[0, len(prompt_ids):].tolist(), logprobs


def hf_logprobs_of(model: str, prompt_ids: list[int], tokens: list[int]) -> torch.Tensor:
    """HF's log_softmax [len(tokens), vocab] of the raw logits that give each of `tokens`,
    one forward over prompt + tokens (teacher forcing: whatever chose them)."""
    hf = _hf_model(str(resolve_model(model)))
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt_ids + tokens[:-1]])).logits[0, len(prompt_ids) - 1:]
    return torch.log_softmax(logits.float(), dim=-1)
