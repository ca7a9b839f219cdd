"""Serving the OpenAI-compatible HTTP API (http_api.build_app) with uvicorn as a task on
the router's event loop: bound to its address before it starts, over TLS (mutual with
tls_client_ca_file) when RouterConfig.tls_cert_file is set, and stopped with a grace
period that lets open requests finish before they are cancelled (and so aborted on the
workers)."""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import time
from contextlib import nullcontext

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .http_api import build_app

logger = logging.getLogger(__name__)

SEND_BUFFER_BYTES = 8 << 10       # the kernel's, per connection (Linux doubles it)
WRITE_BUFFER_BYTES = 8 << 10      # asyncio's, per connection, before writes wait
WRITE_TIMEOUT_MARGIN_S = 5.0      # a connection's write timeout past the stall timeout
KEEP_ALIVE_S = 75.0               # an idle connection's life: longer than clients keep
                                  # theirs (aiohttp 15 s), so a client never sends a request
                                  # on a connection the server is closing (uvicorn's 5 s
                                  # lost one of 36 requests to `vllm bench serve` that way)


class _H11(H11Protocol):
    """uvicorn's h11 protocol with a small write buffer and a write timeout.

    A response waits for the connection once WRITE_BUFFER_BYTES are queued above the
    kernel's SEND_BUFFER_BYTES (asyncio's default is 64 KiB), so a client that reads
    nothing parks its stream after ~20 KiB, ~100 streamed tokens, and StallWatch sees
    it (router/stalls.py); a client that reads keeps the buffers near empty. A
    connection whose writes have waited `write_timeout_s` is aborted: what StallWatch
    does not hold (a whole JSON body written to a client that stopped reading) is not
    kept either. serve_http sets write_timeout_s to the stall timeout plus
    WRITE_TIMEOUT_MARGIN_S, so a parked stream is StallWatch's first."""

    write_timeout_s = 35.0

    def connection_made(self, transport: asyncio.Transport) -> None:
        transport.set_write_buffer_limits(high=WRITE_BUFFER_BYTES)
        self._write_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.write_timeout_s, self._timed_out)

    def resume_writing(self) -> None:
        self._cancel_timer()
        super().resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        super().connection_lost(exc)

    def _cancel_timer(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _timed_out(self) -> None:
        self._write_timer = None
        logger.warning("HTTP connection aborted: its client read nothing for %.0f s",
                       self.write_timeout_s)
        self.transport.abort()       # close() would wait to flush what it cannot


class _Server(uvicorn.Server):
    """uvicorn's Server without its signal handlers: the router's process owns its
    signals (uvicorn would install them if it ran on the main thread)."""

    def capture_signals(self):
        return nullcontext()


class HTTPServer:
    """The HTTP API served by uvicorn as a task on the running event loop."""

    def __init__(self, server, task: asyncio.Task, port: int):
        self._server, self._task, self.port = server, task, port

    async def stop(self, grace_s: float = 2.0) -> None:
        """Stop accepting, give open requests `grace_s` seconds, then cancel them
        (which aborts them on the workers)."""
        self._server.config.timeout_graceful_shutdown = grace_s
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), grace_s + 5)
        except asyncio.TimeoutError:
            self._task.cancel()
            logger.warning("HTTP API did not stop within %.0f s; cancelled", grace_s + 5)


def _bind(host: str, port: int, shared: bool = False) -> socket.socket:
    """A listening socket's, bound; `shared`: with SO_REUSEPORT, so router replicas
    (ClusterConfig.num_routers) bind the same port and the kernel spreads connections
    over them."""
    family, kind, proto, _, addr = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # restart past TIME_WAIT
    if shared:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    # A fixed send buffer (connections inherit it; Linux doubles it): with the kernel's
    # autotuned one (up to tcp_wmem's 4 MiB), a client that reads nothing absorbs a
    # whole 4000-token stream and is never seen to stall (router/stalls.py).
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise RuntimeError(f"could not bind the HTTP API to {host}:{port}: "
                           f"{e.strerror or e}") from e
    return sock


async def serve_http(router, host: str, port: int) -> HTTPServer:
    """Serve build_app(router) on host:port (0: a free port) from the running loop,
    over TLS (mutual with tls_client_ca_file) when router.config.router.tls_cert_file
    is set; returns once it accepts connections.

    Raises:
        RuntimeError: the address could not be bound, or the server failed to start.
        OSError / ssl.SSLError: a tls_* file cannot be read or used.
    """
    rc = router.config.router
    tls = {}
    if rc.tls_cert_file is not None:
        tls = {"ssl_certfile": rc.tls_cert_file, "ssl_keyfile": rc.tls_key_file,
               "ssl_ca_certs": rc.tls_client_ca_file,
               "ssl_cert_reqs": ssl.CERT_REQUIRED if rc.tls_client_ca_file else ssl.CERT_NONE}
    # h11 (pure Python) explicitly: its ASGI spec 2.3 is what makes Starlette watch for
    # disconnects while streaming. log_config=None: the router's logging config rules.
    http = type("_H11", (_H11,), {"write_timeout_s":
                                  rc.stream_stall_timeout_s + WRITE_TIMEOUT_MARGIN_S})
    config = uvicorn.Config(build_app(router), http=http, ws="none", lifespan="off",
                            interface="asgi3", log_config=None, log_level="warning",
                            access_log=False, server_header=False,
                            timeout_keep_alive=KEEP_ALIVE_S,
                            # uvicorn counts the connection asking too: more than this, 503
                            limit_concurrency=rc.max_concurrent_calls + 1,
                            **tls)
    config.load()          # builds the TLS context now: a bad file fails `serve` at start
    sock = _bind(host, port, router.config.num_routers > 1)
    server = _Server(config)
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    deadline = time.monotonic() + 30
    while not server.started:
        if task.done() or time.monotonic() > deadline:
            cause = task.exception() if task.done() else None
            task.cancel()
            sock.close()
            raise RuntimeError(f"HTTP API failed to start on {host}:{port}"
                               + (f": {cause!r}" if cause else " within 30 s")) from cause
        await asyncio.sleep(0.01)
    return HTTPServer(server, task, sock.getsockname()[1])
