"""OpenAI-compatible HTTP API of the router (FastAPI on uvicorn), served beside gRPC on
the router's event loop and on the same request path: every completion goes through
service.metered_generate -> Router.generate, so validation, admission control,
retries, deadlines, aborts and metrics are gRPC's.

    POST /v1/completions        prompt (text or token ids)  -> text_completion
    POST /v1/chat/completions   messages (chat template)    -> chat.completion
    GET  /v1/models             the served model
    GET  /health                200 when a prefill and a decode worker are available

One request:

    _Gate (api key -> 401; body over max_request_bytes -> 413)
      -> pydantic body (-> 400) -> openai_protocol.to_request (-> 400)
      -> wait for the router's first message (errors -> 400/429/503/504/500)
      -> JSON, or SSE: `data: {chunk}` per message, `data: [DONE]`; an error after the
         first event is sent as `data: {"error": ...}` and the stream ends

Headers wait for the first token, so an SSE client also gets a status code for every
error admission or routing can raise. A client that goes away at any point closes the
router's generator, whose `finally` aborts the request on P and D: while waiting, the
disconnect is watched here; while streaming, Starlette cancels the response (ASGI
spec 2.3 as uvicorn's h11 protocol speaks it) and _EventStream closes the generator.

Errors are OpenAI's error object: 400/401/404/413 type "invalid_request_error" (401
code "invalid_api_key"), 429 "rate_limit_error" (code "rate_limit_exceeded"), 5xx
"server_error" with the gRPC status name as code.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import suppress
from typing import TypeVar

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import tracing
from ..engine.sampling_params import InvalidRequestError
from ..proto import pdserve_pb2 as pb
from . import openai_protocol as oai
from . import openai_responses as oair
from .errors import RequestError
from .security import UNAUTHENTICATED_MESSAGE, bearer_matches
from .service import metered_generate

logger = logging.getLogger(__name__)

T = TypeVar("T")

HEALTH_PATH = "/health"       # probes carry no key (as grpc.health.v1 on gRPC)
HTTP_STATUS = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.UNAUTHENTICATED: 401,
               grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.UNAVAILABLE: 503,
               grpc.StatusCode.DEADLINE_EXCEEDED: 504}


def http_status(code: grpc.StatusCode) -> int:
    """The HTTP status a router RequestError with gRPC status `code` is answered with."""
    return HTTP_STATUS.get(code, 500)


def error_response(status: int, message: str, param: str | None = None,
                   code: str | None = None, headers: dict | None = None) -> JSONResponse:
    """An OpenAI error body with its status; the type follows from the status."""
    type_ = ("invalid_request_error" if status < 429 else
             "rate_limit_error" if status == 429 else "server_error")
    if status == 429 and code is None:
        code = "rate_limit_exceeded"
    return JSONResponse(oair.error_body(message, type_, param, code), status, headers=headers)


def _error(e: InvalidRequestError | RequestError, body) -> JSONResponse:
    """The response for an error the request path raised: InvalidRequestError names the
    OpenAI parameter (param, and first in the message); a RequestError's gRPC status
    gives the HTTP one."""
    if isinstance(e, InvalidRequestError):
        param = oai.openai_param(e.field, body)
        text = str(e).removeprefix(f"{e.field}: ")
        return error_response(400, f"{param}: {text}" if param else text, param)
    status = http_status(e.code)
    return error_response(status, str(e), code=None if status == 429 else e.code.name.lower())


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() \
        + b"\n\n"


class _ClientGone(Exception):
    """The HTTP client disconnected before its response began."""


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (uvicorn sends http.disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_gone(request: Request, aw: Awaitable[T]) -> T:
    """`aw`'s result; if the client disconnects first, `aw` is cancelled (and awaited,
    so the router's finally has run) and _ClientGone raised."""
    work = asyncio.ensure_future(aw)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
            with suppress(asyncio.CancelledError):
                await work
    if work.cancelled():
        raise _ClientGone
    return work.result()


async def _first(stream: AsyncIterator[pb.GenerateResponse]) -> pb.GenerateResponse:
    try:
        return await anext(stream)
    except StopAsyncIteration:   # the router always ends with a finishing message
        raise RequestError(grpc.StatusCode.INTERNAL, "router stream ended empty") from None


class _Sample:
    """One sample's messages, gathered (non-streamed responses)."""

    def __init__(self):
        self.text, self.logprobs, self.last = [], [], None


