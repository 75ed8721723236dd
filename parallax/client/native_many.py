"""The compiled path of multi-table pulls and pushes (`parallax.client.many`): one call into
parallax.native's worker kernels per step and direction, for every table and part at once.

`start_pull` routes every table's ids, lays them out by shard, cuts the parts and encodes
one packed PullMany body per server in one kernel call (`pull_plan`); `NativePull.result`
scatters each packed answer's rows into the tables' rows in one call per answer
(`pull_scatter`). `start_push` sums every table's gradient rows per id, narrows them to the
tables' wire dtypes and encodes the PushMany bodies in one call (`push_encode`). The bytes
on the wire and the rows are bit for bit the numpy path's (tests/server/test_native_worker.py).

Each returns None where the numpy path is to run instead: no compiled kernels
(PARALLAX_NATIVE=0, or not built), a table whose rows are not float32, a pull that needs
several requests to one server, a gradient its wire dtype would make infinite (the numpy
path raises the error). An answer that is not what was asked (another layout, a wrong
count) is decoded by the numpy path, which reports it as it always does.
"""
from __future__ import annotations

import collections
from typing import Sequence

import numpy as np

from parallax import native
from parallax.client import many_calls
from parallax.client.table import ShardedTable
from parallax.protocol import wire, wire_dtypes
from parallax.protocol.packed_codec import EncodedPullMany, EncodedPushMany, RawAnswer
from parallax.protocol.routing import _KINDS, Runs, _kind

_F32 = np.dtype(np.float32)
_NARROW = {None: 0, "float32": 0, "float16": 1, "bfloat16": 2}  # as push_encode numbers them
_CACHED_SETS = 64  # table lists whose arrays are kept (one or two per traced step)
ran: collections.Counter = collections.Counter()  # calls made natively, by kind (tests)


class _TableSet:
    """The fixed facts of a list of tables as the kernels read them (made once per list)."""

    def __init__(self, tables: Sequence[ShardedTable]) -> None:
        self.tables = list(tables)
        conns: dict[int, int] = {}
        self.conns: list = []
        server_of, shard_base = [], [0]
        for table in tables:
            for conn in table.shards:
                if id(conn) not in conns:
                    conns[id(conn)] = len(self.conns)
                    self.conns.append(conn)
                server_of.append(conns[id(conn)])
            shard_base.append(len(server_of))
        names = [t.name.encode() for t in tables]
        self.names = b"".join(names)
        self.dims = _int64([t.spec.dim for t in tables])
        self.layout = {
            "shard_counts": _int64([t.spec.shard_count for t in tables]),
            "kinds": _int64([_KINDS[_kind(t.router)] for t in tables]),
            "blocks": _int64([1 if t.router.hashed else max(1, t.router.block)
                              for t in tables]),
            "chunk_rows": _int64([t.chunk_rows for t in tables]),
            "name_at": _int64(np.cumsum([0] + [len(n) for n in names])),
            "server_of": _int64(server_of), "shard_base": _int64(shard_base),
        }
        self.row_bytes = _int64([max(t.spec.dim * t.dtype.itemsize, 8) for t in tables])
        wires = [t.wire.name if t.wire else None for t in tables]
        self.push = dict(self.layout, names=self.names, dims=self.dims,
                         sessions=np.asarray([t.session for t in tables],  # u64 bits
                                             np.uint64).view(np.int64),
                         narrow=_int64([_NARROW.get(w, -1) for w in wires]),
                         codes=_int64([wire.dtype_code(t.push_dtype) for t in tables]),
                         thresholds=np.array([t.wire.overflows_at if t.wire else np.inf
                                              for t in tables], np.float32))
        self.native = all(t.dtype == _F32 for t in tables) and all(w in _NARROW for w in wires)
        self.limit = many_calls._request_limit(tables[0].shards[0].options)


