"""The error a request handler raises to answer with a specific gRPC status and message."""
from __future__ import annotations

import grpc


class RequestError(Exception):
    """Rejects one request; nothing has been changed when this is raised."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


def precondition(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.FAILED_PRECONDITION, message)
