"""Which shard counts a table may have: the search space the proposers choose from."""
from __future__ import annotations

from dataclasses import dataclass

from parallax.errors import ConfigError
from parallax.placement.planner.estimators import bytes_per_shard
from parallax.placement.planner.types import (ClusterProfile, PlannerError, TableProfile,
                                              size_text)


@dataclass(frozen=True)
class ShardCountEnumerator:
    """Counts in [min_shards, max_shards], at most the table's rows and at least the fewest
    shards whose largest fits one server's memory. With `powers_of_two`, only 1, 2, 4, ...
    within those bounds plus the bounds themselves (the memory minimum and the capped
    maximum); otherwise every count between them."""

    min_shards: int = 1
    max_shards: int = 64
    powers_of_two: bool = True

    def __post_init__(self) -> None:
        for what in ("min_shards", "max_shards"):
            value = getattr(self, what)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"ShardCountEnumerator {what} must be an int >= 1, "
                                  f"got {value!r}")
        if self.max_shards < self.min_shards:
            raise ConfigError(f"ShardCountEnumerator max_shards={self.max_shards} is below "
                              f"min_shards={self.min_shards}")

    def candidates(self, table: TableProfile, cluster: ClusterProfile) -> tuple[int, ...]:
        high = min(self.max_shards, table.rows)
        low = max(self.min_shards, memory_minimum(table, cluster, high))
        if low > high:
            raise _too_few_shards(table, cluster, self, high, low)
        if not self.powers_of_two:
            return tuple(range(low, high + 1))
        powers = {1 << k for k in range(high.bit_length()) if low <= 1 << k <= high}
        return tuple(sorted(powers | {low, high}))


def memory_minimum(table: TableProfile, cluster: ClusterProfile, high: int) -> int:
    """The fewest shards whose largest (ceil(rows / n) rows) fits one server; `high` + 1 when
    even one row does not fit, or `high` shards are not enough. 1 when memory is unknown."""
    memory = cluster.server_memory_bytes
    if memory is None or table.bytes <= memory:
        return 1
    rows_that_fit = memory * table.rows // table.bytes
    if rows_that_fit == 0:
        return high + 1
    return min(high + 1, -(-table.rows // rows_that_fit))


def _too_few_shards(table: TableProfile, cluster: ClusterProfile,
                    enumerator: ShardCountEnumerator, high: int, low: int) -> PlannerError:
    memory = cluster.server_memory_bytes
    largest = bytes_per_shard(table, high)
    limit = (f"max_shards={enumerator.max_shards}" if high == enumerator.max_shards
             else f"its {table.rows} rows")
    fixes = []
    if memory is not None and largest > memory:
        problem = (f"table {table.name!r} ({size_text(table.bytes)}) does not fit the servers: "
                   f"even split into {high} shard(s), the most {limit} allows, its largest "
                   f"shard is {size_text(largest)} but a server has {size_text(memory)}")
        if high == enumerator.max_shards and table.rows > high:
            wanted = memory_minimum(table, cluster, table.rows)
            if wanted <= table.rows:
                fixes.append(f"allow more shards: ShardCountEnumerator(max_shards>={wanted})")
        fixes.append(f"start the servers with more memory: at least {size_text(largest)} each")
        fixes.append(f"place {table.name!r} with fewer optimizer slots (smaller bytes), or in "
                     f"allreduce (StrategyConfig(placement={{{table.name!r}: 'allreduce'}}))")
    else:
        problem = (f"table {table.name!r} may have at most {high} shard(s) ({limit}) but "
                   f"min_shards={enumerator.min_shards}")
        fixes.append(f"lower min_shards to at most {high}")
    return PlannerError(problem, fixes, table=table.name, needed_bytes=table.bytes,
                        server_memory_bytes=memory, num_servers=cluster.num_servers,
                        shards=high)
