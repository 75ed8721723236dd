"""Change the shard count and placement of tables while a job runs, between two steps.

Every worker calls `Resharder.apply` at the same step boundary with the same new layouts:
1. each worker's pushes land (sync: and the servers closed the step), then all meet;
2. the chief copies each changed table into a new table (rows, optimizer slots, step; see
   `parallax.client.row_mover`), named `<table>.r<generation>`;
3. every worker routes the variable to the new table; the chief deletes the old one.
Nothing is lost or applied twice: no push is in flight while rows move, and every push
after the switch goes to the new table. If the move fails, the old tables stay in use, the
new ones are deleted, and every worker raises.
"""
from __future__ import annotations

import dataclasses
import logging
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Mapping

from parallax.client import PSClient, ShardedTable
from parallax.client.row_mover import move_rows
from parallax.errors import ConfigError
from parallax.placement.plan import Plan, VariablePlan
from parallax.tf.collectives.workers import Workers, on_chief
from parallax.tf.graph.remote import RemoteTable

logger = logging.getLogger("parallax")  # `log` is apply()'s flag

_GENERATION = re.compile(r"\.r(\d+)$")
MOVE_TABLES = 4  # tables copied at once (each reads its source shards concurrently too)


def _generation_of(table: str) -> int:
    """The resharding generation in a table's name (`<table>.r<generation>`; 0: none)."""
    found = _GENERATION.search(table)
    return int(found.group(1)) if found else 0


@dataclass(frozen=True)
class Layout:
    """Where one table's shards live: one server index per shard."""

    servers: tuple[int, ...]

    @property
    def shards(self) -> int:
        return len(self.servers)


@dataclass(frozen=True)
class ReshardReport:
    tables: tuple[str, ...]  # variable names whose layout changed
    rows: int
    bytes: int
    seconds: float


def check_layouts(plan: Plan, layouts: Mapping[str, Layout]) -> None:
    on_servers = {v.name: v for v in plan.on_servers}
    for name, layout in layouts.items():
        vp = on_servers.get(name)
        if vp is None:
            raise ConfigError(f"cannot reshard {name!r}: it is not a table on the parameter "
                              f"servers; tables: {', '.join(on_servers) or 'none'}")
        rows = vp.shape[0] if vp.shape else 1
        if not 1 <= layout.shards <= rows:
            raise ConfigError(f"cannot give {name!r} {layout.shards} shards: it has {rows} "
                              f"rows; use 1 to {rows}")
        bad = [s for s in layout.servers if not 0 <= s < plan.num_servers]
        if bad:
            raise ConfigError(f"cannot place a shard of {name!r} on server {bad[0]}: the job "
                              f"has servers 0 to {plan.num_servers - 1}")


def with_groups(plan: Plan, layouts: Mapping[str, Layout]) -> dict[str, Layout]:
    """`layouts` given to every variable of a table group one of them is given to (the group
    is one table); two members given different layouts are refused."""
    out = dict(layouts)
    for name, layout in layouts.items():
        vp = next((v for v in plan.on_servers if v.name == name), None)
        if vp is None:
            continue  # check_layouts names it
        for member in plan.members(vp.table):
            given = out.setdefault(member.name, layout)
            if given != layout:
                raise ConfigError(
                    f"{name!r} and {member.name!r} share one server table (a table group) "
                    f"but were given different layouts ({layout.servers} and "
                    f"{given.servers}); give the group one layout, or build the strategy "
                    f"with group_tables=False to shard them apart")
    return out


