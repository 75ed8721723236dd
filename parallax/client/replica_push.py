"""A step's push to replicated shards (`parallax.client.replicas`) in one request per server.

A `ReplicaSet` sends each write to every copy on its own, so a server would get a push
request for the shards placed on it and another for the copies it keeps of the server
before it: twice the requests, and a request costs a server more than its rows do. A
multi-table push (`many.start_push_many`, every training step's) therefore goes out as a
push of twice the tables: each table once with its shards' first copies and once with their
second (`views`), whose parts the usual grouping by server packs into one request per
server. Each server is reached through its `CopyConnection`, which gives an answer the
meaning of a write to a copy. Once a copy is lost, pushes go through the `ReplicaSet`s again
(one request per live copy), as every other write does.
"""
from __future__ import annotations

import weakref
from typing import Sequence

from parallax.client.replicas import Liveness, ReplicaSet, caught_up, is_behind
from parallax.client.table import ShardedTable
from parallax.errors import ServerError


class CopyConnection:
    """One server as the holder of copies (the interface of `ServerConnection` that a
    push's requests use). A request it refuses as ahead of its open step is sent again until
    it takes it (`replicas.caught_up`); one it cannot take because the server is lost is
    done (None, as a retry that found its first attempt landed) while every shard keeps a
    live copy (`survives()`): each of its parts went to the other copy too."""

    def __init__(self, conn, liveness: Liveness, survives) -> None:
        self.conn, self.liveness, self.survives = conn, liveness, survives
        self.address, self.options = conn.address, conn.options

    def _gone(self) -> bool:
        return self.liveness.gone(self.conn)

    def future(self, method: str, request, timeout: float | None = None):
        return self.conn.future(method, request, timeout)

    def result(self, future, method: str, request, table=None, timeout: float | None = None,
               done_on_retry: tuple = ()):
        try:
            return self.conn.result(future, method, request, table, timeout, done_on_retry,
                                    self._gone)
        except ServerError as err:
            if not is_behind(err):
                return self._failed(err)
            try:
                return caught_up(self.conn, err, method, request, table, timeout,
                                 done_on_retry)
            except ServerError as again:  # (lost while it caught up: as any other loss)
                return self._failed(again)

    def _failed(self, err: ServerError):
        """None for a lost server while every shard keeps a live copy; else raise `err`."""
        if self.liveness.loses(self.address, err) and self.survives():
            return None
        raise err

    def call(self, method: str, request, table=None, timeout: float | None = None,
             done_on_retry: tuple = (), pending=None):
        return self.result(pending, method, request, table, timeout, done_on_retry)


_VIEWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # table -> its copies' views


def views(tables: Sequence[ShardedTable]) -> list[ShardedTable] | None:
    """The tables once per copy, each shard on that copy's `CopyConnection` (first copies,
    then second copies); None unless every shard of every table is replicated and every copy
    is live."""
    if not tables or not isinstance(tables[0].shards[0], ReplicaSet):
        return None  # (every step's push asks: without copies, one look)
    sets = [rs for table in tables for rs in table.shards]
    if not all(isinstance(rs, ReplicaSet) and rs.holders for rs in sets):
        return None
    if any(not rs.liveness.alive(c.address) for rs in sets for c in rs.copies):
        return None
    copies = len(sets[0].copies)
    return [_view(table, copy) for copy in range(copies) for table in tables]


def _view(table: ShardedTable, copy: int) -> ShardedTable:
    made = _VIEWS.setdefault(table, {})
    if copy not in made:
        made[copy] = ShardedTable(table.spec, [rs.holders[copy] for rs in table.shards],
                                  table.session)
    return made[copy]


class Copied:
    """A push sent through `views`, in flight (the shape of `many.PendingPush`)."""

    def __init__(self, pending, tables: int) -> None:
        self.pending, self.tables = pending, tables

    def abandon(self) -> None:
        self.pending.abandon()

    def result(self) -> list[bool]:
        """Per table, True if this push closed the step on every one of its shards (on the
        first copies, or where they did not answer, the second)."""
        closed = self.pending.result()
        n = self.tables
        return [any(closed[k::n]) for k in range(n)]
