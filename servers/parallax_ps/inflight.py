"""The working memory of a request in flight, held against `--memory-mb` (`MemoryBudget.hold`)
from its size alone, before it is read, decoded or its answer allocated.

A request runs in one `scope` (one per thread): the data plane opens it when a frame's
header has told the body's length, and holds the body's estimate there before reading the
body (`frame_need`); a gRPC handler opens it on entry (gRPC has read the body by then). In
the handler, `ensure` raises what the scope holds to what the request needs, once its parts
are known: a push's rows and their optimizer temporaries, a pull's answer (after any wait for
its step, so a pull waiting for a step never holds the room a push needs to close it). The
scope gives everything back when the request is answered.

The factors were measured on the server process (VmHWM, numpy and compiled kernels): a push
of B body bytes peaked at about 3.2 B above its tables (the received bytes, their copy, the
summed gradients and the optimizer's temporaries), a pull of answer A at about 1.1 A.
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator

from parallax_ps.budget import MemoryBudget
from parallax_ps.errors import RequestError

PUSH_BYTES_PER_BODY_BYTE = 4   # received body, its copy, summed gradients, optimizer temporaries
PULL_BYTES_PER_ID_BYTE = 3     # received ids, their copy, the rows located for them
PULL_BYTES_PER_ANSWER_BYTE = 1.25  # the answer and gathering temporaries
NO_DEADLINE_WAIT_S = 60.0      # the longest a request without a deadline waits for room
_PUSHES = ("Push", "PushMany", "PushManyPacked")
_local = threading.local()


def frame_need(method: str, body_bytes: int) -> int:
    """Bytes a request of `method` needs from its body's size alone (a pull's answer is
    added by `ensure` once its rows are known)."""
    factor = PUSH_BYTES_PER_BODY_BYTE if method in _PUSHES else PULL_BYTES_PER_ID_BYTE
    return int(factor * body_bytes)


def pull_need(id_bytes: int, answer_bytes: int) -> int:
    return int(PULL_BYTES_PER_ID_BYTE * id_bytes + PULL_BYTES_PER_ANSWER_BYTE * answer_bytes)


class Scope:
    """What one request holds of a budget."""

    def __init__(self, budget: MemoryBudget) -> None:
        self.budget = budget
        self.held = 0

    def ensure(self, nbytes: int, deadline: float | None, what) -> None:
        """Hold at least `nbytes` in all: the rest at once if there is room, else all of it
        once there is (until `deadline`), holding nothing while it waits."""
        more = int(nbytes) - self.held
        if more <= 0:
            return
        if deadline is None:
            deadline = time.monotonic() + NO_DEADLINE_WAIT_S
        try:
            self.budget.hold(more, time.monotonic(), what)  # room now: no wait
        except RequestError:  # wait holding nothing: requests that hold part of what they
            self.close()      # need never wait on each other
            self.budget.hold(int(nbytes), deadline, what)
            self.held = int(nbytes)
        else:
            self.held += more

    def close(self) -> None:
        self.budget.unhold(self.held)
        self.held = 0


@contextlib.contextmanager
def scope(budget: MemoryBudget) -> Iterator[Scope]:
    """This thread's request scope: the open one (the data plane's), else a new one given
    back on exit."""
    current = getattr(_local, "scope", None)
    if current is not None:
        yield current
        return
    opened = _local.scope = Scope(budget)
    try:
        yield opened
    finally:
        _local.scope = None
        opened.close()


def current() -> Scope | None:
    return getattr(_local, "scope", None)


def ensure(nbytes: int, deadline: float | None, what) -> None:
    """`Scope.ensure` on this thread's scope (none outside a request: nothing held)."""
    opened = current()
    if opened is not None:
        opened.ensure(nbytes, deadline, what)
