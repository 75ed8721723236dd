"""Multi-table pulls and pushes: every table a step reads or writes, in one request per server.

`pull_many` and `push_many` take several tables' ids (or gradients) at once, route each
table's rows to its shards exactly as `ShardedTable` does, then pack every part bound for one
server into PullMany / PushMany requests of about `ClientOptions.chunk_mb` (one request per
server for a typical step) and send them all at once. A table's semantics are unchanged:
sync pulls wait for `min_step` on every shard of the table (an empty part where no id falls),
every shard gets a push part (empty ones close the step too), large parts are split into
chunks.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from parallax.client.many_calls import (_DONE_ON_RETRY, _PART_FIELDS_BYTES, PullPart,
                                        PushPart, _abandon, _by_server, _in_flight,
                                        _Names, _packed, _request_limit, land_pull_answer)
from parallax.client import replica_push, replicas
from parallax.client.table import ShardedTable
from parallax.errors import InternalError
from parallax.protocol import bulk_codec
from parallax.protocol.packed_codec import PullManyParts, PushManyParts
from parallax.protocol.routing import Runs


def _checked_runs(tables: Sequence[ShardedTable], ids: Sequence) -> Runs:
    """Every table's ids, checked as `ShardedTable.checked_ids` checks them, as one `Runs`."""
    arrays = [np.asarray(i) for i in ids]
    for table, array in zip(tables, arrays):
        if array.dtype.kind not in "iu":
            table.checked_ids(array)  # raises, naming the table
    runs = Runs([t.router for t in tables], [a.reshape(-1) for a in arrays])
    bad = runs.first_outside([None if t.spec.hashed_keys else t.spec.vocabulary_size
                              for t in tables])
    if bad is not None:
        tables[bad].checked_ids(runs.run(bad))  # raises, naming the table and the id
        raise InternalError(f"table {tables[bad].name!r} has an id out of range that its own "
                            f"check let through")
    return runs


# ---- pulls ---------------------------------------------------------------------------------
def pull_many(tables: Sequence[ShardedTable], unique_ids: Sequence[np.ndarray],
              min_steps: Sequence[int], checked: Runs | None = None) -> list[np.ndarray]:
    """Rows for each table's unique ids, in their order; `min_steps[k] > 0` waits until every
    shard of table k applied that many steps. `checked`: the ids as `Runs` over the tables'
    routers, already range-checked by the caller (then `unique_ids` is not read)."""
    return start_pull_many(tables, unique_ids, min_steps, checked, now=False).result()


def start_pull_many(tables: Sequence[ShardedTable], unique_ids: Sequence[np.ndarray],
                    min_steps: Sequence[int], checked: Runs | None = None,
                    now: bool = True) -> "PendingPull":
    """`pull_many` with its requests sent now and its answers read by `result()` (`now`:
    every request leaves now; otherwise the last one is made when `result()` is called)."""
    if not tables:
        return PendingPull(tables, [], [], [])
    runs = checked if checked is not None else _checked_runs(tables, unique_ids)
    from parallax.client import native_many  # (it builds on this module)
    compiled = native_many.start_pull(tables, runs, min_steps, now)
    if compiled is not None:
        return compiled
    orders, grouped, parts = pull_parts(tables, runs, min_steps)
    return _start_pull(tables, grouped, orders, parts, min_steps, now)


def pull_parts(tables: Sequence[ShardedTable], runs: Runs, min_steps: Sequence[int]
               ) -> tuple[list, list, list[PullPart]]:
    """(orders, grouped ids, parts) of a pull: each table's layout and its parts."""
    orders, grouped, parts = [], [], []
    for k, table in enumerate(tables):
        order, offsets, ids = _pull_layout(runs, k)
        orders.append(order)
        grouped.append(ids)
        row_bytes = max(table.spec.dim * table.dtype.itemsize, 8)  # answer row or request id
        fields = _PART_FIELDS_BYTES + len(table.name.encode())
        for shard, lo, hi, _, _ in table.slices(offsets):
            if hi > lo or min_steps[k] > 0:
                parts.append(PullPart(k, shard, lo, hi, (hi - lo) * row_bytes + fields))
    return orders, grouped, parts


def _pull_layout(runs: Runs, k: int) -> tuple[np.ndarray | None, list[int], np.ndarray]:
    """(order, offsets, ids[order]) of table k's pull: its ids as they are for a table in
    one shard, else by shard, in their order (`ShardRouter.shard_order`); when a push of the
    same ids follows (`runs.expect_push`), distinct ids are laid out by their push routing
    instead (sorted within each shard), which the push then finds made."""
    ids = runs.run(k)
    if runs.routers[k].shard_count == 1:
        return None, [0, len(ids)], ids
    if runs.expect_push:
        routing = runs.push_routings()[k]
        if routing.starts is None:
            return routing.order, routing.offsets, routing.ids
    order, offsets = runs.routers[k].shard_order(ids)
    return order, list(offsets), ids[order]


