"""Named, reusable barriers: a generation completes when `count` distinct ranks arrive."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

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

    def wait(self, name: str, rank: int, count: int, deadline: float | None) -> int:
        if count < 1 or not 0 <= rank < count:
            raise invalid(f"barrier {name!r}: rank {rank} must be in [0, count={count})")
        with self._cond:
            barrier = self._barriers.setdefault(name, _Barrier(count))
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
                if self._closed or (remaining is not None and remaining <= 0):
                    barrier.arrived.discard(rank)
                    code = grpc.StatusCode.UNAVAILABLE if self._closed else \
                        grpc.StatusCode.DEADLINE_EXCEEDED
                    raise RequestError(code, f"barrier {name!r}: {len(barrier.arrived) + 1} of "
                                       f"{count} ranks arrived before "
                                       f"{'shutdown' if self._closed else 'the deadline'}")
                self._cond.wait(timeout=min(remaining, 1.0) if remaining is not None else 1.0)
            return generation

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
