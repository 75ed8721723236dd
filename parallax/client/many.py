"""Multi-table pulls and pushes: every table a step reads or writes, in one request per server.

`pull_many` and `push_many` take several tables' ids (or gradients) at once, route each
table's rows to its shards exactly as `ShardedTable` does, then pack every part bound for one
server into PullMany / PushMany requests of about `ClientOptions.chunk_mb` (one request per
server for a typical step) and send them all at once. A table's semantics are unchanged:
sync pulls wait for `min_step` on every shard of the table (an empty part where no id falls),
every shard gets a push part (empty ones close the step too), large parts are split into
chunks. A server without these methods (UNIMPLEMENTED: an older server) gets the same parts
as single-table Pull and Push requests from then on.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import grpc
import numpy as np

from parallax.client.connection import ServerConnection, run_in_background
from parallax.client.table import ShardedTable, start_call
from parallax.errors import ConfigError, ServerError
from parallax.protocol import bulk_codec, wire_dtypes
from parallax.protocol.packed_codec import PullManyParts, PushManyParts
from parallax.protocol.routing import Runs
from parallax.ps.v1 import ps_pb2

_DONE_ON_RETRY = (grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.FAILED_PRECONDITION)
# A request (and a pull's answer) must fit the message limit with its headers: requests are
# packed to chunk_bytes less this (as ShardedTable.chunk_rows leaves), each part counted
# with its rows, its table's name and the fields around them (tags, lengths, shard, step,
# worker, learning rate, chunk fields, session, tensor headers, alignment padding).
_REQUEST_HEADROOM = 4096
_PART_FIELDS_BYTES = 192


class PullPart(NamedTuple):
    """Rows `ids` (unique int64, grouped by shard) of one table shard go to
    rows[order[lo:hi]] of table `index`'s answer; `nbytes`: what the part adds to the larger
    of its request (8-byte ids) and its answer (rows)."""

    index: int
    shard: int
    lo: int
    hi: int
    nbytes: int


class PushPart(NamedTuple):
    """Rows ids[lo:hi] of table `index`'s push routing, chunk `chunk` of `chunks` of a shard."""

    index: int
    shard: int
    lo: int
    hi: int
    chunk: int
    chunks: int
    nbytes: int


def _by_server(tables: Sequence[ShardedTable], parts) -> dict[int, tuple[ServerConnection, list]]:
    """Parts grouped by the server connection they go to, in a stable order."""
    out: dict[int, tuple[ServerConnection, list]] = {}
    for part in parts:
        conn = tables[part.index].shards[part.shard]
        out.setdefault(id(conn), (conn, []))[1].append(part)
    return out


def _packed(parts: list, limit: int) -> list[list]:
    """Consecutive parts in requests of at most `limit` row bytes (at least one part each)."""
    requests, current, size = [], [], 0
    for part in parts:
        if current and size + part.nbytes > limit:
            requests.append(current)
            current, size = [], 0
        current.append(part)
        size += part.nbytes
    return requests + [current] if current else requests


def _request_limit(options) -> int:
    return max(1, options.chunk_bytes - _REQUEST_HEADROOM)


def _start(conn: ServerConnection, method: str, request, calls: int):
    return start_call(conn, method, request, calls) if conn.multi_table else None


def _in_flight(requests: list, method: str, now: bool = False) -> list:
    """(conn, parts, request, future) of every request: all but the last start now (a
    data-plane request is sent from this thread, any other call runs on an RPC thread); the
    last comes first in the list with no future, so that it is made on the calling thread
    while the others are in flight (one thread hand-off less per call). `now`: the last
    starts now too (for calls whose answers are read later)."""
    if now:  # a server without multi-table methods gets its parts now, on an RPC thread
        return [(conn, chunk, request, _start(conn, method, request, 2) if conn.multi_table
                 else _Legacy(run_in_background(_LEGACY[method], conn, request)))
                for conn, chunk, request in requests]
    started = [(conn, chunk, request, _start(conn, method, request, 2))
               for conn, chunk, request in requests[:-1]]
    return [(*requests[-1], None)] + started if requests else []


class _Legacy:
    """Parts of a multi-table request made one by one (an older server), already started."""

    def __init__(self, future) -> None:
        self.future = future

    def result(self):
        return self.future.result()


def _abandon(calls: list) -> None:
    """Close the connections of started data-plane calls nobody will read."""
    for *_, future in calls:
        if hasattr(future, "abandon"):
            future.abandon()


