"""The table client: what a fused training step asks of the parameter servers (extension
point `TABLE_CLIENTS`).

A fused step makes one multi-table pull and one multi-table push (`parallax.client.step`)
through a `TableClient`. `DirectClient` sends both to the servers as they are
(`parallax.client.many`). A worker-side row cache would be another `TableClient`: it answers
hits from its rows, pulls the misses and the rows older than its staleness bound through
`DirectClient`, and pushes every gradient, registered here under its name: that is
`parallax.client.row_cache.CachingClient` ("row_cache").

    class CachingClient(TableClient):
        name = "row_cache"
        def start_pull(self, tables, min_steps, runs, clocks): ...
        def start_push(self, tables, grads, steps, worker, learning_rates, runs): ...
        def invalidate(self, tables=None): ...
"""
from __future__ import annotations

import abc
from typing import ClassVar, Protocol, Sequence

import numpy as np

from parallax.client.many import start_pull_many, start_push_many
from parallax.client.table import ShardedTable
from parallax.client.worker_metrics import WORKER_METRICS
from parallax.errors import ConfigError
from parallax.protocol.routing import Runs


class Pending(Protocol):
    """A pull or push in flight: `result()` waits for it, `abandon()` lets it go unread."""

    def result(self): ...

    def abandon(self) -> None: ...


class TableClient(abc.ABC):
    """Pulls and pushes of several tables at once, for one worker.

    `runs`: every table's ids as `Runs` over the tables' routers, already checked
    against the tables' rows (`parallax.client.step.checked_runs`): unique ids for a
    pull, the ids of the gradient rows for a push. `min_steps[k] > 0`: the rows of table k
    as of at least that many applied steps (sync training). `clocks[k]`: the steps this
    worker has pushed to table k, in either mode (what a cache counts staleness in)."""

    name: ClassVar[str] = ""

    @abc.abstractmethod
    def start_pull(self, tables: Sequence[ShardedTable], min_steps: Sequence[int],
                   runs: Runs, clocks: Sequence[int]) -> Pending:
        """The pull in flight; its `result()` is the rows of each table's ids, in order."""

    @abc.abstractmethod
    def start_push(self, tables: Sequence[ShardedTable], grads: Sequence[np.ndarray],
                   steps: Sequence[int], worker: int, learning_rates: Sequence[float],
                   runs: Runs) -> Pending:
        """The push in flight (the gradients are read before it returns); its `result()` is,
        per table, whether this push closed the step on every shard."""

    def pull(self, tables: Sequence[ShardedTable], min_steps: Sequence[int],
             runs: Runs, clocks: Sequence[int]) -> list[np.ndarray]:
        """`start_pull`, waited for (async training's pulls and pushes)."""
        return self.start_pull(tables, min_steps, runs, clocks).result()

    def push(self, tables: Sequence[ShardedTable], grads: Sequence[np.ndarray],
             steps: Sequence[int], worker: int, learning_rates: Sequence[float],
             runs: Runs) -> list[bool]:
        return self.start_push(tables, grads, steps, worker, learning_rates, runs).result()

    def invalidate(self, tables: Sequence[ShardedTable] | None = None) -> None:
        """These tables' rows (None: every table's) changed other than by this worker's
        pushes (an assign, a restore) or moved to another layout (a reshard): forget any
        copy of them. Nothing to forget here."""


class DirectClient(TableClient):
    """Every pull and push to the servers, one multi-table request per server."""

    name = "direct"

    def start_pull(self, tables, min_steps, runs, clocks):
        WORKER_METRICS.moved("in", tables, runs.lengths)  # what the servers are asked for
        return start_pull_many(tables, (), min_steps, checked=runs)

    def start_push(self, tables, grads, steps, worker, learning_rates, runs):
        WORKER_METRICS.moved("out", tables, runs.lengths)  # before duplicates are summed
        return start_push_many(tables, (), grads, steps, worker, learning_rates, checked=runs)


TABLE_CLIENTS: dict[str, type[TableClient]] = {DirectClient.name: DirectClient}


def table_client(name: str = DirectClient.name, *args) -> TableClient:
    """A new client of the registered kind `name`, made with `args` (its configuration)."""
    kind = TABLE_CLIENTS.get(name)
    if kind is None:
        raise ConfigError(f"no table client named {name!r}; registered: "
                          f"{', '.join(sorted(TABLE_CLIENTS))}")
    return kind(*args)
