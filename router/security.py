"""Security of the router's gRPC front: TLS (optionally mutual) server credentials, a
bearer api-key check, and an admin role, all set by RouterConfig (tls_*, api_key,
admin_api_key).

A call passes through two gates, in this order:

    TCP connect ─▶ TLS handshake ─────────────▶ ApiKeyInterceptor ─────────────▶ servicer
                   (tls_cert_file/key_file;     (api_key: metadata               (Generate,
                    tls_client_ca_file: the      `authorization: Bearer <key>`;   ClusterStatus,
                    client must present a cert   grpc.health.v1.Health/* is       Drain, Scale,
                    that CA signed)              exempt, so probes need no key;   reflection)
                                                 Admin/Drain and Admin/Scale need
                                                 the admin key)

A failed handshake never reaches gRPC (the client sees UNAVAILABLE); a missing or wrong
key is refused with UNAUTHENTICATED before the request message is even parsed.

The admin role: the calls that change the cluster (ADMIN_METHODS: Drain, which stops a
node's workers taking requests until they restart, and Scale, which starts and retires
workers) need `authorization: Bearer <admin_api_key>`; the generate key gets
PERMISSION_DENIED for them. The admin key also passes where the generate key does. With
no admin key configured they are served only when the router binds a loopback address
(whoever can reach it can already run commands on the host), and refused with
PERMISSION_DENIED otherwise, the message naming the flag.

The HTTP API (http_api.py) applies the same settings: uvicorn's TLS context from the
same files (CERT_REQUIRED with tls_client_ca_file), and `bearer_matches` on the
`Authorization` header of every path but /health (401 before the body is parsed).
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc

logger = logging.getLogger(__name__)

EXEMPT_PREFIX = "/grpc.health.v1.Health/"   # load balancers and k8s probes carry no key
UNAUTHENTICATED_MESSAGE = "missing or invalid api key: send 'authorization: Bearer <key>'"
ADMIN_METHODS = frozenset({"/pdserve.v1.Admin/Drain", "/pdserve.v1.Admin/Scale"})
ADMIN_KEY_MESSAGE = ("{method} needs the admin key: send 'authorization: Bearer <admin key>' "
                     "(serve --admin-api-key / $PDSERVE_ADMIN_API_KEY)")
ADMIN_CLOSED_MESSAGE = ("{method} is refused: the router serves a non-loopback address and "
                        "has no admin key; set serve --admin-api-key (or "
                        "$PDSERVE_ADMIN_API_KEY), or serve on 127.0.0.1")


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or "localhost") binds the loopback interface only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:       # a name, "auto", "" or "0.0.0.0"-like: not loopback
        return False


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
    """Refuses every call but grpc.health.v1.Health/* whose metadata lacks
    `authorization: Bearer <api_key>` (or the admin key), with UNAUTHENTICATED; and the
    calls of ADMIN_METHODS with PERMISSION_DENIED unless they carry the admin key, or,
    with no admin key, unless `admin_open` (the router binds loopback). Either key may
    be None (not required). Works for every RPC kind: the refusal takes the same
    streaming shape as the method it stands in for."""

    def __init__(self, api_key: str | None, admin_api_key: str | None = None,
                 admin_open: bool = False):
        assert api_key != "" and admin_api_key != "", "keys are non-empty (RouterConfig)"
        self._key = api_key.encode() if api_key else None
        self._admin = admin_api_key.encode() if admin_api_key else None
        self._admin_open = admin_open and self._admin is None

    @staticmethod
    def _carries(metadata, key: bytes | None) -> bool:
        return key is not None and any(
            k == "authorization" and isinstance(v, str) and bearer_matches(v, key)
            for k, v in metadata or ())

    def authorized(self, metadata) -> bool:
        """Whether `metadata` ((key, value) pairs) may make non-admin calls: it carries
        the api key or the admin key, or no api key is required."""
        return (self._key is None or self._carries(metadata, self._key)
                or self._carries(metadata, self._admin))

    def refusal(self, method: str, metadata) -> tuple[grpc.StatusCode, str] | None:
        """The status and message refusing `method` with `metadata`, or None to serve it."""
        if method.startswith(EXEMPT_PREFIX):
            return None
        if method in ADMIN_METHODS:
            if self._carries(metadata, self._admin) or (
                    self._admin_open and self.authorized(metadata)):
                return None
            if not self.authorized(metadata):
                return grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE
            name = method.rsplit(".", 1)[-1]          # "Admin/Scale"
            return grpc.StatusCode.PERMISSION_DENIED, (
                ADMIN_KEY_MESSAGE if self._admin is not None else ADMIN_CLOSED_MESSAGE
            ).format(method=name)
        if self.authorized(metadata):
            return None
        return grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails],
                                         Awaitable[grpc.RpcMethodHandler]],
            details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        refused = self.refusal(details.method, details.invocation_metadata)
        if refused is None:
            return handler
        logger.debug("refused %s: %s", details.method, refused[0].name)
        return _refusal(handler, *refused)


def _refusal(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str
             ) -> grpc.RpcMethodHandler:
    """A handler of `handler`'s kind that aborts at once with `code` and `message`. No
    request deserializer: the message of a refused caller is never parsed."""
    async def abort(_request, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, message)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(abort)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(abort)
    return grpc.unary_unary_rpc_method_handler(abort)
