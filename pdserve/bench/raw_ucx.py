"""Raw ucxx baseline for `pdserve bench transfer`: the same bytes in the same message
sizes as pdserve's UCX transport, without its framing, handshake or scatter.

It connects the way the transport does (``kv_transfer/ucx.py``): a listener endpoint to
swap worker addresses, then a worker-address endpoint without error handling for the
data (the only one on which UCX uses shared memory / CMA / cuda_ipc), with the same env
defaults and the same one-loop-per-process runtime, so the ratio against the transport
measures pdserve's overhead and not a different UCX path.

The two functions are meant for two processes (multiprocessing "spawn"); the sender may
also run in a process that uses the transport before or after it::

    receiver: listen -> port_queue.put(port) -> recv len(sizes) messages -> 1-byte ack
              -> wait for the sender to hang up -> done_queue.put("ok")
    sender:   connect -> swap addresses -> t0 -> send every size back to back
              -> recv ack -> t1; returns t1 - t0 (delivery included)
"""

from __future__ import annotations

import asyncio
import time

import numpy as np

from pdserve.kv_transfer import ucx as _ucx

TIMEOUT_S = 120.0  # bounds every step of one run
DATA_TAG = 0x5044_4B56_5241_5700  # "PDKVRAW": one connection per receiver process
ACK_TAG = DATA_TAG + 1  # the other direction; a different tag in case both share a worker


async def _swap_addresses(ctl, my_address: bytes, *, listener: bool) -> bytes:
    """Exchange worker addresses over the control endpoint (size, then bytes)."""
    size, peer_size = np.array([len(my_address)], np.uint64), np.zeros(1, np.uint64)
    if listener:
        await ctl.recv(peer_size)
    await ctl.send(size)
    if not listener:
        await ctl.recv(peer_size)
    peer = np.zeros(int(peer_size[0]), np.uint8)
    if listener:
        await ctl.recv(peer)
        await ctl.send(np.frombuffer(my_address, np.uint8))
    else:
        await ctl.send(np.frombuffer(my_address, np.uint8))
        await ctl.recv(peer)
    return peer.tobytes()


def raw_ucx_receiver(port_queue, sizes: list[int], done_queue) -> None:
    """Listen, put the port on ``port_queue``, receive one message per entry of ``sizes``
    (bytes) into consecutive regions of one preallocated buffer, ack with one byte, then put "ok" on
    ``done_queue``."""
    rt = _ucx.acquire_runtime()
    try:
        # Distinct destination bytes, like a real transfer (one reused buffer would stay
        # in CPU cache and flatter the baseline); touched now, so page faults are not timed.
        buf = np.ones(sum(sizes), np.uint8)
        finished: asyncio.Future | None = None
        listener = None
        tasks: set[asyncio.Task] = set()  # the loop holds tasks weakly

        async def serve(ctl) -> None:
            data = None
            try:
                peer = await _swap_addresses(ctl, rt.worker_address, listener=True)
                data = await _ucx.endpoint_to_worker(peer)
                off = 0
                for n in sizes:
                    await data.recv(buf[off : off + n], tag=DATA_TAG, force_tag=True)
                    off += n
                await data.send(np.zeros(1, np.uint8), tag=ACK_TAG, force_tag=True)
                try:  # the sender hangs up once it has the ack
                    await asyncio.wait_for(ctl.recv(np.zeros(1, np.uint8)), TIMEOUT_S)
                except _ucx.UCX_ERRORS:
                    pass
                if not finished.done():
                    finished.set_result(None)
            except BaseException as e:
                if not finished.done():
                    finished.set_exception(RuntimeError(f"raw ucx receiver failed: {e!r}"))
            finally:
                _ucx.abort_endpoint(data)
                _ucx.abort_endpoint(ctl)

        async def start() -> int:
            nonlocal finished, listener
            finished = asyncio.get_running_loop().create_future()
            listener = _ucx.ucx.create_listener(
                lambda ep: tasks.add(asyncio.get_running_loop().create_task(serve(ep))), 0
            )
            return listener.port

        async def wait() -> None:
            try:
                await asyncio.wait_for(finished, TIMEOUT_S)
            finally:
                rt.park_listener(listener)  # destroyed safely when the runtime stops

        port_queue.put(rt.call(start(), TIMEOUT_S))
        rt.call(wait(), TIMEOUT_S + _ucx.CALL_SLACK_S)
        done_queue.put("ok")
    finally:
        _ucx.release_runtime(rt)


def raw_ucx_sender(host: str, port: int, sizes: list[int]) -> float:
    """Connect to a :func:`raw_ucx_receiver`, send one message per entry of ``sizes``
    (consecutive regions of one buffer) back to back and return the seconds from the first send to the receiver's ack."""
    rt = _ucx.acquire_runtime()
    try:
        buf = np.ones(sum(sizes), np.uint8)  # distinct source bytes, as the receiver's

        async def run() -> float:
            ctl = data = None
            try:
                ctl = await _ucx.ucx.create_endpoint(host, port)
                peer = await _swap_addresses(ctl, rt.worker_address, listener=False)
                data = await _ucx.endpoint_to_worker(peer)
                ack = np.zeros(1, np.uint8)
                t0 = time.perf_counter()
                off = 0
                for n in sizes:
                    await data.send(buf[off : off + n], tag=DATA_TAG, force_tag=True)
                    off += n
                await data.recv(ack, tag=ACK_TAG, force_tag=True)
                return time.perf_counter() - t0
            finally:
                _ucx.abort_endpoint(data)
                _ucx.abort_endpoint(ctl)

        timed = _ucx.guarded(run(), "raw ucx sender", TIMEOUT_S)
        return rt.call(timed, TIMEOUT_S + _ucx.CALL_SLACK_S)
    finally:
        _ucx.release_runtime(rt)
