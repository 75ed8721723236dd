"""Step bookkeeping of one shard: which workers pushed the open step, and their gradients.

Sync mode closes a step when all `num_workers` workers have sent every chunk of their push;
the aggregate (sum, or mean over workers) is applied once. Async mode applies each chunk on
arrival and counts one step per complete push. A worker may split a large push into
`chunk_count` chunks that arrive in any order; a chunk that arrives twice (a retry) is refused
with ALREADY_EXISTS instead of being applied twice.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import grpc
import numpy as np

from parallax.routing import sum_duplicates
from parallax_ps.errors import RequestError, invalid, precondition

Batch = tuple[np.ndarray, np.ndarray]  # (ids, grads)


@dataclass
class StepState:
    num_workers: int
    sync: bool
    mean: bool
    step: int = 0  # steps applied so far == index of the open step
    parts: dict[int, dict[int, Batch]] = field(default_factory=dict)  # sync: worker -> chunks
    learning_rates: dict[int, float] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)  # sync: workers whose push is whole
    recent: dict[int, tuple[int, set[int]]] = field(default_factory=dict)  # async: last push

    def check_push(self, table: str, shard: int, step: int, worker: int, chunk: int,
                   chunks: int) -> None:
        """Raise (changing nothing) unless `worker` may push this chunk of `step` now."""
        where = f"table {table!r} shard {shard}"
        if not 0 <= worker < self.num_workers:
            raise invalid(f"{where}: worker {worker} is out of range; the table has "
                          f"num_workers={self.num_workers}")
        if not 0 <= chunk < chunks:
            raise invalid(f"{where}: chunk_index {chunk} is outside [0, chunk_count={chunks})")
        if not self.sync:
            last_step, seen = self.recent.get(worker, (None, set()))
            if last_step == step and chunk in seen:
                raise RequestError(grpc.StatusCode.ALREADY_EXISTS,
                                   f"{where}: worker {worker} already sent chunk {chunk} of "
                                   f"step {step}")
            return
        if step < self.step:
            raise precondition(f"{where}: step {step} is already closed (the shard has applied "
                               f"{self.step} steps); push step {self.step}")
        if step > self.step:
            raise precondition(f"{where}: step {step} is ahead of the open step {self.step}; "
                               f"wait for step {self.step} to close (pull or WaitStep with "
                               f"min_step={step})")
        if worker in self.finished:
            raise RequestError(grpc.StatusCode.ALREADY_EXISTS,
                               f"{where}: worker {worker} already pushed step {step}")
        if chunk in self.parts.get(worker, {}):
            raise RequestError(grpc.StatusCode.ALREADY_EXISTS,
                               f"{where}: worker {worker} already sent chunk {chunk} of this "
                               f"push")

    def check_learning_rate(self, table: str, learning_rate: float) -> None:
        for other, lr in self.learning_rates.items():
            if lr != learning_rate:
                raise invalid(f"table {table!r}: learning_rate {learning_rate} differs from "
                              f"worker {other}'s {lr} for the same step; workers must agree")

    def add(self, worker: int, step: int, batch: Batch, learning_rate: float, chunk: int,
            chunks: int) -> tuple[list[Batch], bool]:
        """Record a validated chunk: (batches to apply now, whether a step is completed)."""
        if not self.sync:
            last_step, seen = self.recent.get(worker, (None, set()))
            seen = seen if last_step == step else set()
            seen.add(chunk)
            self.recent[worker] = (step, seen)
            return [batch], len(seen) == chunks
        received = self.parts.setdefault(worker, {})
        received[chunk] = batch
        self.learning_rates[worker] = learning_rate
        if len(received) == chunks:
            self.finished.add(worker)
        if len(self.finished) < self.num_workers:
            return [], False
        return self._aggregate(), True

    def _aggregate(self) -> list[Batch]:
        """The step's gradient as batches with disjoint ids, then reset for the next step.

        One worker's chunks whose ids are already increasing across chunks (what the client
        sends) are applied chunk by chunk, avoiding a copy the size of the whole push."""
        chunks = [self.parts[w][c] for w in sorted(self.parts) for c in sorted(self.parts[w])]
        self.parts.clear()
        self.finished.clear()
        self.learning_rates.clear()
        ids = np.concatenate([c[0] for c in chunks]) if len(chunks) > 1 else chunks[0][0]
        if self.num_workers == 1 and (len(ids) < 2 or bool(np.all(ids[1:] > ids[:-1]))):
            return chunks
        unique, summed = sum_duplicates(ids, np.concatenate([c[1] for c in chunks]))
        if self.mean:
            summed = summed / summed.dtype.type(self.num_workers)
        return [(unique, summed)]

    def pending_keys(self) -> list[np.ndarray]:
        return [ids for chunks in self.parts.values() for ids, _ in chunks.values()]

    @property
    def pending(self) -> bool:
        return bool(self.parts)

    def pushed_workers(self) -> list[int]:
        return sorted(self.finished)
