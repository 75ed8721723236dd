"""Hand-written protobuf encoding of the two bulk messages: PullResponse and PushRequest.

The bytes are exactly the `parallax.ps.v1` wire format (any protobuf peer can read or write
them; tests check both directions against the generated code), but rows never pass through a
protobuf object: encoding writes the header and then the row bytes in one copy, and decoding
returns numpy views into the received buffer (zero copy). Python protobuf serialises a large
bytes field at well under 1 GB/s, so this is where parameter-server throughput is won.
Row data is placed 16-byte aligned (padding goes in an unknown field that parsers skip), which
keeps numpy's copies into the message at full speed.
"""
from __future__ import annotations

import ctypes
import math
import platform
import struct
from dataclasses import dataclass

import numpy as np

from google.protobuf.message import DecodeError as ProtobufDecodeError

from parallax.protocol import wire
from parallax.ps.v1 import ps_pb2

_VARINT, _FIXED64, _LEN, _FIXED32 = 0, 1, 2, 5
_U64 = (1 << 64) - 1
_BYTES_OFFSET = bytes.__basicsize__ - 1  # where a bytes object's storage starts (CPython)
if platform.python_implementation() == "CPython":
    _FROM_SIZE = ctypes.pythonapi.PyBytes_FromStringAndSize
    _FROM_SIZE.restype = ctypes.py_object
    _FROM_SIZE.argtypes = (ctypes.c_char_p, ctypes.c_ssize_t)
else:  # pragma: no cover
    _FROM_SIZE = None


class DecodeError(ValueError):
    """The bytes are not a well-formed message of the expected type."""


class MessageTooLarge(ValueError):
    """A message would be longer than allowed; raised before its buffer is allocated."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"the message would be {size} bytes, over the limit of {limit}")
        self.size = size
        self.limit = limit


def _varint(value: int) -> bytes:
    if 0 <= value < _SMALL_VARINTS_BELOW:
        return _SMALL_VARINTS[value]
    return _encode_varint(value)


def _encode_varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # negative int64 -> two's complement, as protobuf does
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_SMALL_VARINTS_BELOW = 1 << 14  # every length, tag, dim and dtype of a typical message
_SMALL_VARINTS = [_encode_varint(v) for v in range(_SMALL_VARINTS_BELOW)]


def _varint_of_width(value: int, width: int) -> bytes:
    """`value` as a varint of exactly `width` bytes (>= its minimal width): the same number,
    with redundant continuation bytes."""
    out = bytearray(_varint(value))
    if len(out) < width:
        out[-1] |= 0x80
        out += b"\x80" * (width - len(out) - 1) + b"\x00"
    return bytes(out)


def _read_varint(data: memoryview, pos: int) -> tuple[int, int]:
    """A varint as protobuf reads it: at most 10 bytes, bits beyond 64 dropped."""
    result = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise DecodeError("truncated or overlong varint")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result & _U64, pos
        shift += 7


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _int32(value: int) -> int:
    """An int32 field: protobuf keeps the low 32 bits of the varint."""
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def _fields(data: memoryview, lo: int = 0, hi: int | None = None):
    """Yield (field number, wire type, value, start, end) for every field of the message in
    data[lo:hi]; positions are offsets into `data`."""
    pos, hi = lo, len(data) if hi is None else hi
    data = data[:hi]  # a view: varints cannot run past the message
    while pos < hi:
        key, pos = _read_varint(data, pos)
        number, kind = key >> 3, key & 7
        if kind == _VARINT:
            value, pos = _read_varint(data, pos)
            yield number, kind, value, pos, pos
        elif kind == _LEN:
            size, pos = _read_varint(data, pos)
            if pos + size > hi:
                raise DecodeError(f"field {number} claims {size} bytes, {hi - pos} left")
            yield number, kind, None, pos, pos + size
            pos += size
        elif kind in (_FIXED64, _FIXED32):
            width = 8 if kind == _FIXED64 else 4
            if pos + width > hi:
                raise DecodeError(f"field {number} is truncated")
            yield number, kind, None, pos, pos + width
            pos += width
        else:
            raise DecodeError(f"field {number} has unsupported wire type {kind}")


_DTYPE_CODES: dict[np.dtype, int] = {}


def _dtype_code(dtype: np.dtype) -> int:
    code = _DTYPE_CODES.get(dtype)
    if code is None:
        code = _DTYPE_CODES[dtype] = wire.dtype_code(dtype)
    return code


def _tensor_header(dtype: np.dtype, shape: tuple[int, ...], nbytes: int) -> bytes:
    """Tensor fields before the content: dtype, packed shape, content tag and length."""
    dims = b"".join(_varint(d) for d in shape)
    head = b"\x08" + _varint(_dtype_code(dtype))
    if shape:
        head += b"\x12" + _varint(len(dims)) + dims
    return head + (b"\x1a" + _varint(nbytes) if nbytes else b"")  # proto3: omit empty


_PAD_FIELD = 15  # an unknown field every parser skips: used to align row data to 16 bytes
_ALIGN = 16
_PADS = {pad: _varint(_PAD_FIELD << 3 | _LEN) + _varint(pad - 2) + bytes(pad - 2)
         for pad in range(2, _ALIGN + 2)}


@dataclass(frozen=True)
class _TensorPiece:
    """A tensor field of a message being laid out: its header bytes, computed once."""

    key: object
    field: bytes  # tag, length and the Tensor's fields before the content
    nbytes: int
    dtype: np.dtype
    shape: tuple[int, ...]


def _new_bytes(size: int) -> tuple[bytes, np.ndarray]:
    """A new bytes object and a writable uint8 view of its storage, for filling in place.

    Filling a bytes object before anyone else holds it is what CPython's C API offers with
    PyBytes_FromStringAndSize(NULL, n); gRPC wants `bytes`, so this saves a full copy of the
    rows. Elsewhere a bytearray is filled and copied once.
    """
    if _FROM_SIZE is None:
        holder = bytearray(size)
        return holder, np.frombuffer(holder, dtype=np.uint8)  # caller converts with bytes()
    data = _FROM_SIZE(None, size)
    return data, np.asarray(_Storage(data)) if size else np.empty(0, np.uint8)


class _Storage:
    """A new bytes object's storage as numpy's array interface (the array keeps this, and so
    the bytes, alive). A ctypes array type per size would cost ~12 us a message and one
    cached type per distinct size, for ever."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.__array_interface__ = {"data": (id(data) + _BYTES_OFFSET, False),
                                    "shape": (len(data),), "typestr": "|u1", "version": 3}


