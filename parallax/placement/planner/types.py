"""Value types of the planner: what it is told (table and cluster profiles, measurements),
what it models (a table's cost curve), what it answers (a partition plan) and its one error.

All frozen; mappings are stored as `FrozenMap`, so every value here is hashable and can be
shared between the planner's components without copies.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping, Sequence, TypeVar

from parallax.errors import ConfigError, ParallaxError

V = TypeVar("V")
PLAN_FORMAT = 1  # the "version" field of PartitionPlan.to_json


class FrozenMap(Mapping[str, V]):
    """A read-only, hashable mapping (a copy of what it was built from)."""

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[str, V] | Iterable[tuple[str, V]] = ()) -> None:
        self._items = dict(items)

    def __getitem__(self, key: str) -> V:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(frozenset(self._items.items()))

    def __repr__(self) -> str:
        return f"FrozenMap({self._items!r})"


def size_text(nbytes: float) -> str:
    """'40.0 GiB', '12.5 MiB' or '300 B'."""
    if abs(nbytes) >= 2**30:
        return f"{nbytes / 2**30:.1f} GiB"
    return f"{nbytes / 2**20:.1f} MiB" if abs(nbytes) >= 2**20 else f"{nbytes:.0f} B"


def by_name(items: Iterable[Any], name: str, what: str) -> Any:
    """The item of `items` called `name` (a plan's table or variable); a KeyError naming
    the ones it has otherwise, so a typo shows its fix."""
    items = tuple(items)
    for item in items:
        if item.name == name:
            return item
    raise KeyError(f"no {what} {name!r} in the plan; known: "
                   f"{', '.join(i.name for i in items)}")


def _finite(value: float, minimum: float, what: str) -> float:
    if not isinstance(value, (int, float)) or not math.isfinite(value) or value < minimum:
        raise ConfigError(f"{what} must be a finite number >= {minimum}, got {value!r}")
    return float(value)


def _int(value: object, minimum: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{what} must be an int >= {minimum}, got {value!r}")
    return value


@dataclass(frozen=True)
class TableProfile:
    """One sparse table. `bytes`: values plus optimizer slots of the whole table;
    `unique_rows_per_step`: distinct rows one worker reads per step (measured, 0 if unknown);
    `hot_ids`/`hot_shares`: the most-read global ids and the fraction of all row reads each
    takes (a Zipf head); the other reads are taken to be spread uniformly over the other ids."""

    name: str
    rows: int
    dim: int
    bytes: int
    unique_rows_per_step: float = 0.0
    hot_ids: tuple[int, ...] = ()
    hot_shares: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"a table's name must be a non-empty str, got {self.name!r}")
        where = f"of table {self.name!r}"
        _int(self.rows, 1, f"rows {where}")
        _int(self.dim, 1, f"dim {where}")
        _int(self.bytes, 0, f"bytes {where}")
        _finite(self.unique_rows_per_step, 0, f"unique_rows_per_step {where}")
        if self.unique_rows_per_step > self.rows:
            raise ConfigError(f"unique_rows_per_step {where} is {self.unique_rows_per_step}, "
                              f"more than its {self.rows} rows")
        object.__setattr__(self, "hot_ids", tuple(self.hot_ids))
        object.__setattr__(self, "hot_shares", tuple(float(s) for s in self.hot_shares))
        if len(self.hot_ids) != len(self.hot_shares):
            raise ConfigError(f"hot_ids and hot_shares {where} differ in length "
                              f"({len(self.hot_ids)} and {len(self.hot_shares)})")
        for i in self.hot_ids:
            _int(i, 0, f"hot_ids {where}")
            if i >= self.rows:
                raise ConfigError(f"hot_ids {where}: id {i} is not below rows={self.rows}")
        if len(set(self.hot_ids)) != len(self.hot_ids):
            raise ConfigError(f"hot_ids {where} repeat an id")
        for s in self.hot_shares:
            if not 0.0 <= s <= 1.0:
                raise ConfigError(f"hot_shares {where} must be in [0, 1], got {s}")
        if sum(self.hot_shares) > 1 + 1e-9:
            raise ConfigError(f"hot_shares {where} sum to {sum(self.hot_shares):.6g}, over 1")


@dataclass(frozen=True)
class ClusterProfile:
    num_servers: int
    num_workers: int
    server_memory_bytes: int | None = None  # None: unknown, not checked

    def __post_init__(self) -> None:
        _int(self.num_servers, 1, "num_servers")
        _int(self.num_workers, 1, "num_workers")
        if self.server_memory_bytes is not None:
            _int(self.server_memory_bytes, 1, "server_memory_bytes")


@dataclass(frozen=True)
class Measurement:
    """One sampled plan: every table's shard count, the measured seconds per step and,
    optionally, per table the seconds a worker spent per step in its pulls and pushes."""

    counts: Mapping[str, int]
    step_seconds: float
    table_seconds: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, n in self.counts.items():
            _int(n, 1, f"counts[{name!r}] of a measurement")
        _finite(self.step_seconds, 0, "step_seconds of a measurement")
        for name, s in self.table_seconds.items():
            if name not in self.counts:
                raise ConfigError(f"table_seconds names {name!r}, which has no entry in counts")
            _finite(s, 0, f"table_seconds[{name!r}] of a measurement")
        object.__setattr__(self, "counts", FrozenMap(self.counts))
        object.__setattr__(self, "table_seconds",
                           FrozenMap((k, float(v)) for k, v in self.table_seconds.items()))


@dataclass(frozen=True)
class CostPrior:
    """Physical constants of the cost model before anything is measured (docs/benchmarks.md):
    ~1 ms of server CPU per request in Python gRPC, 1 Gbit/s links, float32 rows on the wire,
    and as many requests served at once as there are servers (None: the cluster's count)."""

    request_seconds: float = 1e-3
    bytes_per_second: float = 125e6
    server_parallelism: int | None = None
    value_bytes: int = 4

    def __post_init__(self) -> None:
        _finite(self.request_seconds, 0, "request_seconds")
        if _finite(self.bytes_per_second, 0, "bytes_per_second") == 0:
            raise ConfigError("bytes_per_second must be > 0")
        if self.server_parallelism is not None:
            _int(self.server_parallelism, 1, "server_parallelism")
        _int(self.value_bytes, 1, "value_bytes")


@dataclass(frozen=True)
class TableCost:
    """Seconds per step a table costs with n shards, the Parallax paper's fit
    t(n) = b/n + a(n-1) + c, with b = `divisible`, a = `per_shard`, c = `fixed`. With
    `parallelism` P set, the divisible part stops shrinking past P shards (b/min(n, P)):
    shards beyond the servers that can work at once add requests but no bandwidth."""

    fixed: float
    per_shard: float
    divisible: float
    parallelism: int | None = None

    def __post_init__(self) -> None:
        for what in ("fixed", "per_shard", "divisible"):
            _finite(getattr(self, what), 0, f"TableCost.{what}")
        if self.parallelism is not None:
            _int(self.parallelism, 1, "TableCost.parallelism")

    def seconds(self, n: int) -> float:
        _int(n, 1, "a shard count")
        spread = n if self.parallelism is None else min(n, self.parallelism)
        return self.divisible / spread + self.per_shard * (n - 1) + self.fixed

    def best(self, candidates: Iterable[int]) -> int:
        """The cheapest count among candidates (the smallest on ties)."""
        options = sorted(set(candidates))
        if not options:
            raise ConfigError("TableCost.best needs at least one candidate shard count")
        return min(options, key=lambda n: (self.seconds(n), n))


@dataclass(frozen=True)
class FitPoint:
    """One measured point beside what the calibrated model says for it (for plots).
    `table` is "" for a whole-step point; `shards` is then the tables' shared count, or 0."""

    table: str
    shards: int
    measured_seconds: float
    estimated_seconds: float


@dataclass(frozen=True)
class TablePlacement:
    name: str
    shards: int
    servers: tuple[int, ...]  # the server of each shard

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"name of a table placement must be a non-empty str, "
                              f"got {self.name!r}")
        _int(self.shards, 1, f"shards of {self.name!r}")
        object.__setattr__(self, "servers", tuple(self.servers))
        if len(self.servers) != self.shards:
            raise ConfigError(f"servers of {self.name!r} lists {len(self.servers)} server(s) "
                              f"for {self.shards} shard(s)")
        for s in self.servers:
            _int(s, 0, f"servers of {self.name!r}")


@dataclass(frozen=True)
class PartitionPlan:
    """Per table, its shard count and the server of each shard; how it was found and what
    the model expects a step to take with it."""

    tables: tuple[TablePlacement, ...]
    estimated_step_seconds: float | None = None
    source: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "tables", tuple(self.tables))
        names = [t.name for t in self.tables]
        if len(set(names)) != len(names):
            raise ConfigError(f"tables of a partition plan repeat a name: {names}")
        if self.estimated_step_seconds is not None:
            _finite(self.estimated_step_seconds, 0, "estimated_step_seconds")

    def counts(self) -> dict[str, int]:
        return {t.name: t.shards for t in self.tables}

    def get(self, name: str) -> TablePlacement:
        return by_name(self.tables, name, "table")

    def to_json(self) -> str:
        return json.dumps({
            "version": PLAN_FORMAT, "source": self.source,
            "estimated_step_seconds": self.estimated_step_seconds,
            "tables": [{"name": t.name, "shards": t.shards, "servers": list(t.servers)}
                       for t in self.tables]}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> PartitionPlan:
        try:
            data = json.loads(text)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"a partition plan must be JSON: {e}") from e
        return _plan_from_dict(data)

    def format(self) -> str:
        est = (f", estimated {self.estimated_step_seconds * 1e3:.2f} ms/step"
               if self.estimated_step_seconds is not None else "")
        rows = [("table", "shards", "servers")] + [
            (t.name, str(t.shards), ",".join(map(str, t.servers))) for t in self.tables]
        widths = [max(len(r[i]) for r in rows) for i in range(2)]
        lines = [f"{r[0].ljust(widths[0])}  {r[1].rjust(widths[1])}  {r[2]}" for r in rows]
        head = (f"partition plan ({self.source or 'given'}{est}): {len(self.tables)} table(s), "
                f"{sum(t.shards for t in self.tables)} shard(s)")
        return "\n".join([head] + lines)


