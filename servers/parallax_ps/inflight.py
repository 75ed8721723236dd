"""The working memory of a request in flight, held against `--memory-mb` (`MemoryBudget.hold`)
from its size alone, before it is read, decoded or its answer allocated.

A request runs in one `scope` (one per thread): the data plane opens it when a frame's
header has told the body's length, and holds the request's whole estimate there before
reading the body (`Scope.admit`); a gRPC handler opens it on entry (gRPC has read the body
by then). In the handler, `ensure` raises what the scope holds to what the request needs,
once its parts are known: a push's rows and their optimizer temporaries, a pull's answer
(after any wait for its step, during which it holds nothing, so a pull waiting for a step
never holds the room a push needs to close it). The scope gives everything back when the
request is answered.

The factors were measured on the server process (VmHWM, numpy and compiled kernels): a push
of B body bytes that it applied peaked at about 3.2 B above its tables (the received bytes,
their copy, the summed gradients and the optimizer's temporaries; a sync push that only
buffers its rows holds its body), a pull of answer A at about 1.1 A (and
one more A over gRPC, which copies the answer after its handler has returned).
"""
from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Iterator

from parallax.runtime.malloc_tuning import return_freed_memory
from parallax_ps import waits
from parallax_ps.budget import MemoryBudget
from parallax_ps.errors import RequestError

RECEIVED_BYTES_PER_BODY_BYTE = 2  # a push's received body and its copy
APPLY_BYTES_PER_GRADIENT_BYTE = 2  # summed gradients and the optimizer's temporaries
PULL_BYTES_PER_ID_BYTE = 3     # received ids, their copy, the rows located for them
PULL_BYTES_PER_ANSWER_BYTE = 1.25  # the answer and gathering temporaries
NO_DEADLINE_WAIT_S = 60.0      # the longest a request without a deadline waits for room
TRIM_SLACK = 1 / 8             # of --memory-mb resident beyond what the budget explains: a
TRIM_MIN_BYTES = 4 << 20       # request's end (one that held this much) returns freed pages
_PAGE = os.sysconf("SC_PAGE_SIZE")
_PUSHES = ("Push", "PushMany", "PushManyPacked")
_local = threading.local()


def frame_need(method: str, body_bytes: int) -> int:
    """Bytes a request of `method` needs from its body's size alone: received and copied
    (what a push applies, or a pull answers, is added by `ensure` once its parts are known)."""
    factor = RECEIVED_BYTES_PER_BODY_BYTE if method in _PUSHES else PULL_BYTES_PER_ID_BYTE
    return int(factor * body_bytes)


def whole_need(method: str, body_bytes: int) -> int:
    """What a request of `method` needs in all, as far as its body's size tells: a push's
    received bytes and the optimizer's work on every one of them (`push_need` of a push
    that applies its whole body: what an async push, or a sync push that buffers, needs at
    most; one closing a sync step needs more for the step's other pushes). A pull's answer
    depends on its tables: its ids' bytes."""
    if method in _PUSHES:
        return push_need(body_bytes, body_bytes)
    return frame_need(method, body_bytes)


def push_need(body_bytes: int, applied_bytes: int) -> int:
    """A push's bytes: its body, and the optimizer's work on the gradients it applies."""
    return int(RECEIVED_BYTES_PER_BODY_BYTE * body_bytes +
               APPLY_BYTES_PER_GRADIENT_BYTE * applied_bytes)


def pull_need(id_bytes: int, answer_bytes: int, copies: int = 1) -> int:
    """A pull's bytes: its ids', and its answer's, of which gRPC keeps a copy of its own."""
    return int(PULL_BYTES_PER_ID_BYTE * id_bytes +
               (PULL_BYTES_PER_ANSWER_BYTE + copies - 1) * answer_bytes)


