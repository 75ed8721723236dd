"""Proposers: which shard counts to try next. They never compute a cost: the planner tells
them what each proposal cost (`feedback`), or, for `ModelFitProposer`, hands them the
estimator's per-table cost curves."""
from __future__ import annotations

from typing import Callable, Mapping, Protocol

from parallax.errors import ConfigError
from parallax.placement.planner.types import TableCost

Candidates = Mapping[str, tuple[int, ...]]
Counts = dict[str, int]


class Proposer(Protocol):
    name: str

    def propose(self) -> Mapping[str, int] | None:
        """The next counts to try (every table), or None when there is nothing left."""

    def feedback(self, counts: Mapping[str, int], cost: float) -> None:
        """What `counts`, an earlier proposal, costs."""


def _sorted_candidates(candidates: Candidates) -> dict[str, tuple[int, ...]]:
    out = {}
    for name, options in candidates.items():
        if not options:
            raise ConfigError(f"table {name!r} has no candidate shard counts")
        out[name] = tuple(sorted(set(options)))
    return out


def uniform_counts(candidates: Candidates, n: int) -> Counts:
    """Every table at n shards, or at its nearest allowed count below n (its smallest if
    none is): the sweep's one shared count, within each table's bounds."""
    out = {}
    for name, options in _sorted_candidates(candidates).items():
        below = [c for c in options if c <= n]
        out[name] = below[-1] if below else options[0]
    return out


class GridProposer:
    """The Parallax paper's sweep: one shared count for every table, each value of the sorted
    union of the candidates in turn (capped to each table's allowed counts)."""

    name = "grid"

    def __init__(self, candidates: Candidates) -> None:
        values = sorted({c for options in candidates.values() for c in options})
        plans: list[Counts] = []
        for n in values:
            counts = uniform_counts(candidates, n)
            if counts not in plans:
                plans.append(counts)
        self._plans = plans[::-1]

    def propose(self) -> Counts | None:
        return self._plans.pop() if self._plans else None

    def feedback(self, counts: Mapping[str, int], cost: float) -> None:
        pass  # a sweep tries everything regardless


class GreedyProposer:
    """Coordinate descent: start with every table at its smallest count; try moving one table
    one candidate up or down; keep a move that lowers the cost and start over from it; stop
    when no single move improves."""

    name = "greedy"

    def __init__(self, candidates: Candidates) -> None:
        self._options = _sorted_candidates(candidates)
        self._current: Counts = {t: opts[0] for t, opts in self._options.items()}
        self._cost: float | None = None
        self._seen = {self._key(self._current)}
        self._moves: list[Counts] = []
        self._started = False

    @staticmethod
    def _key(counts: Mapping[str, int]) -> tuple:
        return tuple(sorted(counts.items()))

    def _neighbours(self) -> list[Counts]:
        moves = []
        for name in sorted(self._options):
            options = self._options[name]
            i = options.index(self._current[name])
            for j in (i + 1, i - 1):
                if 0 <= j < len(options):
                    move = {**self._current, name: options[j]}
                    if self._key(move) not in self._seen:
                        moves.append(move)
        return moves[::-1]

    def propose(self) -> Counts | None:
        if not self._started:
            self._started = True
            return dict(self._current)
        if self._cost is None:
            return None  # the start was never costed: nothing to compare moves with
        while self._moves:
            move = self._moves.pop()
            if self._key(move) not in self._seen:
                self._seen.add(self._key(move))
                return move
        return None

    def feedback(self, counts: Mapping[str, int], cost: float) -> None:
        if self._cost is None and dict(counts) == self._current:
            self._cost = cost
            self._moves = self._neighbours()
        elif self._cost is not None and cost < self._cost:
            self._current, self._cost = dict(counts), cost
            self._moves = self._neighbours()


class ModelFitProposer:
    """Given each table's fitted cost curve, proposes every table at its own cheapest count
    (the optimum when the step time is a sum of per-table costs), then each single-table
    step to a neighbouring count, for estimators whose costs do not simply add."""

    name = "model-fit"

    def __init__(self, candidates: Candidates,
                 table_cost: Callable[[str], TableCost]) -> None:
        options = _sorted_candidates(candidates)
        best = {name: table_cost(name).best(opts) for name, opts in options.items()}
        plans = [best]
        for name in sorted(options):
            i = options[name].index(best[name])
            for j in (i - 1, i + 1):
                if 0 <= j < len(options[name]):
                    plans.append({**best, name: options[name][j]})
        self._plans = plans[::-1]

    def propose(self) -> Counts | None:
        return self._plans.pop() if self._plans else None

    def feedback(self, counts: Mapping[str, int], cost: float) -> None:
        pass  # the model already chose; the planner keeps the cheapest
