"""Thin gRPC client helpers over the pdserve.v1 stubs (used by the CLI, demo and tests)."""

from __future__ import annotations

import time
from pathlib import Path

import grpc

from .proto import pdserve_pb2 as pb
from .proto import pdserve_pb2_grpc as pb_grpc


def make_request(prompt: str | list[int] | list[dict] | None = None, *, request_id: str = "",
                 max_tokens: int | None = None, temperature: float | None = None,
                 cache_salt: str = "", **sampling) -> pb.GenerateRequest:
    """Build a GenerateRequest: a str prompt is text, a list of ints token_ids, a list of
    {"role", "content"} dicts chat messages; `cache_salt` salts its KV (GenerateRequest).
    Other keywords go to SamplingParams."""
    req = pb.GenerateRequest(request_id=request_id, cache_salt=cache_salt)
    if isinstance(prompt, str):
        req.text = prompt
    elif prompt and isinstance(prompt[0], dict):
        req.messages.messages.extend(pb.ChatMessage(**m) for m in prompt)
    elif prompt is not None:
        req.token_ids.ids.extend(prompt)
    if max_tokens is not None:
        req.sampling.max_tokens = max_tokens
    if temperature is not None:
        req.sampling.temperature = temperature
    for k, v in sampling.items():
        field = getattr(req.sampling, k)
        if isinstance(v, (list, tuple)):
            field.extend(v)
        elif isinstance(v, dict):     # logit_bias
            field.update(v)
        elif hasattr(v, "DESCRIPTOR"):   # a message: structured_outputs
            field.CopyFrom(v)
        else:
            setattr(req.sampling, k, v)
    return req


def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path is not None else None


# A router that restarts (its process died; Ray restarts it and `serve` starts it on the
# same port within seconds) is reconnected to within 2 s: gRPC's default backoff grows
# to 120 s between tries, so a channel that failed a few times would idle long after.
_CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 250),
                    ("grpc.min_reconnect_backoff_ms", 250),
                    ("grpc.max_reconnect_backoff_ms", 2000)]


class Client:
    """Blocking client: `stream()` yields GenerateResponses, `generate()` collects them.

    With no security keywords the channel is plaintext, as before. TLS is used when `tls`
    is true or any tls_* keyword is given: the server's certificate is checked against
    `tls_ca_file` (or the PEM bytes `tls_root_certificates`), else the system's roots;
    `tls_client_cert_file` + `tls_client_key_file` present a client certificate (for a
    server with mutual TLS). `api_key` is sent as `authorization: Bearer <key>` on every
    call, ClusterStatus included; `admin_api_key`, when given, in its place on Drain and
    Scale (a router with an admin key refuses them the api key). Calls raise grpc.RpcError: UNAVAILABLE when the TLS
    handshake fails (or a plaintext client meets a TLS server), UNAUTHENTICATED when the
    server wants an api key that the call lacks or gets wrong, PERMISSION_DENIED when
    Drain or Scale lacks the admin key.

    A stream whose router goes away (its process died: UNAVAILABLE from the connection,
    not from the router) is sent again for up to `resume_timeout_s` seconds (0: never),
    with the tokens received so far as `resume_token_ids`: it goes on where it stopped,
    greedy and seeded output as if unbroken (n = 1 without best_of, once a message of
    it arrived: ResumingStream).

    Raises:
        ValueError: only one of tls_client_cert_file / tls_client_key_file, or both
            tls_ca_file and tls_root_certificates.
        OSError: a tls_* file cannot be read.
    """

    def __init__(self, address: str, timeout_s: float | None = 600.0, *, tls: bool = False,
                 resume_timeout_s: float = 60.0,
                 tls_ca_file: str | None = None, tls_root_certificates: bytes | None = None,
                 tls_client_cert_file: str | None = None,
                 tls_client_key_file: str | None = None, api_key: str | None = None,
                 admin_api_key: str | None = None):
        if (tls_client_cert_file is None) != (tls_client_key_file is None):
            raise ValueError("tls_client_cert_file and tls_client_key_file go together: give "
                             "both for mutual TLS, or neither")
        if tls_ca_file is not None and tls_root_certificates is not None:
            raise ValueError("give tls_ca_file or tls_root_certificates, not both")
        if tls or tls_ca_file or tls_root_certificates or tls_client_cert_file:
            creds = grpc.ssl_channel_credentials(
                root_certificates=tls_root_certificates or _read(tls_ca_file),
                private_key=_read(tls_client_key_file),
                certificate_chain=_read(tls_client_cert_file))
            self.channel = grpc.secure_channel(address, creds, options=_CHANNEL_OPTIONS)
        else:
            self.channel = grpc.insecure_channel(address, options=_CHANNEL_OPTIONS)
        # What router/security.py's ApiKeyInterceptor checks (no import: the client
        # should not need the server's modules).
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
        self.admin_metadata = ((("authorization", f"Bearer {admin_api_key}"),)
                               if admin_api_key else self.metadata)
        self.generator = pb_grpc.GeneratorStub(self.channel)
        self.admin = pb_grpc.AdminStub(self.channel)
        self.timeout_s = timeout_s
        self.resume_timeout_s = resume_timeout_s

    def stream(self, request: pb.GenerateRequest) -> "ResumingStream":
        """The response stream of one request (grpc.RpcError on failure, see the class),
        resumed when its router goes away (ResumingStream); `.cancel()` ends it."""
        return ResumingStream(self, request)

    def generate(self, request: pb.GenerateRequest) -> tuple[list[int], str, str]:
        """(token_ids, text, finish_reason) of a whole request."""
        ids, text, reason = [], [], ""
        for msg in self.stream(request):
            ids += msg.token_ids
            text.append(msg.text)
            reason = msg.finish_reason or reason
        return ids, "".join(text), reason

    def status(self) -> pb.ClusterStatusResponse:
        """Admin.ClusterStatus (grpc.RpcError on failure, see the class)."""
        return self.admin.ClusterStatus(pb.ClusterStatusRequest(), timeout=30,
                                        metadata=self.metadata)

    def drain(self, node_ip: str, timeout_s: float) -> pb.DrainResponse:
        """Admin.Drain: the router sends no new requests to `node_ip`'s workers and
        waits up to `timeout_s` seconds for theirs to finish (grpc.RpcError on failure)."""
        return self.admin.Drain(pb.DrainRequest(node_ip=node_ip, timeout_s=timeout_s),
                                timeout=timeout_s + 30, metadata=self.admin_metadata)

    def scale(self, num_prefill: int, num_decode: int, timeout_s: float = 300.0
              ) -> pb.ScaleResponse:
        """Admin.Scale: start or retire workers until there are `num_prefill` prefill
        and `num_decode` decode workers, a retiring one stopped once its requests
        finished, or after `timeout_s` seconds with what it still has moved to the
        others. grpc.RpcError on failure."""
        return self.admin.Scale(pb.ScaleRequest(num_prefill_workers=num_prefill,
                                                num_decode_workers=num_decode,
                                                timeout_s=timeout_s),
                                timeout=timeout_s + 600, metadata=self.admin_metadata)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _from_connection(e: grpc.RpcError) -> bool:
    """An UNAVAILABLE the router did not answer (router/service.py ROUTER_STATUS marks
    the ones it did): the connection failed or the router's process died."""
    if e.code() != grpc.StatusCode.UNAVAILABLE:
        return False
    trailing = e.trailing_metadata() if hasattr(e, "trailing_metadata") else None
    return not any(k == "pdserve-status-from" for k, _ in (trailing or ()))


