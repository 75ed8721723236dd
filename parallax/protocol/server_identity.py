"""A server process's identity on the wire (the contract's one owner).

Every server process draws a random nonzero 64-bit `server_id` at start
(`DataPlaneResponse.server_id`, and its data plane's hello). A client that built state on
one process (replayed servers, `parallax.client.replay`) sends that id with every gRPC call
as `HEADER` metadata; a server of another id refuses the call UNAVAILABLE, its details
naming `REPLACED`, before any handler runs. A gRPC channel reconnects to a process started
again on the same address without a word: without this, a read could reach the
replacement before the client rebuilt its shards there and wait for a step only the
client's own pushes close. Calls without the header (every other client) are served.
"""
from __future__ import annotations

import grpc

from parallax.protocol.security import denying_handler

HEADER = "parallax-server-id"
REPLACED = "was started again as another server process"  # in the refusal's details
ANY_PROCESS = frozenset({"Stats", "Barrier"})  # answered by any process: sent without it


def metadata(server_id: int) -> tuple[tuple[str, str], ...] | None:
    """The call metadata that asks for server `server_id` (None: any server)."""
    return ((HEADER, str(server_id)),) if server_id else None


def replaced(details: str | None) -> bool:
    """Whether a refusal's details say the server is another process than the one asked."""
    return REPLACED in (details or "")


class IdentityInterceptor(grpc.ServerInterceptor):
    """Refuses (UNAVAILABLE) every call that asks for another server process than this one."""

    def __init__(self, server_id: int) -> None:
        self._mine = str(server_id)

    def intercept_service(self, continuation, handler_call_details):
        for key, value in handler_call_details.invocation_metadata or ():
            if key == HEADER and value != self._mine:
                return denying_handler(
                    continuation(handler_call_details),
                    f"this server {REPLACED} (it is {self._mine}, the call asked for {value}): "
                    f"the state built on the one before is gone from it",
                    grpc.StatusCode.UNAVAILABLE)
        return continuation(handler_call_details)
