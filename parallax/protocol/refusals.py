"""Refusals a client tells apart by more than their gRPC code: the stable words of their
messages, written by the servers and read by the clients (one owner for both sides).

STEP_AHEAD: a sync push for a step after the shard's open step (FAILED_PRECONDITION). It was
not applied, unlike a push sent again and refused as "already closed" (its first attempt
landed and closed the step), so a retry refused so has not landed; a copy of a replicated
shard refuses so while it is a push behind the copy the worker read the step from.
"""
from __future__ import annotations

STEP_AHEAD = "is ahead of the open step"
