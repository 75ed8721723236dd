"""The data plane's own encoding of PullMany and PushMany: fixed-size part headers in one
numpy record array, then every part's rows, instead of protobuf's field-by-field varints.

The gRPC methods keep protobuf (`bulk_codec`): any protobuf peer can still talk to a server.
On the data plane both sides are parallax, and a step's request carries one part per table
shard (52 for a 26-table model on 2 servers): laying out or reading protobuf costs tens of
microseconds a part in Python, where a record array costs a few numpy calls a request
(`examples/benchmarks/request_cost.py` measures both). The data plane carries only this
layout (its `DataPlane` answer's `packed` is always true).

Layouts (little-endian; every row block starts 16-byte aligned within the body):

    PullMany request:  u32 parts, u32 names length, PULL_PART[parts], names (UTF-8, each
                       part's table name in turn), zero padding to 8, int64 ids of every
                       part in turn
    PullMany answer:   u32 parts, u32 0, PULL_ANSWER_PART[parts], padding to 16, then each
                       part's rows ([count, dim] of its dtype), each padded to 16
    PushMany request:  u32 parts, u32 names length, PUSH_PART[parts], names, padding to 16,
                       int64 ids of every part in turn, padding to 16, then each part's
                       gradients ([count, dim] of its dtype), each padded to 16
    PushMany answer:   protobuf PushManyResponse (a few bytes a part)

Decoding checks every count, dimension, dtype and length against the body before making
any view, and raises `DecodeError` naming what is wrong: the server answers it
INVALID_ARGUMENT.
"""
from __future__ import annotations

import itertools

import struct
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from parallax.protocol import wire
from parallax.protocol.bulk_codec import (BulkPush, BulkPushMany, DecodeError, MessageTooLarge,
                                          PushHeader, PushManyRequestWriter, _finish, _new_bytes,
                                          decode_push_many_request, serialize_push)
from parallax.ps.v1 import ps_pb2

_PREFIX = struct.Struct("<II")  # parts, names length
_ALIGN = 16
_INT32 = (-(1 << 31), (1 << 31) - 1)
PULL_PART = np.dtype([("shard", "<i8"), ("min_step", "<i8"), ("count", "<i8"),
                      ("name_len", "<i8")])
PULL_ANSWER_PART = np.dtype([("step", "<i8"), ("count", "<i8"), ("dim", "<i8"),
                             ("dtype", "<i8")])
PUSH_PART = np.dtype([("shard", "<i8"), ("step", "<i8"), ("worker", "<i8"), ("lr", "<f8"),
                      ("chunk", "<i8"), ("chunks", "<i8"), ("session", "<u8"),
                      ("count", "<i8"), ("dim", "<i8"), ("dtype", "<i8"),
                      ("name_len", "<i8")])


def _up(at: int, align: int) -> int:
    return at + (-at % align)


@dataclass(frozen=True)
class PullPart:
    """One part of a decoded PullMany request (ids: a read-only view of the body)."""

    table: str
    shard_index: int
    min_step: int
    ids: np.ndarray


@dataclass(frozen=True)
class PackedPullMany:
    parts: list[PullPart]


def _names_block(names: Sequence[str]) -> tuple[bytes, list[int]]:
    encoded = [n.encode() for n in names]
    return b"".join(encoded), [len(e) for e in encoded]


def _records(dtype: np.dtype, columns: dict) -> np.ndarray:
    records = np.zeros(len(next(iter(columns.values()))), dtype)
    for name, values in columns.items():
        records[name] = values
    return records


# ---- PullMany request -------------------------------------------------------------------
def encode_pull_many(tables: Sequence[str], shards: Sequence[int], min_steps: Sequence[int],
                     ids: Sequence[np.ndarray]) -> bytes:
    """A PullMany request body: part i reads `ids[i]` (int64) of `tables[i]`'s shard."""
    names, name_lens = _names_block(tables)
    counts = [len(i) for i in ids]
    head = _PREFIX.size + PULL_PART.itemsize * len(tables) + len(names)
    ids_at = _up(head, 8)
    data, raw = _new_bytes(ids_at + 8 * sum(counts))
    raw[:_PREFIX.size] = np.frombuffer(_PREFIX.pack(len(tables), len(names)), np.uint8)
    records = _records(PULL_PART, {"shard": shards, "min_step": min_steps, "count": counts,
                                   "name_len": name_lens})
    at = _PREFIX.size + records.nbytes
    raw[_PREFIX.size:at] = records.view(np.uint8)
    raw[at:at + len(names)] = np.frombuffer(names, np.uint8)
    raw[at + len(names):ids_at] = 0
    if counts and sum(counts):
        np.concatenate(ids, out=raw[ids_at:].view(np.int64), casting="same_kind")
    return _finish(data)


