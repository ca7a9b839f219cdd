"""`serve --routers 2`: two router replicas serve the same gRPC port (SO_REUSEPORT).
`kill -9` of the replica that holds pdserve's client's streams, under steady load from
clients that do not resume: requests started 3 s after the kill all succeed (new
connections go to the live replica, then to both once Ray restarted the dead one), the
resuming client's streams complete on the other replica with HF's greedy tokens,
nothing the dead replica held on the workers is left (every pool free), and what the
live replica serves meanwhile is untouched by the restart's abort of the dead one's
requests.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import pytest
import ray
from serving import Served, hf_greedy_of, start_load_then_streams, start_ray, wait_until

from pdserve.client import Client, make_request

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "Tell me about the moon."]
N = 16
LONG = ["Write a long essay about the sea.", "The history of the railway begins"]
N_LONG = 96
FAILOVER_S = 3.0     # from the kill until every request that starts succeeds


def _replica_state(served: Served) -> list[tuple[int, list[str]]]:
    """Per router replica: its pid and the attempt ids it has open."""
    return ray.get([r.__ray_call__.remote(lambda self: (os.getpid(), list(self.streams._samples)))
                    for r in served.cluster.routers], timeout=60)


def test_a_killed_replica_costs_nothing_but_its_own_connections():
    expect = hf_greedy_of(PROMPTS, N)
    expect_long = hf_greedy_of(LONG, N_LONG, ignore_eos=True)
    start_ray()
    served = Served(prefill_workers=1, decode_workers=1, threads_per_worker=1, num_routers=2)
    try:
        log: list[tuple[float, str, list[int] | None, grpc.StatusCode | None]] = []
        stop = threading.Event()
        resumed: dict[str, list] = {p: [] for p in LONG}
        finals: dict[str, object] = {}

        def loop(prompt: str) -> None:     # clients that do not resume, a channel each
            plain = Client(served.address, timeout_s=120, resume_timeout_s=0)
            try:
                while not stop.is_set():
                    t0 = time.monotonic()
                    try:
                        ids, _, _ = plain.generate(make_request(prompt, max_tokens=N,
                                                                temperature=0))
                        log.append((t0, prompt, ids, None))
                    except grpc.RpcError as e:
                        log.append((t0, prompt, None, e.code()))
                        time.sleep(0.05)
            finally:
                plain.close()

        def wait(cond, what: str, timeout_s: float = 120.0) -> None:
            wait_until(cond, what, log, timeout_s)

        def long_stream(i: int, prompt: str) -> None:    # pdserve's client: resumes
            req = make_request(prompt, request_id=f"long-{i}", max_tokens=N_LONG,
                               temperature=0, ignore_eos=True)
            for msg in served.client.stream(req):
                resumed[prompt] += msg.token_ids
                if msg.finish_reason:
                    finals[prompt] = msg

        threads = [threading.Thread(target=loop, args=(p,)) for p in PROMPTS * 2]
        streams = [threading.Thread(target=long_stream, args=(i, p)) for i, p in enumerate(LONG)]
        try:
            start_load_then_streams(threads, streams, log, resumed)
            state = _replica_state(served)
            holder = [pid for pid, ids in state if any(i.startswith("long-") for i in ids)]
            assert len(holder) == 1, state          # one client: one connection, one replica
            assert all(len(v) < N_LONG for v in resumed.values()), "ended before the kill"
            killed_at = time.monotonic()
            os.kill(holder[0], signal.SIGKILL)      # this test's router replica, by its pid
            wait(lambda: sum(r[2] is not None and r[0] > killed_at + FAILOVER_S
                             for r in log) >= 12, "no request succeeded after the kill")
            wait(lambda: len(finals) == len(LONG), "a resumed stream did not finish")
        finally:
            stop.set()
            for t in threads + streams:
                t.join(120)
        assert not any(t.is_alive() for t in threads + streams), "a client hung"
        for prompt in LONG:            # nothing lost, nothing repeated
            assert resumed[prompt] == expect_long[prompt], prompt
            assert finals[prompt].finish_reason == "length"
            assert finals[prompt].usage.completion_tokens == N_LONG
        late = [r for r in log if r[0] > killed_at + FAILOVER_S]
        assert all(r[3] is None for r in late), [r for r in late if r[3] is not None]
        failed = {r[3] for r in log if r[3] is not None}
        assert failed <= {grpc.StatusCode.UNAVAILABLE}, failed
        for _, prompt, ids, _ in (r for r in log if r[3] is None):
            assert ids == expect[prompt], prompt
        def restarted() -> bool:
            try:
                return all(pid != holder[0] for pid, _ in _replica_state(served))
            except ray.exceptions.RayActorError:      # still restarting
                return False

        wait(restarted, "the killed replica was not restarted")
        served.assert_all_free(timeout_s=30)
    finally:
        served.stop()
