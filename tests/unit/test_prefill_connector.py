"""The prefill worker's KV connector (prefill_worker/connector.py) over a real TCP
sender and receiver in one process: the step loop's hand-offs go out in order, and a
request is listed by get_finished() only once its transfer ended (DONE sent, ABORT
sent, or the transfer failed), with the first token or the reason."""

import threading
import time

import pytest
import torch

from pdserve.engine.sampling_params import SamplingParams
from pdserve.kv_transfer import KVLayout, make_receiver, make_sender
from pdserve.prefill_worker.connector import PrefillKVConnector
from pdserve.prefill_worker.requests import FinishCause, PrefillRequest, fail

LAYERS, EPOCH = 3, 4


def cache(num_blocks, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAYERS, 2, num_blocks, 2, 4, 8, generator=g)


@pytest.fixture
def link():
    src, dst = cache(8, 1), cache(8, 2)
    rx = make_receiver("tcp", dst, KVLayout.for_cache(dst, "m"), EPOCH)
    addr = rx.start()
    wake = threading.Event()
    conn = PrefillKVConnector(make_sender("tcp", src, KVLayout.for_cache(src, "m")), LAYERS,
                              wake.set, on_done=lambda req, tok: conn.answered.append(
                                  (req.request_id, tok)))
    conn.answered = []          # on_done: the first token goes out at DONE
    yield src, dst, rx, addr, conn, wake
    conn.close()
    rx.close()


def request(rid, addr, block_table, num_cached_blocks=0):
    r = PrefillRequest(rid, [1] * 4 * len(block_table), SamplingParams(), addr, EPOCH,
                       num_cached_blocks=num_cached_blocks)
    r.block_table = block_table
    return r


def poll(conn, wake, n):
    """What get_finished() lists until n requests are in (woken by notify)."""
    out = []
    while len(out) < n:
        assert wake.wait(10), f"only {len(out)} of {n} finished"
        wake.clear()
        out += conn.get_finished()
    return out


def completions(rx):
    """D's completions, waiting for the first (the receiver's threads judge DONE)."""
    deadline = time.monotonic() + 10
    while not (c := rx.get_finished().completions):
        assert time.monotonic() < deadline, "D reported nothing"
        time.sleep(0.01)
    return [(x.request_id, x.ok, x.first_token, x.error) for x in c]


def test_layers_then_done_and_only_then_finished(link):
    src, dst, rx, addr, conn, wake = link
    rx.expect("a", [6, 2])                     # D holds block 0 of the prompt cached
    a = request("a", addr, [3, 4, 5], num_cached_blocks=1)
    for layer in range(LAYERS):
        conn.save_layers(a, layer, layer + 1, 1, 3)
    assert conn.get_finished() == []           # no DONE yet: P keeps the blocks
    conn.request_finished(a, 17)
    assert poll(conn, wake, 1) == [a]
    assert a.finish is None and conn.answered == [("a", 17)]
    assert completions(rx) == [("a", True, 17, None)]
    assert torch.equal(dst[:, :, [6, 2]], src[:, :, [4, 5]])
    assert conn.kv_bytes_sent == KVLayout.for_cache(src, "m").payload_bytes(LAYERS, 2)


def test_an_aborted_request_sends_abort_and_finishes_without_a_token(link):
    _, _, rx, addr, conn, wake = link
    rx.expect("b", [1])
    b = request("b", addr, [0])
    conn.save_layers(b, 0, 1, 0, 1)
    fail(b, FinishCause.ABORTED, "request b aborted")
    conn.save_layers(b, 1, 2, 0, 1)            # skipped: the request is aborted
    conn.request_finished(b, None)
    assert poll(conn, wake, 1) == [b]
    assert b.finish.message == "request b aborted" and conn.kv_send_failures == 0
    assert conn.answered == []
    [(rid, ok, _, error)] = completions(rx)
    assert (rid, ok) == ("b", False) and "aborted by prefill worker" in error


def test_a_failed_transfer_fails_that_request_only(link):
    src, dst, rx, addr, conn, wake = link
    dead = request("dead", ("127.0.0.1", 9), [0])    # nothing listens there
    conn.save_layers(dead, 0, 1, 0, 1)
    conn.request_finished(dead, 5)
    rx.expect("ok", [3])
    ok = request("ok", addr, [1])
    for layer in range(LAYERS):
        conn.save_layers(ok, layer, layer + 1, 0, 1)
    conn.request_finished(ok, 6)
    finished = {r.request_id: r for r in poll(conn, wake, 2)}
    assert "KV transfer to 127.0.0.1:9 failed" in finished["dead"].finish.message
    assert finished["ok"] is ok and ok.finish is None
    assert conn.kv_send_failures == 1 and conn.answered == [("ok", 6)]
