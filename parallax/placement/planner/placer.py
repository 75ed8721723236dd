"""Which server holds each shard, given every table's shard count."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from parallax.errors import ConfigError
from parallax.placement.planner.estimators import ServerLoadEstimator, shard_bytes
from parallax.placement.planner.types import (ClusterProfile, PartitionPlan, PlannerError,
                                              TablePlacement, TableProfile, size_text)


@dataclass(frozen=True)
class _Shard:
    table: str
    index: int
    bytes: int
    memory: float  # share of the memory resource (see `place`)
    load: float    # share of the server work


def place(counts: Mapping[str, int], tables: Sequence[TableProfile], cluster: ClusterProfile,
          load: ServerLoadEstimator | None = None,
          keep: Mapping[str, Sequence[int]] | None = None) -> PartitionPlan:
    """Greedy LPT over two resources, memory and server work per step.

    Each shard weighs its share of each resource: bytes over the cluster's memory (over all
    shards' bytes when memory is unknown) and load (`ServerLoadEstimator`: requests plus
    row traffic, skew from hot ids included) over the total load. The heaviest shards by
    their larger share go first, each onto the server whose larger level (max of its memory
    and load levels) grows least; among those, the one with less in all, then the lowest
    index. A server not yet holding a shard of the same table is preferred while one is left
    (so a table's shards, and its traffic, spread), and none is ever filled past
    `server_memory_bytes`.

    Why the max of the two shares, not a weighted sum: GiB and seconds have no exchange rate,
    and a sum lets one server take all of a hot table's traffic while another takes the big
    cold tables, balanced "in sum". The max is each shard's dominant share (as in dominant
    resource fairness), so both resources stay balanced at the level of the tighter one; with
    plenty of memory the bytes' shares are small and the load decides, with memory tight the
    bytes do. When no table is measured (no `unique_rows_per_step`, no hot ids) and server
    memory is not limited, load says nothing about which server is busier: a fused step
    sends each server one pull and one push per worker, whatever number of shards it holds.
    Then whole tables are placed by bytes alone (`_place_by_bytes`), which is how a plan
    places its tables before any measurement (`parallax.placement.plan.place_shards`); with
    a memory limit, shards go heaviest first as above, which packs tighter.

    `keep` (table -> servers of its shards, e.g. the running layout): a table whose count
    equals its kept layout's stays there and counts as load, so a job that changes a few
    tables' counts moves only those (moving rows is the expensive part of resharding).

    Deterministic: equal inputs give equal plans on every worker."""
    load = load or ServerLoadEstimator()
    names = [t.name for t in tables]
    if sorted(names) != sorted(counts) or len(set(names)) != len(names):
        raise ConfigError(f"place needs one count per table: counts name {sorted(counts)}, "
                          f"tables {names}")
    servers: dict[str, list[int]] = {t.name: [0] * counts[t.name] for t in tables}
    state = _Servers(cluster)
    kept = {name: list(where) for name, where in (keep or {}).items()
            if name in counts and len(where) == counts[name]
            and all(0 <= s < cluster.num_servers for s in where)}
    if cluster.server_memory_bytes is None and \
            not any(t.unique_rows_per_step or t.hot_shares for t in tables):
        _place_by_bytes(counts, tables, kept, state, servers)
        return _plan(counts, tables, servers)
    shards = _shards(counts, tables, cluster, load)
    for shard in shards:
        if shard.table in kept:
            servers[shard.table][shard.index] = state.put(
                shard, tables, counts, at=kept[shard.table][shard.index])
    for shard in sorted(shards, key=lambda s: (-max(s.memory, s.load), s.table, s.index)):
        if shard.table not in kept:
            servers[shard.table][shard.index] = state.put(shard, tables, counts)
    return _plan(counts, tables, servers)


def _plan(counts: Mapping[str, int], tables: Sequence[TableProfile],
          servers: Mapping[str, Sequence[int]]) -> PartitionPlan:
    return PartitionPlan(tuple(TablePlacement(t.name, counts[t.name], tuple(servers[t.name]))
                               for t in tables))


def _place_by_bytes(counts: Mapping[str, int], tables: Sequence[TableProfile],
                    kept: Mapping[str, Sequence[int]], state: "_Servers",
                    servers: dict[str, list[int]]) -> None:
    """Unmeasured tables, whole: the biggest first (ties in `tables` order), each of its
    shards (an equal share of its bytes) onto the server with the fewest bytes that its
    table does not use yet (the lowest index on ties), so one-shard tables spread over the
    servers instead of all landing on server 0. Kept tables stay and count."""
    for t in tables:
        for i, at in enumerate(kept.get(t.name, ())):
            servers[t.name][i] = state.put(_even_shard(t, i, counts), tables, counts, at=at)
    moving = [t for t in tables if t.name not in kept]
    for t in sorted(moving, key=lambda t: -t.bytes):  # stable: ties keep `tables` order
        for i in range(counts[t.name]):
            servers[t.name][i] = state.put(_even_shard(t, i, counts), tables, counts)


def _even_shard(table: TableProfile, index: int, counts: Mapping[str, int]) -> _Shard:
    """Shard `index` of `table` weighing an equal share of its bytes (no load)."""
    n = counts[table.name]
    return _Shard(table.name, index, shard_bytes(table, n)[index], table.bytes / n, 0.0)


def _shards(counts: Mapping[str, int], tables: Sequence[TableProfile], cluster: ClusterProfile,
            load: ServerLoadEstimator) -> list[_Shard]:
    sizes = {t.name: shard_bytes(t, counts[t.name]) for t in tables}
    loads = {t.name: load.shard_loads(t, counts[t.name], cluster) for t in tables}
    memory = (cluster.num_servers * cluster.server_memory_bytes if cluster.server_memory_bytes
              else sum(map(sum, sizes.values()))) or 1
    total_load = float(sum(float(v.sum()) for v in loads.values())) or 1.0
    return [_Shard(t.name, i, sizes[t.name][i], sizes[t.name][i] / memory,
                   float(loads[t.name][i]) / total_load)
            for t in tables for i in range(counts[t.name])]


class _Servers:
    """Each server's memory and load levels, bytes used and tables held, while placing."""

    def __init__(self, cluster: ClusterProfile) -> None:
        self.cluster = cluster
        self.memory = [0.0] * cluster.num_servers
        self.load = [0.0] * cluster.num_servers
        self.used = [0] * cluster.num_servers
        self.holds: list[set[str]] = [set() for _ in range(cluster.num_servers)]

    def put(self, shard: _Shard, tables: Sequence[TableProfile],
            counts: Mapping[str, int], at: int | None = None) -> int:
        """The server `shard` goes to (`at`: that one, if it fits)."""
        limit = self.cluster.server_memory_bytes
        fits = [i for i in range(len(self.used)) if (at is None or i == at)
                and (limit is None or self.used[i] + shard.bytes <= limit)]
        if not fits:
            raise self._full(shard, tables, counts)
        fresh = [i for i in fits if shard.table not in self.holds[i]] or fits
        best = min(fresh, key=lambda i: (max(self.memory[i] + shard.memory,
                                             self.load[i] + shard.load),
                                         self.memory[i] + self.load[i], i))
        self.memory[best] += shard.memory
        self.load[best] += shard.load
        self.used[best] += shard.bytes
        self.holds[best].add(shard.table)
        return best

    def _full(self, shard: _Shard, tables: Sequence[TableProfile],
              counts: Mapping[str, int]) -> PlannerError:
        limit = self.cluster.server_memory_bytes or 0
        free = min(self.used)
        total = sum(t.bytes for t in tables)
        n = counts[shard.table]
        return PlannerError(
            f"shard {shard.index} of {n} of table {shard.table!r} ({size_text(shard.bytes)}) "
            f"fits on no server: the emptiest of {self.cluster.num_servers} has "
            f"{size_text(limit - free)} free of {size_text(limit)} (all tables: "
            f"{size_text(total)})",
            [f"add servers: try {max(self.cluster.num_servers + 1, -(-total // limit) + 1)} "
             f"of {size_text(limit)}, whole shards leave gaps when packed",
             f"start the servers with more memory: at least {size_text(free + shard.bytes)} "
             f"each",
             f"split {shard.table!r} into more, smaller shards, which pack tighter: more than "
             f"{n} (ShardCountEnumerator(min_shards=...) or StrategyConfig(shards=...))"],
            table=shard.table, needed_bytes=shard.bytes, server_memory_bytes=limit,
            num_servers=self.cluster.num_servers, shards=n)