def _answer(conn: ServerConnection, method: str, request, future, names: str, **kwargs):
    """The answer to a multi-table call (started or not); a server that does not know the
    method is asked part by part, now and from then on."""
    if isinstance(future, _Legacy):
        return future.result()
    if conn.multi_table:
        try:
            return conn.result(future, method, request, names, **kwargs)
        except ServerError as err:
            if err.code != grpc.StatusCode.UNIMPLEMENTED:
                raise
            conn.multi_table = False
    return _LEGACY[method](conn, request, names)


def _legacy_pull(conn: ServerConnection, request: PullManyParts, names=None) -> list:
    return [conn.call("Pull", ps_pb2.PullRequest(table=p.table, shard_index=p.shard_index,
                                                 ids=p.ids, min_step=p.min_step), p.table)
            for p in request.protobuf().parts]


def _legacy_push(conn: ServerConnection, request: PushManyParts, names=None):
    reply = ps_pb2.PushManyResponse()
    for p in bulk_codec.decode_push_many_request(request.protobuf()).parts:
        data = bulk_codec.encode_push_request(p.table, p.shard_index, p.step, p.worker, p.ids,
                                              p.grads, p.learning_rate, p.chunk_index,
                                              p.chunk_count, p.session)
        answer = conn.call("Push", data, p.table, done_on_retry=_DONE_ON_RETRY)
        reply.parts.add(step=answer.step if answer else 0, applied=bool(answer and
                                                                        answer.applied))
    return reply


_LEGACY = {"PullMany": _legacy_pull, "PushMany": _legacy_push}


def _checked_runs(tables: Sequence[ShardedTable], ids: Sequence) -> Runs:
    """Every table's ids, checked as `ShardedTable.checked_ids` checks them, as one `Runs`."""
    arrays = [np.asarray(i) for i in ids]
    for table, array in zip(tables, arrays):
        if array.dtype.kind not in "iu":
            table.checked_ids(array)  # raises, naming the table
    runs = Runs([t.partitioner for t in tables], [a.reshape(-1) for a in arrays])
    bad = runs.first_outside([None if t.spec.hashed_keys else t.spec.vocabulary_size
                              for t in tables])
    if bad is not None:
        tables[bad].checked_ids(runs.run(bad))  # raises, naming the table and the id
        raise ConfigError(f"internal: table {tables[bad].name!r} has an id out of range that "
                          f"its own check let through")
    return runs


