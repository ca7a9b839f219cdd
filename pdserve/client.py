"""Thin gRPC client helpers over the pdserve.v1 stubs (used by the CLI, demo and tests)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc

from .proto import pdserve_pb2 as pb
from .proto import pdserve_pb2_grpc as pb_grpc


def make_request(prompt: str | list[int] | list[dict] | None = None, *, request_id: str = "",
                 max_tokens: int | None = None, temperature: float | None = None,
                 **sampling) -> pb.GenerateRequest:
    """Build a GenerateRequest: a str prompt is text, a list of ints token_ids, a list of
    {"role", "content"} dicts chat messages. Other keywords go to SamplingParams."""
    req = pb.GenerateRequest(request_id=request_id)
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


class Client:
    """Blocking client: `stream()` yields GenerateResponses, `generate()` collects them.

    With no security keywords the channel is plaintext, as before. TLS is used when `tls`
    is true or any tls_* keyword is given: the server's certificate is checked against
    `tls_ca_file` (or the PEM bytes `tls_root_certificates`), else the system's roots;
    `tls_client_cert_file` + `tls_client_key_file` present a client certificate (for a
    server with mutual TLS). `api_key` is sent as `authorization: Bearer <key>` on every
    call, ClusterStatus included. Calls raise grpc.RpcError: UNAVAILABLE when the TLS
    handshake fails (or a plaintext client meets a TLS server), UNAUTHENTICATED when the
    server wants an api key that the call lacks or gets wrong.

    Raises:
        ValueError: only one of tls_client_cert_file / tls_client_key_file, or both
            tls_ca_file and tls_root_certificates.
        OSError: a tls_* file cannot be read.
    """

    def __init__(self, address: str, timeout_s: float | None = 600.0, *, tls: bool = False,
                 tls_ca_file: str | None = None, tls_root_certificates: bytes | None = None,
                 tls_client_cert_file: str | None = None,
                 tls_client_key_file: str | None = None, api_key: str | None = None):
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
            self.channel = grpc.secure_channel(address, creds)
        else:
            self.channel = grpc.insecure_channel(address)
        # What router/security.py's ApiKeyInterceptor checks (no import: the client
        # should not need the server's modules).
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
        self.generator = pb_grpc.GeneratorStub(self.channel)
        self.admin = pb_grpc.AdminStub(self.channel)
        self.timeout_s = timeout_s

    def stream(self, request: pb.GenerateRequest) -> Iterator[pb.GenerateResponse]:
        """The response stream of one request (grpc.RpcError on failure, see the class)."""
        return self.generator.Generate(request, timeout=self.timeout_s, metadata=self.metadata)

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
                                timeout=timeout_s + 30, metadata=self.metadata)

    def scale(self, num_prefill: int, num_decode: int, timeout_s: float = 300.0
              ) -> pb.ScaleResponse:
        """Admin.Scale: start or retire workers until there are `num_prefill` prefill
        and `num_decode` decode workers, a retiring one stopped once its requests
        finished, or after `timeout_s` seconds with what it still has moved to the
        others. grpc.RpcError on failure."""
        return self.admin.Scale(pb.ScaleRequest(num_prefill_workers=num_prefill,
                                                num_decode_workers=num_decode,
                                                timeout_s=timeout_s),
                                timeout=timeout_s + 600, metadata=self.metadata)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