def _pull_request(tables, grouped, parts, min_steps, wait: bool) -> PullManyParts:
    return PullManyParts([tables[p.index].name for p in parts], [p.shard for p in parts],
                         [min_steps[p.index] if wait else 0 for p in parts],
                         [grouped[p.index][p.lo:p.hi] for p in parts])


def _wait_request(tables, parts, min_steps) -> PullManyParts | None:
    """An empty pull waiting for the step of every table shard among `parts`, or None."""
    waits = {(p.index, p.shard): p for p in parts if min_steps[p.index] > 0}
    if not waits:
        return None
    empty = np.empty(0, np.int64)
    return PullManyParts([tables[k].name for k, _ in waits], [s for _, s in waits],
                         [min_steps[k] for k, _ in waits], [empty] * len(waits))


def _start_pull(tables, grouped, orders, parts, min_steps, now: bool) -> "PendingPull":
    waits, requests = pull_requests(tables, grouped, parts, min_steps)
    for conn, server_parts, wait in waits:
        conn.result(None, "PullMany", wait, _Names(tables, server_parts))
    return PendingPull(tables, grouped, orders, _in_flight(requests, "PullMany", now))


def pull_requests(tables, grouped, parts, min_steps) -> tuple[list, list]:
    """(waits, requests), each (conn, parts, request): the requests of a pull, and the
    empty requests to wait with first. Several requests to one server: one empty request
    waits first, then the pulls do not wait, so that a worker holds at most one waiting
    server thread; but each waits itself where the shards have copies (`ReplicaSet`): a
    pull sent again to the copy after a loss must wait there, as the copy can be a push
    behind."""
    limit = _request_limit(tables[0].shards[0].options)
    waits, requests = [], []
    for conn, server_parts in _by_server(tables, parts).values():
        packed = _packed(server_parts, limit)
        each_waits = len(packed) == 1 or isinstance(conn, replicas.ReplicaSet)
        if not each_waits:
            wait = _wait_request(tables, server_parts, min_steps)
            if wait is not None:
                waits.append((conn, server_parts, wait))
        requests += [(conn, chunk, _pull_request(tables, grouped, chunk, min_steps,
                                                 each_waits)) for chunk in packed]
    return waits, requests


class PendingPull:
    """A multi-table pull whose requests are in flight; `result()` reads the answers."""

    def __init__(self, tables, grouped, orders, calls: list) -> None:
        self.tables, self.grouped, self.orders, self.calls = tables, grouped, orders, calls

    def abandon(self) -> None:
        """The rows will not be read (the step failed): let go of the connections."""
        _abandon(self.calls)

    def result(self) -> list[np.ndarray]:
        """Rows for each table's ids, in their order."""
        tables, orders = self.tables, self.orders
        rows = [np.empty((len(g), t.spec.dim), dtype=t.dtype)
                for t, g in zip(tables, self.grouped)]
        try:
            for conn, chunk, request, future in self.calls:
                answer = conn.result(future, "PullMany", request, _Names(tables, chunk))
                land_pull_answer(conn, chunk, answer, rows, orders)
        except BaseException:
            self.abandon()  # the calls not read yet (the others have let go already)
            raise
        return rows


# ---- pushes --------------------------------------------------------------------------------
def push_many(tables: Sequence[ShardedTable], ids: Sequence[np.ndarray],
              grads: Sequence[np.ndarray], steps: Sequence[int], worker: int,
              learning_rates: Sequence[float], checked: Runs | None = None) -> list[bool]:
    """Push every table's gradients (duplicates summed here); per table, True if this push
    closed the step on every one of its shards. `checked`: as for `pull_many`."""
    return start_push_many(tables, ids, grads, steps, worker, learning_rates, checked,
                           now=False).result()


