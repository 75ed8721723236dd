"""Step bookkeeping of one shard: which workers pushed the open step, and their gradients.

Sync mode closes a step when all `num_workers` workers have sent their last push chunk; the
aggregate (sum, or mean over workers) is applied once. Async mode applies every complete push
on arrival and just counts steps. A worker may split a large push into `chunk_count` chunks
that arrive in any order; they are held until all have arrived.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import grpc
import numpy as np

from parallax.routing import sum_duplicates
from parallax_ps.errors import RequestError, invalid, precondition


@dataclass
class StepState:
    num_workers: int
    sync: bool
    mean: bool
    step: int = 0  # steps applied so far == index of the open step
    parts: dict[int, dict[int, tuple[np.ndarray, np.ndarray]]] = field(default_factory=dict)
    learning_rates: dict[int, float] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)  # workers whose push for the step is whole

    def check_push(self, table: str, shard: int, step: int, worker: int, chunk: int,
                   chunks: int) -> None:
        """Raise (changing nothing) unless `worker` may push this chunk of `step` now."""
        if not 0 <= worker < self.num_workers:
            raise invalid(f"table {table!r} shard {shard}: worker {worker} is out of range; "
                          f"the table has num_workers={self.num_workers}")
        if not 0 <= chunk < chunks:
            raise invalid(f"table {table!r} shard {shard}: chunk_index {chunk} is outside "
                          f"[0, chunk_count={chunks})")
        if chunk in self.parts.get(worker, {}):
            raise RequestError(grpc.StatusCode.ALREADY_EXISTS,
                               f"table {table!r} shard {shard}: worker {worker} already sent "
                               f"chunk {chunk} of this push")
        if not self.sync:
            return
        if step < self.step:
            raise precondition(f"table {table!r} shard {shard}: step {step} is already closed "
                               f"(the shard has applied {self.step} steps); push step {self.step}")
        if step > self.step:
            raise precondition(f"table {table!r} shard {shard}: step {step} is ahead of the open "
                               f"step {self.step}; wait for step {self.step} to close "
                               f"(pull or WaitStep with min_step={step})")
        if worker in self.finished:
            raise RequestError(grpc.StatusCode.ALREADY_EXISTS,
                               f"table {table!r} shard {shard}: worker {worker} already pushed "
                               f"step {step}")

    def check_learning_rate(self, table: str, worker: int, learning_rate: float) -> None:
        known = {w: lr for w, lr in self.learning_rates.items() if self.sync or w == worker}
        for other, lr in known.items():
            if lr != learning_rate:
                raise invalid(f"table {table!r}: learning_rate {learning_rate} differs from "
                              f"worker {other}'s {lr} for the same step; workers must agree")

    def add(self, worker: int, ids: np.ndarray, grads: np.ndarray, learning_rate: float,
            chunk: int, chunks: int) -> bool:
        """Record a validated chunk; True when a step (sync) or push (async) is ready."""
        received = self.parts.setdefault(worker, {})
        received[chunk] = (ids, grads)
        self.learning_rates[worker] = learning_rate
        if len(received) < chunks:
            return False
        self.finished.add(worker)
        return not self.sync or len(self.finished) == self.num_workers

    def take(self, worker: int) -> tuple[np.ndarray, np.ndarray, float]:
        """The ready aggregate: (unique ids, summed or averaged grads, learning rate).

        Sync: every worker's chunks; async: the chunks of the worker that just finished."""
        workers = sorted(self.finished) if self.sync else [worker]
        chunks = [c for w in workers for c in self.parts.pop(w).values()]
        lr = self.learning_rates[workers[0]]
        for w in workers:
            self.learning_rates.pop(w)
        self.finished.difference_update(workers)
        if len(chunks) == 1:
            unique, summed = sum_duplicates(*chunks[0])
        else:
            unique, summed = sum_duplicates(np.concatenate([c[0] for c in chunks]),
                                            np.concatenate([c[1] for c in chunks]))
        if self.sync and self.mean:
            summed = summed / summed.dtype.type(self.num_workers)
        return unique, summed, lr

    def pending_keys(self) -> list[np.ndarray]:
        return [ids for chunks in self.parts.values() for ids, _ in chunks.values()]

    @property
    def pending(self) -> bool:
        return bool(self.parts)

    def pushed_workers(self) -> list[int]:
        return sorted(self.finished)
