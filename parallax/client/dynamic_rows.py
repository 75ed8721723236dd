"""The rows a keyed table holds, read back for serving: given keys, the most used, or all.

`export_rows` pages through ExportRows of each shard (`ShardedTable.export_pages`), so it
reads between steps only and sees every shard at one step. A dynamic table's pages carry each
row's use count, which `top_n` ranks by; another keyed table keeps none (its `uses` come
back empty and `top_n` is refused). With `top_n`, at most max(2 * top_n, 1024) rows plus one page
are held at once, whatever the table's size. With `keys`, only the shards that own one of them
are read, but each of those whole: ExportRows has no key filter.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

import grpc
import numpy as np

from parallax.errors import ConfigError, ServerError
from parallax.protocol import wire

if TYPE_CHECKING:
    from parallax.client.table import ShardedTable

Rows = tuple[np.ndarray, np.ndarray, np.ndarray]  # keys int64[n], values [n, dim], uses
PRUNE_ROWS = 1024  # top_n: rows held at least before the ranking prunes them to top_n


def export_rows(table: "ShardedTable", keys=None, top_n: int | None = None) -> Rows:
    """(keys, values, uses) of the rows `table` holds: those of `keys` (left out: keys it
    does not hold), with `top_n` the n most used (of `keys`, when given too), else all.
    Sorted by key; `top_n`: by uses, most first, ties by the smaller key. `uses` is
    int64[n] for a dynamic table and empty for another keyed one.

    Raises:
        ConfigError: a fixed-vocabulary table, `top_n` not an int >= 0 or on a table that
            keeps no use counts, or a shard whose step moved while it was read.
        ServerError: a shard refused (FAILED_PRECONDITION: it is in the middle of a step).
    """
    _check(table, top_n)
    wanted = None if keys is None else np.unique(table.checked_ids(keys))
    shards = range(table.spec.shard_count) if wanted is None else \
        np.unique(table.router.shard_of(wanted)).tolist()
    picked = _Picked(table, top_n)
    steps: dict[int, int] = {}
    for shard in shards:
        for page in _pages(table, shard):
            steps[shard] = page.step
            picked.add(*_rows_of(page, wanted))
    if len(set(steps.values())) > 1:
        raise ConfigError(f"cannot export {table.name!r}: its shards are at different steps "
                          f"{steps}; a push landed while they were read. Export between "
                          f"steps, once every worker's pushes have landed")
    return picked.result()


def _check(table: "ShardedTable", top_n: int | None) -> None:
    name = table.name
    if not table.spec.hashed_keys:
        raise ConfigError(f"table {name!r} has a fixed vocabulary (every id in [0, "
                          f"{table.spec.vocabulary_size}) has a row): read it with pull_all() "
                          f"or pull(ids); export_rows reads the rows a keyed table "
                          f"(hashed_keys=True) holds")
    if top_n is None:
        return
    if isinstance(top_n, bool) or not isinstance(top_n, (int, np.integer)) or top_n < 0:
        raise ConfigError(f"table {name!r}: top_n must be an int >= 0 (or None: every row), "
                          f"got {top_n!r}")
    if not table.spec.dynamic:
        raise ConfigError(f"table {name!r} is not a dynamic table: its rows keep no use "
                          f"counts, so top_n cannot rank them; export given keys or every row "
                          f"(top_n=None), or create it as a dynamic table (count_uses, "
                          f"eviction, admit_after, admit_probability or ttl_steps)")


def _pages(table: "ShardedTable", shard: int) -> Iterator:
    """`table.export_pages(shard)`, a shard's mid-step refusal said as export_rows'."""
    try:
        yield from table.export_pages(shard)
    except ServerError as exc:
        if exc.code != grpc.StatusCode.FAILED_PRECONDITION:
            raise
        raise ServerError(f"table {table.name!r}: export_rows reads between steps only, and "
                          f"shard {shard} is in the middle of one; call it once every "
                          f"worker's pushes of the step have landed (e.g. after wait_step). "
                          f"{exc}", address=exc.address, table=exc.table,
                          code=exc.code) from exc


def _rows_of(page, wanted: np.ndarray | None) -> Rows:
    """A page's (keys, values, uses; empty without use counts), only `wanted` keys."""
    ids = wire.decode(page.ids, "ids")
    values = wire.decode(page.values, "values")
    uses = wire.decode(page.uses, "uses") if page.HasField("uses") else np.zeros(0, np.int64)
    if wanted is None:
        return ids, values, uses
    held = np.isin(ids, wanted)
    return ids[held], values[held], uses[held] if len(uses) else uses


class _Picked:
    """The rows kept so far: all of them, or (top_n) the most used, pruned as pages come."""

    def __init__(self, table: "ShardedTable", top_n: int | None) -> None:
        self.top_n = top_n
        self.parts: list[Rows] = []
        self.count = 0
        self.empty: Rows = (np.zeros(0, np.int64), np.zeros((0, table.spec.dim), table.dtype),
                            np.zeros(0, np.int64))

    def add(self, keys: np.ndarray, values: np.ndarray, uses: np.ndarray) -> None:
        self.parts.append((keys, values, uses))
        self.count += len(keys)
        if self.top_n is not None and self.count > max(2 * self.top_n, PRUNE_ROWS):
            self.parts = [self._ranked(self.top_n)]
            self.count = len(self.parts[0][0])

    def _joined(self) -> Rows:
        if not self.parts:
            return self.empty
        return tuple(np.concatenate([p[i] for p in self.parts]) for i in range(3))

    def _ranked(self, n: int) -> Rows:
        """The n most used rows so far, most first, ties by the smaller key."""
        keys, values, uses = self._joined()
        order = np.lexsort((keys, -uses))[:n]
        return keys[order], values[order], uses[order]

    def result(self) -> Rows:
        if self.top_n is not None:
            return self._ranked(self.top_n)
        keys, values, uses = self._joined()
        order = np.argsort(keys, kind="stable")
        return keys[order], values[order], uses[order] if len(uses) else uses