def _kind(value: Any, kinds: tuple[type, ...], what: str) -> Any:
    if isinstance(value, bool) or not isinstance(value, kinds):
        wanted = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
        raise ConfigError(f"partition plan JSON: {what} must be {wanted}, got {value!r}")
    return value


def _field(data: Mapping[str, Any], key: str, kinds: tuple[type, ...], where: str) -> Any:
    if key not in data:
        raise ConfigError(f"partition plan JSON: {where}{key} is missing")
    return _kind(data[key], kinds, where + key)


def _plan_from_dict(data: Any) -> PartitionPlan:
    if not isinstance(data, dict):
        raise ConfigError(f"partition plan JSON must be an object, got {type(data).__name__}")
    if _field(data, "version", (int,), "") != PLAN_FORMAT:
        raise ConfigError(f"partition plan JSON: version is {data['version']}, "
                          f"this parallax reads version {PLAN_FORMAT}")
    tables: Sequence[Any] = _field(data, "tables", (list,), "")
    placements = []
    for i, entry in enumerate(tables):
        where = f"tables[{i}]."
        if not isinstance(entry, dict):
            raise ConfigError(f"partition plan JSON: tables[{i}] must be an object")
        servers = _field(entry, "servers", (list,), where)
        for j, s in enumerate(servers):
            _kind(s, (int,), f"{where}servers[{j}]")
        try:
            placements.append(TablePlacement(_field(entry, "name", (str,), where),
                                             _field(entry, "shards", (int,), where),
                                             tuple(servers)))
        except ConfigError as e:
            raise ConfigError(f"partition plan JSON: tables[{i}]: {e}") from e
    est = _field(data, "estimated_step_seconds", (int, float, type(None)), "")
    return PartitionPlan(tuple(placements), None if est is None else float(est),
                         _field(data, "source", (str,), ""))


class PlannerError(ParallaxError):
    """No plan fits. The message states the problem with its numbers, then numbered fixes;
    the numbers are attributes too (None where they do not apply)."""

    def __init__(self, problem: str, fixes: Sequence[str], *, table: str | None = None,
                 needed_bytes: int | None = None, server_memory_bytes: int | None = None,
                 num_servers: int | None = None, shards: int | None = None) -> None:
        self.problem = problem
        self.fixes = tuple(fixes)
        self.table = table
        self.needed_bytes = needed_bytes
        self.server_memory_bytes = server_memory_bytes
        self.num_servers = num_servers
        self.shards = shards
        listed = "".join(f"\n  {i}. {fix}" for i, fix in enumerate(self.fixes, 1))
        super().__init__(f"{problem}. Possible fixes:{listed}" if listed else problem)