def _tensor_field(number: int, dtype: np.dtype, shape: tuple[int, ...], nbytes: int) -> bytes:
    """A Tensor field up to its content: tag, length, dtype, shape, content tag and length."""
    header = _tensor_header(dtype, shape, nbytes)
    return _varint(number << 3 | _LEN) + _varint(len(header) + nbytes) + header


def _pad(at: int, field: bytes, align: bool) -> int:
    """Bytes of padding field before `field` (placed at `at`) so its content starts 16-byte
    aligned; 0 when not aligning. A padding field takes at least 2 bytes."""
    pad = -(at + len(field)) % _ALIGN if align else 0
    return pad + _ALIGN if pad == 1 else pad


def _materialize(plan: list, size: int) -> tuple[bytes, list[np.ndarray]]:
    """Allocate `size` bytes once, copy the plan's constant pieces in (consecutive ones in
    one copy) and return views of its tensor slots, in order. A slot is a tuple ending in
    (offset, nbytes, dtype, shape)."""
    data, raw = _new_bytes(size)
    views: list[np.ndarray] = []
    pending, at = [], 0
    for item in plan + [None]:
        if isinstance(item, bytes):
            pending.append(item)
            continue
        if pending:
            joined = b"".join(pending)
            raw[at:at + len(joined)] = np.frombuffer(joined, dtype=np.uint8)
            at += len(joined)
            pending = []
        if item is not None:
            *_, begin, nbytes, dtype, shape = item
            views.append(raw[begin:begin + nbytes].view(dtype).reshape(shape))
            at = begin + nbytes
    return data, views