def _int64(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


_SETS: collections.OrderedDict[tuple[int, ...], _TableSet] = collections.OrderedDict()


def _table_set(tables: Sequence[ShardedTable]) -> _TableSet | None:
    """The tables' `_TableSet` when the kernels can carry them, else None."""
    key = tuple(map(id, tables))
    found = _SETS.get(key)
    if found is None or any(a is not b for a, b in zip(found.tables, tables)):
        found = _SETS[key] = _TableSet(tables)
        while len(_SETS) > _CACHED_SETS:
            _SETS.popitem(last=False)
    return found if found.native else None


class _IndexNames(many_calls._Names):
    """The tables of a request's parts, for error messages (`parts[:, 0]`: table indices)."""

    def _sorted(self) -> list[str]:
        return sorted({self.tables[k].name for k in set(self.parts[:, 0].tolist())})


# ---- pulls ---------------------------------------------------------------------------------
def start_pull(tables: Sequence[ShardedTable], runs: Runs, min_steps: Sequence[int],
               now: bool) -> "NativePull | None":
    """`many.start_pull_many` made by the kernels, or None (the numpy path makes it)."""
    planned = pull_requests(tables, runs, min_steps)
    if planned is None:
        return None
    found, positions, requests = planned
    ran["pull"] += 1
    return NativePull(found, runs, positions, many_calls._in_flight(requests, "PullMany", now))


def pull_requests(tables: Sequence[ShardedTable], runs: Runs, min_steps: Sequence[int]
                  ) -> tuple[_TableSet, np.ndarray, list] | None:
    """(tables, layout positions, [(conn, parts, request)]) of a pull, or None."""
    kernels = native.kernels()
    found = _table_set(tables) if kernels is not None and tables else None
    if found is None:
        return None
    flat = runs.flat_routing(kernels.route) if runs.expect_push else None
    empty = np.empty(0, np.int64)
    order, unique, bounds = (flat.order, flat.unique, flat.bounds) if flat is not None else \
        (empty, empty, empty)
    layout = found.layout
    planned = kernels.pull_plan(
        runs.ids, _int64(runs.starts), layout["shard_counts"], layout["kinds"],
        layout["blocks"], flat is not None, order, unique, bounds, layout["chunk_rows"],
        found.row_bytes, layout["name_at"], found.names, layout["server_of"],
        layout["shard_base"], _int64(min_steps), found.limit)
    if planned is None:
        return None
    servers, bodies, parts, positions = planned
    return found, positions, [(found.conns[s], p, EncodedPullMany(b))
                              for s, b, p in zip(servers, bodies, parts)]


class NativePull:
    """A pull made by the kernels, in flight (the shape of `many.PendingPull`)."""

    def __init__(self, found: _TableSet, runs: Runs, positions: np.ndarray, calls: list
                 ) -> None:
        self.found, self.runs, self.positions, self.calls = found, runs, positions, calls

    def abandon(self) -> None:
        many_calls._abandon(self.calls)

    def result(self) -> list[np.ndarray]:
        """Rows for each table's ids, in their order."""
        tables, starts = self.found.tables, _int64(self.runs.starts)
        sizes = np.diff(starts) * self.found.dims
        bases = _int64(np.cumsum(sizes) - sizes)
        flat = np.empty(int(sizes.sum()), np.float32)
        rows = [flat[b:b + s].reshape(-1, d) for b, s, d in
                zip(bases.tolist(), sizes.tolist(), self.found.dims.tolist())]
        try:
            for conn, parts, request, future in self.calls:
                answer = conn.result(future, "PullMany", request, _IndexNames(tables, parts))
                if not (isinstance(answer, RawAnswer) and native.kernels().pull_scatter(
                        answer.body, parts, self.positions, starts, self.found.dims, bases,
                        flat, _f16_table(), _CODES)):
                    self._land_in_python(conn, parts, answer, rows)
        except BaseException:
            self.abandon()
            raise
        return rows

    def _land_in_python(self, conn, parts: np.ndarray, answer, rows: list[np.ndarray]) -> None:
        """An answer the kernels did not take (not packed, or not what was asked): the
        numpy path's decoding and checks."""
        if isinstance(answer, RawAnswer):
            answer = answer.decoded()
        starts = self.runs.starts
        orders = [self.positions[lo:hi] for lo, hi in zip(starts, starts[1:])]
        chunk = [many_calls.PullPart(int(k), 0, int(lo), int(hi), 0)
                 for k, lo, hi in parts.tolist()]
        many_calls.land_pull_answer(conn, chunk, answer, rows, orders)


_CODES = _int64([wire.dtype_code(np.float32), wire.dtype_code(np.float16),
                 wire_dtypes.WIRE_DTYPES["bfloat16"].code])


def _f16_table() -> np.ndarray:
    """float32 of every float16 bit pattern, as wire_dtypes.f16_decode reads them."""
    if not wire_dtypes._F16_TABLE:  # noqa: SLF001 - the same table, made once
        wire_dtypes.f16_decode(np.zeros(1, np.float16))
    return wire_dtypes._F16_TABLE[0]  # noqa: SLF001


# ---- pushes --------------------------------------------------------------------------------
def start_push(tables: Sequence[ShardedTable], runs: Runs, grads: Sequence[np.ndarray],
               steps: Sequence[int], worker: int, learning_rates: Sequence[float],
               now: bool) -> "NativePush | None":
    """`many.start_push_many` made by the kernels, or None (the numpy path makes it)."""
    requests = push_requests(tables, runs, grads, steps, worker, learning_rates)
    if requests is None:
        return None
    ran["push"] += 1
    return NativePush(tables, many_calls._in_flight(requests, "PushMany", now))


def push_requests(tables: Sequence[ShardedTable], runs: Runs, grads: Sequence[np.ndarray],
                  steps: Sequence[int], worker: int, learning_rates: Sequence[float]
                  ) -> list | None:
    """[(conn, parts, request)] of a push (encoded now), or None."""
    kernels = native.kernels()
    found = _table_set(tables) if kernels is not None and tables else None
    if found is None:
        return None
    flat = runs.flat_routing(kernels.route)
    routing = {"starts": _int64(runs.starts), "order": flat.order, "unique": flat.unique,
               "first": flat.first, "bounds": flat.bounds}
    arrays = [np.ascontiguousarray(g, dtype=np.float32) for g in grads]
    out = kernels.push_encode(routing, found.push, arrays, _int64(steps),
                              np.asarray(learning_rates, np.float64), int(worker), found.limit)
    if isinstance(out, int):
        return None  # a gradient beyond its wire dtype: the numpy path raises the error
    servers, bodies, parts = out
    return [(found.conns[s], p, EncodedPushMany(b)) for s, b, p in zip(servers, bodies, parts)]


class NativePush:
    """A push made by the kernels, in flight (the shape of `many.PendingPush`)."""

    def __init__(self, tables: Sequence[ShardedTable], calls: list) -> None:
        self.tables, self.calls = tables, calls

    def abandon(self) -> None:
        many_calls._abandon(self.calls)

    def result(self) -> list[bool]:
        """Per table, True if this push closed the step on every one of its shards."""
        closed: list[set[int]] = [set() for _ in self.tables]
        try:
            for conn, parts, request, future in self.calls:
                reply = conn.result(future, "PushMany", request, _IndexNames(self.tables, parts),
                                    done_on_retry=many_calls._DONE_ON_RETRY)
                if reply is None:  # a retry found the first attempt landed
                    continue
                for (k, shard), answer in zip(parts.tolist(), reply.parts):
                    if answer.applied:
                        closed[k].add(shard)
        except BaseException:
            many_calls._abandon(self.calls)
            raise
        return [len(c) == t.spec.shard_count for c, t in zip(closed, self.tables)]
