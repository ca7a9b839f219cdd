"""gRPC services of the router: pdserve.v1 Generator and Admin, grpc.health.v1, and
server reflection (so grpcurl and reflection clients work without the .proto), behind
the TLS and api-key gates of security.py."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from .. import tracing
from ..engine.sampling_params import InvalidRequestError
from ..proto import pdserve_pb2 as pb
from ..proto import pdserve_pb2_grpc as pb_grpc
from . import validation
from .errors import RequestError
from .stalls import watched
from .security import ApiKeyInterceptor, is_loopback, server_credentials

logger = logging.getLogger(__name__)


# Trailing metadata on every status the router itself returns: an UNAVAILABLE without it
# came from the connection (the router's process died), which a client may resume
# (GenerateRequest.resume_token_ids; pdserve.client does).
ROUTER_STATUS = (("pdserve-status-from", "router"),)


class GeneratorService(pb_grpc.GeneratorServicer):
    def __init__(self, router):
        self.router = router

    async def Generate(self, data: bytes, context: grpc.aio.ServicerContext):
        """The request arrives as bytes (see add_generator) and is parsed here."""
        failed, request_bytes = None, len(data)
        try:
            async for msg in metered_generate(
                    self.router, functools.partial(parse_request, data),
                    context.time_remaining(),
                    tracing.trace_headers(context.invocation_metadata() or ())):
                yield msg
        except InvalidRequestError as e:
            failed = grpc.StatusCode.INVALID_ARGUMENT, str(e)
        except RequestError as e:
            failed = e.code, str(e)
        finally:
            self.router.heap_trim.ended(request_bytes)
        # The call's state keeps the AbortError, whose traceback holds this frame, which
        # holds the call's state: a cycle only the garbage collector frees, so nothing
        # large may be in it: aborted outside the handler (else the AbortError chains
        # the error, whose traceback holds every frame of the request path), the
        # request's bytes (up to max_request_bytes) dropped first
        if failed is not None:
            del data
            await context.abort(*failed, ROUTER_STATUS)


async def metered_generate(router, build: Callable[[], pb.GenerateRequest],
                           deadline_s: float | None, trace_headers: dict | None = None
                           ) -> AsyncIterator[pb.GenerateResponse]:
    """`router.generate(build(), deadline_s)`, counted in the router's request metrics
    (pdserve/metrics.py): the status is the finish_reason, or the error's gRPC status
    code in lower case; a stream that ends otherwise (the client cancelled or went away,
    or the caller closed this generator) counts as cancelled. `build` runs inside, so a
    request that does not parse counts too. Every front end (gRPC here, HTTP in
    http_api.py) serves through this, so both count alike. With tracing on
    (pdserve/tracing.py), the request's root span, parented on the client's W3C
    `trace_headers` when given, wraps it all from the moment the request parsed and its
    request_id is valid (a request refused before is counted, not traced).

    Raises:
        InvalidRequestError: from `build` or the router (bad input).
        RequestError: from the router (capacity, deadline, no worker), or the client
            left the stream parked at a response past stream_stall_timeout_s or the
            deadline (router/stalls.py).
    """
    timer = router.metrics.request()
    status, prompt_tokens = "cancelled", 0
    request = trace = error = None
    started, ttft, output_tokens, finish_reasons = time.monotonic(), None, 0, []
    try:
        request = build()
        if tracing.enabled():
            # the span is built once the fields it copies are valid: an 8 MiB
            # request_id refused here never reaches an attribute
            rid = validation.request_id(request)
            trace = tracing.request_trace(_operation(request) + f" {router.model_name}",
                                          trace_headers, _request_attributes(
                                              request, rid, router.model_name))
        # aclosing: a caller that stops early (an HTTP client gone) closes the router's
        # generator at once, so its `finally` aborts the request on P and D now.
        # watched: a client that stops reading cannot park the request (and its KV)
        # past stream_stall_timeout_s or its deadline (router/stalls.py)
        deadline = router.config.router.deadline(deadline_s)
        generate = (router.generate(request, deadline_s) if trace is None
                    else router.generate(request, deadline_s, trace))
        async with aclosing(watched(getattr(router, "stalls", None), generate, deadline)
                            ) as stream:
            async for msg in stream:
                timer.tokens(len(msg.token_ids), msg.index)
                if msg.finish_reason:
                    status, prompt_tokens = msg.finish_reason, msg.usage.prompt_tokens
                if trace is not None:
                    if ttft is None and msg.token_ids:
                        ttft = time.monotonic() - started
                    output_tokens += len(msg.token_ids)
                    if msg.finish_reason:
                        finish_reasons.append(msg.finish_reason)
                yield msg
    except InvalidRequestError as e:
        status, error = grpc.StatusCode.INVALID_ARGUMENT.name.lower(), e
        raise
    except RequestError as e:
        status, error = e.code.name.lower(), e
        raise
    except asyncio.CancelledError:
        logger.debug("client cancelled %s", getattr(request, "request_id", "") or "<no id>")
        raise
    except Exception as e:
        status, error = "internal", e
        raise
    finally:
        timer.finish(status, prompt_tokens)
        if trace is not None:
            tracing.end(trace.root, {
                "pdserve.status": status, tracing.USAGE_INPUT_TOKENS: prompt_tokens,
                tracing.USAGE_OUTPUT_TOKENS: output_tokens,
                tracing.RESPONSE_FINISH_REASONS: finish_reasons,
                **({tracing.RESPONSE_TTFT: ttft} if ttft is not None else {})}, error)
        # The exception's traceback holds this frame: bound here, it would hold the
        # exception back, a cycle only the garbage collector frees, with the request
        # (up to max_request_bytes) in it
        error = None


def _operation(request: pb.GenerateRequest) -> str:
    """The GenAI operation name: chat for messages, else text_completion."""
    return "chat" if request.WhichOneof("prompt") == "messages" else "text_completion"


def _request_attributes(request: pb.GenerateRequest, request_id: str | None,
                        model: str) -> dict:
    """The root span's request attributes (GenAI conventions); `request_id` validated."""
    s = request.sampling
    return {
        tracing.PROVIDER: "pdserve", tracing.REQUEST_MODEL: model,
        tracing.OPERATION: _operation(request),
        **({tracing.RESPONSE_ID: request_id} if request_id else {}),
        **({tracing.REQUEST_MAX_TOKENS: s.max_tokens} if s.HasField("max_tokens") else {}),
        **({tracing.REQUEST_TEMPERATURE: s.temperature} if s.HasField("temperature") else {}),
        **({tracing.REQUEST_TOP_P: s.top_p} if s.HasField("top_p") else {}),
        **({tracing.REQUEST_CHOICES: s.n} if s.HasField("n") and s.n != 1 else {})}


