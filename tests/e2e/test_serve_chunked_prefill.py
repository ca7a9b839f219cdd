"""Chunked prefill through the real server: a short prompt sent while a 2k-token prompt
is being prefilled (4 chunks of 512) gets its first token before the long one does; both get HF's tokens
(the long one's KV reached D chunk by chunk)."""

from __future__ import annotations

import threading
import time

import pytest
import ray
from serving import Served, hf_greedy, start_ray

from pdserve.client import make_request

pytestmark = pytest.mark.slow


def test_short_prompt_is_not_stuck_behind_a_long_one():
    start_ray()
    # no local prefill on D: the short prompt must go through the prefill worker too
    # the long prompt's prefill takes ~20 s on an AVX2-only 2-core box (no AVX-512 for
    # the C++ kernels), ~60 s at 4096 tokens: D's reservation waits up to 300 s for it
    served = Served(prefill_blocks=160, decode_blocks=160, local_prefill_max_tokens=0,
                    router_kw={"max_prefill_queue_tokens": 0},   # nor when P is backed up
                    decode_kw={"lease_s": 300.0})
    try:
        long = [1000 + (i * 37) % 20000 for i in range(2048)]
        short = [17 + i for i in range(40)]
        first_token_at, long_got = {}, []

        def run(name, prompt):
            for msg in served.client.stream(make_request(prompt, max_tokens=4, temperature=0)):
                if msg.token_ids and name not in first_token_at:
                    first_token_at[name] = time.monotonic()
                long_got.extend(msg.token_ids)

        t = threading.Thread(target=run, args=("long", long))
        t.start()
        time.sleep(1.0)                     # the long prompt's first chunks are running
        got = served.generate(short, max_tokens=6, temperature=0)
        short_done = time.monotonic()
        t.join(120)
        assert "long" in first_token_at, "long request did not finish"
        assert short_done < first_token_at["long"], (
            f"short finished {short_done - first_token_at['long']:+.1f}s after the long "
            "one's first token")
        assert got[0] == hf_greedy("default", short, 6)
        assert long_got == hf_greedy("default", long, 4)
        [p] = served.cluster.prefill
        s = ray.get(p.status.remote())
        assert s.prefill_tokens_computed == len(long) + len(short)
    finally:
        served.stop()
