"""Request-scoped router failures, each carrying the gRPC status the call ends with."""

from __future__ import annotations

import grpc


class RequestError(Exception):
    """A request-scoped failure carrying the gRPC status to end the call with."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
