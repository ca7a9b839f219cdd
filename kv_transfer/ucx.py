"""UCX transport (ucxx, or the older ucx-py): same frames (``frames.py``) and receiver
state machine (``reservations.py``) as TCP, moved by UCX tag messages, so the bytes go
over whatever UCX finds between the two workers (shared memory / CMA on one node,
cuda_ipc or RDMA verbs where present, TCP otherwise). CUDA caches are sent from and
received into device memory; nothing in this package copies them to host.

Two endpoints per P -> D connection::

    P (UcxKVSender)                                 D (UcxKVReceiver)
    ctl = create_endpoint(host, port) -----------> listener (tcp; error handling on)
                <--  CHALLENGE nonce_d
      HANDSHAKE      {layout, epoch, nonce_p, auth,
                      ucx: {worker_address(P)}}  -->
                <--  HANDSHAKE_ACK {layout, epoch, error, auth,
                                    ucx: {worker_address(D), data_tag, slot_bytes}}
                     (auth: HMAC proofs of the cluster secret, auth.py; a
                     wrong one is refused before any data endpoint exists)
    data = endpoint to worker_address(D)            data = endpoint to worker_address(P)
           (error handling off: shm / cma / cuda_ipc)
      [header][K l0][V l0][K l1]...  --data_tag-->  headers: receives kept posted;
      [header] (DONE)                               payload: received straight into the
                                                    blocks (or a staging slot) without
                                                    waiting before the next header
      [EOS] on close()                              ctl broken: drain the data endpoint
                                                    (<= DRAIN_S), then fail that
                                                    connection's unfinished requests

Every message after the handshake travels on the data endpoint: headers under the
connection's ``data_tag`` (even, chosen by D), payload messages under ``data_tag + 1``,
so D can keep header receives posted and still place each payload where it belongs. A
header message is always ``ucx_wire.HEADER_MSG_BYTES`` long (56-byte header, request id,
zero padding). A KV payload follows as messages of whole blocks of one layer's K or V, at
most D's ``slot_bytes`` each, in the order ``ucx_wire.payload_chunks`` gives: their
concatenation is the TCP payload, and each is a plain region of the sender's cache when
its blocks form one run (no gather). An ABORT reason is one message. Senders keep up to
32 frames in flight and D as many payload receives (``ucx_sender`` and ``ucx_receiver``
say why). The control endpoint carries only the handshake, and tells each side through
UCX's error handling that the peer went away. No CRC32C over UCX (it would need a device
-> host copy): such frames are refused.

Why two endpoints: an endpoint created through a listener always has peer error handling
on (ucxx's listener offers no switch, and both ends must agree), and UCX then leaves out
every transport without peer-failure support -- sysv, posix and cma among them
(measured on this project's 2-core VM: 0.6-1.1 GB/s over tcp/lo that way, against
7-9 GB/s over sysv/cma on a worker-address endpoint; the full table of settings, lanes
and GB/s is in docs/ucx.md). The defaults below are thread progress with Python futures
(blocking/polling are ~10% faster but an idle pair then burns a whole core); UCX_TLS is
left alone, since UCX's own choice already takes shared memory here and pinning it would
hide RDMA and cuda_ipc where they exist.

One event loop per process: with Python futures, ucxx binds its request notifier -- and
every future it hands out -- to the event loop that created its one process-wide context
("Future attached to a different loop" from any other loop). So all UCX transports of a
process share one :class:`UcxRuntime`: a daemon thread running the loop on which the
context is created, reference-counted by the senders and receivers (and the raw
benchmark) using it; the last ``close()`` resets UCX and stops the thread. Blocking
transport calls are bridged with ``run_coroutine_threadsafe(...).result(timeout)``.
ucxx must not have been initialised in this process on another loop before.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import traceback
from typing import Any, Awaitable, TypeVar

from .base import KVTransferError


def ucx_env_defaults() -> dict[str, str]:
    """UCX / ucxx environment settings this transport recommends (see the measurements in
    the module docstring). Applied with ``os.environ.setdefault``: explicit env wins."""
    return {
        "UCXPY_PROGRESS_MODE": "thread",  # fast, and cheap when idle (with futures)
        "UCXPY_ENABLE_PYTHON_FUTURE": "1",  # requests complete futures, no spin-wait
        # ucxx sets UCX_MEMTYPE_CACHE, which UCX >= 1.19 no longer knows, so every
        # context creation would warn about it on stderr.
        "UCX_WARN_UNUSED_ENV_VARS": "n",
    }


def apply_ucx_env_defaults() -> None:
    for name, value in ucx_env_defaults().items():
        os.environ.setdefault(name, value)


apply_ucx_env_defaults()  # before the first import of ucxx: it reads some at import

try:
    import ucxx as ucx
except ImportError:
    try:
        import ucp as ucx  # ucx-py, ucxx's predecessor: same asyncio API
    except ImportError:
        raise ImportError(
            "the ucx KV transport needs ucxx (or ucx-py); install it with "
            "pip install 'pdserve[ucx]', or choose the tcp transport"
        ) from None

logger = logging.getLogger(__name__)

UCX_ERRORS: tuple[type[BaseException], ...] = (
    getattr(ucx.exceptions, "UCXBaseException", ucx.exceptions.UCXError),
)
UCX_TRUNCATED = ucx.exceptions.UCXMsgTruncated  # both libraries spell it so
# ucxx's abort() waits up to `period` ns for the close to complete (default 10 s, which
# would stall the loop on a peer that died); ucx-py's abort() takes no arguments.
_ABORT_KW = {"period": 10**9} if ucx.__name__ == "ucxx" else {}
THREAD_PREFIX = "kvucx"  # the runtime's loop thread: kvucx-loop
# After the control endpoint breaks, how long a receiver keeps reading frames that were
# already delivered on the data endpoint (a sender's last frames race its hang-up).
DRAIN_S = 1.0
# Slack on top of a coroutine's own deadline before the calling thread gives up on it.
CALL_SLACK_S = 5.0

T = TypeVar("T")


class UcxRuntime:
    """The process's UCX event loop thread and context; see the module docstring.
    Get it with :func:`acquire_runtime`, hand it back with :func:`release_runtime`."""

    def __init__(self) -> None:
        self.users = 0
        self._parked: list[Any] = []  # closed listeners, destroyed at shutdown
        self._populate_futures: Any = None  # bound to the worker: dropped at shutdown
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._run, name=f"{THREAD_PREFIX}-loop", daemon=True
        )
        self._thread.start()
        # Creating the context inside the loop binds ucxx's notifier to this loop (and,
        # created from a daemon thread, the notifier thread is a daemon too).
        try:
            self.worker_address: bytes = self.call(self._init(), 30.0)
        except BaseException:
            self._stop_loop()
            raise

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    async def _init(self) -> bytes:
        address = bytes(ucx.get_worker_address())
        worker = getattr(getattr(ucx.core, "_ctx", None), "worker", None)
        if getattr(worker, "enable_python_future", False):
            self._populate_futures = getattr(worker, "populate_python_futures_pool", None)
        return address

    def refill_futures(self) -> None:
        """Top up ucxx's pool of Python futures (on the loop, right before posting a
        request: tag_send / tag_recv do). Each request takes one from a pool of 100 that
        ucxx's notifier thread tops up only when it wakes; posting dozens of requests in
        between drains it, and ucxx then refills inline with a warning on stderr. A
        no-op while the pool holds 50 or more; nothing to do for ucx-py."""
        if self._populate_futures is not None:
            self._populate_futures()

    def call(self, coro: Awaitable[T], timeout_s: float) -> T:
        """Run ``coro`` on the loop and wait at most ``timeout_s`` for it. KVTransferError
        (or the KVTransferError subclass the coroutine raised) on failure."""
        return self.result(self.submit(coro), timeout_s)

    def submit(self, coro: Awaitable[T]) -> concurrent.futures.Future:
        """Start ``coro`` on the loop; collect it with :meth:`result`."""
        if threading.current_thread() is self._thread:
            coro.close()  # type: ignore[attr-defined]
            raise RuntimeError(
                "blocking UCX transport call made on the UCX loop thread (e.g. from "
                "on_complete); hand it to another thread"
            )
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    @staticmethod
    def result(fut: concurrent.futures.Future, timeout_s: float) -> Any:
        """``fut``'s result within ``timeout_s``; KVTransferError (or the subclass the
        coroutine raised) on failure or timeout."""
        try:
            return fut.result(timeout_s)
        except concurrent.futures.TimeoutError:
            fut.cancel()  # its finally blocks close the endpoints it used
            kind, args = KVTransferError, (f"UCX operation did not finish in {timeout_s:.1f}s",)
        except KVTransferError as e:
            # Re-raised fresh, outside the except: the original's traceback holds loop
            # frames that reference UCX endpoints, which would block ucx.reset().
            kind, args = type(e), e.args
        raise kind(*args)

    def park_listener(self, listener: Any) -> None:
        """Take a listener its owner is done with; it is destroyed at shutdown, once UCX
        no longer progresses. (Destroying a ucxx listener while a connection request is
        in flight -- or while an endpoint it accepted lives on -- frees the Python data
        its C++ callback still uses: a crash on the next connection. Until shutdown the
        port keeps accepting, and the owner's callback drops what comes in.)"""
        self._parked.append(listener)

    def shutdown(self) -> None:
        """Reset UCX and stop the loop thread."""
        self._populate_futures = None  # holds the worker, which must go before reset()
        worker = getattr(getattr(ucx.core, "_ctx", None), "worker", None)
        stop_notifier = (  # only ucxx with Python futures has a notifier thread
            getattr(worker, "stop_request_notifier_thread", None)
            if getattr(worker, "enable_python_future", False)
            else None
        )
        stop_progress = getattr(worker, "stop_progress_thread", None)
        del worker
        if stop_notifier is not None:
            stop_notifier()  # wakes ucxx's notifier thread now, not after its 1 s poll
            ucx.stop_notifier_thread()
            # Again: a notifier that woke between waits has flipped itself back to
            # "running", and the worker's destructor would warn about it.
            stop_notifier()
        if stop_progress is not None:
            stop_progress()  # no more listener callbacks from here on
        del stop_notifier, stop_progress
        for listener in self._parked:
            listener.close()
        self._parked.clear()
        try:
            ucx.reset()
        except UCX_ERRORS as e:
            # reset() has dropped the context all the same (the next one starts fresh);
            # what still references the old one leaks, with its UCX progress thread.
            logger.warning("UCX context leaked at shutdown: %s", e)
        self._stop_loop()

    def _stop_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10.0)
        if self._thread.is_alive():
            logger.warning("UCX loop thread did not stop in 10 s")
            return
        self.loop.close()
        # ucxx's progress task hangs itself on loop.close and holds the UCX worker: drop
        # the loop so the worker is destroyed now, not at interpreter exit.
        self.loop = None  # type: ignore[assignment]