class ResumingStream:
    """The GenerateResponses of one request; when the router goes away mid-stream, the
    request is sent again (every 0.25 s, for up to client.resume_timeout_s) with the
    tokens received so far as resume_token_ids, and the messages go on after them.
    Only a stream of one sample (the field takes one sample's tokens) that had
    received a message is resumed: a request that got nothing fails at once, as a
    server that is down should (a request in its prefill when the router died too).
    Iterating raises grpc.RpcError as a plain stream does, the last one when the
    router did not come back in time."""

    RETRY_S = 0.25

    def __init__(self, client: Client, request: pb.GenerateRequest):
        self._client, self._request = client, request
        self._deadline = (None if client.timeout_s is None
                          else time.monotonic() + client.timeout_s)
        self._one_sample = request.sampling.n <= 1 and not request.sampling.HasField("best_of")
        self._received: list[int] = list(request.resume_token_ids)
        self._any = False
        self._cancelled = False
        self._call = self._send(request)

    def _send(self, request: pb.GenerateRequest):
        timeout = None if self._deadline is None else max(self._deadline - time.monotonic(), 0.001)
        return self._client.generator.Generate(request, timeout=timeout,
                                               metadata=self._client.metadata)

    def __iter__(self) -> "ResumingStream":
        return self

    def __next__(self) -> pb.GenerateResponse:
        give_up = None
        while True:
            try:
                msg = next(self._call)
            except grpc.RpcError as e:
                if self._cancelled or not self._any or not self._one_sample \
                        or not _from_connection(e):
                    raise
                now = time.monotonic()
                give_up = give_up or now + self._client.resume_timeout_s
                if now + self.RETRY_S > min(give_up, self._deadline or give_up):
                    raise
                time.sleep(self.RETRY_S)
                request = pb.GenerateRequest()
                request.CopyFrom(self._request)
                del request.resume_token_ids[:]
                request.resume_token_ids.extend(self._received)
                self._call = self._send(request)
                continue
            self._any = True
            if msg.index == 0:
                self._received += msg.token_ids
            return msg

    def cancel(self) -> None:
        self._cancelled = True
        self._call.cancel()