class _Writer:
    """Lays out a message as constant bytes, tensor fields whose contents start 16-byte
    aligned (fast numpy copies) and nested messages, then allocates it once and exposes the
    tensors' storage by the keys they were given."""

    def __init__(self) -> None:
        self._pieces: list = []

    def raw(self, data: bytes) -> "_Writer":
        self._pieces.append(data)
        return self

    def tensor(self, number: int, key, dtype: np.dtype, shape: tuple[int, ...]) -> "_Writer":
        dtype = np.dtype(dtype)
        shape = tuple(int(d) for d in shape)
        nbytes = math.prod(shape) * dtype.itemsize
        field = _tensor_field(number, dtype, shape, nbytes)
        self._pieces.append(_TensorPiece(key, field, nbytes, dtype, shape))
        return self

    def message(self, number: int, inner: "_Writer") -> "_Writer":
        """A nested message field (its tensors stay aligned in the whole buffer)."""
        self._pieces.append((number, inner))
        return self

    def _unpadded(self) -> int:
        """Length without alignment padding (a lower bound, for a first guess)."""
        total = 0
        for piece in self._pieces:
            if isinstance(piece, bytes):
                total += len(piece)
            elif isinstance(piece, _TensorPiece):
                total += len(piece.field) + piece.nbytes
            else:
                inner = piece[1]._unpadded()
                total += len(_varint(piece[0] << 3 | _LEN)) + len(_varint(inner)) + inner
        return total

    def _layout(self, offset: int, align: bool = True) -> tuple[list, int]:
        """(plan, length) of this message placed at `offset` of the buffer: the plan holds
        bytes to copy and (key, offset, nbytes, dtype, shape) tensor slots."""
        plan, at = [], offset
        for piece in self._pieces:
            if isinstance(piece, bytes):
                plan.append(piece)
                at += len(piece)
            elif isinstance(piece, _TensorPiece):
                at = self._tensor(plan, at, piece, align)
            else:
                at = self._nested(plan, at, *piece, align)
        return plan, at - offset

    @staticmethod
    def _tensor(plan: list, at: int, piece: "_TensorPiece", align: bool) -> int:
        field = piece.field
        pad = _pad(at, field, align)
        if pad:
            plan.append(_PADS[pad])
        plan.append(field)
        at += pad + len(field)
        plan.append((piece.key, at, piece.nbytes, piece.dtype, piece.shape))
        return at + piece.nbytes

    @staticmethod
    def _nested(plan: list, at: int, number: int, inner: "_Writer", align: bool) -> int:
        """The length prefix depends on the content's length, which depends (through the
        padding) on where the content starts. Widen the prefix until the length fits it:
        the width only grows, so this ends (at most 10 bytes), where a prefix of the
        minimal width could flip between two widths forever (content just around 2**21
        bytes, say). A prefix wider than its value needs is a varint with redundant
        continuation bytes, which every protobuf parser reads."""
        tag = _varint(number << 3 | _LEN)
        width = len(_varint(inner._unpadded()))  # the length is at least this
        while True:
            inner_plan, length = inner._layout(at + len(tag) + width, align)
            need = len(_varint(length))
            if need <= width:
                break
            width = need
        plan.append(tag + _varint_of_width(length, width))
        plan.extend(inner_plan)
        return at + len(tag) + width + length

    def build(self, max_bytes: int | None = None) -> tuple[bytes, dict]:
        """(the message's bytes, tensor views by key); `max_bytes`: refuse a longer message
        (MessageTooLarge) before allocating it."""
        plan, size = self._layout(0)
        if max_bytes is not None and size > max_bytes:
            raise MessageTooLarge(size, max_bytes)
        data, views = _materialize(plan, size)
        keys = [item[0] for item in plan if not isinstance(item, bytes)]
        return data, dict(zip(keys, views))


_ALIGN_MIN_BYTES = 1024  # tensors of many-part messages smaller than this are not padded


def _build_many(parts: list, max_bytes: int | None = None) -> tuple[bytes, list[np.ndarray]]:
    """A message of repeated field 1 (each a nested message), laid out in one pass: `parts`
    is [(head bytes, [(field number, dtype, shape)], tail bytes)]; returns the bytes and
    views of every tensor's storage, part after part. Each part's length prefix is sized for the
    most padding it could need (a wider prefix has redundant continuation bytes, which
    protobuf parsers read), so padding that aligns large tensors to 16 bytes is decided in
    the same pass."""
    pieces: list = []
    at = 0
    for head, tensors, tail in parts:
        fields = []
        for number, dtype, shape in tensors:
            nbytes = math.prod(shape) * dtype.itemsize
            fields.append((_tensor_field(number, dtype, shape, nbytes), nbytes, dtype, shape))
        unpadded = len(head) + len(tail) + sum(len(f) + n for f, n, _, _ in fields)
        width = len(_varint(unpadded + (_ALIGN + 1) * len(fields)))
        start = at + 1 + width
        pos = start + len(head)
        pieces.append(b"\x0a")
        length_at = len(pieces)
        pieces.append(b"")  # the length prefix, once known
        pieces.append(head)
        for field, nbytes, dtype, shape in fields:
            pad = _pad(pos, field, nbytes >= _ALIGN_MIN_BYTES)
            if pad:
                pieces.append(_PADS[pad])
            pieces.append(field)
            pos += pad + len(field)
            pieces.append((pos, nbytes, dtype, shape))
            pos += nbytes
        pieces.append(tail)
        at = pos + len(tail)
        pieces[length_at] = _varint_of_width(at - start, width)
    if max_bytes is not None and at > max_bytes:
        raise MessageTooLarge(at, max_bytes)
    return _materialize(pieces, at)