class Scope:
    """What one request holds of a budget."""

    def __init__(self, budget: MemoryBudget) -> None:
        self.budget = budget
        self.held = 0
        self.floor = 0  # bytes of the received body: held while the request waits for more
        self.grpc = False  # a gRPC request's (its answer is copied by gRPC)

    def ensure(self, nbytes: int, deadline: float | None, what, admitting: bool = False
               ) -> None:
        """Hold at least `nbytes` in all: the rest at once if there is room, else once there
        is (until `deadline`), holding only `floor` (the received body) while it waits, so
        requests that hold part of what they need do not wait on each other's estimates;
        and only one waiter at a time keeps its floor (`MemoryBudget.floor_turn`): two
        waiters each holding its body could leave neither the room it waits for (a push
        closing two tables' sync steps, sent as two frames, waited out its deadline)."""
        nbytes = int(nbytes)
        if self.try_ensure(nbytes, what, admitting):
            return
        if deadline is None:
            deadline = time.monotonic() + NO_DEADLINE_WAIT_S
        waits.check()  # (the data plane's loop hands the request to a thread instead)
        with self.budget.floor_turn(self.floor, self.held) as keep:
            self.budget.unhold(self.held - keep)
            self.held = keep
            if not self.budget.hold(nbytes - keep, deadline, what, own=keep,
                                    admitting=admitting):
                self.budget.refuse_waited(nbytes, what)
        self.held = nbytes

    def admit(self, method: str, body_bytes: int, deadline: float | None, what) -> None:
        """Hold a data-plane frame's memory before its body is read: its whole need
        (`whole_need`), waited for holding nothing, so a request holds the body's room only
        once it is let in whole; its least (`frame_need`) where the whole cannot fit beside
        the tables, or stops fitting while it waits (a sync push that buffers may still go
        on with that). Requests that each hold a body while waiting for the rest could
        hold, together, the room every one of them waits for (four pushes of 4 MiB under
        --memory-mb 28 waited out their deadlines); whole admission leaves pushes closing a
        sync step, which need the step's buffered gradients too, to wait holding their
        bodies (one at a time: `MemoryBudget.floor_turn`)."""
        if deadline is None:
            deadline = time.monotonic() + NO_DEADLINE_WAIT_S
        whole = whole_need(method, body_bytes)
        while self.budget.fits(whole):
            try:
                self.ensure(whole, deadline, what, admitting=True)
                break
            except RequestError:
                if time.monotonic() >= deadline:
                    raise
        else:  # (the tables grew while it waited: another worker's push buffered)
            self.ensure(frame_need(method, body_bytes), deadline, what, admitting=True)
        self.floor = body_bytes

    def try_ensure(self, nbytes: int, what, admitting: bool = False) -> bool:
        """`ensure` without waiting: whether it holds `nbytes` in all now (nothing more held
        when not; RESOURCE_EXHAUSTED when `nbytes` can never fit)."""
        nbytes = int(nbytes)
        if nbytes <= self.held:
            return True
        if self.budget.hold(nbytes - self.held, time.monotonic(), what, own=self.held,
                            admitting=admitting):
            self.held = nbytes
            return True
        return False

    def close(self) -> None:
        held, self.held = self.held, 0
        release(self.budget, held)


def resident_bytes() -> int:
    """This process's resident memory now (0 where /proc has none)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


def release(budget: MemoryBudget, nbytes: int) -> None:
    """Give `nbytes` back; and when the process is resident well beyond what the budget
    explains (`TRIM_SLACK`), hand the pages its requests freed back to the kernel: the
    allocator keeps freed buffers for reuse (malloc_tuning), in arenas other threads may not
    reuse, so bursts of requests on many threads would otherwise leave RSS above what is
    held. (Within the slack, freed buffers stay for the next requests, page faults saved.)"""
    budget.unhold(nbytes)
    if nbytes >= TRIM_MIN_BYTES and budget.limit and \
            resident_bytes() > budget.accounted() + TRIM_SLACK * budget.limit:
        return_freed_memory()


@contextlib.contextmanager
def scope(budget: MemoryBudget, context=None) -> Iterator[Scope]:
    """This thread's request scope: the open one (the data plane's), else a new one given
    back on exit, or, for a gRPC `context`, once gRPC has sent the answer (it copies the
    answer after the handler returns: `add_callback` runs when the RPC ends)."""
    current = getattr(_local, "scope", None)
    if current is not None:
        yield current
        return
    opened = _local.scope = Scope(budget)
    opened.grpc = context is not None and hasattr(context, "add_callback")
    try:
        yield opened
    finally:
        _local.scope = None
        held, opened.held = opened.held, 0
        if not (held and opened.grpc and context.add_callback(lambda: release(budget, held))):
            release(budget, held)


@contextlib.contextmanager
def using(opened: Scope) -> Iterator[Scope]:
    """`opened` as this thread's request scope for a while (the data plane's loop serves
    many requests on one thread, each with its own scope); the caller closes it."""
    previous, _local.scope = current(), opened
    try:
        yield opened
    finally:
        _local.scope = previous


def answer_copies() -> int:
    """Copies of an answer that live until it is sent: gRPC's own besides ours."""
    opened = current()
    return 2 if opened is not None and opened.grpc else 1


def current() -> Scope | None:
    return getattr(_local, "scope", None)


def ensure(nbytes: int, deadline: float | None, what) -> None:
    """`Scope.ensure` on this thread's scope (none outside a request: nothing held)."""
    opened = current()
    if opened is not None:
        opened.ensure(nbytes, deadline, what)


def try_ensure(nbytes: int, what) -> bool:
    """`Scope.try_ensure` on this thread's scope (none outside a request: True)."""
    opened = current()
    return opened is None or opened.try_ensure(nbytes, what)


def give_back_held() -> None:
    """Give back what this thread's request holds, its scope staying open (a request whose
    next hold comes after a wait it must not hold room through: a pull about to wait for
    its step, which the push closing that step may need the room of)."""
    opened = current()
    if opened is not None and opened.held:
        held, opened.held = opened.held, 0
        opened.budget.unhold(held)
