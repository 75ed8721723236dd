"""The client of a set of parameter servers: create tables, place shards, checkpoints, stats."""
from __future__ import annotations

import dataclasses
import secrets
from typing import Sequence

from parallax.client.connection import ClientOptions, ServerConnection
from parallax.client.reshard import MoveReport, move_rows
from parallax.client.table import ShardedTable
from parallax.errors import ConfigError
from parallax.ps.v1 import ps_pb2
from parallax.specs import TableSpec


class PSClient:
    """Connections to every server of a job; shard i of a table goes to server i % N unless a
    placement is given."""

    def __init__(self, addresses: Sequence[str], options: ClientOptions | None = None) -> None:
        if not addresses:
            raise ConfigError("PSClient needs at least one server address (host:port)")
        self.addresses = list(addresses)
        self.options = options = options or ClientOptions()
        self.servers = [ServerConnection(a, options) for a in self.addresses]
        self._sync_tables: set[str] = set()  # sync tables this client has handles on
        self.session = secrets.randbits(63) + 1  # this client's identity in async pushes

    def __enter__(self) -> "PSClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for server in self.servers:
            server.close()

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Block until every server reports SERVING; the error names the one that does not."""
        for server in self.servers:
            server.wait_healthy(timeout)

    def _placement(self, spec: TableSpec, placement: Sequence[int] | None) -> list[int]:
        placement = list(placement) if placement is not None else \
            [i % len(self.servers) for i in range(spec.shard_count)]
        if len(placement) != spec.shard_count or not all(0 <= p < len(self.servers)
                                                         for p in placement):
            raise ConfigError(f"table {spec.name!r}: placement {placement} must give a server "
                              f"index in [0, {len(self.servers)}) for each of its "
                              f"{spec.shard_count} shards")
        return placement

    def table(self, spec: TableSpec, placement: Sequence[int] | None = None) -> ShardedTable:
        """A handle on an existing table (no RPC)."""
        if spec.sync_mode == "sync":
            self._sync_tables.add(spec.name)
        return ShardedTable(spec, [self.servers[p] for p in self._placement(spec, placement)],
                            self.session)

    def create_table(self, spec: TableSpec, placement: Sequence[int] | None = None) -> ShardedTable:
        """Create every shard (idempotent: identical re-creation is a no-op)."""
        table = self.table(spec, placement)
        proto = spec.to_proto()
        calls = []
        for shard, conn in enumerate(table.shards):
            request = ps_pb2.CreateTableRequest(spec=proto, shard_index=shard)
            calls.append((conn, conn.future("CreateTable", request), request))
        for conn, future, request in calls:
            conn.result(future, "CreateTable", request, spec.name)
        return table

    def reshard(self, table: ShardedTable, name: str, shard_count: int,
                placement: Sequence[int] | None = None) -> tuple[ShardedTable, MoveReport]:
        """A new table `name` holding `table`'s rows, slots and step in `shard_count` shards
        (on `placement`). Call between steps; the old table is left for the caller to delete
        once no worker routes to it. On failure the new table is deleted again."""
        spec = dataclasses.replace(table.spec, name=name, shard_count=shard_count)
        target = self.create_table(spec, placement)
        try:
            if target.wait_step(0):
                raise ConfigError(f"cannot reshard {table.name!r} into {name!r}: a table of "
                                  f"that name already exists and has trained; pick a new name")
            return target, move_rows(table, target)
        except BaseException:
            self.delete_table(target)
            raise

    def delete_table(self, table: ShardedTable) -> None:
        for shard, conn in enumerate(table.shards):
            conn.call("DeleteTable", ps_pb2.DeleteTableRequest(table=table.name,
                                                               shard_index=shard), table.name)

    def _each(self, method: str, request) -> list:
        calls = [(s, s.future(method, request)) for s in self.servers]
        return [s.result(f, method, request) for s, f in calls]

    def _shards_of(self, replies, tables: Sequence[str], verb: str) -> list:
        shards = [shard for reply in replies for shard in reply.shards]
        missing = set(tables) - {s.table for s in shards}
        if missing:
            raise ConfigError(f"cannot {verb} tables {sorted(missing)}: no server of "
                              f"{self.addresses} holds them; create them first")
        return shards

    def save(self, path: str, tables: Sequence[str] = ()) -> list[ps_pb2.ShardCheckpoint]:
        """Every server writes its shards under its data directory at `path`."""
        replies = self._each("Save", ps_pb2.SaveRequest(path=path, tables=list(tables)))
        shards = self._shards_of(replies, tables, "save")
        steps: dict[str, set[int]] = {}
        for shard in shards:
            steps.setdefault(shard.table, set()).add(shard.step)
        mixed = {t: sorted(s) for t, s in steps.items() if len(s) > 1}
        if mixed and self._sync_tables.intersection(mixed):
            raise ConfigError(f"checkpoint {path!r} caught sync tables mid-step (shard steps "
                              f"{mixed}); save between steps, after table.wait_step(k) and "
                              f"before any push of step k")
        return shards

    def restore(self, path: str, tables: Sequence[str] = ()) -> list[ps_pb2.ShardCheckpoint]:
        """Every server reloads its shards (any saved shard count) from `path`."""
        replies = self._each("Restore", ps_pb2.RestoreRequest(path=path, tables=list(tables)))
        return self._shards_of(replies, tables, "restore")

    def stats(self, tables: Sequence[str] = ()) -> dict[str, ps_pb2.StatsResponse]:
        replies = self._each("Stats", ps_pb2.StatsRequest(tables=list(tables)))
        return dict(zip(self.addresses, replies))

    def barrier(self, name: str, rank: int, count: int, timeout: float | None = None) -> int:
        """Wait until `count` ranks reach barrier `name` (held by the first server)."""
        request = ps_pb2.BarrierRequest(name=name, rank=rank, count=count)
        return self.servers[0].call("Barrier", request, timeout=timeout).generation
