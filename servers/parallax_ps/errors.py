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


DETAILS_BYTES = 4096  # a status's details, as gRPC sends them (percent-encoded), at most


def _sent_size(char: str) -> int:
    """Bytes one character takes in gRPC's percent-encoded grpc-message trailer."""
    return sum(1 if 0x20 <= b <= 0x7E and b != 0x25 else 3
               for b in char.encode("utf-8", "surrogatepass"))


def bounded(message: str, limit: int = DETAILS_BYTES) -> str:
    """`message` cut in the middle to fit `limit` bytes on the wire. gRPC clients drop
    trailers over 8 KiB (some of the time) to 16 KiB (always): a longer status, one echoing a
    client's megabyte-long table name say, would reach the client as RESOURCE_EXHAUSTED with
    the server's answer lost."""
    if len(message) * 12 <= limit or _fitting(message, limit) == message:
        return message  # (a character takes at most 12 bytes)
    marker = " [...] "
    head = _fitting(message, (limit - len(marker)) // 2)
    tail = _fitting(message[::-1], (limit - len(marker)) // 2)[::-1]
    return head + marker + tail


def _fitting(text: str, budget: int) -> str:
    """The longest start of `text` whose encoding fits `budget` bytes."""
    used = 0
    for i, char in enumerate(text):
        used += _sent_size(char)
        if used > budget:
            return text[:i]
    return text
