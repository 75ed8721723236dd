"""Named, reusable barriers: a generation completes when `count` distinct ranks arrive.

A barrier outlives the job that used it (the server keeps running across `parallax run`'s
restarts and elastic stops: only the run's tables are dropped), so a rank whose caller went
away (its RPC cancelled: the worker was killed) leaves it at once, and a barrier nobody waits
in may be met by another number of ranks (an elastic job's new worker count). Else the
restarted rank was refused ("already waits"), or the others passed the barrier with a dead
rank's arrival, and a new count was refused for good."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import grpc

from parallax_ps.errors import RequestError, invalid


@dataclass
class _Barrier:
    count: int
    generation: int = 0
    arrived: set[int] = field(default_factory=set)


class Barriers:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._barriers: dict[str, _Barrier] = {}
        self._closed = False

    def wait(self, name: str, rank: int, count: int, deadline: float | None,
             cancelled: Callable[[], bool] = lambda: False) -> int:
        """The generation `rank` met the others in; `cancelled()`: its caller went away
        (checked every second and at `wake`), which takes its arrival back."""
        if count < 1 or not 0 <= rank < count:
            raise invalid(f"barrier {name!r}: rank {rank} must be in [0, count={count})")
        with self._cond:
            barrier = self._barriers.setdefault(name, _Barrier(count))
            if barrier.count != count and not barrier.arrived:
                barrier.count = count  # nobody waits: the ranks there are now meet here
            if barrier.count != count:
                raise invalid(f"barrier {name!r} was opened for {barrier.count} ranks; rank "
                              f"{rank} says {count}")
            if rank in barrier.arrived:
                raise RequestError(grpc.StatusCode.ALREADY_EXISTS,
                                   f"barrier {name!r}: rank {rank} already waits in generation "
                                   f"{barrier.generation}")
            generation = barrier.generation
            barrier.arrived.add(rank)
            if len(barrier.arrived) == count:
                barrier.arrived.clear()
                barrier.generation += 1
                self._cond.notify_all()
            while barrier.generation == generation:
                remaining = None if deadline is None else deadline - time.monotonic()
                gone = cancelled()
                if self._closed or gone or (remaining is not None and remaining <= 0):
                    barrier.arrived.discard(rank)
                    code, before = (grpc.StatusCode.UNAVAILABLE, "shutdown") if self._closed \
                        else (grpc.StatusCode.CANCELLED, "its caller left") if gone \
                        else (grpc.StatusCode.DEADLINE_EXCEEDED, "the deadline")
                    raise RequestError(code, f"barrier {name!r}: {len(barrier.arrived) + 1} of "
                                       f"{count} ranks arrived before {before}")
                self._cond.wait(timeout=min(remaining, 1.0) if remaining is not None else 1.0)
            return generation

    def wake(self) -> None:
        """Have every waiting rank look again (a caller went away)."""
        with self._cond:
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
