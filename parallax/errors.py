"""The package's single exception family, so callers can catch everything parallax raises."""
from __future__ import annotations


class ParallaxError(Exception):
    """Base class of every error parallax raises on purpose."""


class ConfigError(ParallaxError, ValueError):
    """A spec, argument or configuration value is invalid; the message names it and the fix."""


class InternalError(ParallaxError, RuntimeError):
    """An invariant parallax keeps broke: a bug in parallax, not in the caller's code or
    configuration, so no fix of theirs helps; the message says so and asks for a report."""

    def __init__(self, message: str) -> None:
        self.message = message
        super().__init__(f"{message} (a bug in parallax, not in your code or configuration: "
                         f"please report it with this traceback and `parallax version`'s "
                         f"output)")

    def __reduce__(self):
        return type(self), (self.message,)  # copied or pickled: the note added once


class ServerError(ParallaxError):
    """An RPC to a parameter server failed; carries the server address, table and gRPC code."""

    def __init__(self, message: str, *, address: str, table: str | None, code: object) -> None:
        super().__init__(message)
        self.address = address
        self.table = table
        self.code = code
