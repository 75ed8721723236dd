"""Step bookkeeping of one shard: which workers pushed the open step, and their gradients.

Sync mode closes a step when all `num_workers` pushes are in; the aggregate (sum, or mean over
workers) is applied once. Async mode applies every push on arrival and just counts steps.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import grpc
import numpy as np

from parallax.routing import sum_duplicates
from parallax_ps.errors import RequestError, precondition


@dataclass
class StepState:
    num_workers: int
    sync: bool
    mean: bool
    step: int = 0  # steps applied so far == index of the open step
    pending: dict[int, tuple[np.ndarray, np.ndarray, float]] = field(default_factory=dict)

    def check_push(self, table: str, shard: int, step: int, worker: int) -> None:
        """Raise (changing nothing) unless `worker` may push `step` now."""
        if not 0 <= worker < self.num_workers:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"table {table!r} shard {shard}: worker {worker} is out of range; "
                               f"the table has num_workers={self.num_workers}")
        if not self.sync:
            return
        if step < self.step:
            raise precondition(f"table {table!r} shard {shard}: step {step} is already closed "
                               f"(the shard has applied {self.step} steps); push step {self.step}")
        if step > self.step:
            raise precondition(f"table {table!r} shard {shard}: step {step} is ahead of the open "
                               f"step {self.step}; wait for step {self.step} to close "
                               f"(pull or WaitStep with min_step={step})")
        if worker in self.pending:
            raise RequestError(grpc.StatusCode.ALREADY_EXISTS,
                               f"table {table!r} shard {shard}: worker {worker} already pushed "
                               f"step {step}")

    def check_learning_rate(self, table: str, learning_rate: float) -> None:
        for worker, (_, _, lr) in self.pending.items():
            if lr != learning_rate:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"table {table!r}: learning_rate {learning_rate} differs from "
                                   f"worker {worker}'s {lr} for the same step; workers must agree")

    def add(self, worker: int, ids: np.ndarray, grads: np.ndarray, learning_rate: float) -> bool:
        """Record a validated push; True when the step is complete and must be applied."""
        self.pending[worker] = (ids, grads, learning_rate)
        return not self.sync or len(self.pending) == self.num_workers

    def take(self) -> tuple[np.ndarray, np.ndarray, float]:
        """The step's aggregate (unique ids, summed or averaged grads, learning rate)."""
        parts = list(self.pending.values())
        self.pending.clear()
        ids = np.concatenate([p[0] for p in parts])
        grads = np.concatenate([p[1] for p in parts])
        unique, summed = sum_duplicates(ids, grads)
        if self.sync and self.mean:
            summed = summed / summed.dtype.type(self.num_workers)
        return unique, summed, parts[0][2]

    def pending_keys(self) -> list[np.ndarray]:
        return [p[0] for p in self.pending.values()]

    def pushed_workers(self) -> list[int]:
        return sorted(self.pending)