def _header(body: bytes, dtype: np.dtype, what: str) -> tuple[np.ndarray, int, int]:
    """(records, names length, where the names start) after checking the body holds them."""
    if len(body) < _PREFIX.size:
        raise DecodeError(f"{what}: {len(body)} bytes is shorter than its {_PREFIX.size}-byte "
                          f"prefix")
    count, names_len = _PREFIX.unpack_from(body)
    at = _PREFIX.size + count * dtype.itemsize
    if at + names_len > len(body):
        raise DecodeError(f"{what}: {count} parts and {names_len} bytes of names need "
                          f"{at + names_len} bytes, the body has {len(body)}")
    return np.frombuffer(body, dtype, count=count, offset=_PREFIX.size), names_len, at


def _names(body: bytes, at: int, total: int, lengths: list[int], what: str) -> list[str]:
    if any(n < 0 for n in lengths) or sum(lengths) != total:
        raise DecodeError(f"{what}: the parts' name lengths {lengths[:8]} do not add up to "
                          f"the {total} bytes of names")
    names, block = [], body[at:at + total]
    pos = 0
    for i, n in enumerate(lengths):
        try:
            names.append(block[pos:pos + n].decode())
        except UnicodeDecodeError as exc:
            raise DecodeError(f"{what} part {i}: table name is not UTF-8 ({exc})") from None
        pos += n
    return names


def _counts(values: list[int], what: str, field: str) -> None:
    bad = next((i for i, v in enumerate(values) if v < 0), None)
    if bad is not None:
        raise DecodeError(f"{what} part {bad}: {field} {values[bad]} is negative")


def _dims(values: list[int], what: str) -> None:
    """Row widths: >= 0 and within int32 (an empty part's width is not bounded by the body,
    and numpy refuses shapes past its own limits)."""
    _counts(values, what, "dim")
    _in_int32(values, what, "dim")


def _in_int32(values: list[int], what: str, field: str) -> None:
    lo, hi = _INT32
    bad = next((i for i, v in enumerate(values) if not lo <= v <= hi), None)
    if bad is not None:
        raise DecodeError(f"{what} part {bad}: {field} {values[bad]} is outside int32")


def _columns(records: np.ndarray) -> dict[str, list]:
    """{field: its values as Python numbers} of parts' records, read in one pass."""
    names = records.dtype.names
    values = list(zip(*records.tolist())) if len(records) else [()] * len(names)
    return dict(zip(names, (list(v) for v in values)))


def _exact(body: bytes, need: int, what: str) -> None:
    if len(body) != need:
        raise DecodeError(f"{what}: the parts' headers describe {need} bytes, the body has "
                          f"{len(body)}")


def decode_pull_many(body: bytes) -> PackedPullMany:
    what = "packed PullManyRequest"
    records, names_len, at = _header(body, PULL_PART, what)
    columns = _columns(records)
    counts, shards = columns["count"], columns["shard"]
    _counts(counts, what, "id count")
    _in_int32(shards, what, "shard_index")
    names = _names(body, at, names_len, columns["name_len"], what)
    ids_at = _up(at + names_len, 8)
    _exact(body, ids_at + 8 * sum(counts), what)
    ids = np.frombuffer(body, np.int64, count=sum(counts), offset=ids_at)
    bounds = list(itertools.accumulate(counts, initial=0))
    parts = [PullPart(name, shard, step, ids[lo:hi]) for name, shard, step, lo, hi in
             zip(names, shards, columns["min_step"], bounds, bounds[1:])]
    return PackedPullMany(parts)


# ---- PullMany answer --------------------------------------------------------------------
def _row_blocks(counts: list[int], dims: list[int], itemsizes: list[int], start: int
                ) -> tuple[list[int], int]:
    """(where each part's rows start, the end) for blocks laid out from `start`, each
    16-byte aligned."""
    offsets, at = [], _up(start, _ALIGN)
    for count, dim, size in zip(counts, dims, itemsizes):
        offsets.append(at)
        at = _up(at + count * dim * size, _ALIGN)
    return offsets, at