def start_push_many(tables: Sequence[ShardedTable], ids: Sequence[np.ndarray],
                    grads: Sequence[np.ndarray], steps: Sequence[int], worker: int,
                    learning_rates: Sequence[float], checked: Runs | None = None,
                    now: bool = True) -> "PendingPush":
    """`push_many` with its requests sent now (the gradients are read before it returns)
    and its answers read by `result()`; `now` as for `start_pull_many`."""
    if not tables:
        return PendingPush(tables, [])
    runs = checked if checked is not None else _checked_runs(tables, ids)
    copies = replica_push.views(tables)
    if copies is not None:  # replicated shards: one request per server for every copy
        k = len(copies) // len(tables)
        doubled = Runs([t.router for t in copies], [runs.run(i) for i in range(len(tables))] * k)
        return replica_push.Copied(start_push_many(
            copies, (), list(grads) * k, list(steps) * k, worker, list(learning_rates) * k,
            doubled, now), len(tables))
    grads = [np.asarray(g, dtype=t.dtype).reshape(hi - lo, t.spec.dim)
             for t, g, lo, hi in zip(tables, grads, runs.starts, runs.starts[1:])]
    from parallax.client import native_many  # (it builds on this module)
    compiled = native_many.start_push(tables, runs, grads, steps, worker, learning_rates, now)
    if compiled is not None:
        return compiled
    routings, narrow, parts = push_parts(tables, runs, grads)
    return _start_push(tables, routings, (grads, narrow), parts, steps, worker, learning_rates,
                       now)


def push_parts(tables: Sequence[ShardedTable], runs: Runs, grads: Sequence[np.ndarray]
               ) -> tuple[list, list, list[PushPart]]:
    """(push routings, narrowed sums or None, parts) of a push, per table; narrowed before
    anything is sent: a gradient beyond its wire dtype sends nothing."""
    routings = runs.push_routings()
    narrow = [t.narrowed(t.summed(p, g)) if t.wire else None
              for t, p, g in zip(tables, routings, grads)]
    parts = []
    for k, (table, routing) in enumerate(zip(tables, routings)):
        row_bytes = table.spec.dim * table.push_dtype.itemsize + 8
        fields = _PART_FIELDS_BYTES + len(table.name.encode())
        for shard, lo, hi, chunk, chunks in table.slices(routing.offsets):
            parts.append(PushPart(k, shard, lo, hi, chunk, chunks,
                                  (hi - lo) * row_bytes + fields))
    return routings, narrow, parts


def _push_request(tables, routings, grads, parts, steps, worker, learning_rates
                  ) -> PushManyParts:
    """`grads`: (each table's gradients, each table's narrowed sums or None)."""
    grads, narrow = grads
    headers = []
    for p in parts:
        table = tables[p.index]
        header = bulk_codec.PushHeader(table.name, p.shard, steps[p.index], worker,
                                       float(learning_rates[p.index]), p.chunk, p.chunks,
                                       table.session)
        headers.append((header, p.hi - p.lo, table.spec.dim, table.push_dtype))

    def fill(i: int, ids: np.ndarray, rows: np.ndarray) -> None:
        p = parts[i]
        ids[...] = routings[p.index].ids[p.lo:p.hi]
        if narrow[p.index] is None:
            routings[p.index].fill(grads[p.index], p.lo, p.hi, rows)
        else:
            rows[...] = narrow[p.index][p.lo:p.hi]
    return PushManyParts(headers, fill)


def _start_push(tables, routings, grads, parts, steps, worker, learning_rates, now: bool
                ) -> "PendingPush":
    requests = push_requests(tables, routings, grads, parts, steps, worker, learning_rates, now)
    return PendingPush(tables, _in_flight(requests, "PushMany", now))


def push_requests(tables, routings, grads, parts, steps, worker, learning_rates, now: bool
                  ) -> list:
    """(conn, parts, request) of each request of a push (`now`: encoded now, so that the
    gradients may be reused once this returns)."""
    limit = _request_limit(tables[0].shards[0].options)
    requests = []
    for conn, server_parts in _by_server(tables, parts).values():
        for chunk in _packed(server_parts, limit):
            request = _push_request(tables, routings, grads, chunk, steps, worker, learning_rates)
            requests.append((conn, chunk, request.settled() if now else request))
    return requests


class PendingPush:
    """A multi-table push whose requests are in flight; `result()` reads the answers."""

    def __init__(self, tables, calls: list) -> None:
        self.tables, self.calls = tables, calls

    def abandon(self) -> None:
        """The answers will not be read: let go of the connections."""
        _abandon(self.calls)

    def result(self) -> list[bool]:
        """Per table, True if this push closed the step on every one of its shards."""
        closed: list[set[int]] = [set() for _ in self.tables]
        try:
            for conn, chunk, request, future in self.calls:
                reply = conn.result(future, "PushMany", request, _Names(self.tables, chunk),
                                    done_on_retry=_DONE_ON_RETRY)
                if reply is None:  # a retry found the first attempt landed
                    continue
                for part, answer in zip(chunk, reply.parts):
                    if answer.applied:
                        closed[part.index].add(part.shard)
        except BaseException:
            _abandon(self.calls)  # the calls not read yet (the others have let go already)
            raise
        return [len(c) == t.spec.shard_count for c, t in zip(closed, self.tables)]
