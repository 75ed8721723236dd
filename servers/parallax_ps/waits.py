"""Waits a handler may not take where it runs: the data plane's event loop thread.

On that thread (inside `not_here()`), a handler that would block instead raises `WouldWait`
before it has changed anything, and the loop decides: a pull waiting for its step is parked
under `shard` until the shard changes or `deadline` (time.monotonic()) passes; a request
waiting for memory (--memory-mb) or for a shard's lock held by another thread (a save's
snapshot, a restore, a push over gRPC) moves to a thread of its own. Every other thread
(gRPC's pools, the loop's hand-off threads) waits as before.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

_local = threading.local()


class WouldWait(Exception):
    """The handler would block here: for `shard`'s step (until `deadline`), or, with no
    shard, for room in the memory budget."""

    def __init__(self, shard=None, deadline: float | None = None) -> None:
        super().__init__("would wait")
        self.shard, self.deadline = shard, deadline


@contextlib.contextmanager
def not_here() -> Iterator[None]:
    """Handlers called inside raise `WouldWait` where they would block."""
    _local.refused = True
    try:
        yield
    finally:
        _local.refused = False


def check(shard=None, deadline: float | None = None) -> None:
    """Raise `WouldWait` if this thread may not block; the caller is about to."""
    if getattr(_local, "refused", False):
        raise WouldWait(shard, deadline)


LOCK_WAIT_S = 0.002  # the longest the loop waits for a shard's lock before handing off: the
#                      holder is often about to let go (a push that closed the step wakes
#                      the loop while it still holds the lock)


def acquire(lock) -> None:
    """Take `lock`; where this thread may not block, only within LOCK_WAIT_S (else
    WouldWait: a save's snapshot or a restore may hold it for seconds)."""
    if not getattr(_local, "refused", False):
        lock.acquire()
    elif not lock.acquire(timeout=LOCK_WAIT_S):
        raise WouldWait()