def _zero_gaps(raw: np.ndarray, gaps: list[tuple[int, int]], offsets: list[int],
               counts: list[int], dims: list[int], dtypes: list[np.dtype], size: int) -> None:
    """Zero the padding of a new body (never send what the allocator left there): `gaps`,
    and the alignment after each row block; the caller fills everything else."""
    ends = [o + n * d * t.itemsize for o, n, d, t in zip(offsets, counts, dims, dtypes)]
    for lo, hi in gaps + list(zip(ends, offsets[1:] + [size])):
        if hi > lo:
            raw[lo:hi] = 0


class PullManyAnswerWriter:
    """A packed PullMany answer written in place: `values[i]` is part i's [rows, dim]
    storage (same interface as bulk_codec.PullManyResponseWriter)."""

    def __init__(self, parts: list[tuple[int, int, object, int]],
                 max_bytes: int | None = None) -> None:
        """parts: (rows, dim, dtype, step) of each part; raise MessageTooLarge, before
        allocating anything, if the answer would be longer than `max_bytes`."""
        dtypes = [np.dtype(d) for _, _, d, _ in parts]
        counts, dims = [int(p[0]) for p in parts], [int(p[1]) for p in parts]
        start = _PREFIX.size + PULL_ANSWER_PART.itemsize * len(parts)
        offsets, size = _row_blocks(counts, dims, [d.itemsize for d in dtypes], start)
        if max_bytes is not None and size > max_bytes:
            raise MessageTooLarge(size, max_bytes)
        self._data, raw = _new_bytes(size)
        records = _records(PULL_ANSWER_PART, {
            "step": [p[3] for p in parts], "count": counts, "dim": dims,
            "dtype": [wire.dtype_code(d) for d in dtypes]})
        raw[:_PREFIX.size] = np.frombuffer(_PREFIX.pack(len(parts), 0), np.uint8)
        raw[_PREFIX.size:start] = records.view(np.uint8)
        self.values = [raw[at:at + n * d * t.itemsize].view(t).reshape(n, d)
                       for at, n, d, t in zip(offsets, counts, dims, dtypes)]
        _zero_gaps(raw, [(start, offsets[0] if offsets else size)], offsets, counts, dims,
                   dtypes, size)

    def data(self) -> bytes:
        return _finish(self._data)


def decode_pull_many_answer(body: bytes) -> list[tuple[np.ndarray, int]]:
    """(values, step) of every part: views of the body."""
    what = "packed PullManyResponse"
    records, names_len, at = _header(body, PULL_ANSWER_PART, what)
    if names_len:
        raise DecodeError(f"{what}: its prefix declares {names_len} bytes of names; an "
                          f"answer has none")
    counts, dims = records["count"].tolist(), records["dim"].tolist()
    _counts(counts, what, "row count")
    _dims(dims, what)
    try:
        dtypes = [wire.numpy_dtype(c) for c in records["dtype"].tolist()]
    except wire.WireError as exc:
        raise DecodeError(f"{what}: {exc}") from None
    offsets, size = _row_blocks(counts, dims, [d.itemsize for d in dtypes], at)
    _exact(body, size, what)
    return [(np.frombuffer(body, t, count=n * d, offset=o).reshape(n, d), step)
            for o, n, d, t, step in zip(offsets, counts, dims, dtypes,
                                        records["step"].tolist())]


