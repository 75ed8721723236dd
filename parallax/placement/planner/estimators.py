"""Every cost the planner knows: shard sizes, where reads land, requests, seconds per step.

The model is additive: a step takes a base time plus, per sparse table, a `TableCost` of its
shard count. Before any measurement each table's cost comes from a prior built from the
cluster's physics (`prior_cost`); `StepTimeEstimator.calibrate` replaces it with what the
measurements support.
"""
from __future__ import annotations

import itertools
import math
from typing import Mapping, Sequence

import numpy as np

from parallax.errors import ConfigError
from parallax.placement.planner.types import (ClusterProfile, CostPrior, FitPoint, Measurement,
                                              TableCost, TableProfile)


def _check_count(table: TableProfile, n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= table.rows:
        raise ConfigError(f"shard count of {table.name!r} must be an int in [1, {table.rows}] "
                          f"(its rows), got {n!r}")


def shard_rows(table: TableProfile, n: int) -> np.ndarray:
    """Rows of each of n shards under MOD partitioning (shard s holds the ids with id % n == s)."""
    _check_count(table, n)
    return (table.rows - np.arange(n, dtype=np.int64) + n - 1) // n


def shard_bytes(table: TableProfile, n: int) -> tuple[int, ...]:
    """Bytes of each of n shards (values and slots, rounded up)."""
    return tuple(-(-int(r) * table.bytes // table.rows) for r in shard_rows(table, n))


def bytes_per_shard(table: TableProfile, n: int) -> int:
    """Bytes of the largest of n shards: shard 0, with ceil(rows / n) rows."""
    _check_count(table, n)
    largest = -(-table.rows // n)
    return -(-largest * table.bytes // table.rows)


def requests_per_step(counts: Mapping[str, int], workers: int) -> int:
    """Requests the servers receive per step: every worker pulls from and pushes to every
    shard once."""
    return 2 * workers * sum(counts.values())


def shard_access_shares(table: TableProfile, n: int) -> np.ndarray:
    """Fraction of the table's row reads that land on each of n shards under MOD partitioning:
    each hot id's share exactly on shard id % n, the rest spread over the other ids uniformly
    (so over the shards in proportion to how many of the other ids each holds)."""
    shares = np.zeros(n)
    hot = np.asarray(table.hot_ids, dtype=np.int64) % n
    np.add.at(shares, hot, np.asarray(table.hot_shares, dtype=np.float64))
    cold_ids = shard_rows(table, n) - np.bincount(hot, minlength=n)
    rest = max(0.0, 1.0 - sum(table.hot_shares))
    total = int(cold_ids.sum())
    return shares + (rest * cold_ids / total if total else rest / n)


def parallelism(cluster: ClusterProfile, prior: CostPrior) -> int:
    return prior.server_parallelism or cluster.num_servers


def prior_cost(table: TableProfile, cluster: ClusterProfile, prior: CostPrior) -> TableCost:
    """The cost of a table before anything is measured, counted as server work per step
    spread over the P servers that work at once (the servers are the shared resource):

    - requests: each of W workers pulls from and pushes to each shard, 2 n W requests of
      `request_seconds` each over P servers: a = 2 W r / P per shard (the first in `fixed`);
    - bytes: the unique rows each worker pulls (values) and pushes (gradients),
      2 W u dim value_bytes in all, over the links of the min(n, P) servers holding shards:
      b / min(n, P) with b = 2 W u dim value_bytes / bytes_per_second.

    So a small or unmeasured table (b ~ 0) costs least whole, and a table whose rows dominate
    the traffic is worth splitting until sqrt(b / a) shards or the servers run out."""
    p, w = parallelism(cluster, prior), cluster.num_workers
    per_shard = 2 * w * prior.request_seconds / p
    wire = 2 * w * table.unique_rows_per_step * table.dim * prior.value_bytes
    return TableCost(fixed=per_shard, per_shard=per_shard,
                     divisible=wire / prior.bytes_per_second, parallelism=p)


def nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares for a few columns, exactly: the optimum is the unconstrained
    least-squares solution on some subset of the columns (the rest at 0), so try them all."""
    best, best_err = np.zeros(x.shape[1]), float(np.sum(y**2))
    for k in range(1, x.shape[1] + 1):
        for cols in itertools.combinations(range(x.shape[1]), k):
            coef, *_ = np.linalg.lstsq(x[:, cols], y, rcond=None)
            if np.any(coef < 0):
                continue
            err = float(np.sum((x[:, cols] @ coef - y) ** 2))
            if err < best_err - 1e-15 * max(1.0, best_err):
                best, best_err = np.zeros(x.shape[1]), err
                best[list(cols)] = coef
    return best


def _scaled(prior: TableCost, factor: float) -> TableCost:
    return TableCost(prior.fixed * factor, prior.per_shard * factor, prior.divisible * factor,
                     prior.parallelism)


def _fit_table(prior: TableCost, points: Sequence[tuple[int, float]]) -> TableCost:
    """Per-table fit on (n, seconds): the paper's three coefficients when 3 or more counts
    were measured, else the prior scaled through the measurements' mean."""
    n = np.array([p[0] for p in points], dtype=np.float64)
    y = np.array([p[1] for p in points], dtype=np.float64)
    if len(set(n.tolist())) >= 3:
        spread = np.minimum(n, prior.parallelism or np.inf)
        b, a, c = nnls(np.column_stack([1 / spread, n - 1, np.ones_like(n)]), y)
        return TableCost(fixed=float(c), per_shard=float(a), divisible=float(b),
                         parallelism=prior.parallelism)
    expected = float(np.mean([prior.seconds(int(k)) for k in n]))
    if expected <= 0:
        return TableCost(float(np.mean(y)), 0.0, 0.0, prior.parallelism)
    return _scaled(prior, float(np.mean(y)) / expected)


def _fit_step(priors: Mapping[str, TableCost], counts: Sequence[Mapping[str, int]],
              rest: np.ndarray) -> dict[str, TableCost]:
    """Fit tables with no per-table time on what the step time leaves (`rest`): the sum of
    their priors' divisible parts scaled by one factor, their request parts by another, plus
    a base. With every table at one count (a sweep) this is the paper's whole-step
    t(n) = B/n + A(n-1) + C, whose B and A are then shared in proportion to the priors."""
    div = np.array([sum(p.divisible / min(c[t], p.parallelism or c[t]) for t, p in priors.items())
                    for c in counts])
    req = np.array([sum(p.per_shard * (c[t] - 1) + p.fixed for t, p in priors.items())
                    for c in counts])
    if len(set(zip(div.tolist(), req.tolist()))) >= 3:
        k_div, k_req, _ = nnls(np.column_stack([div, req, np.ones_like(div)]), rest)
    else:
        total = float(np.mean(div + req))
        k_div = k_req = float(np.mean(rest)) / total if total > 0 else 0.0
    return {t: TableCost(p.fixed * k_req, p.per_shard * k_req, p.divisible * k_div,
                         p.parallelism) for t, p in priors.items()}


class StepTimeEstimator:
    """Seconds per step of a plan: base + sum over tables of TableCost(shards), calibrated on
    measurements (see `calibrate`). A stateful component: `calibrate` first, then ask."""

    def __init__(self, prior: CostPrior | None = None) -> None:
        self.prior = prior or CostPrior()
        self._costs: dict[str, TableCost] = {}
        self._base = 0.0
        self._measurements: tuple[Measurement, ...] = ()
        self._calibrated = False

    def calibrate(self, measurements: Sequence[Measurement], tables: Sequence[TableProfile],
                  cluster: ClusterProfile) -> StepTimeEstimator:
        """Per table: with its own seconds measured at 3+ counts, fit its three coefficients
        (non-negative least squares); at 1-2 counts, scale its prior through their mean.
        Tables without their own seconds are fitted together on the step time (`_fit_step`);
        with no measurements at all, they keep their prior. The base time is what the step
        time leaves over the tables, on average (>= 0)."""
        measurements = tuple(measurements)
        priors = {t.name: prior_cost(t, cluster, self.prior) for t in tables}
        for i, m in enumerate(measurements):
            missing = [t for t in priors if t not in m.counts]
            if missing:
                raise ConfigError(f"measurement {i} has no shard count for table(s) {missing}")
        costs: dict[str, TableCost] = {}
        for name, prior in priors.items():
            points = [(m.counts[name], m.table_seconds[name]) for m in measurements
                      if name in m.table_seconds]
            if points:
                costs[name] = _fit_table(prior, points)
        unmeasured = {t: p for t, p in priors.items() if t not in costs}
        if unmeasured and measurements:
            rest = np.array([m.step_seconds - self._sum(costs, m.counts) for m in measurements])
            costs.update(_fit_step(unmeasured, [m.counts for m in measurements], rest))
        else:
            costs.update(unmeasured)
        self._costs, self._measurements, self._calibrated = costs, measurements, True
        self._base = max(0.0, float(np.mean([m.step_seconds - self._sum(costs, m.counts)
                                             for m in measurements]))) if measurements else 0.0
        return self

    @staticmethod
    def _sum(costs: Mapping[str, TableCost], counts: Mapping[str, int]) -> float:
        return sum(cost.seconds(counts[name]) for name, cost in costs.items())

    def _check(self) -> None:
        if not self._calibrated:
            raise ConfigError("StepTimeEstimator: call calibrate(measurements, tables, "
                              "cluster) before asking for estimates")

    @property
    def base_seconds(self) -> float:
        self._check()
        return self._base

    def table_cost(self, name: str) -> TableCost:
        self._check()
        if name not in self._costs:
            raise ConfigError(f"no table {name!r} was calibrated; known: "
                              f"{', '.join(self._costs)}")
        return self._costs[name]

    def estimate(self, counts: Mapping[str, int]) -> float:
        self._check()
        missing = [t for t in self._costs if t not in counts]
        if missing:
            raise ConfigError(f"estimate needs a shard count for table(s) {missing}")
        return self._base + self._sum(self._costs, counts)

    def fitted_points(self) -> tuple[FitPoint, ...]:
        """Each measured table time and step time beside the model's value for it."""
        points = []
        for m in self._measurements:
            for name, seconds in m.table_seconds.items():
                if name in self._costs:
                    points.append(FitPoint(name, m.counts[name], seconds,
                                           self._costs[name].seconds(m.counts[name])))
            shared = {m.counts[t] for t in self._costs}
            points.append(FitPoint("", shared.pop() if len(shared) == 1 else 0,
                                   m.step_seconds, self.estimate(m.counts)))
        return tuple(points)

    def residual(self) -> float | None:
        """RMS relative error of the estimated step times against the measured ones (None
        without measurements of a positive step time)."""
        errors = [(p.estimated_seconds - p.measured_seconds) / p.measured_seconds
                  for p in self.fitted_points() if not p.table and p.measured_seconds > 0]
        return math.sqrt(sum(e * e for e in errors) / len(errors)) if errors else None


class ServerLoadEstimator:
    """Seconds of server work per step each shard brings, for balancing servers: its 2 W
    requests, plus its share of the table's row reads (`shard_access_shares`) times the
    table's pulled and pushed unique-row bytes over the link. Uses the same `CostPrior`
    constants as the step estimator, so loads and step times are in one unit.

    Access share x unique rows overstates a hot shard when workers deduplicate ids (a hot id
    is one row however often it is read); per-shard unique-row counts, once measured, are
    the better weight."""

    def __init__(self, prior: CostPrior | None = None) -> None:
        self.prior = prior or CostPrior()

    def shard_loads(self, table: TableProfile, n: int, cluster: ClusterProfile) -> np.ndarray:
        w = cluster.num_workers
        rows = shard_access_shares(table, n) * table.unique_rows_per_step
        wire = 2 * w * rows * table.dim * self.prior.value_bytes / self.prior.bytes_per_second
        return 2 * w * self.prior.request_seconds + wire
