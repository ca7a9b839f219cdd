"""Thin gRPC client helpers over the pdserve.v1 stubs (used by the CLI, demo and tests)."""

from __future__ import annotations

from collections.abc import Iterator

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
        else:
            setattr(req.sampling, k, v)
    return req


class Client:
    """Blocking client: `stream()` yields GenerateResponses, `generate()` collects them."""

    def __init__(self, address: str, timeout_s: float | None = 600.0):
        self.channel = grpc.insecure_channel(address)
        self.generator = pb_grpc.GeneratorStub(self.channel)
        self.admin = pb_grpc.AdminStub(self.channel)
        self.timeout_s = timeout_s

    def stream(self, request: pb.GenerateRequest) -> Iterator[pb.GenerateResponse]:
        return self.generator.Generate(request, timeout=self.timeout_s)

    def generate(self, request: pb.GenerateRequest) -> tuple[list[int], str, str]:
        """(token_ids, text, finish_reason) of a whole request."""
        ids, text, reason = [], [], ""
        for msg in self.stream(request):
            ids += msg.token_ids
            text.append(msg.text)
            reason = msg.finish_reason or reason
        return ids, "".join(text), reason

    def status(self) -> pb.ClusterStatusResponse:
        return self.admin.ClusterStatus(pb.ClusterStatusRequest(), timeout=30)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
