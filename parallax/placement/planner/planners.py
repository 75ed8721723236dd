"""The planner: enumerate, propose, estimate, place; cache the answer."""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Callable, Mapping, Sequence

from parallax.errors import ConfigError
from parallax.placement.json_cache import cache_path, write_atomically
from parallax.placement.planner.enumerators import ShardCountEnumerator
from parallax.placement.planner.estimators import ServerLoadEstimator, StepTimeEstimator
from parallax.placement.planner.placer import place
from parallax.placement.planner.proposers import (Candidates, GreedyProposer, GridProposer,
                                                  ModelFitProposer, Proposer, uniform_counts)
from parallax.placement.planner.types import (ClusterProfile, Measurement, PartitionPlan,
                                              PlannerError, TableCost, TableProfile,
                                              size_text)

ProposerFactory = Callable[[Candidates, Callable[[str], TableCost]], Proposer]
CACHE_FORMAT = 1


def grid(candidates: Candidates, table_cost: Callable[[str], TableCost]) -> Proposer:
    return GridProposer(candidates)


def greedy(candidates: Candidates, table_cost: Callable[[str], TableCost]) -> Proposer:
    return GreedyProposer(candidates)


def model_fit(candidates: Candidates, table_cost: Callable[[str], TableCost]) -> Proposer:
    return ModelFitProposer(candidates, table_cost)


DEFAULT_PROPOSERS: tuple[ProposerFactory, ...] = (grid, greedy, model_fit)


@dataclasses.dataclass(frozen=True)
class _Tried:
    cost: float
    order: int
    counts: Mapping[str, int]
    source: str


class PartitionPlanner:
    """Chooses every table's shard count and the server of each shard.

    `plan` calibrates the estimator on the measurements, enumerates each table's candidate
    counts, runs each proposer (made by its factory from the candidates and the estimator's
    `table_cost`) until it is exhausted or the time budget is spent, feeding back estimated
    costs, and places the cheapest proposal that fits the servers' memory. Every proposer's
    first proposal is always costed, so a budget of 0 still gives a plan.

    With `cache_dir`, a plan is stored under the sha256 of its inputs and returned from there
    when asked again (the time budget is not part of the key)."""

    def __init__(self, enumerator: ShardCountEnumerator | None = None,
                 estimator: StepTimeEstimator | None = None,
                 proposers: Sequence[ProposerFactory] | None = None,
                 time_budget_seconds: float = 1.0, cache_dir: str | None = None,
                 load: ServerLoadEstimator | None = None) -> None:
        if not time_budget_seconds >= 0:
            raise ConfigError(f"time_budget_seconds must be >= 0, got {time_budget_seconds}")
        self.enumerator = enumerator or ShardCountEnumerator()
        self.estimator = estimator or StepTimeEstimator()
        self.proposers = tuple(DEFAULT_PROPOSERS if proposers is None else proposers)
        if not self.proposers:
            raise ConfigError("PartitionPlanner needs at least one proposer")
        self.time_budget_seconds = time_budget_seconds
        self.cache_dir = cache_dir
        self.load = load or ServerLoadEstimator(self.estimator.prior)

    def plan(self, tables: Sequence[TableProfile], cluster: ClusterProfile,
             measurements: Sequence[Measurement] = ()) -> PartitionPlan:
        tables, measurements = tuple(tables), tuple(measurements)
        names = [t.name for t in tables]
        if len(set(names)) != len(names):
            raise ConfigError(f"table names repeat: {names}")
        path = self._cache_path(tables, cluster, measurements)
        cached = _read_cache(path)
        if cached is not None:
            return cached
        _check_total_memory(tables, cluster)
        candidates = {t.name: self.enumerator.candidates(t, cluster) for t in tables}
        self.estimator.calibrate(measurements, tables, cluster)
        tried = sorted(self._search(candidates), key=lambda t: (t.cost, t.order))
        plan = _place_cheapest(tried, tables, cluster, self.load)
        if path is not None:
            _write_cache(path, plan)
        return plan

    def _search(self, candidates: Candidates) -> list[_Tried]:
        deadline = time.monotonic() + self.time_budget_seconds
        tried: dict[tuple, _Tried] = {}
        for factory in self.proposers:
            proposer = factory(candidates, self.estimator.table_cost)
            first = True
            while first or time.monotonic() < deadline:
                counts = proposer.propose()
                if counts is None:
                    break
                _check_proposal(proposer, counts, candidates)
                cost = self.estimator.estimate(counts)
                proposer.feedback(counts, cost)
                key = tuple(sorted(counts.items()))
                if key not in tried:
                    tried[key] = _Tried(cost, len(tried), dict(counts), proposer.name)
                first = False
        return list(tried.values())

    def _cache_path(self, tables: Sequence[TableProfile], cluster: ClusterProfile,
                    measurements: Sequence[Measurement]) -> Path | None:
        if self.cache_dir is None:
            return None
        key = {
            "format": CACHE_FORMAT,
            "tables": [dataclasses.asdict(t) for t in tables],
            "cluster": dataclasses.asdict(cluster),
            "measurements": [{"counts": dict(m.counts), "step_seconds": m.step_seconds,
                              "table_seconds": dict(m.table_seconds)} for m in measurements],
            "enumerator": dataclasses.asdict(self.enumerator),
            "prior": dataclasses.asdict(self.estimator.prior),
            "load_prior": dataclasses.asdict(self.load.prior),
            "proposers": [f"{f.__module__}.{f.__qualname__}" for f in self.proposers],
        }
        return cache_path(self.cache_dir, key)


