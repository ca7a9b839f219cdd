"""The `hf` mode of `pdserve bench serve`: HF transformers `generate` with static
batches, the baseline a user would write without a serving system.

Lifecycle of one run (serial, one `generate` at a time, in the caller's thread):

    t0 ── request i "arrives" at t0 + arrivals[i]
    loop: none arrived and unserved? sleep until the next arrival
          take up to `batch_size` arrived, unserved requests, FIFO by arrival
          left-pad them, generate max(max_tokens of the batch) new tokens
          (min_new_tokens = the same, so EOS never ends a request early: the benchmark
          requests are ignore_eos), timing each decoding step with a streamer
          every request in the batch finishes together; call on_done(len(batch))

A request that arrives while a batch runs waits for the whole batch (no continuous
batching), and a request with fewer `max_tokens` than the batch's longest keeps
generating with it: those extra tokens are wasted and not counted (its token_times stop
at its own max_tokens, so its E2E is when its last wanted token came out, but it holds
its batch slot until the batch ends). Greedy, float32, on CPU, with as many torch
threads as the caller set (nothing here changes them).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from transformers.generation.streamers import BaseStreamer

from ..engine.loader import resolve_model
from .workload import BenchRequest, RequestResult

log = logging.getLogger(__name__)


def load_hf(model: str):
    """The HF transformers model for `model` ("default", a HF directory or a .gguf),
    float32, eval mode, on CPU. Load it before the benchmark clock starts.

    Raises:
        ModelNotFoundError: nothing loadable at `model` (from `resolve_model`).
    """
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(resolve_model(model)),
                                                dtype=torch.float32).eval()


class StepTimer(BaseStreamer):
    """Records `time.perf_counter()` (s) of each decoding step of one `generate`.

    `generate` puts the prompt once, then once per step the batch's new token ids
    ([batch] int64) right after they are sampled (on CPU: transformers' `StopCheck`;
    the deferred variant that streams one step late is used only on "mps").
    """

    def __init__(self) -> None:
        self.step_times: list[float] = []    # perf_counter s, one per new token
        self._seen_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if not self._seen_prompt:
            self._seen_prompt = True
            return
        self.step_times.append(time.perf_counter())

    def end(self) -> None:
        pass


def _pad_token_id(hf_model) -> int:
    """Pad with the model's pad id, else its (first) EOS id: the attention mask hides it."""
    for cfg in (hf_model.generation_config, hf_model.config):
        for key in ("pad_token_id", "eos_token_id"):
            v = getattr(cfg, key, None)
            if isinstance(v, (list, tuple)):
                v = v[0] if v else None
            if v is not None:
                return int(v)
    return 0


def _generate_batch(hf_model, batch: list[BenchRequest], pad_id: int) -> list[float]:
    """Run one static batch; return the perf_counter time (s) of each of its steps."""
    max_new = max(r.max_tokens for r in batch)
    width = max(len(r.prompt_token_ids) for r in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)   # [B, T]
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)     # [B, T]
    for row, r in enumerate(batch):
        n = len(r.prompt_token_ids)
        input_ids[row, width - n:] = torch.tensor(r.prompt_token_ids, dtype=torch.long)
        attention_mask[row, width - n:] = 1
    timer = StepTimer()
    with torch.inference_mode():
        hf_model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=max_new,
                          min_new_tokens=max_new, do_sample=False, pad_token_id=pad_id,
                          streamer=timer)
    assert len(timer.step_times) == max_new, (
        f"generate streamed {len(timer.step_times)} steps, expected max_new_tokens={max_new}")
    return timer.step_times


def run_hf(hf_model, requests: list[BenchRequest], arrivals: list[float],
           batch_size: int = 8, on_done: Callable[[int], None] | None = None,
           ) -> tuple[list[RequestResult], float]:
    """Serve `requests` with static-batched HF `generate`, as the module docstring says.

    Args:
        hf_model: a model from `load_hf` (or any HF causal LM on CPU).
        requests: prompts and their max_tokens (tokens generated per request).
        arrivals: arrival time of each request, s after the run starts (t0).
        batch_size: the most requests per `generate` call.
        on_done: called after each batch with the number of requests it finished.

    Returns:
        (results in the order of `requests`, duration_s): token_times of request i are
        s since t0 + arrivals[i], exactly max_tokens of them; duration_s is s from t0 to
        the last request's last token (0.0 for no requests).

    Raises:
        ValueError: len(arrivals) != len(requests), batch_size < 1, a max_tokens < 1, an
            empty prompt, or a negative arrival time.
    """
    if len(arrivals) != len(requests):
        raise ValueError(f"{len(arrivals)} arrival times for {len(requests)} requests")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    for i, r in enumerate(requests):
        if r.max_tokens < 1 or not r.prompt_token_ids:
            raise ValueError(f"request {i}: needs max_tokens >= 1 and a non-empty prompt, "
                             f"got max_tokens={r.max_tokens}, {len(r.prompt_token_ids)} "
                             "prompt tokens")
    if any(a < 0 for a in arrivals):
        raise ValueError("arrival times must be >= 0 s")
    results = [RequestResult(prompt_tokens=len(r.prompt_token_ids)) for r in requests]
    if not requests:
        return results, 0.0

    pad_id = _pad_token_id(hf_model)
    queue = sorted(range(len(requests)), key=lambda i: arrivals[i])  # FIFO; stable for ties
    last_finish = t0 = time.perf_counter()
    while queue:
        now = time.perf_counter() - t0
        if arrivals[queue[0]] > now:
            time.sleep(arrivals[queue[0]] - now)
            continue
        now = time.perf_counter() - t0
        batch = [i for i in queue[:batch_size] if arrivals[i] <= now]
        queue = queue[len(batch):]
        step_times = _generate_batch(hf_model, [requests[i] for i in batch], pad_id)
        for i in batch:
            arrive = t0 + arrivals[i]
            times = [t - arrive for t in step_times[:requests[i].max_tokens]]
            results[i].token_times, results[i].e2e, results[i].ok = times, times[-1], True
            last_finish = max(last_finish, arrive + times[-1])
        log.debug("hf batch of %d done, %d steps, %d left", len(batch), len(step_times),
                  len(queue))
        if on_done is not None:
            on_done(len(batch))
    return results, last_finish - t0
