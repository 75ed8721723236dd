"""Held checkpoints of one shard: its state at a few named marks, kept in memory, copy on write.

A mark costs nothing when it is taken: it records the step, and from then on the first write
to each row (a push's update, an assign) first copies that row's value and optimizer slots
aside, once per row until the next mark. Rolling back to a mark writes those copies back,
newest mark first: each row ends with its value at the mark (a row first written after a
later mark had the same value at both). So a mark every step costs a copy of the rows each
step changes, not of the table, and holds the rows changed since the oldest mark kept.

Fixed-vocabulary sync shards only (their rows are a fixed array; a keyed shard makes and
evicts rows, an async one has no step every worker shares). A restore or an import of rows
drops every mark: what they replaced was never copied. The server's memory only: a held
checkpoint is gone when the server stops, and a disk checkpoint (`checkpoint.py`) is what
outlives it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

Slots = dict[str, np.ndarray]
Copy = tuple[np.ndarray, np.ndarray, Slots]  # (local rows, their values, their slots)


@dataclass
class _Mark:
    name: str
    step: int
    copies: list[Copy] = field(default_factory=list)  # first writes since this mark
    nbytes: int = 0


class HeldMarks:
    """The marks of one shard, oldest first; only the newest records copies."""

    def __init__(self, num_rows: int) -> None:
        self.marks: list[_Mark] = []
        self._num_rows = num_rows
        self._copied: np.ndarray | None = None  # rows the newest mark has a copy of

    @property
    def nbytes(self) -> int:
        """Bytes of the copies held (the budget counts them with the shard)."""
        return sum(m.nbytes for m in self.marks) + \
            (self._copied.nbytes if self._copied is not None else 0)

    def names(self) -> list[str]:
        return [m.name for m in self.marks]

    def step_of(self, name: str) -> int | None:
        index = self._index(name)
        return None if index is None else self.marks[index].step

    def mark(self, name: str, step: int) -> None:
        """Take a mark at `step` (the shard's state now); the same name again moves it."""
        self.drop(name)
        self.marks.append(_Mark(name, step))
        self._copied = np.zeros(self._num_rows, dtype=bool)

    def before_write(self, rows: np.ndarray, read: Callable[[np.ndarray], Copy]) -> None:
        """Copy aside the rows of `rows` the newest mark has no copy of yet (`read(rows)`:
        their values and slots now), before they are written."""
        if not self.marks or len(rows) == 0:
            return
        first = rows[~self._copied[rows]]
        if len(first) == 0:
            return
        first = np.unique(first)
        self._copied[first] = True
        copy = read(first)
        mark = self.marks[-1]
        mark.copies.append(copy)
        mark.nbytes += copy[1].nbytes + sum(s.nbytes for s in copy[2].values())

    def roll_back(self, name: str, write: Callable[[np.ndarray, np.ndarray, Slots], None]
                  ) -> int:
        """Write back every copy down to mark `name` (`write(rows, values, slots)`); the
        marks after it are dropped and `name` stays, now with no copies. Returns its step."""
        index = self._index(name)
        for mark in reversed(self.marks[index:]):
            for rows, values, slots in reversed(mark.copies):  # (a dropped mark's last)
                write(rows, values, slots)
        kept = self.marks[index]
        self.marks = self.marks[:index]
        self.mark(kept.name, kept.step)
        return kept.step

    def keep(self, newest: int) -> None:
        """Drop all but the newest `newest` marks (their copies are needed only to reach
        them)."""
        del self.marks[:max(0, len(self.marks) - newest)]
        if not self.marks:
            self._copied = None

    def drop(self, name: str) -> None:
        """Drop mark `name` (an aborted save): its copies go to the mark before it, which
        needs them to be reached; the newest mark's record of copied rows is rebuilt."""
        index = self._index(name)
        if index is None:
            return
        mark = self.marks.pop(index)
        if index > 0:
            before = self.marks[index - 1]
            before.copies.extend(mark.copies)
            before.nbytes += mark.nbytes
        self._recount()

    def clear(self) -> None:
        self.marks.clear()
        self._copied = None

    def _recount(self) -> None:
        if not self.marks:
            self._copied = None
            return
        self._copied = np.zeros(self._num_rows, dtype=bool)
        for rows, _, _ in self.marks[-1].copies:
            self._copied[rows] = True

    def _index(self, name: str) -> int | None:
        return next((i for i, m in enumerate(self.marks) if m.name == name), None)