def fit_report(estimator: StepTimeEstimator, candidates: Candidates) -> list[tuple[int, float]]:
    """The calibrated model's step time at each shared count n (every table at n, or its
    nearest allowed count below): the curve to plot against a sweep's measurements."""
    values = sorted({c for options in candidates.values() for c in options})
    return [(n, estimator.estimate(uniform_counts(candidates, n))) for n in values]


def _check_proposal(proposer: Proposer, counts: Mapping[str, int],
                    candidates: Candidates) -> None:
    if set(counts) != set(candidates):
        raise ConfigError(f"proposer {proposer.name!r} proposed counts for {sorted(counts)}, "
                          f"not the tables {sorted(candidates)}")
    for name, n in counts.items():
        if n not in candidates[name]:
            raise ConfigError(f"proposer {proposer.name!r} proposed {n} shard(s) for {name!r}, "
                              f"not one of its candidates {candidates[name]}")


def _place_cheapest(tried: Sequence[_Tried], tables: Sequence[TableProfile],
                    cluster: ClusterProfile, load: ServerLoadEstimator) -> PartitionPlan:
    """Place the cheapest proposal whose shards pack into the servers' memory."""
    first_error: PlannerError | None = None
    for t in tried:
        try:
            plan = place(t.counts, tables, cluster, load)
        except PlannerError as e:
            first_error = first_error or e
            continue
        return dataclasses.replace(plan, estimated_step_seconds=t.cost, source=t.source)
    if first_error is not None:
        raise first_error
    return PartitionPlan((), 0.0, "empty")  # no tables


def _check_total_memory(tables: Sequence[TableProfile], cluster: ClusterProfile) -> None:
    memory = cluster.server_memory_bytes
    needed = sum(t.bytes for t in tables)
    if memory is None or needed <= memory * cluster.num_servers:
        return
    largest = max(tables, key=lambda t: t.bytes)
    raise PlannerError(
        f"tables need {size_text(needed)} of server memory but {cluster.num_servers} servers "
        f"have {size_text(memory)} each ({size_text(memory * cluster.num_servers)})",
        [f"add servers: at least {-(-needed // memory)} of {size_text(memory)}",
         f"start the servers with more memory: at least "
         f"{size_text(-(-needed // cluster.num_servers))} each",
         f"place the largest table, {largest.name} ({size_text(largest.bytes)}), with fewer "
         f"optimizer slots or in allreduce (StrategyConfig(placement={{{largest.name!r}: "
         f"'allreduce'}}))"],
        table=largest.name, needed_bytes=needed, server_memory_bytes=memory,
        num_servers=cluster.num_servers)


def _read_cache(path: Path | None) -> PartitionPlan | None:
    if path is None or not path.is_file():
        return None
    try:
        return PartitionPlan.from_json(path.read_text())
    except (OSError, ConfigError):
        return None  # unreadable or from another version: plan again and overwrite


def _write_cache(path: Path, plan: PartitionPlan) -> None:
    write_atomically(path, plan.to_json())