def _finish(data) -> bytes:
    return data if isinstance(data, bytes) else bytes(data)


def _decode_tensor(buffer: bytes, data: memoryview, start: int, end: int, field: str) -> np.ndarray:
    dtype_code, shape, content = 0, [], None
    for number, kind, value, s, e in _fields(data, start, end):
        if number == 1 and kind == _VARINT:
            dtype_code = value
        elif number == 2 and kind == _LEN:
            packed, p = data[s:e], 0
            while p < len(packed):
                dim, p = _read_varint(packed, p)
                shape.append(_signed(dim))
        elif number == 2 and kind == _VARINT:
            shape.append(_signed(value))
        elif number == 3 and kind == _LEN:
            content = (s, e)
    if not dtype_code:
        raise DecodeError(f"{field}: dtype is unset")
    dtype = wire.numpy_dtype(dtype_code)
    if any(d < 0 for d in shape):
        raise DecodeError(f"{field}: negative dimension in shape {shape}")
    count = math.prod(shape)  # Python ints: a huge shape cannot overflow into a match
    lo, hi = content if content else (start, start)
    if hi - lo != count * dtype.itemsize:
        raise DecodeError(f"{field}: shape {shape} of {dtype.name} needs "
                          f"{count * dtype.itemsize} bytes, got {hi - lo}")
    return np.frombuffer(buffer, dtype=dtype, count=count, offset=lo).reshape(shape)


# ---- PullResponse { Tensor values = 1; int64 step = 2; } -------------------------------------
def _pull_response(key, rows: int, dim: int, dtype: object, step: int) -> _Writer:
    writer = _Writer().tensor(1, key, np.dtype(dtype), (rows, dim))
    return writer.raw(b"\x10" + _varint(step)) if step else writer


class PullResponseWriter:
    """A PullResponse written in place: fill `values` (e.g. `np.take(..., out=values)`),
    then send `data()`; the rows are copied exactly once, into the message itself."""

    def __init__(self, rows: int, dim: int, dtype: object, step: int,
                 max_bytes: int | None = None) -> None:
        """`max_bytes`: raise MessageTooLarge, before allocating, if the answer is longer."""
        self._data, views = _pull_response("values", rows, dim, dtype, step).build(max_bytes)
        self.values = views["values"]

    def data(self) -> bytes:
        return _finish(self._data)


def encode_pull_response(values: np.ndarray, step: int) -> bytes:
    values = np.asarray(values)
    writer = PullResponseWriter(*values.shape, values.dtype, step)
    writer.values[...] = values
    return writer.data()


def _decode_pull(buffer: bytes, data: memoryview, lo: int, hi: int | None
                 ) -> tuple[np.ndarray, int]:
    values, step = None, 0
    for number, kind, value, start, end in _fields(data, lo, hi):
        if number == 1 and kind == _LEN:
            values = _decode_tensor(buffer, data, start, end, "values")
        elif number == 2 and kind == _VARINT:
            step = _signed(value)
    if values is None:
        raise DecodeError("PullResponse carries no values")
    return values, step


def decode_pull_response(buffer: bytes) -> tuple[np.ndarray, int]:
    return _decode_pull(buffer, memoryview(buffer), 0, None)


# ---- PullManyResponse { repeated PullResponse parts = 1; } -----------------------------------
class PullManyResponseWriter:
    """A PullManyResponse written in place: `values[i]` is part i's [rows, dim] storage."""

    def __init__(self, parts: list[tuple[int, int, object, int]],
                 max_bytes: int | None = None) -> None:
        """parts: (rows, dim, dtype, step) of each part, in request order; `max_bytes`:
        raise MessageTooLarge, before allocating anything, if the answer would be longer."""
        layout = [(b"", [(1, np.dtype(dtype), (int(rows), int(dim)))],
                   b"\x10" + _varint(step) if step else b"")
                  for rows, dim, dtype, step in parts]
        self._data, self.values = _build_many(layout, max_bytes)

    def data(self) -> bytes:
        return _finish(self._data)


