"""A sharded table as one object: pull rows and push gradients by global id.

Pull: dedup ids -> order by shard -> chunk to the message limit -> every RPC in flight at
once -> each answer (a zero-copy view) lands in a contiguous slice -> one gather into the
caller's order. Push: plan the layout from the ids alone -> sum duplicates straight into each
outgoing message (one copy of the gradients) -> one push per shard and chunk, empty ones
included: in sync mode every worker's push is what closes a step on every shard.

A table with a `wire_dtype` sends its summed gradients narrowed to it (refusing, before
anything is sent, one that would not stay finite: `WireOverflowError`) and reads pulled rows
back as float32; `full_precision=True` pulls (`pull_all`, exports) travel as float32.
"""
from __future__ import annotations

from typing import Iterator, Sequence

import grpc
import numpy as np

from parallax.client import dynamic_rows
from parallax.client.connection import ServerConnection
from parallax.errors import ConfigError
from parallax.protocol import bulk_codec, wire, wire_dtypes
from parallax.protocol.routing import ShardRouter, dedup, out_of_range
from parallax.protocol.specs import TableSpec
from parallax.ps.v1 import ps_pb2


class ShardedTable:
    def __init__(self, spec: TableSpec, shards: Sequence[ServerConnection],
                 session: int = 0) -> None:
        if len(shards) != spec.shard_count:
            raise ConfigError(f"table {spec.name!r} has {spec.shard_count} shards but "
                              f"{len(shards)} server connections were given")
        self.spec = spec
        self.shards = list(shards)
        self.session = session  # sent with pushes: async retries are recognised per session
        self.router = ShardRouter(spec.shard_count, spec.vocabulary_size, spec.partition)
        self.dtype = np.dtype(spec.dtype)
        self.wire = wire_dtypes.get(spec.wire_dtype) if spec.wire_dtype else None
        self.push_dtype = self.wire.storage if self.wire else self.dtype  # gradients sent
        row_bytes = spec.dim * self.dtype.itemsize + 8  # the row and its int64 id
        self.chunk_rows = max(1, (shards[0].options.chunk_bytes - 4096) // row_bytes)

    @property
    def name(self) -> str:
        return self.spec.name

    def checked_ids(self, ids) -> np.ndarray:
        ids = np.asarray(ids)
        if ids.dtype.kind not in "iu":
            raise ConfigError(f"table {self.name!r}: ids must be integers, got {ids.dtype}")
        ids = ids.astype(np.int64, copy=False).reshape(-1)
        if not self.spec.hashed_keys:
            check_id_range(f"table {self.name!r}", ids, self.spec.vocabulary_size)
        return ids

    def slices(self, offsets: np.ndarray) -> Iterator[tuple[int, int, int, int, int]]:
        """(shard, lo, hi, chunk index, chunk count) covering each shard's slice; a shard with
        nothing still gets one empty chunk."""
        for shard in range(self.spec.shard_count):
            start, stop = int(offsets[shard]), int(offsets[shard + 1])
            bounds = list(range(start, stop, self.chunk_rows)) or [start]
            for index, lo in enumerate(bounds):
                yield shard, lo, min(lo + self.chunk_rows, stop), index, len(bounds)

    def _pull_grouped(self, ids: np.ndarray, offsets: np.ndarray, min_step: int,
                      order: np.ndarray | None = None, full_precision: bool = False
                      ) -> np.ndarray:
        """Rows of shard-grouped `ids`; with `order`, row k lands at position order[k]."""
        every = list(self.slices(offsets))  # a shard with no ids has one empty slice
        one_chunk_per_shard = len(every) == self.spec.shard_count
        if min_step > 0 and not one_chunk_per_shard:
            # Wait with one RPC per shard, then pull every chunk without waiting: a waiting
            # request holds a server thread, and a step can only close if the other workers'
            # pushes still find a free one. With one chunk per shard, the pull itself waits
            # (one thread per shard all the same, and one round trip less per step): then
            # every shard gets a pull, an empty one where no id falls, because the step must
            # be closed on every shard before this worker pushes the next one.
            self.wait_step(min_step)
        wait_in_pull = min_step if one_chunk_per_shard else 0
        slices = [s for s in every if s[2] > s[1] or wait_in_pull]
        rows = np.empty((len(ids), self.spec.dim), dtype=self.dtype)
        calls = []
        for shard, lo, hi, _, _ in slices:
            request = ps_pb2.PullRequest(table=self.name, shard_index=shard,
                                         min_step=wait_in_pull, full_precision=full_precision)
            wire.encode(ids[lo:hi], request.ids)
            conn = self.shards[shard]
            calls.append((conn, start_call(conn, "Pull", request, len(slices)), request, lo, hi))
        for conn, future, request, lo, hi in calls:
            values, _ = conn.result(future, "Pull", request, self.name)
            values = self.widened(values)
            if order is None:
                rows[lo:hi] = values
            else:
                rows[order[lo:hi]] = values
        return rows

    def widened(self, values: np.ndarray) -> np.ndarray:
        """Pulled rows (float32, or the wire dtype's) in the table's dtype."""
        return values if values.dtype == self.dtype else wire_dtypes.to_float32(values)

    def narrowed(self, summed: np.ndarray) -> np.ndarray:
        """Summed gradients in the wire dtype; WireOverflowError if one would not stay
        finite there."""
        return wire_dtypes.encode_checked(summed, self.wire, self.name, "gradient")

    def pull(self, ids, min_step: int = 0) -> np.ndarray:
        """Rows for `ids` (any shape, duplicates allowed), shape ids.shape + (dim,).

        Args:
            ids: integer ids, each in [0, vocabulary_size) (any int64 for a keyed table); each
                distinct id travels once.
            min_step: wait until every shard has applied steps [0, min_step) (sync mode:
                the rows a step reads once every worker pushed the step before).

        Raises:
            ConfigError: an id that is not an integer or is out of range (nothing is sent).
            ServerError: a server refused or did not answer in time (it names the server,
                the table and the gRPC status).
        """
        shape = np.shape(ids)
        unique, inverse = dedup(self.checked_ids(ids))
        return self._pull_in_order(unique, min_step)[inverse].reshape(*shape, self.spec.dim)

    def pull_unique(self, unique, min_step: int = 0, full_precision: bool = False
                    ) -> np.ndarray:
        """Rows for ids that are already unique, in their order (skips the dedup);
        `full_precision`: in the table's dtype even if it has a narrower wire_dtype."""
        return self._pull_in_order(self.checked_ids(unique), min_step, full_precision)

    def _pull_in_order(self, unique: np.ndarray, min_step: int,
                       full_precision: bool = False) -> np.ndarray:
        order, offsets = self.router.shard_order(unique)
        grouped = unique if order is None else unique[order]
        return self._pull_grouped(grouped, offsets, min_step, order, full_precision)

    def push(self, ids, grads, step: int, worker: int = 0, learning_rate: float = 0.0) -> bool:
        """Send gradients for `ids` (duplicates summed here), chunked to the message limit;
        True if this push closed the step on every shard.

        Args:
            ids: integer ids of the rows, as for `pull`; a repeated id's gradients are summed.
            grads: one row of `dim` values per id (cast to the table's dtype).
            step: the step this push belongs to (sync mode: the shard's open step).
            worker: this worker's index in [0, num_workers).
            learning_rate: the rate to apply (0: the table's optimizer spec's).

        Raises:
            ConfigError: bad ids or a gradient of the wrong shape (nothing is sent).
            WireOverflowError: a summed gradient beyond the wire dtype's range (nothing is
                sent).
            ServerError: a shard refused the push (a step already closed or ahead, a
                non-finite update, a repeated chunk): the shard is unchanged.
        """
        ids = self.checked_ids(ids)
        grads = np.asarray(grads, dtype=self.dtype).reshape(len(ids), self.spec.dim)
        routing = self.router.route_push(ids)
        narrow = self.narrowed(self.summed(routing, grads)) if self.wire else None
        calls = []
        slices = list(self.slices(routing.offsets))
        for shard, lo, hi, index, count in slices:
            writer = bulk_codec.PushRequestWriter(self.name, shard, step, worker, hi - lo,
                                                  self.spec.dim, self.push_dtype,
                                                  learning_rate, index, count, self.session)
            writer.ids[...] = routing.ids[lo:hi]
            if narrow is None:
                routing.fill(grads, lo, hi, writer.grads)
            else:
                writer.grads[...] = narrow[lo:hi]
            request = writer.data()
            conn = self.shards[shard]
            calls.append((shard, conn, start_call(conn, "Push", request, len(slices)), request))
        closed = set()  # shards on which one of this push's chunks completed the step
        for shard, conn, future, request in calls:
            reply = conn.result(future, "Push", request, self.name,
                                done_on_retry=(grpc.StatusCode.ALREADY_EXISTS,
                                               grpc.StatusCode.FAILED_PRECONDITION))
            if reply is not None and reply.applied:
                closed.add(shard)
        return len(closed) == self.spec.shard_count

    def summed(self, routing, grads: np.ndarray) -> np.ndarray:
        """Every routed id's summed gradient, in the table's dtype, in `routing.ids` order."""
        out = np.empty((len(routing.ids), self.spec.dim), self.dtype)
        routing.fill(grads, 0, len(routing.ids), out)
        return out

    def wait_step(self, min_step: int) -> int:
        """Block until every shard has applied `min_step` steps; returns the lowest step."""
        calls = []
        for shard, conn in enumerate(self.shards):
            request = ps_pb2.StepRequest(table=self.name, shard_index=shard, min_step=min_step)
            calls.append((conn, start_call(conn, "WaitStep", request, len(self.shards)), request))
        return min(conn.result(future, "WaitStep", request, self.name).step
                   for conn, future, request in calls)

    def assign(self, ids, values) -> int:
        """Set rows to explicit values, streamed to each shard in message-sized chunks."""
        ids = self.checked_ids(ids)
        values = np.asarray(values, dtype=self.dtype).reshape(len(ids), self.spec.dim)
        order, offsets = self.router.shard_order(ids)
        if order is not None:
            ids, values = ids[order], values[order]
        total = 0
        for shard in range(self.spec.shard_count):
            lo, hi = int(offsets[shard]), int(offsets[shard + 1])
            if hi == lo:
                continue

            def chunks(shard=shard, lo=lo, hi=hi) -> Iterator[ps_pb2.InitRowsChunk]:
                for start in range(lo, hi, self.chunk_rows):
                    stop = min(start + self.chunk_rows, hi)
                    msg = ps_pb2.InitRowsChunk(table=self.name, shard_index=shard,
                                               last=stop == hi)  # (else nothing is put in)
                    wire.encode(ids[start:stop], msg.ids)
                    wire.encode(values[start:stop], msg.values)
                    yield msg

            total += self.shards[shard].call("InitRows", chunks, self.name).rows
        return total

    def export_pages(self, shard: int, page_rows: int = 0, changed_only: bool = False
                     ) -> Iterator[ps_pb2.ShardRows]:
        """One shard's touched rows, page by page (ExportRows; `page_rows` <= 0: about the
        client's chunk size, with up to 3 slots per row), all at one step: a page at
        another step (a push landed while the shard was read) raises ConfigError, as does
        a shard that stops short. Between steps only (a shard mid-step refuses:
        ServerError, FAILED_PRECONDITION)."""
        if page_rows <= 0:
            row_bytes = 4 * self.spec.dim * self.dtype.itemsize + 8
            page_rows = max(1, self.shards[0].options.chunk_bytes // row_bytes)
        offset, total, step = 0, None, None
        while total is None or offset < total:
            request = ps_pb2.ExportRowsRequest(table=self.name, shard_index=shard,
                                               offset=offset, max_rows=page_rows,
                                               changed_only=changed_only)
            page = self.shards[shard].call("ExportRows", request, self.name)
            if step is not None and page.step != step:
                raise ConfigError(f"cannot read {self.name!r}: shard {shard} moved from step "
                                  f"{step} to {page.step} while it was read; a push landed. "
                                  f"Read between steps, once every worker's pushes landed")
            step, total = page.step, page.total_rows
            if page.next_offset <= offset and offset < total:
                raise ConfigError(f"shard {shard} of {self.name!r} exported no rows at "
                                  f"offset {offset} of {total}")
            offset = page.next_offset
            yield page

    def export_rows(self, keys=None, top_n: int | None = None
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(keys int64[n], values [n, dim] in the table's dtype, uses int64[n]) of the
        rows a keyed table holds, sorted by key: those of `keys` it holds (the others are
        left out), or with `top_n`, the n rows with the most uses over all shards (most
        first, ties by the smaller key; of `keys`, when given too), or else every row.
        Pages through ExportRows of each shard, between steps only; `uses` is empty for a
        table that is not dynamic (it keeps no use counts). See
        `parallax.client.dynamic_rows`."""
        return dynamic_rows.export_rows(self, keys, top_n)

    def pull_all(self) -> np.ndarray:
        """The whole table (fixed vocabulary), e.g. for export, in message-sized pieces; in
        full precision whatever the table's wire_dtype."""
        if self.spec.hashed_keys:
            raise ConfigError(f"table {self.name!r} is a keyed table (hashed_keys=True), with no "
                              f"whole value; pull the keys you need")
        return self.pull_unique(np.arange(self.spec.vocabulary_size, dtype=np.int64),
                                full_precision=True)


def start_call(conn, method: str, request, calls: int):
    """A call started now when others will overlap it; a lone call is made when its result
    is asked for (no hand-off to another thread)."""
    return conn.future(method, request) if calls > 1 else None


def check_id_range(what: str, ids: np.ndarray, rows: int) -> None:
    """Raise, naming `what` (a table or a variable) and the first bad id, if an id is
    outside [0, rows): the worker's one id check and its one message."""
    bad = out_of_range(ids, rows)
    if bad is not None:
        raise ConfigError(f"{what} has {rows} rows: id {int(ids[bad[0]])} is out of range "
                          f"[0, {rows}) ({len(bad)} bad ids in this batch); check the "
                          f"vocabulary size of the layer and the input ids")