async def _collect(stream: AsyncIterator[pb.GenerateResponse]) -> list[_Sample]:
    """Every sample's whole text, last (finishing) message, and every token's logprobs
    (the prompt's first, when they came), by GenerateResponse.index."""
    samples: dict[int, _Sample] = {}
    async for msg in stream:
        one = samples.setdefault(msg.index, _Sample())
        one.text.append(msg.text)
        one.logprobs += [*msg.prompt_logprobs, *msg.logprobs]
        one.last = msg
    if not samples or any(not x.last.finish_reason for x in samples.values()):
        raise RequestError(grpc.StatusCode.INTERNAL, "router stream ended unfinished")
    return [samples[i] for i in sorted(samples)]


class _EventStream(StreamingResponse):
    """An SSE response that closes its events and the router's stream when it ends.
    Starlette cancels the sending task when the client disconnects: that leaves the
    events suspended at a `yield`, or never started (then their own `finally` never
    runs); closing both runs the router's `finally` at once, not at garbage collection."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], stream, **kw):
        super().__init__(events, **kw)
        self.stream = stream

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            await self.stream.aclose()


async def _events(first: pb.GenerateResponse, stream: AsyncIterator[pb.GenerateResponse],
                  writer: oair.ChunkWriter, body) -> AsyncIterator[bytes]:
    try:
        for chunk in writer.chunks(first):
            yield _sse(chunk)
        async for msg in stream:
            for chunk in writer.chunks(msg):
                yield _sse(chunk)
        yield b"data: [DONE]\n\n"
    except (InvalidRequestError, RequestError) as e:   # after the status was sent: an event
        yield b"data: " + _error(e, body).body + b"\n\n"
    except Exception:
        logger.exception("stream %s failed", writer.head["id"])
        yield _sse(oair.error_body("internal error", "server_error", code="internal"))
    finally:
        await stream.aclose()


async def _complete(router, request: Request, body, chat: bool) -> Response:
    """Serve one completion (chat or not, streamed or not) through the router."""
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    tracing.set_log_request(rid)     # before the tasks that serve it start (they copy it)
    created, model = int(time.time()), router.model_name
    tokenizer = getattr(router, "tokenizer", None)   # decodes an echoed token-id prompt
    # No client deadline over HTTP: the router bounds it with request_timeout_s.
    salt_from_user = router.config.router.cache_salt_from_user
    stream = metered_generate(router, lambda: oai.to_request(body, rid, salt_from_user), None,
                              tracing.trace_headers(request.headers.items()))
    try:
        if body.stream:
            first = await _unless_gone(request, _first(stream))
        else:
            samples = await _unless_gone(request, _collect(stream))
    except (InvalidRequestError, RequestError) as e:
        response = _error(e, body)
    except _ClientGone:
        response = Response(status_code=499)   # nobody reads it (nginx's "client closed")
    else:
        if body.stream:     # the stream goes on in the response, which closes it
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            writer = oair.ChunkWriter(rid, created, model, chat, include_usage,
                                     oai.wants_logprobs(body), oai.echo_text(body, tokenizer),
                                     n=body.n or 1)
            return _EventStream(_events(first, stream, writer, body), stream,
                                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        make = oair.chat_completion if chat else oair.completion
        echo = oai.echo_text(body, tokenizer) or ""
        choices = [oair.Choice(echo + "".join(x.text), x.last.finish_reason,
                               oair.logprobs_body(x.logprobs, chat)
                               if oai.wants_logprobs(body) else None) for x in samples]
        u = oair.usage(samples[0].last.usage.prompt_tokens,
                       sum(x.last.usage.completion_tokens for x in samples))
        response = JSONResponse(make(rid, created, model, choices, u))
    await stream.aclose()
    return response


def _param_path(loc) -> str | None:
    """pydantic's error location as OpenAI names a parameter: messages[0].content."""
    out = ""
    for x in loc:
        out += f"[{x}]" if isinstance(x, int) else (f".{x}" if out else str(x))
    return out or None