# Many-part messages up to this size are parsed by protobuf's C parser (one copy of the
# bytes, a few microseconds a part); larger ones by the zero-copy parser here, whose per-part
# cost in Python is small next to the rows it spares copying.
SMALL_MESSAGE_BYTES = 1 << 20


def decode_pull_many_response(buffer: bytes) -> list[tuple[np.ndarray, int]]:
    """(values, step) of every part (views into `buffer` for large answers)."""
    if len(buffer) <= SMALL_MESSAGE_BYTES:
        try:
            message = ps_pb2.PullManyResponse.FromString(buffer)
            if all(part.HasField("values") for part in message.parts):
                return [(wire.decode(part.values, "values"), part.step)
                        for part in message.parts]
        except (ProtobufDecodeError, wire.WireError):
            pass  # the parser below says precisely what is wrong
    data = memoryview(buffer)
    parts = []
    for number, kind, _, start, end in _fields(data):
        if number == 1 and kind == _LEN:
            parts.append(_decode_pull(buffer, data, start, end))
    return parts


# ---- PushRequest ----------------------------------------------------------------------------
@dataclass
class BulkPush:
    """A decoded PushRequest whose ids and grads are views into the received bytes."""

    table: str = ""
    shard_index: int = 0
    step: int = 0
    worker: int = 0
    ids: np.ndarray | None = None
    grads: np.ndarray | None = None
    learning_rate: float = 0.0
    chunk_index: int = 0
    chunk_count: int = 0
    session: int = 0
    error: str | None = None  # set instead of raising, so the handler can answer precisely


@dataclass(frozen=True)
class PushHeader:
    """Everything of a PushRequest but its rows."""

    table: str
    shard_index: int
    step: int
    worker: int
    learning_rate: float = 0.0
    chunk_index: int = 0
    chunk_count: int = 0
    session: int = 0


def _push_head_tail(header: PushHeader) -> tuple[bytes, bytes]:
    """A PushRequest's fields before its tensors (1-4) and after them (7-10)."""
    name = header.table.encode()
    head = b"\x0a" + _varint(len(name)) + name
    for number, value in ((2, header.shard_index), (3, header.step), (4, header.worker)):
        if value:
            head += _varint(number << 3) + _varint(value)
    tail = b"\x39" + struct.pack("<d", header.learning_rate) if header.learning_rate else b""
    for number, value in ((8, header.chunk_index), (9, header.chunk_count),
                          (10, header.session)):
        if value:
            tail += _varint(number << 3) + _varint(value)
    return head, tail


def _push_request(header: PushHeader, rows: int, dim: int, dtype: object) -> _Writer:
    head, tail = _push_head_tail(header)
    return _Writer().raw(head).tensor(5, "ids", np.int64, (rows,)) \
        .tensor(6, "grads", np.dtype(dtype), (rows, dim)).raw(tail)


class PushRequestWriter:
    """A PushRequest written in place: fill `ids` and `grads`, then send `data()`."""

    def __init__(self, table: str, shard_index: int, step: int, worker: int, rows: int,
                 dim: int, dtype: object, learning_rate: float = 0.0, chunk_index: int = 0,
                 chunk_count: int = 0, session: int = 0) -> None:
        header = PushHeader(table, shard_index, step, worker, learning_rate, chunk_index,
                            chunk_count, session)
        self._data, views = _push_request(header, rows, dim, dtype).build()
        self.ids, self.grads = views["ids"], views["grads"]

    def data(self) -> bytes:
        return _finish(self._data)


def encode_push_request(table: str, shard_index: int, step: int, worker: int, ids: np.ndarray,
                        grads: np.ndarray, learning_rate: float = 0.0, chunk_index: int = 0,
                        chunk_count: int = 0, session: int = 0) -> bytes:
    grads = np.asarray(grads)
    writer = PushRequestWriter(table, shard_index, step, worker, len(ids), grads.shape[1],
                               grads.dtype, learning_rate, chunk_index, chunk_count, session)
    writer.ids[...] = ids
    writer.grads[...] = grads
    return writer.data()


class PushManyRequestWriter:
    """A PushManyRequest written in place: fill `ids[i]` and `grads[i]` of every part."""

    def __init__(self, parts: list[tuple[PushHeader, int, int, object]]) -> None:
        """parts: (header, rows, dim, dtype) of each part, in order."""
        layout = []
        for header, rows, dim, dtype in parts:
            head, tail = _push_head_tail(header)
            layout.append((head, [(5, _INT64, (int(rows),)),
                                  (6, np.dtype(dtype), (int(rows), int(dim)))], tail))
        self._data, views = _build_many(layout)
        self.ids, self.grads = views[0::2], views[1::2]

    def data(self) -> bytes:
        return _finish(self._data)


