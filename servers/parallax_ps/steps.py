"""Step bookkeeping of one shard: which workers pushed the open step, and their gradients.

Sync mode closes a step when all `num_workers` workers have sent every chunk of their push;
the aggregate (sum, or mean over workers) is applied once. Async mode applies each chunk on
arrival and counts one step per complete push. A worker may split a large push into
`chunk_count` chunks that arrive in any order; a chunk that arrives twice (a retry) is refused
with ALREADY_EXISTS instead of being applied twice (async: for a worker's last
`ASYNC_HISTORY` steps). A push declares at most `MAX_CHUNKS` chunks.

A step's bookkeeping changes in two stages: `add` records a chunk and hands back what to
apply; the shard then either applies it and calls `complete`, or refuses it and calls
`withdraw`, which leaves the state as it was before `add`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import grpc
import numpy as np

from parallax.protocol.refusals import STEP_AHEAD
from parallax_ps.errors import RequestError, invalid, precondition
from parallax_ps.native_path import aggregate, sum_duplicates

Batch = tuple[np.ndarray, np.ndarray]  # (ids, grads)
ASYNC_HISTORY = 64  # async steps per worker whose chunks are remembered to refuse repeats
MAX_CHUNKS = 1 << 16  # chunks one push may declare (64 GiB in 1 MiB chunks)



def chunk_total(chunk_count: int) -> int:
    """The chunks a push comes in: the wire's 0 (unset) means one whole push; a negative
    count is refused rather than read as one."""
    if chunk_count < 0:
        raise invalid(f"chunk_count {chunk_count} is negative; send 0 or 1 for a whole push, "
                      f"or the number of chunks")
    return max(1, chunk_count)


@dataclass
class _Push:
    """One worker's push for one step, as its chunks arrive."""

    chunk_count: int
    chunks: dict[int, Batch | None] = field(default_factory=dict)  # async keeps no data

    @property
    def whole(self) -> bool:
        return len(self.chunks) == self.chunk_count