def build_app(router) -> FastAPI:
    """The FastAPI app serving the OpenAI-compatible API through `router` (a Router, or
    anything with its model_name, config, metrics, heap_trim, prefill, decode and
    generate()).
    Security and limits come from router.config.router: api_key (every path but
    /health needs `Authorization: Bearer <key>`, or the admin key, else 401) and
    max_request_bytes
    (a larger body gets 413). Errors raised on the request path become OpenAI error
    bodies (see the module docstring); the app itself raises none."""
    rc = router.config.router
    app = FastAPI(title="pdserve", openapi_url=None, docs_url=None, redoc_url=None)
    app.add_middleware(_Gate, api_key=rc.api_key, admin_api_key=rc.admin_api_key,
                       max_request_bytes=rc.max_request_bytes,
                       on_request_end=router.heap_trim.ended,
                       write_timeout_s=rc.stream_stall_timeout_s,
                       on_write_timeout=router.metrics.stalled.inc)
    started = int(time.time())

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0]
        if err["type"] == "json_invalid":
            return error_response(400, f"the body is not valid JSON: "
                                       f"{err.get('ctx', {}).get('error', err['msg'])}")
        param = _param_path([x for x in err["loc"] if x != "body"][:8])
        if param is None and err["type"] in ("model_attributes_type", "dict_type"):
            return error_response(400, "the body must be a JSON object (Content-Type: "
                                       "application/json)")
        text = ("unrecognized request argument (pdserve does not serve it)"
                if err["type"] == "extra_forbidden" else
                "required" if err["type"] == "missing" else err["msg"])
        return error_response(400, f"{param}: {text}" if param else text, param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), headers=exc.headers)

    @app.post("/v1/completions")
    async def completions(body: oai.CompletionRequest, request: Request) -> Response:
        return await _complete(router, request, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: oai.ChatCompletionRequest, request: Request) -> Response:
        return await _complete(router, request, body, chat=True)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": router.model_name, "object": "model",
                                            "created": started, "owned_by": "pdserve"}]}

    @app.get(HEALTH_PATH)
    async def health() -> JSONResponse:
        down = [role for role, workers in (("prefill", router.prefill), ("decode", router.decode))
                if not any(w.available for w in workers)]
        if down:
            return error_response(503, f"no {' or '.join(down)} worker is available",
                                  code="unavailable")
        return JSONResponse({"status": "ok"})

    return app


class _WriteTimeout(ConnectionError):
    """A response the client did not read within stream_stall_timeout_s."""


class _Gate:
    """ASGI middleware in front of the app: the api key (401), then the body size (413),
    before FastAPI reads or parses anything. The body is read here, within
    max_request_bytes, and handed on whole."""

    def __init__(self, app, api_key: str | None, max_request_bytes: int,
                 write_timeout_s: float | None = None, on_write_timeout=lambda: None,
                 admin_api_key: str | None = None,
                 on_request_end: Callable[[int], None] = lambda request_bytes: None):
        """`on_request_end(bytes read of the body)` once a request read here ended."""
        self.app, self.max_bytes = app, max_request_bytes
        self.on_request_end = on_request_end
        self.key = api_key.encode() if api_key else None
        self.admin_key = admin_api_key.encode() if admin_api_key else None
        self.write_timeout_s, self.on_write_timeout = write_timeout_s, on_write_timeout

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])     # lower-case names, as ASGI gives them
        auth = headers.get(b"authorization", b"").decode("latin-1")
        if self.key is not None and scope["path"] != HEALTH_PATH and not (
                bearer_matches(auth, self.key)
                or self.admin_key is not None and bearer_matches(auth, self.admin_key)):
            response = error_response(401, UNAUTHENTICATED_MESSAGE, code="invalid_api_key",
                                      headers={"WWW-Authenticate": "Bearer"})
            return await response(scope, receive, send)
        too_large = error_response(413, f"request body exceeds {self.max_bytes} bytes "
                                        "(max_request_bytes)", code="request_too_large")
        if int(headers.get(b"content-length", b"0") or 0) > self.max_bytes:
            return await too_large(scope, receive, send)
        body = bytearray()
        try:
            await self._serve(scope, receive, send, body, too_large)
        finally:
            self.on_request_end(len(body))

    async def _serve(self, scope, receive, send, body: bytearray, too_large) -> None:
        """Read the body into `body` (413 past max_bytes), then hand it to the app."""
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return                        # gone before it finished sending
            body += msg.get("body", b"")
            if len(body) > self.max_bytes:     # chunked bodies carry no length up front
                return await too_large(scope, receive, send)
            if not msg.get("more_body"):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()        # then http.disconnect, when it comes
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        try:
            await self.app(scope, replay, self._bounded(send))
        except _WriteTimeout as e:   # uvicorn closes the connection of an unfinished response
            logger.warning("%s %s: %s", scope.get("method"), scope["path"], e)

    def _bounded(self, send):
        """`send` that gives up after write_timeout_s: a client that reads nothing holds
        the response in the server's buffers, and uvicorn then waits for it without
        end. Raising here ends the app, and uvicorn closes the connection."""
        if self.write_timeout_s is None:
            return send

        async def bounded(message) -> None:
            try:
                await asyncio.wait_for(send(message), self.write_timeout_s)
            except asyncio.TimeoutError:
                self.on_write_timeout()
                raise _WriteTimeout(f"the client read nothing for {self.write_timeout_s:g} s "
                                    "(stream_stall_timeout_s): response aborted") from None
        return bounded