# ---- pulls ---------------------------------------------------------------------------------
def pull_many(tables: Sequence[ShardedTable], unique_ids: Sequence[np.ndarray],
              min_steps: Sequence[int], checked: Runs | None = None) -> list[np.ndarray]:
    """Rows for each table's unique ids, in their order; `min_steps[k] > 0` waits until every
    shard of table k applied that many steps. `checked`: the ids as `Runs` over the tables'
    partitioners, already range-checked by the caller (then `unique_ids` is not read)."""
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
    one shard, else by shard, in their order (`Partitioner.shard_order`); when a push of the
    same ids follows (`runs.expect_push`), distinct ids are laid out by their push routing
    instead (sorted within each shard), which the push then finds made."""
    ids = runs.run(k)
    if runs.partitioners[k].shard_count == 1:
        return None, [0, len(ids)], ids
    if runs.expect_push:
        plan = runs.push_routings()[k]
        if plan.starts is None:
            return plan.order, plan.offsets, plan.ids
    order, offsets = runs.partitioners[k].shard_order(ids)
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
        _answer(conn, "PullMany", wait, None, _Names(tables, server_parts))
    return PendingPull(tables, grouped, orders, _in_flight(requests, "PullMany", now))


def pull_requests(tables, grouped, parts, min_steps) -> tuple[list, list]:
    """(waits, requests), each (conn, parts, request): the requests of a pull, and the
    empty requests to wait with first. Several requests to one server: one empty request
    waits first, then the pulls do not wait, so that a worker holds at most one waiting
    server thread."""
    limit = _request_limit(tables[0].shards[0].options)
    waits, requests = [], []
    for conn, server_parts in _by_server(tables, parts).values():
        packed = _packed(server_parts, limit)
        if len(packed) > 1:
            wait = _wait_request(tables, server_parts, min_steps)
            if wait is not None:
                waits.append((conn, server_parts, wait))
        requests += [(conn, chunk, _pull_request(tables, grouped, chunk, min_steps,
                                                 len(packed) == 1)) for chunk in packed]
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
                answer = _answer(conn, "PullMany", request, future, _Names(tables, chunk))
                land_pull_answer(conn, chunk, answer, rows, orders)
        except BaseException:
            self.abandon()  # the calls not read yet (the others have let go already)
            raise
        return rows


def land_pull_answer(conn: ServerConnection, chunk: list, answer, rows: list[np.ndarray],
                     orders: list) -> None:
    """Each part's rows of one PullMany answer into its table's rows (`orders[k]`: where
    table k's layout rows go, None: in order)."""
    if len(answer) != len(chunk):
        raise ServerError(f"PullMany on server {conn.address} answered {len(answer)} parts "
                          f"for {len(chunk)} asked; is the server a compatible parallax "
                          f"version?", address=conn.address, table=None,
                          code=grpc.StatusCode.INTERNAL)
    for part, (values, _) in zip(chunk, answer):
        order = orders[part.index]
        target = rows[part.index]
        if values.dtype != target.dtype:  # a wire dtype's rows
            values = wire_dtypes.to_float32(values)
        if order is None:
            target[part.lo:part.hi] = values
        else:
            target[order[part.lo:part.hi]] = values


class _Names:
    """The tables a request concerns, for error messages only (formatted when needed)."""

    def __init__(self, tables: Sequence[ShardedTable], parts) -> None:
        self.tables, self.parts = tables, parts

    def _sorted(self) -> list[str]:
        return sorted({self.tables[p.index].name for p in self.parts})

    def __str__(self) -> str:
        return ",".join(self._sorted())

    def __repr__(self) -> str:
        names = self._sorted()
        shown = ", ".join(map(repr, names[:3]))
        return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")


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
    grads = [np.asarray(g, dtype=t.dtype).reshape(hi - lo, t.spec.dim)
             for t, g, lo, hi in zip(tables, grads, runs.starts, runs.starts[1:])]
    from parallax.client import native_many  # (it builds on this module)
    compiled = native_many.start_push(tables, runs, grads, steps, worker, learning_rates, now)
    if compiled is not None:
        return compiled
    plans, narrow, parts = push_parts(tables, runs, grads)
    return _start_push(tables, plans, (grads, narrow), parts, steps, worker, learning_rates,
                       now)


def push_parts(tables: Sequence[ShardedTable], runs: Runs, grads: Sequence[np.ndarray]
               ) -> tuple[list, list, list[PushPart]]:
    """(routing plans, narrowed sums or None, parts) of a push, per table; narrowed before
    anything is sent: a gradient beyond its wire dtype sends nothing."""
    plans = runs.push_routings()
    narrow = [t.narrowed(t.summed(p, g)) if t.wire else None
              for t, p, g in zip(tables, plans, grads)]
    parts = []
    for k, (table, plan) in enumerate(zip(tables, plans)):
        row_bytes = table.spec.dim * table.push_dtype.itemsize + 8
        fields = _PART_FIELDS_BYTES + len(table.name.encode())
        for shard, lo, hi, chunk, chunks in table.slices(plan.offsets):
            parts.append(PushPart(k, shard, lo, hi, chunk, chunks,
                                  (hi - lo) * row_bytes + fields))
    return plans, narrow, parts


def _push_request(tables, plans, grads, parts, steps, worker, learning_rates
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
        ids[...] = plans[p.index].ids[p.lo:p.hi]
        if narrow[p.index] is None:
            plans[p.index].fill(grads[p.index], p.lo, p.hi, rows)
        else:
            rows[...] = narrow[p.index][p.lo:p.hi]
    return PushManyParts(headers, fill)


def _start_push(tables, plans, grads, parts, steps, worker, learning_rates, now: bool
                ) -> "PendingPush":
    requests = push_requests(tables, plans, grads, parts, steps, worker, learning_rates, now)
    return PendingPush(tables, _in_flight(requests, "PushMany", now))


def push_requests(tables, plans, grads, parts, steps, worker, learning_rates, now: bool
                  ) -> list:
    """(conn, parts, request) of each request of a push (`now`: encoded now, so that the
    gradients may be reused once this returns)."""
    limit = _request_limit(tables[0].shards[0].options)
    requests = []
    for conn, server_parts in _by_server(tables, parts).values():
        for chunk in _packed(server_parts, limit):
            request = _push_request(tables, plans, grads, chunk, steps, worker, learning_rates)
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
                reply = _answer(conn, "PushMany", request, future, _Names(self.tables, chunk),
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