_runtime_lock = threading.Lock()
_runtime: UcxRuntime | None = None


def acquire_runtime() -> UcxRuntime:
    """The process's UCX runtime, started on first use; pair with release_runtime()."""
    global _runtime
    with _runtime_lock:
        if _runtime is None:
            _runtime = UcxRuntime()
        _runtime.users += 1
        return _runtime


def release_runtime(rt: UcxRuntime) -> None:
    """Drop one use; the last one resets UCX and stops the loop thread."""
    global _runtime
    with _runtime_lock:
        assert rt is _runtime and rt.users > 0, "release_runtime without acquire_runtime"
        rt.users -= 1
        if rt.users == 0:
            _runtime = None
            rt.shutdown()


# ---- helpers shared by the sender, the receiver and the raw benchmark ---------------


async def guarded(coro: Awaitable[T], what: str, timeout_s: float | None) -> T:
    """Await ``coro`` within ``timeout_s`` (None: no deadline); UCX errors and timeouts
    become KVTransferError naming ``what``."""
    try:
        return await (coro if timeout_s is None else asyncio.wait_for(coro, timeout_s))
    except asyncio.TimeoutError as e:
        msg = f"{what}: timed out after {timeout_s:.1f}s"
        _clear_frames(e)
    except UCX_ERRORS as e:
        msg = f"{what}: {type(e).__name__}: {e}"
        _clear_frames(e)
    raise KVTransferError(msg)  # outside the except: no reference to UCX's traceback


