"""Measured tuning of shard counts (`search_partitions`): what the user sets, which layouts
to sample in which order, and the saved decision.

The search runs while the job trains. It measures the starting plan, then one shared shard
count after another (1, 2, 4, ...: the Parallax paper's sweep, stopped as soon as the step
time climbs past the best by `stop_ratio`, since the cost curve b/n + a(n-1) + c has one
minimum), then the per-table plan the planner's fitted cost model proposes. The best
*measured* layout wins, so a poor fit can cost a sample but never the decision. The
decision is saved under a key of the model, optimizer layout and cluster shape, and the
next run of the same job starts with it instead of searching.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from parallax.env import PLAN_CACHE_ENV
from parallax.errors import ConfigError
from parallax.placement.json_cache import cache_path, write_atomically
from parallax.placement.planner import Measurement
from parallax.placement.plan import Plan, PlacementOptions

log = logging.getLogger("parallax")



@dataclass(frozen=True)
class PartitionSearch:
    """How `ParallaxStrategy(search_partitions=...)` tunes shard counts.

    min_shards / max_shards bound every table's count; steps_per_sample timed steps (after
    warmup_steps untimed ones, which absorb the move) measure each sampled layout, at most
    max_samples of them; the first sample also waits settle_steps (rows touched for the
    first time are slower); a sweep ends past stop_ratio x the best; the last two layouts are
    measured once more when within confirm_ratio of each other (one sample on a busy machine
    can be off by 20%); cache_dir keeps decisions (default $PARALLAX_PLAN_CACHE, else
    ~/.cache/parallax/partitions; "" keeps none); plan_seconds bounds the planner's search.
    For a fixed plan instead, pass `shards=` to the strategy and leave this off.

    Example:

        strategy = parallax.ParallaxStrategy(
            search_partitions=parallax.PartitionSearch(max_shards=16, max_samples=4))

    Raises:
        ConfigError: a count, ratio or time out of range (when made, before any training).
    """

    min_shards: int = 1
    max_shards: int = 64
    steps_per_sample: int = 15
    warmup_steps: int = 3
    settle_steps: int = 10
    max_samples: int = 6
    stop_ratio: float = 1.1
    confirm_ratio: float = 1.25
    cache_dir: str | None = None
    plan_seconds: float = 1.0

    def __post_init__(self) -> None:
        checks = [("min_shards", self.min_shards, 1), ("max_shards", self.max_shards, 1),
                  ("steps_per_sample", self.steps_per_sample, 1),
                  ("warmup_steps", self.warmup_steps, 0), ("settle_steps", self.settle_steps, 0),
                  ("max_samples", self.max_samples, 1)]
        for name, value, least in checks:
            if not isinstance(value, int) or value < least:
                raise ConfigError(f"PartitionSearch.{name} must be an int >= {least}, got "
                                  f"{value!r}")
        if self.max_shards < self.min_shards:
            raise ConfigError(f"PartitionSearch.max_shards {self.max_shards} is below "
                              f"min_shards {self.min_shards}")
        for name in ("stop_ratio", "confirm_ratio"):
            if not getattr(self, name) > 1.0:
                raise ConfigError(f"PartitionSearch.{name} must be > 1, got "
                                  f"{getattr(self, name)}")
        if not self.plan_seconds >= 0:
            raise ConfigError(f"PartitionSearch.plan_seconds must be >= 0, got "
                              f"{self.plan_seconds}")

    def cache_root(self) -> Path | None:
        root = self.cache_dir if self.cache_dir is not None else os.environ.get(PLAN_CACHE_ENV)
        if root == "":
            return None
        return Path(root) if root else Path.home() / ".cache" / "parallax" / "partitions"


def check_setting(value) -> None:
    if not (value in (None, True, False, "auto") or isinstance(value, PartitionSearch)):
        raise ConfigError(f"search_partitions must be 'auto', True, False, a "
                          f"parallax.PartitionSearch or None (the job's plan override, else "
                          f"'auto'), got {value!r}")


def resolve(value, plan: Plan, config: PlacementOptions) -> PartitionSearch | None:
    """The search a job runs, if any. "auto" (the default) searches where it can pay: tables
    on the servers, several workers, no shard counts fixed by the user, and no table groups
    (a strategy asked to search plans without them)."""
    check_setting(value)
    if not plan.on_servers or value in (None, False):
        return None
    if value == "auto":
        if plan.num_workers < 2 or config.shards is not None or plan.grouped:
            return None  # (table groups: one table's requests already carry many tables)
        return PartitionSearch()
    return PartitionSearch() if value is True else value


def with_layouts(plan: Plan, layouts: Mapping[str, tuple[int, ...]]) -> Plan:
    """`plan` with saved shard counts and servers for its tables (a dynamic table keeps its
    total bound: `DynamicRows.resharded`)."""
    return dataclasses.replace(plan, variables=tuple(
        dataclasses.replace(v, shards=len(layouts[v.name]), servers=tuple(layouts[v.name]),
                            dynamic=v.dynamic and v.dynamic.resharded(len(layouts[v.name])))
        if v.name in layouts else v for v in plan.variables))


# ---- which layouts to sample ------------------------------------------------------------

def uniform_counts(n: int, rows: Mapping[str, int]) -> dict[str, int]:
    """Every table at n shards, capped by its rows."""
    return {name: max(1, min(n, r)) for name, r in rows.items()}


def counts_text(counts: Mapping[str, int]) -> str:
    """{table: n} as 'n' when all agree, else 'n x tables' groups: '4 (x20), 8 (x6)'."""
    values = sorted(counts.values())
    if not values:
        return "n/a"
    if len(set(values)) == 1:
        return str(values[0]) + (f" (all {len(values)} tables)" if len(values) > 1 else "")
    return ", ".join(f"{n} (x{values.count(n)})" for n in sorted(set(values)))


def sweep_counts(config: PartitionSearch) -> list[int]:
    counts, n = [], 1
    while n <= config.max_shards:
        if n >= config.min_shards:
            counts.append(n)
        n *= 2
    if config.min_shards not in counts:
        counts.insert(0, config.min_shards)
    return counts


def _key(counts: Mapping[str, int]) -> tuple:
    return tuple(sorted(counts.items()))


def next_uniform(config: PartitionSearch, rows: Mapping[str, int],
                 measurements: Sequence[Measurement]) -> dict[str, int] | None:
    """The next shared count of the sweep, or None once the sweep is over: the step time
    of the last sweep point climbed past the best by `stop_ratio`, the counts ran out, or
    one sample is left (kept for the model's proposal)."""
    if len(measurements) >= config.max_samples - 1:
        return None
    measured = {_key(m.counts): m.step_seconds for m in measurements}
    best = min(measured.values())
    sweep = [uniform_counts(n, rows) for n in sweep_counts(config)]
    last_seen = None
    for counts in sweep:
        if _key(counts) in measured:
            last_seen = measured[_key(counts)]
            continue
        if last_seen is not None and last_seen > config.stop_ratio * best:
            return None  # past the minimum
        return counts
    return None


# ---- the saved decision -------------------------------------------------------------------

def decision_path(root: Path, plan: Plan) -> Path:
    """Where a decision is saved: named by what it depends on, the tables, the run mode and
    the cluster's shape."""
    tables = [(v.name, list(v.shape), v.dtype) for v in plan.on_servers]
    return cache_path(root, [plan.mode, plan.sync, plan.num_workers, plan.num_servers,
                             tables], digits=24)


def load_decision(config: PartitionSearch, plan: Plan) -> dict | None:
    """The saved decision for this job, or None (none saved, or the file is unreadable:
    then the job searches again rather than fail)."""
    root = config.cache_root()
    if root is None:
        return None
    path = decision_path(root, plan)
    try:
        saved = json.loads(path.read_text())
        layouts = {name: tuple(int(s) for s in servers)
                   for name, servers in saved["layouts"].items()}
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as err:
        log.warning("ignoring the saved partition decision %s (%s); searching again (delete "
                    "the file to stop this warning)", path, err)
        return None
    names = {v.name for v in plan.on_servers}
    if set(layouts) != names or any(not s or min(s) < 0 or max(s) >= plan.num_servers
                                    for s in layouts.values()):
        return None
    log.info("partition decision loaded from %s (shard counts %s): the search is skipped; "
             "delete the file to search again", path,
             ", ".join(f"{name} {len(servers)}" for name, servers in sorted(layouts.items())))
    return {"layouts": layouts, "report": saved.get("report", {}), "path": str(path)}


def save_decision(config: PartitionSearch, plan: Plan, report: dict) -> Path | None:
    root = config.cache_root()
    if root is None:
        return None
    path = decision_path(root, plan)
    layouts = {v.name: list(v.servers) for v in plan.on_servers}
    write_atomically(path, json.dumps({"layouts": layouts, "report": report}, indent=1))
    return path
