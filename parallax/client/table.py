"""A sharded table as one object: pull rows and push gradients by global id.

Pull: dedup ids -> split by shard -> chunk to the message limit -> all RPCs in flight at once
-> decode (zero-copy views) -> reassemble in the caller's order. Push: sum duplicate ids ->
split -> one push per shard, empty ones included, since in sync mode every worker's push is
what closes a step on every shard.
"""
from __future__ import annotations

from typing import Iterator, Sequence

import grpc
import numpy as np

from parallax import bulk_codec, wire
from parallax.client.connection import ServerConnection
from parallax.errors import ConfigError
from parallax.ps.v1 import ps_pb2
from parallax.routing import Partitioner, dedup, sum_duplicates
from parallax.specs import TableSpec


class ShardedTable:
    def __init__(self, spec: TableSpec, shards: Sequence[ServerConnection]) -> None:
        if len(shards) != spec.shard_count:
            raise ConfigError(f"table {spec.name!r} has {spec.shard_count} shards but "
                              f"{len(shards)} server connections were given")
        self.spec = spec
        self.shards = list(shards)
        self.partitioner = Partitioner(spec.shard_count, spec.vocabulary_size, spec.partition)
        self.dtype = np.dtype(spec.dtype)
        row_bytes = spec.dim * self.dtype.itemsize + 8  # the row and its int64 id
        self.chunk_rows = max(1, (shards[0].options.max_message_bytes - 4096) // row_bytes)

    @property
    def name(self) -> str:
        return self.spec.name

    def _check_ids(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids)
        if ids.dtype.kind not in "iu":
            raise ConfigError(f"table {self.name!r}: ids must be integers, got {ids.dtype}")
        ids = ids.astype(np.int64, copy=False).reshape(-1)
        if not self.spec.hashed_keys and len(ids):
            bad = np.flatnonzero((ids < 0) | (ids >= self.spec.vocabulary_size))
            if len(bad):
                raise ConfigError(f"table {self.name!r}: id {ids[bad[0]]} is outside the "
                                  f"vocabulary [0, {self.spec.vocabulary_size})")
        return ids

    def _chunks(self, positions: np.ndarray) -> list[np.ndarray]:
        return [positions[i:i + self.chunk_rows]
                for i in range(0, max(len(positions), 1), self.chunk_rows)]

    def pull(self, ids, min_step: int = 0) -> np.ndarray:
        """Rows for `ids` (any shape, duplicates allowed), shape ids.shape + (dim,)."""
        shape = np.shape(ids)
        unique, inverse = dedup(self._check_ids(ids))
        rows = self.pull_unique(unique, min_step)
        return rows[inverse].reshape(*shape, self.spec.dim)

    def pull_unique(self, unique: np.ndarray, min_step: int = 0) -> np.ndarray:
        """Rows for ids that are already unique, in their order."""
        out = np.empty((len(unique), self.spec.dim), dtype=self.dtype)
        calls = []
        for shard, positions in self.partitioner.split(unique):
            for chunk in self._chunks(positions):
                if len(chunk) == 0:
                    continue
                request = ps_pb2.PullRequest(table=self.name, shard_index=shard,
                                             min_step=min_step)
                wire.encode(unique[chunk], request.ids)
                conn = self.shards[shard]
                calls.append((conn, conn.future("Pull", request), request, chunk))
        for conn, future, request, chunk in calls:
            values, _ = conn.result(future, "Pull", request, self.name)
            out[chunk] = values
        return out

    def push(self, ids, grads, step: int, worker: int = 0, learning_rate: float = 0.0) -> bool:
        """Send gradients for `ids` (duplicates summed here), chunked to the message limit;
        True if this push closed the step on every shard."""
        ids = self._check_ids(ids)
        grads = np.asarray(grads, dtype=self.dtype).reshape(len(ids), self.spec.dim)
        unique, summed = sum_duplicates(ids, grads)
        calls = []
        for shard, positions in self.partitioner.split(unique):
            chunks = self._chunks(positions)
            for index, chunk in enumerate(chunks):
                request = bulk_codec.encode_push_request(
                    self.name, shard, step, worker, unique[chunk], summed[chunk],
                    learning_rate, index, len(chunks))
                conn = self.shards[shard]
                calls.append((shard, conn, conn.future("Push", request), request))
        closed = set()  # shards on which one of this push's chunks completed the step
        for shard, conn, future, request in calls:
            reply = conn.result(future, "Push", request, self.name,
                                done_on_retry=grpc.StatusCode.ALREADY_EXISTS)
            if reply is not None and reply.applied:
                closed.add(shard)
        return len(closed) == self.spec.shard_count

    def wait_step(self, min_step: int) -> int:
        """Block until every shard has applied `min_step` steps; returns the lowest step."""
        steps = []
        for shard, conn in enumerate(self.shards):
            request = ps_pb2.StepRequest(table=self.name, shard_index=shard, min_step=min_step)
            steps.append(conn.call("WaitStep", request, self.name).step)
        return min(steps)

    def assign(self, ids, values) -> int:
        """Set rows to explicit values, streamed to each shard in message-sized chunks."""
        ids = self._check_ids(ids)
        values = np.asarray(values, dtype=self.dtype).reshape(len(ids), self.spec.dim)
        total = 0
        for shard, positions in self.partitioner.split(ids):
            if len(positions) == 0:
                continue

            def chunks(shard=shard, positions=positions) -> Iterator[ps_pb2.InitRowsChunk]:
                for chunk in self._chunks(positions):
                    msg = ps_pb2.InitRowsChunk(table=self.name, shard_index=shard)
                    wire.encode(ids[chunk], msg.ids)
                    wire.encode(values[chunk], msg.values)
                    yield msg

            total += self.shards[shard].call("InitRows", chunks, self.name).rows
        return total

    def pull_all(self) -> np.ndarray:
        """The whole table (fixed vocabulary), e.g. for export; in message-sized pieces."""
        if self.spec.hashed_keys:
            raise ConfigError(f"table {self.name!r} has hashed keys; pull the keys you need")
        return self.pull_unique(np.arange(self.spec.vocabulary_size, dtype=np.int64))