_INT64 = np.dtype(np.int64)
_PUSH_INTS = {2: "shard_index", 3: "step", 4: "worker", 8: "chunk_index", 9: "chunk_count",
              10: "session"}
_PUSH_INT32 = {"shard_index", "worker", "chunk_index", "chunk_count"}


def _decode_push(buffer: bytes, data: memoryview, lo: int, hi: int | None) -> BulkPush:
    push = BulkPush()
    for number, kind, value, start, end in _fields(data, lo, hi):
        if number == 1 and kind == _LEN:
            push.table = bytes(data[start:end]).decode()
        elif number in _PUSH_INTS and kind == _VARINT:
            name = _PUSH_INTS[number]
            setattr(push, name, _int32(value) if name in _PUSH_INT32 else
                    value if name == "session" else _signed(value))
        elif number in (5, 6) and kind == _LEN:
            name = "ids" if number == 5 else "grads"
            setattr(push, name, _decode_tensor(buffer, data, start, end, name))
        elif number == 7 and kind == _FIXED64:
            push.learning_rate = struct.unpack_from("<d", buffer, start)[0]
    if push.ids is None:  # proto3 omits nothing for tensors, but be lenient: empty
        push.ids = np.empty(0, np.int64)
    if push.grads is None:
        push.grads = np.empty((0, 0), np.float32)
    return push


_DECODE_ERRORS = (DecodeError, wire.WireError, UnicodeDecodeError)


def decode_push_request(buffer: bytes) -> BulkPush:
    try:
        return _decode_push(buffer, memoryview(buffer), 0, None)
    except _DECODE_ERRORS as exc:
        return BulkPush(error=f"malformed PushRequest: {exc}")


@dataclass
class BulkPushMany:
    """A decoded PushManyRequest: its parts, or why it could not be read."""

    parts: list[BulkPush]
    error: str | None = None


def decode_push_many_request(buffer: bytes) -> BulkPushMany:
    if len(buffer) <= SMALL_MESSAGE_BYTES:
        try:
            return _small_push_many(buffer)
        except (ProtobufDecodeError, *_DECODE_ERRORS):
            pass  # the parser below says precisely what is wrong, and where
    data = memoryview(buffer)
    parts: list[BulkPush] = []
    try:
        for number, kind, _, start, end in _fields(data):
            if number == 1 and kind == _LEN:
                parts.append(_decode_push(buffer, data, start, end))
    except _DECODE_ERRORS as exc:
        return BulkPushMany(parts, f"malformed PushManyRequest part {len(parts)}: {exc}")
    return BulkPushMany(parts)


def _small_push_many(buffer: bytes) -> BulkPushMany:
    parts = []
    for i, p in enumerate(ps_pb2.PushManyRequest.FromString(buffer).parts):
        ids = wire.decode(p.ids, "ids") if p.HasField("ids") else np.empty(0, np.int64)
        grads = wire.decode(p.grads, "grads") if p.HasField("grads") else \
            np.empty((0, 0), np.float32)
        parts.append(BulkPush(p.table, p.shard_index, p.step, p.worker, ids, grads,
                              p.learning_rate, p.chunk_index, p.chunk_count, p.session))
    return BulkPushMany(parts)


def serialize_push(request) -> bytes:
    """Request serializer for Push and PushMany: pre-encoded bytes pass through, messages
    serialise, and a request not yet encoded (packed_codec.PushManyParts) is encoded."""
    if isinstance(request, bytes):
        return request
    return request.protobuf() if hasattr(request, "protobuf") else request.SerializeToString()


def serialize_pull_many(request) -> bytes:
    """Request serializer for PullMany: a message, or a request not yet encoded
    (packed_codec.PullManyParts)."""
    if hasattr(request, "protobuf"):
        request = request.protobuf()
    return request.SerializeToString()


# How a client (de)serialises the methods whose rows go through this codec: (request
# serializer, response deserializer) by method, for gRPC stubs and the data plane alike.
CLIENT_CODECS = {
    "Pull": (ps_pb2.PullRequest.SerializeToString, decode_pull_response),
    "Push": (serialize_push, ps_pb2.PushResponse.FromString),
    "PullMany": (serialize_pull_many, decode_pull_many_response),
    "PushMany": (serialize_push, ps_pb2.PushManyResponse.FromString),
}