# ---- PushMany request -------------------------------------------------------------------
class PushManyWriter:
    """A packed PushMany request written in place: fill `ids[i]` and `grads[i]` of every
    part (same interface as bulk_codec.PushManyRequestWriter)."""

    def __init__(self, parts: list[tuple[PushHeader, int, int, object]]) -> None:
        """parts: (header, rows, dim, dtype) of each part, in order."""
        names, name_lens = _names_block([h.table for h, _, _, _ in parts])
        dtypes = [np.dtype(d) for _, _, _, d in parts]
        counts, dims = [int(p[1]) for p in parts], [int(p[2]) for p in parts]
        at = _PREFIX.size + PUSH_PART.itemsize * len(parts)
        ids_at = _up(at + len(names), _ALIGN)
        offsets, size = _row_blocks(counts, dims, [d.itemsize for d in dtypes],
                                    ids_at + 8 * sum(counts))
        self._data, raw = _new_bytes(size)
        ids_end = ids_at + 8 * sum(counts)
        _zero_gaps(raw, [(at + len(names), ids_at), (ids_end, offsets[0] if offsets else
                                                     ids_end)], offsets, counts, dims, dtypes,
                   size)
        heads = [h for h, _, _, _ in parts]
        records = _records(PUSH_PART, {
            "shard": [h.shard_index for h in heads], "step": [h.step for h in heads],
            "worker": [h.worker for h in heads], "lr": [h.learning_rate for h in heads],
            "chunk": [h.chunk_index for h in heads], "chunks": [h.chunk_count for h in heads],
            "session": [h.session for h in heads], "count": counts, "dim": dims,
            "dtype": [wire.dtype_code(d) for d in dtypes], "name_len": name_lens})
        raw[:_PREFIX.size] = np.frombuffer(_PREFIX.pack(len(parts), len(names)), np.uint8)
        raw[_PREFIX.size:at] = records.view(np.uint8)
        raw[at:at + len(names)] = np.frombuffer(names, np.uint8)
        all_ids = raw[ids_at:ids_at + 8 * sum(counts)].view(np.int64)
        bounds = list(itertools.accumulate(counts, initial=0))
        self.ids = [all_ids[lo:hi] for lo, hi in zip(bounds, bounds[1:])]
        self.grads = [raw[o:o + n * d * t.itemsize].view(t).reshape(n, d)
                      for o, n, d, t in zip(offsets, counts, dims, dtypes)]

    def data(self) -> bytes:
        return _finish(self._data)


def decode_push_many(body: bytes) -> BulkPushMany:
    """The parts of a packed PushMany request (ids and grads: read-only views of the body);
    raises DecodeError."""
    what = "packed PushManyRequest"
    records, names_len, at = _header(body, PUSH_PART, what)
    columns = _columns(records)
    counts, dims = columns["count"], columns["dim"]
    _counts(counts, what, "row count")
    _dims(dims, what)
    for field in ("shard", "worker", "chunk", "chunks"):
        _in_int32(columns[field], what, field)
    names = _names(body, at, names_len, columns["name_len"], what)
    try:
        dtypes = [wire.numpy_dtype(c) for c in columns["dtype"]]
    except wire.WireError as exc:
        raise DecodeError(f"{what}: {exc}") from None
    ids_at = _up(at + names_len, _ALIGN)
    offsets, size = _row_blocks(counts, dims, [d.itemsize for d in dtypes],
                                ids_at + 8 * sum(counts))
    _exact(body, size, what)
    ids = np.frombuffer(body, np.int64, count=sum(counts), offset=ids_at)
    bounds = list(itertools.accumulate(counts, initial=0))
    parts = [BulkPush(name, shard, step, worker, ids[lo:hi],
                      np.frombuffer(body, t, count=n * d, offset=o).reshape(n, d),
                      lr, chunk, chunks, session)
             for name, shard, step, worker, lo, hi, o, n, d, t, lr, chunk, chunks, session in
             zip(names, columns["shard"], columns["step"], columns["worker"], bounds,
                 bounds[1:], offsets, counts, dims, dtypes, columns["lr"],
                 columns["chunk"], columns["chunks"], columns["session"])]
    return BulkPushMany(parts)


# ---- requests before encoding: the client's PullMany and PushMany, for either path --------
class PullManyParts:
    """A PullMany request not yet encoded: protobuf for gRPC, packed for the data plane."""

    def __init__(self, tables: list[str], shards: list[int], min_steps: list[int],
                 ids: list[np.ndarray]) -> None:
        self.tables, self.shards, self.min_steps, self.ids = tables, shards, min_steps, ids

    def protobuf(self) -> ps_pb2.PullManyRequest:
        request = ps_pb2.PullManyRequest()
        for table, shard, step, ids in zip(self.tables, self.shards, self.min_steps, self.ids):
            wire.encode(ids, request.parts.add(table=table, shard_index=shard,
                                               min_step=step).ids)
        return request

    def packed(self) -> bytes:
        return encode_pull_many(self.tables, self.shards, self.min_steps, self.ids)


