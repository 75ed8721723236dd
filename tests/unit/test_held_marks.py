"""`parallax_ps.held.HeldMarks` on a plain array: every rollback gives the values at its mark,
whatever marks were taken, dropped or kept in between."""
from __future__ import annotations

import numpy as np

from parallax_ps.held import HeldMarks


class _Rows:
    def __init__(self, n: int) -> None:
        self.values = np.arange(n, dtype=np.float64)[:, None] * np.ones((1, 2))
        self.slot = self.values * 10
        self.marks = HeldMarks(n)

    def read(self, rows):
        return rows, self.values[rows].copy(), {"s": self.slot[rows].copy()}

    def write(self, rows, values, slots):
        self.values[rows], self.slot[rows] = values, slots["s"]

    def step(self, rng) -> None:
        rows = rng.integers(0, len(self.values), size=7)
        rows = np.unique(rows)
        self.marks.before_write(rows, self.read)
        self.values[rows] += rng.normal(size=(len(rows), 2))
        self.slot[rows] += 1

    def state(self):
        return self.values.copy(), self.slot.copy()


def _same(a, b) -> None:
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def test_rollback_through_dropped_and_moved_marks():
    rng = np.random.default_rng(0)
    rows = _Rows(50)
    seen = {}
    for i, name in enumerate("abcd"):
        seen[name] = rows.state()
        rows.marks.mark(name, i)
        for _ in range(3):
            rows.step(rng)
    rows.marks.drop("b")  # an aborted save in the middle: its copies go to "a"
    rows.marks.drop("d")  # the newest: "c" records again
    for _ in range(2):
        rows.step(rng)
    assert rows.marks.roll_back("c", rows.write) == 2
    _same(rows.state(), seen["c"])
    rows.step(rng)
    assert rows.marks.roll_back("a", rows.write) == 0
    _same(rows.state(), seen["a"])
    assert rows.marks.names() == ["a"]


def test_keep_and_a_name_taken_again():
    rng = np.random.default_rng(1)
    rows = _Rows(20)
    rows.marks.mark("x", 0)
    rows.step(rng)
    rows.marks.mark("y", 1)
    rows.step(rng)
    at_x2 = rows.state()
    rows.marks.mark("x", 2)  # moved: now the newest
    rows.step(rng)
    assert rows.marks.names() == ["y", "x"]
    rows.marks.keep(1)
    assert rows.marks.names() == ["x"] and rows.marks.nbytes > 0
    rows.marks.roll_back("x", rows.write)
    _same(rows.state(), at_x2)
    rows.marks.clear()
    assert rows.marks.nbytes == 0 and rows.marks.step_of("x") is None