@dataclass
class StepState:
    num_workers: int
    sync: bool
    mean: bool
    step: int = 0  # steps applied so far == index of the open step
    pushes: dict[int, _Push] = field(default_factory=dict)  # sync: worker -> open-step push
    learning_rates: dict[int, float] = field(default_factory=dict)
    # async: worker -> (session, step -> push); a new session of a worker forgets the old one
    history: dict[int, tuple[int, dict[int, _Push]]] = field(default_factory=dict)
    buffered_bytes: int = 0  # sync: ids and gradients held for the open step

    def _known(self, worker: int, step: int, session: int) -> _Push | None:
        if self.sync:
            return self.pushes.get(worker)
        known_session, steps = self.history.get(worker, (None, {}))
        return steps.get(step) if known_session == session else None

    def check_push(self, table: str, shard: int, step: int, worker: int, chunk: int,
                   chunks: int, session: int = 0) -> None:
        """Raise (changing nothing) unless `worker` may push this chunk of `step` now."""
        where = f"table {table!r} shard {shard}"
        if not 0 <= worker < self.num_workers:
            raise invalid(f"{where}: worker {worker} is out of range; the table has "
                          f"num_workers={self.num_workers}")
        if chunks > MAX_CHUNKS:
            raise invalid(f"{where}: chunk_count {chunks} is over the server's bound of "
                          f"{MAX_CHUNKS} chunks per push; send fewer, larger chunks "
                          f"(ClientOptions.chunk_mb)")
        if not 0 <= chunk < chunks:
            raise invalid(f"{where}: chunk_index {chunk} is outside [0, chunk_count={chunks})")
        if self.sync and step < self.step:
            raise precondition(f"{where}: step {step} is already closed (the shard has applied "
                               f"{self.step} steps); push step {self.step}")
        if self.sync and step > self.step:
            raise precondition(f"{where}: step {step} {STEP_AHEAD} {self.step}; "
                               f"wait for step {self.step} to close (pull or WaitStep with "
                               f"min_step={step})")
        known = self._known(worker, step, session)
        if known is None:
            return
        if known.chunk_count != chunks:
            raise invalid(f"{where}: worker {worker} step {step}: chunk_count {chunks} differs "
                          f"from the {known.chunk_count} its earlier chunks gave")
        if chunk in known.chunks:
            what = "push" if known.whole and chunks == 1 else f"chunk {chunk} of its push"
            raise RequestError(grpc.StatusCode.ALREADY_EXISTS,
                               f"{where}: worker {worker} already sent the {what} for step "
                               f"{step}")

    def check_learning_rate(self, table: str, learning_rate: float) -> None:
        for other, lr in self.learning_rates.items():
            if lr != learning_rate:
                raise invalid(f"table {table!r}: learning_rate {learning_rate} differs from "
                              f"worker {other}'s {lr} for the same step; workers must agree")

    def add(self, worker: int, step: int, batch: Batch, learning_rate: float, chunk: int,
            chunks: int, session: int = 0) -> tuple[list[Batch], bool]:
        """Record a validated chunk: (batches to apply now, whether they complete a step);
        then `complete` once they are applied, or `withdraw` if they are refused."""
        if not self.sync:
            known_session, steps = self.history.get(worker, (None, {}))
            if known_session != session:
                steps = {}
                self.history[worker] = (session, steps)
            push = steps.setdefault(step, _Push(chunks))
            push.chunks[chunk] = None
            while len(steps) > ASYNC_HISTORY:
                del steps[min(steps)]
            return [sum_duplicates(*batch)], push.whole
        push = self.pushes.setdefault(worker, _Push(chunks))
        push.chunks[chunk] = batch
        self.learning_rates[worker] = learning_rate
        self.buffered_bytes += batch[0].nbytes + batch[1].nbytes
        if len(self.pushes) < self.num_workers or not all(p.whole for p in self.pushes.values()):
            return [], False
        return self._aggregate(), True

    def complete(self) -> tuple:
        """Close the open step (its batches are applied); returns what `reopen` needs."""
        closed = (self.pushes, self.learning_rates, self.buffered_bytes)
        self.step += 1
        if self.sync:
            self.pushes, self.learning_rates, self.buffered_bytes = {}, {}, 0
        return closed

    def reopen(self, closed: tuple) -> None:
        """Undo `complete` (a later part of the same request was refused)."""
        self.step -= 1
        if self.sync:
            self.pushes, self.learning_rates, self.buffered_bytes = closed

    def withdraw(self, worker: int, step: int, batch: Batch, chunk: int, session: int) -> None:
        """Forget a chunk `add` recorded, whose update was refused: as before `add`."""
        push = self._known(worker, step, session)
        if push is None:
            return
        push.chunks.pop(chunk, None)
        if self.sync:
            self.buffered_bytes -= batch[0].nbytes + batch[1].nbytes
        if push.chunks:
            return
        if self.sync:
            del self.pushes[worker]
            self.learning_rates.pop(worker, None)
        else:
            self.history[worker][1].pop(step, None)

    def _aggregate(self) -> list[Batch]:
        """The step's gradient as batches with disjoint ids (the pushes stay recorded until
        `complete`).

        One worker's chunks whose ids are already increasing across chunks (what the client
        sends) are applied chunk by chunk, avoiding a copy the size of the whole push."""
        chunks = [push.chunks[c] for _, push in sorted(self.pushes.items())
                  for c in sorted(push.chunks)]
        if self.num_workers == 1:
            ids = np.concatenate([c[0] for c in chunks]) if len(chunks) > 1 else chunks[0][0]
            if len(ids) < 2 or bool(np.all(ids[1:] > ids[:-1])):
                return chunks
        return [aggregate(chunks, self.num_workers if self.mean else 0)]

    def reset(self, step: int) -> None:
        """Forget every push (after a restore) and continue from `step`."""
        self.step = step
        self.pushes.clear()
        self.learning_rates.clear()
        self.history.clear()
        self.buffered_bytes = 0

    def pending_keys(self) -> list[np.ndarray]:
        return [b[0] for p in self.pushes.values() for b in p.chunks.values() if b is not None]

    @property
    def pending(self) -> bool:
        return bool(self.pushes)

    def pushed_workers(self) -> list[int]:
        """Sync: the workers whose push for the open step is complete."""
        return sorted(w for w, p in self.pushes.items() if p.whole)

    def waiting_for(self) -> str:
        """Sync: who the open step waits for, named for a timeout's message: the workers
        that have not pushed it, and those whose push still lacks chunks."""
        missing = [w for w in range(self.num_workers) if w not in self.pushes]
        partial = sorted(w for w, p in self.pushes.items() if not p.whole)
        text = (f"worker(s) {missing} of {self.num_workers} have not pushed step {self.step}"
                if missing else f"every worker has started its push for step {self.step}")
        if partial:
            text += f"; worker(s) {partial} sent only part of their chunks"
        return text + f" (complete pushes: {self.pushed_workers()})"
