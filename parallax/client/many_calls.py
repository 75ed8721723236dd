"""How a multi-table request travels (`parallax.client.many` and its compiled path,
`parallax.client.native_many`): parts grouped by server and packed into requests of about
`ClientOptions.chunk_mb`, started so that one hand-off less is made per call, answered with
retries.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import grpc
import numpy as np

from parallax.client.connection import ServerConnection
from parallax.client.table import ShardedTable
from parallax.errors import ServerError
from parallax.protocol import wire_dtypes

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


def _in_flight(requests: list, method: str, now: bool = False) -> list:
    """(conn, parts, request, future) of every request: all but the last start now (a
    data-plane request is sent from this thread, any other call runs on an RPC thread); the
    last comes first in the list with no future, so that it is made on the calling thread
    while the others are in flight (one thread hand-off less per call). `now`: the last
    starts now too (for calls whose answers are read later)."""
    started = [(conn, chunk, request, conn.future(method, request))
               for conn, chunk, request in (requests if now else requests[:-1])]
    return started if now or not requests else [(*requests[-1], None)] + started


def _abandon(calls: list) -> None:
    """Close the connections of started data-plane calls nobody will read."""
    for *_, future in calls:
        if hasattr(future, "abandon"):
            future.abandon()


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