class PushManyParts:
    """A PushMany request not yet encoded: `parts` are (header, rows, dim, dtype), and
    `fill(i, ids, grads)` writes part i's rows into the message being built."""

    def __init__(self, parts: list[tuple[PushHeader, int, int, object]], fill) -> None:
        self.parts, self.fill = parts, fill

    def _written(self, writer):
        for i, (ids, grads) in enumerate(zip(writer.ids, writer.grads)):
            self.fill(i, ids, grads)
        return writer.data()

    def protobuf(self) -> bytes:
        return self._written(PushManyRequestWriter(self.parts))

    def packed(self) -> bytes:
        return self._written(PushManyWriter(self.parts))

    def settled(self) -> "PushManyParts":
        """The same request encoded now (packed, the layout a data plane reads), so that it
        no longer reads the arrays `fill` reads: they may be reused at once. Another
        encoding, for a server without the packed layout, is made from those bytes."""
        return _SettledPush(self.parts, self.packed())


class _SettledPush(PushManyParts):
    """A PushManyParts whose rows live in its own packed encoding."""

    def __init__(self, parts, body: bytes) -> None:
        super().__init__(parts, self._fill_from_body)
        self._body = body
        self._decoded: list | None = None

    def packed(self) -> bytes:
        return self._body

    def settled(self) -> "PushManyParts":
        return self

    def _fill_from_body(self, i: int, ids: np.ndarray, grads: np.ndarray) -> None:
        if self._decoded is None:
            self._decoded = decode_push_many(self._body).parts
        ids[...], grads[...] = self._decoded[i].ids, self._decoded[i].grads


class EncodedPullMany(PullManyParts):
    """A PullMany request already encoded (packed), e.g. by the compiled data path; its
    answer is wanted as it arrived (`raw_answer`: a `RawAnswer`), for the caller to decode."""

    raw_answer = True

    def __init__(self, body: bytes) -> None:
        self._body = body

    def packed(self) -> bytes:
        return self._body

    def protobuf(self) -> ps_pb2.PullManyRequest:
        parts = decode_pull_many(self._body).parts
        return PullManyParts([p.table for p in parts], [p.shard_index for p in parts],
                             [p.min_step for p in parts], [p.ids for p in parts]).protobuf()


class EncodedPushMany(_SettledPush):
    """A PushMany request already encoded (packed), e.g. by the compiled data path."""

    def __init__(self, body: bytes) -> None:
        self._body, self._decoded, self.fill = body, None, self._fill_from_body
        self._parts: list | None = None

    @property
    def parts(self) -> list:
        if self._parts is None:
            self._parts = [(PushHeader(p.table, p.shard_index, p.step, p.worker,
                                       p.learning_rate, p.chunk_index, p.chunk_count,
                                       p.session), *p.grads.shape, p.grads.dtype)
                           for p in decode_push_many(self._body).parts]
        return self._parts


class RawAnswer:
    """A PullMany answer's packed body, not decoded (what an `EncodedPullMany` asks for):
    `decoded()` is what `decode_pull_many_answer` makes of it."""

    def __init__(self, body) -> None:
        self.body = body

    def decoded(self) -> list[tuple[np.ndarray, int]]:
        return decode_pull_many_answer(self.body)


def _packed_pull(request) -> bytes:
    if isinstance(request, PullManyParts):
        return request.packed()
    parts = request.parts  # a protobuf PullManyRequest
    return encode_pull_many([p.table for p in parts], [p.shard_index for p in parts],
                            [p.min_step for p in parts],
                            [wire.decode(p.ids, "ids").astype(np.int64, copy=False)
                             for p in parts])


def _packed_push(request) -> bytes:
    if isinstance(request, PushManyParts):
        return request.packed()
    decoded = decode_push_many_request(serialize_push(request))  # protobuf bytes or message
    if decoded.error:
        raise DecodeError(decoded.error)
    parts = [(PushHeader(p.table, p.shard_index, p.step, p.worker, p.learning_rate,
                         p.chunk_index, p.chunk_count, p.session), *p.grads.shape,
              p.grads.dtype) for p in decoded.parts]

    def fill(i, ids, grads):
        ids[...], grads[...] = decoded.parts[i].ids, decoded.parts[i].grads
    return PushManyParts(parts, fill).packed()


# How a client (de)serialises PullMany and PushMany on a data plane of version 2.
CLIENT_CODECS = {
    "PullMany": (_packed_pull, decode_pull_many_answer),
    "PushMany": (_packed_push, lambda body: ps_pb2.PushManyResponse.FromString(bytes(body))),
}
