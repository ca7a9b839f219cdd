"""Security of the router's gRPC front: TLS (optionally mutual) server credentials and a
bearer api-key check, both set by RouterConfig (tls_* and api_key).

A call passes through two gates, in this order:

    TCP connect ─▶ TLS handshake ─────────────▶ ApiKeyInterceptor ─────────────▶ servicer
                   (tls_cert_file/key_file;     (api_key: metadata               (Generate,
                    tls_client_ca_file: the      `authorization: Bearer <key>`;   ClusterStatus,
                    client must present a cert   grpc.health.v1.Health/* is       reflection)
                    that CA signed)              exempt, so probes need no key)

A failed handshake never reaches gRPC (the client sees UNAVAILABLE); a missing or wrong
key is refused with UNAUTHENTICATED before the request message is even parsed.

The HTTP API (http_api.py) applies the same settings: uvicorn's TLS context from the
same files (CERT_REQUIRED with tls_client_ca_file), and `bearer_matches` on the
`Authorization` header of every path but /health (401 before the body is parsed).
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc

logger = logging.getLogger(__name__)

EXEMPT_PREFIX = "/grpc.health.v1.Health/"   # load balancers and k8s probes carry no key
UNAUTHENTICATED_MESSAGE = "missing or invalid api key: send 'authorization: Bearer <key>'"


class SecurityConfigError(ValueError):
    """A TLS file named in RouterConfig cannot be read or is not PEM; the message names
    the field and the path."""


def _read_pem(field: str, path: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise SecurityConfigError(f"{field}={path!r}: cannot read it ({e.strerror or e})") \
            from e
    if b"-----BEGIN " not in data:
        raise SecurityConfigError(f"{field}={path!r}: not a PEM file (no '-----BEGIN' line)")
    return data


def server_credentials(rc) -> grpc.ServerCredentials | None:
    """TLS credentials of the router's server from `rc` (a RouterConfig), or None when
    it serves plaintext. With tls_client_ca_file, clients must present a certificate
    signed by that CA (mutual TLS).

    Raises:
        SecurityConfigError: a tls_* file cannot be read or is not PEM (names the field).
    """
    if rc.tls_cert_file is None:
        return None
    cert = _read_pem("tls_cert_file", rc.tls_cert_file)
    key = _read_pem("tls_key_file", rc.tls_key_file)
    ca = (_read_pem("tls_client_ca_file", rc.tls_client_ca_file)
          if rc.tls_client_ca_file is not None else None)
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                       require_client_auth=ca is not None)


def bearer_matches(authorization: str, key: bytes) -> bool:
    """Whether an `authorization` value ("Bearer <token>", scheme in any case) carries
    `key`. The token is compared in constant time, so its timing tells nothing about the
    key. Shared by the gRPC interceptor and the HTTP API (http_api.py)."""
    scheme, _, token = authorization.strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses, with UNAUTHENTICATED, every call but grpc.health.v1.Health/* whose
    metadata lacks `authorization: Bearer <api_key>`. Works for every RPC kind: the
    refusal takes the same streaming shape as the method it stands in for."""

    def __init__(self, api_key: str):
        assert api_key, "ApiKeyInterceptor needs a non-empty key (RouterConfig checks it)"
        self._key = api_key.encode()

    def authorized(self, metadata) -> bool:
        """Whether `metadata` ((key, value) pairs) carries the bearer key."""
        return any(k == "authorization" and isinstance(v, str) and bearer_matches(v, self._key)
                   for k, v in metadata or ())

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails],
                                         Awaitable[grpc.RpcMethodHandler]],
            details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if (handler is None or details.method.startswith(EXEMPT_PREFIX)
                or self.authorized(details.invocation_metadata)):
            return handler
        logger.debug("refused %s: no valid api key", details.method)
        return _refusal(handler)


async def _abort(_request, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of `handler`'s kind that aborts at once. No request deserializer: the
    message of an unauthenticated caller is never parsed."""
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(_abort)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(_abort)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(_abort)
    return grpc.unary_unary_rpc_method_handler(_abort)
