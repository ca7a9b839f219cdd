"""The prompts of `pdserve bench goodput`'s workloads (pdserve/bench/goodput.py's
docstring): ShareGPT requests drawn per workload, and the slice of them each rate point
sends."""

from __future__ import annotations

import random


def workload(name: str, tokenizer, n: int, seed: int, at_most: bool = False) -> list[dict]:
    """`n` requests {"prompt", "output_tokens", "prompt_tokens"} of workload `name`
    (pdserve/bench/goodput.py's docstring), drawn at random (`seed`); with `at_most`, as many as the data
    holds when that is fewer.

    Raises:
        ValueError: fewer than `n` found (and not `at_most`)."""
    from ..sharegpt import conversations, first_turns

    rng = random.Random(seed)
    pool: list[dict] = []
    if name == "summarize":
        head = "Summarize the conversation below.\n\n"
        for conv in conversations():
            text = "\n".join(f"{t.get('from')}: {t.get('value')}"
                             for t in conv.get("conversations") or [])
            ids = tokenizer(head + text)["input_ids"]
            if len(ids) >= 1000:
                keep = ids[:rng.randint(1000, min(1900, len(ids)))]
                pool.append({"prompt": tokenizer.decode(keep), "output_tokens": rng.randint(64, 128)})
            if len(pool) >= 4 * n:
                break
    else:
        for prompt, reply in first_turns():
            p = len(tokenizer(prompt)["input_ids"])
            if name == "chat":
                out = len(tokenizer(reply)["input_ids"])
                if 4 <= p <= 1024 and out >= 4 and p + out <= 2048:
                    pool.append({"prompt": prompt, "output_tokens": out})
            elif 4 <= p <= 64:
                pool.append({"prompt": prompt, "output_tokens": rng.randint(256, 512)})
            if len(pool) >= 4 * n:
                break
    if at_most:
        n = min(n, len(pool))
    if len(pool) < n or not pool:
        raise ValueError(f"workload {name}: {len(pool)} requests found, {n} asked for")
    out = rng.sample(pool, n)
    for r in out:                     # as the server counts them (no chat template)
        r["prompt_tokens"] = len(tokenizer(r["prompt"])["input_ids"])
    return out


class Prompts:
    """A workload's prompts, a slice of `size` per rate: the first time any arm visits a
    rate, that rate gets the next slice, and every arm and repetition visiting it later
    gets the same one (so arms are compared on the same requests where they meet, and a
    server never sees a prompt twice). Once the pool is spent, slices reuse its prompts
    behind a line naming the slice: its first KV block differs, so no prefix cache
    carries over."""

    def __init__(self, pool: list[dict], size: int, slices: dict | None = None):
        """`slices`: {rate: slice index} given out before (a resumed run's; JSON's
        string keys are read as rates)."""
        self.pool, self.size = pool, size
        self.slices = {float(r): k for r, k in (slices or {}).items()}

    def at(self, rate: float) -> list[dict]:
        k = self.slices.setdefault(rate, len(self.slices))
        out = []
        for i in range(k * self.size, (k + 1) * self.size):
            r = self.pool[i % len(self.pool)]
            out.append(r if i < len(self.pool) else
                       dict(r, prompt=f"(slice {k})\n{r['prompt']}"))
        return out