class Resharder:
    """Applies new layouts to the bound tables of one job (see the module docstring).

    With `keep_previous`, a replaced table is kept (not deleted) while it is the one before
    the current: going back to its layout then copies only the rows training changed since
    (`changed_only` export), not the whole table, and the table left is kept in turn, so two
    layouts can alternate at the cost of their changes. The partition search samples that
    way; `release_previous` deletes what is kept."""

    def __init__(self, client: PSClient, workers: Workers,
                 remotes: Mapping[int, RemoteTable]) -> None:
        self.client = client
        self.workers = workers
        self.remotes = remotes
        self.generation = 0
        self.previous: dict[int, tuple[ShardedTable, Layout]] = {}

    def apply(self, plan: Plan, layouts: Mapping[str, Layout], log: bool = True,
              keep_previous: bool = False) -> tuple[Plan, ReshardReport]:
        check_layouts(plan, layouts)
        layouts = with_groups(plan, layouts)
        start = time.perf_counter()
        changed = [v for v in plan.on_servers if v.name in layouts
                   and layouts[v.name].servers != v.servers]
        if not changed:
            return plan, ReshardReport((), 0, 0, 0.0)
        # above every table's own (a restored table keeps the name a reshard gave it)
        self.generation = max([self.generation] + [_generation_of(v.table)
                                                   for v in plan.on_servers]) + 1
        for vp in changed:
            self.remotes[vp.index].land_pushes()
        self.workers.allgather_object(None)  # every worker's last pushes are in
        reverts = {vp.index for vp in changed if vp.index in self.previous
                   and self.previous[vp.index][1] == layouts[vp.name]}
        targets: dict[str, ShardedTable] = {}  # by the old table name
        moved = [0, 0]
        heads = [vp for vp in changed if vp.offset == 0]  # a table group moves once
        on_chief(self.workers, lambda: self._move(heads, layouts, reverts, targets, moved),
                 "failed to reshard the tables")
        new_plans, dropped = {}, []
        for vp in changed:
            layout, remote = layouts[vp.name], self.remotes[vp.index]
            old, old_layout = remote.table, Layout(vp.servers)
            if vp.index in reverts:  # the kept table is current again; keep this one instead
                remote.table = self.previous.pop(vp.index)[0]
                if keep_previous:
                    self.previous[vp.index] = (old, old_layout)
                else:
                    dropped.append(old)
            else:
                spec = old.spec.resharded(self._name(vp), layout.shards,
                                          _bound(vp, layout.shards))
                remote.table = targets.get(vp.table) or self.client.table(spec, layout.servers)
                targets[vp.table] = remote.table  # the other members of a group share it
                if vp.index in self.previous:
                    dropped.append(self.previous.pop(vp.index)[0])
                if keep_previous:
                    self.previous[vp.index] = (old, old_layout)
                else:
                    dropped.append(old)
            new_plans[vp.index] = dataclasses.replace(vp, shards=layout.shards,
                                                      servers=layout.servers,
                                                      table=remote.table.name,
                                                      dynamic=vp.dynamic and
                                                      vp.dynamic.resharded(layout.shards))
        self._delete(dropped)
        new_plan = dataclasses.replace(plan, variables=tuple(
            new_plans.get(v.index, v) for v in plan.variables))
        report = ReshardReport(tuple(v.name for v in changed), moved[0], moved[1],
                               time.perf_counter() - start)
        if log and self.workers.info.is_chief:
            logger.info("%s", describe(plan, new_plan, report))
        return new_plan, report

    def release_previous(self) -> None:
        """Delete the tables kept for going back (every worker calls it at the same point)."""
        dropped = [table for table, _ in self.previous.values()]
        self.previous.clear()
        self._delete(dropped)

    def _delete(self, tables: list[ShardedTable]) -> None:
        tables = list({t.name: t for t in tables}.values())  # a group's members share one
        if tables:
            on_chief(self.workers, lambda: [self.client.delete_table(t) for t in tables],
                     "failed to delete the tables replaced by resharding")

    def _name(self, vp: VariablePlan) -> str:
        base = _GENERATION.sub("", vp.table)[:120]
        return f"{base}.r{self.generation}"

    def _move(self, changed, layouts, reverts: set[int], targets: dict, moved: list) -> None:
        """Chief: copy the changed tables, several at once (a revert: only the rows changed
        since into the kept table); on failure delete every new copy (each
        `PSClient.reshard` deletes its own half-made one); a kept table caught up halfway
        is only ever read after a complete catch-up."""
        def move(vp: VariablePlan):
            current = self.remotes[vp.index].table
            if vp.index in reverts:
                return move_rows(current, self.previous[vp.index][0], changed_only=True)
            layout = layouts[vp.name]
            table, report = self.client.reshard(current, self._name(vp), layout.shards,
                                                layout.servers, _bound(vp, layout.shards))
            targets[vp.table] = table
            return report

        with ThreadPoolExecutor(max_workers=min(len(changed), MOVE_TABLES)) as pool:
            futures = [pool.submit(move, vp) for vp in changed]
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            for table in targets.values():
                self.client.delete_table(table)
            targets.clear()
            raise errors[0]
        for future in futures:
            moved[0] += future.result().rows
            moved[1] += future.result().bytes


def _bound(vp: VariablePlan, shards: int) -> int | None:
    """A dynamic table's bound per shard over `shards` (`DynamicRows.resharded`), or None:
    the table's own rule (`TableSpec.resharded`)."""
    return vp.dynamic.resharded(shards).max_rows_per_shard if vp.dynamic else None


def describe(before: Plan, after: Plan, report: ReshardReport) -> str:
    lines = [f"parallax: resharded {len(report.tables)} table(s) in {report.seconds:.2f} s "
             f"({report.rows} rows, {report.bytes / 2**20:.1f} MB moved)"]
    old = {v.name: v for v in before.on_servers}
    for v in after.on_servers:
        if v.name in report.tables:
            lines.append(f"  {v.name}: {old[v.name].shards} @ "
                         f"{','.join(map(str, old[v.name].servers))} -> {v.shards} @ "
                         f"{','.join(map(str, v.servers))}")
    return "\n".join(lines)