def _clear_frames(exc: BaseException) -> None:
    """Drop the locals of the finished frames in ``exc``'s tracebacks (and its context's).

    A failed ucxx create_endpoint leaves its half-made endpoint in a reference cycle that
    runs through C++ (endpoint -> request -> future -> exception -> traceback -> frame ->
    endpoint), which the garbage collector cannot break and which keeps the UCX context
    alive, so ucx.reset() would refuse. Clearing the frames breaks the cycle."""
    todo, seen = [exc], set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        todo += [e.__context__, e.__cause__]


async def endpoint_to_worker(address: bytes) -> Any:
    """Endpoint to a peer's worker address, without peer error handling (the only way
    UCX picks shared memory, CMA or cuda_ipc; see the module docstring)."""
    return await ucx.create_endpoint_from_worker_address(
        ucx.get_ucx_address_from_buffer(address), endpoint_error_handling=False
    )


def _refill_futures() -> None:
    rt = _runtime
    if rt is not None:
        rt.refill_futures()


async def tag_send(ep: Any, buf: Any, tag: int) -> None:
    """Send ``buf`` under ``tag`` exactly (no per-endpoint tag hashing)."""
    # Checked in the same loop step that submits the send: an endpoint aborted by a
    # watcher since the caller looked would otherwise fail inside ucxx (AttributeError).
    if ep is None or ep.closed:
        raise KVTransferError("UCX endpoint closed")
    _refill_futures()
    await ep.send(buf, tag=tag, force_tag=True)


async def tag_recv(ep: Any, buf: Any, tag: int) -> None:
    """Receive the next message sent under ``tag`` into ``buf``."""
    if ep is None or ep.closed:
        raise KVTransferError("UCX endpoint closed")
    _refill_futures()
    await ep.recv(buf, tag=tag, force_tag=True)


def abort_endpoint(ep: Any) -> None:
    """Close ``ep`` at once, cancelling its requests in flight (after which the buffers
    they used may be freed)."""
    if ep is not None:
        try:
            ep.abort(**_ABORT_KW)
        except UCX_ERRORS as e:
            logger.debug("aborting UCX endpoint: %s", e)


def __getattr__(name: str) -> Any:
    # The transport classes live in their own modules, which import this one; resolving
    # them lazily keeps either import order free of cycles.
    if name == "UcxKVSender":
        from .ucx_sender import UcxKVSender

        return UcxKVSender
    if name == "UcxKVReceiver":
        from .ucx_receiver import UcxKVReceiver

        return UcxKVReceiver
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "THREAD_PREFIX",
    "UcxKVReceiver",
    "UcxKVSender",
    "UcxRuntime",
    "acquire_runtime",
    "apply_ucx_env_defaults",
    "release_runtime",
    "ucx_env_defaults",
]