def parse_request(data: bytes) -> pb.GenerateRequest:
    """A GenerateRequest from its wire bytes.

    Raises:
        InvalidRequestError: the bytes are not a GenerateRequest (e.g. invalid UTF-8 in a
            string field, a truncated field), with the parser's message; a request_id
            over its bound, before any parse (validation.request_id_on_wire).
    """
    validation.request_id_on_wire(data)
    try:
        return pb.GenerateRequest.FromString(data)
    except DecodeError as e:
        raise InvalidRequestError("request", f"not a valid GenerateRequest ({e}); string "
                                             "fields must be valid UTF-8") from None


def add_generator(service: GeneratorService, server: grpc.aio.Server) -> None:
    """Register Generate with no request deserializer, so bytes that do not parse get
    INVALID_ARGUMENT with a message (gRPC's own deserializer would answer INTERNAL
    "Exception deserializing request!")."""
    name = pb.DESCRIPTOR.services_by_name["Generator"].full_name
    handlers = {"Generate": grpc.unary_stream_rpc_method_handler(
        service.Generate, request_deserializer=None,
        response_serializer=pb.GenerateResponse.SerializeToString)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
    server.add_registered_method_handlers(name, handlers)


class AdminService(pb_grpc.AdminServicer):
    def __init__(self, router):
        self.router = router

    async def ClusterStatus(self, request, context):
        return await self.router.cluster_status()

    async def Drain(self, request, context):
        try:
            return await self.router.drain(request.node_ip, request.timeout_s)
        except InvalidRequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    async def Scale(self, request, context):
        try:
            return await self.router.scale(request.num_prefill_workers,
                                           request.num_decode_workers, request.timeout_s)
        except InvalidRequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except Exception as e:   # a new worker failed to start or pair: named
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"scaling failed: {type(e).__name__}: {e}"[:2000])


def build_server(router, address: str) -> tuple[grpc.aio.Server, int]:
    """A grpc.aio server (not started) with every service; returns it and the bound port.

    Security and limits come from `router.config.router` (RouterConfig): TLS (mutual with
    tls_client_ca_file) when tls_cert_file is set, the api-key check when api_key is, the
    admin role (admin_api_key, or Drain and Scale only on a loopback bind; security.py),
    max_request_bytes, beyond which gRPC itself refuses a request (RESOURCE_EXHAUSTED),
    and max_concurrent_calls, beyond which it refuses a call the same way.

    Raises:
        SecurityConfigError: a tls_* file cannot be read or is not PEM (names the field).
        RuntimeError: the address could not be bound.
    """
    rc = router.config.router
    creds = server_credentials(rc)      # before binding: a bad file fails with its name
    if (rc.api_key is not None or rc.admin_api_key is not None) and creds is None:
        logger.warning("an api key is set without TLS: it crosses the network in clear "
                       "text (set tls_cert_file and tls_key_file)")
    admin_open = is_loopback(rc.host)
    gate = (rc.api_key is not None or rc.admin_api_key is not None or not admin_open)
    server = grpc.aio.server(
        interceptors=[ApiKeyInterceptor(rc.api_key, rc.admin_api_key, admin_open)]
        if gate else None,
        maximum_concurrent_rpcs=rc.max_concurrent_calls,   # more: RESOURCE_EXHAUSTED
        options=[
            ("grpc.max_receive_message_length", rc.max_request_bytes),
            # a second server on a busy port must fail, not share it; router replicas
            # (ClusterConfig.num_routers) share theirs
            ("grpc.so_reuseport", int(router.config.num_routers > 1)),
        ])
    add_generator(GeneratorService(router), server)
    pb_grpc.add_AdminServicer_to_server(AdminService(router), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (pb.DESCRIPTOR.services_by_name["Generator"].full_name,
             pb.DESCRIPTOR.services_by_name["Admin"].full_name,
             health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    port = (server.add_secure_port(address, creds) if creds is not None
            else server.add_insecure_port(address))
    if port == 0:
        raise RuntimeError(f"could not bind gRPC server to {address}")
    for name in ("", names[0], names[1]):
        asyncio.get_running_loop().create_task(
            health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING))
    return server, port
