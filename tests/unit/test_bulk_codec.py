"""The bulk codec writes and reads exactly the protobuf wire format of ps.proto."""
from __future__ import annotations

import numpy as np
import pytest

from parallax.protocol import bulk_codec, wire
from parallax.ps.v1 import ps_pb2


@pytest.mark.parametrize("shape, dtype", [((3, 4), "float32"), ((0, 8), "float64"),
                                          ((2, 1), "float16")])
@pytest.mark.parametrize("step", [0, 7, 2**40])
def test_pull_response_matches_protobuf_both_ways(shape, dtype, step):
    values = np.arange(int(np.prod(shape)), dtype=dtype).reshape(shape)
    ours = bulk_codec.encode_pull_response(values, step)
    parsed = ps_pb2.PullResponse.FromString(ours)
    assert parsed.step == step
    np.testing.assert_array_equal(wire.decode(parsed.values), values)
    theirs = ps_pb2.PullResponse(step=step)
    wire.encode(values, theirs.values)
    decoded, decoded_step = bulk_codec.decode_pull_response(theirs.SerializeToString())
    np.testing.assert_array_equal(decoded, values)
    assert decoded_step == step and decoded.dtype == values.dtype


@pytest.mark.parametrize("rows, dim", [(1, 1), (3, 5), (1000, 64)])
def test_writers_fill_bytes_in_place_with_aligned_rows(rows, dim):
    writer = bulk_codec.PullResponseWriter(rows, dim, np.float32, step=3)
    assert writer.values.ctypes.data % 16 == 0 and writer.values.flags.writeable
    writer.values[...] = np.arange(rows * dim, dtype=np.float32).reshape(rows, dim)
    data = writer.data()
    assert type(data) is bytes
    parsed = ps_pb2.PullResponse.FromString(data)  # the padding is an unknown field
    np.testing.assert_array_equal(wire.decode(parsed.values), writer.values)
    push = bulk_codec.PushRequestWriter("t", 1, 2, 0, rows, dim, np.float64, chunk_count=2)
    assert push.ids.ctypes.data % 16 == 0 and push.grads.ctypes.data % 16 == 0
    push.ids[...] = np.arange(rows)
    push.grads[...] = 1.5
    message = ps_pb2.PushRequest.FromString(push.data())
    np.testing.assert_array_equal(wire.decode(message.ids), np.arange(rows))
    assert (wire.decode(message.grads) == 1.5).all() and message.chunk_count == 2


def test_push_request_matches_protobuf_both_ways():
    ids, grads = np.array([5, -1, 2**50]), np.ones((3, 2), np.float32)
    fields = dict(table="emb.v2", shard_index=3, step=2**33, worker=-2, learning_rate=0.125,
                  chunk_index=1, chunk_count=4, session=2**63 + 5)
    ours = bulk_codec.encode_push_request(ids=ids, grads=grads, **fields)
    message = ps_pb2.PushRequest.FromString(ours)
    for name, value in fields.items():
        assert getattr(message, name) == value, name
    np.testing.assert_array_equal(wire.decode(message.ids), ids)
    np.testing.assert_array_equal(wire.decode(message.grads), grads)
    decoded = bulk_codec.decode_push_request(message.SerializeToString())
    assert decoded.error is None
    for name, value in fields.items():
        assert getattr(decoded, name) == value, name
    np.testing.assert_array_equal(decoded.ids, ids)
    np.testing.assert_array_equal(decoded.grads, grads)
    assert not decoded.grads.flags.writeable  # a view into the received bytes, not a copy


def test_decoder_skips_unknown_fields_and_reads_unpacked_shapes():
    values = np.arange(6, dtype=np.float32).reshape(2, 3)
    tensor = b"\x08\x01" + b"\x10\x02\x10\x03" + b"\x1a\x18" + values.tobytes()
    unknown = b"\x78\x05" + b"\x82\x01\x03abc"  # field 15 varint, field 16 bytes
    buffer = unknown + b"\x0a" + bytes([len(tensor)]) + tensor + b"\x10\x09"
    decoded, step = bulk_codec.decode_pull_response(buffer)
    np.testing.assert_array_equal(decoded, values)
    assert step == 9


@pytest.mark.parametrize("mangle, message", [
    (lambda b: b[:-3], "field 6 claims 32 bytes, 29 left"),
    (lambda b: ps_pb2.PushRequest(table="t", grads=ps_pb2.Tensor(
        dtype=ps_pb2.FLOAT32, shape=[2, 4], content=bytes(24))).SerializeToString(),
     "grads: shape [2, 4] of float32 needs 32 bytes, got 24"),
    (lambda b: b + b"\x80", "truncated or overlong varint"),
    (lambda b: b + b"\x0b", "unsupported wire type 3"),
])
def test_malformed_push_is_reported_not_raised(mangle, message):
    good = bulk_codec.encode_push_request("t", 0, 0, 0, np.array([1, 2]),
                                          np.zeros((2, 3), np.float32))
    decoded = bulk_codec.decode_push_request(mangle(good))
    assert decoded.error and message in decoded.error


def test_decoder_reads_integers_as_protobuf_does():
    message = ps_pb2.PushRequest(table="t", worker=1)
    data = message.SerializeToString().replace(b"\x20\x01", b"\x20\x81\x80\x80\x80\x10")
    assert ps_pb2.PushRequest.FromString(data).worker == 1  # 2**32 + 1 as int32 is 1
    assert bulk_codec.decode_push_request(data).worker == 1
    minus_one = b"\x18" + b"\xff" * 9 + b"\x7f"  # step: 10-byte varint with high bits set
    assert ps_pb2.PushRequest.FromString(minus_one).step == -1
    assert bulk_codec.decode_push_request(minus_one).step == -1


def test_shape_whose_size_overflows_int64_is_rejected():
    huge = ps_pb2.Tensor(dtype=ps_pb2.FLOAT32, shape=[2**61 + 1, 8], content=bytes(64))
    decoded = bulk_codec.decode_push_request(ps_pb2.PushRequest(grads=huge).SerializeToString())
    assert decoded.error and "needs" in decoded.error
    with pytest.raises(wire.WireError, match="needs"):
        wire.decode(huge)


# ---- PullManyResponse / PushManyRequest: nested parts -----------------------------------------
def _fill(values: list[np.ndarray]) -> None:
    for k, v in enumerate(values):
        v[...] = np.arange(v.size, dtype=v.dtype).reshape(v.shape) + 1000 * k


PULL_MANY_PARTS = [
    [],
    [(0, 4, "float32", 0)],
    [(3, 4, "float32", 7), (0, 8, "float64", 0), (5, 1, "float32", 2**40), (2, 3, "float64", 1)],
]


@pytest.mark.parametrize("parts", PULL_MANY_PARTS, ids=["none", "one empty", "mixed"])
def test_pull_many_response_matches_protobuf_both_ways(parts):
    writer = bulk_codec.PullManyResponseWriter(parts)
    assert len(writer.values) == len(parts)
    _fill(writer.values)
    for values, (rows, dim, dtype, _) in zip(writer.values, parts):
        assert values.shape == (rows, dim) and values.dtype == np.dtype(dtype)
        assert aligned(values) and values.flags.writeable
    data = writer.data()
    parsed = ps_pb2.PullManyResponse.FromString(data)
    assert [p.step for p in parsed.parts] == [p[3] for p in parts]
    for part, values in zip(parsed.parts, writer.values):
        np.testing.assert_array_equal(wire.decode(part.values), values)
    theirs = ps_pb2.PullManyResponse()
    for values, (*_, step) in zip(writer.values, parts):
        wire.encode(values, theirs.parts.add(step=step).values)
    for buffer in (data, theirs.SerializeToString()):
        decoded = bulk_codec.decode_pull_many_response(buffer)
        assert [s for _, s in decoded] == [p[3] for p in parts]
        for (got, _), values in zip(decoded, writer.values):
            np.testing.assert_array_equal(got, values)
            assert got.dtype == values.dtype and got.shape == values.shape


def aligned(array: np.ndarray) -> bool:
    """Parts of many-part messages are 16-byte aligned from _ALIGN_MIN_BYTES on (smaller ones
    are copied by small memcpys either way; padding them costs bytes, not speed)."""
    return array.nbytes < bulk_codec._ALIGN_MIN_BYTES or array.ctypes.data % 16 == 0


@pytest.mark.parametrize("rows", [*range(20, 40), *range(4085, 4100), 524_280, 524_290])
def test_nested_parts_stay_aligned_across_length_prefix_widths(rows):
    """A part's length prefix grows at 128, 16384, 2**21 bytes while its content's padding
    depends on where it starts: every size must still parse and stay 16-byte aligned."""
    parts = [(1, 3, "float32", 5), (rows, 1, "float32", 1), (rows // 2, 2, "float64", 0)]
    writer = bulk_codec.PullManyResponseWriter(parts)
    _fill(writer.values)
    assert all(aligned(v) for v in writer.values)
    parsed = ps_pb2.PullManyResponse.FromString(writer.data())
    decoded = bulk_codec.decode_pull_many_response(writer.data())
    for part, (ours, _), values in zip(parsed.parts, decoded, writer.values):
        np.testing.assert_array_equal(wire.decode(part.values), values)
        np.testing.assert_array_equal(ours, values)
    push = bulk_codec.PushManyRequestWriter(
        [(bulk_codec.PushHeader("t", 0, 1, 0), rows, 1, np.float32),
         (bulk_codec.PushHeader("u" * 130, 2, 1, 0), 3, 2, np.float64)])
    assert all(aligned(a) for a in push.ids + push.grads)
    _fill(push.ids + push.grads)
    message = ps_pb2.PushManyRequest.FromString(push.data())
    np.testing.assert_array_equal(wire.decode(message.parts[0].grads), push.grads[0])
    np.testing.assert_array_equal(wire.decode(message.parts[1].ids), push.ids[1])


def test_pull_many_writer_refuses_a_message_over_max_bytes_before_allocating():
    parts = [(1000, 64, "float32", 3), (10, 2, "float64", 0)]
    size = len(bulk_codec.PullManyResponseWriter(parts).data())
    assert len(bulk_codec.PullManyResponseWriter(parts, max_bytes=size).data()) == size
    with pytest.raises(bulk_codec.MessageTooLarge) as info:
        bulk_codec.PullManyResponseWriter(parts, max_bytes=size - 1)
    assert (info.value.size, info.value.limit) == (size, size - 1)
    with pytest.raises(bulk_codec.MessageTooLarge):  # 4 PiB: refused, never allocated
        bulk_codec.PullManyResponseWriter([(2**40, 1024, "float32", 0)], max_bytes=1 << 20)


def test_pull_many_decoder_skips_unknown_fields_and_refuses_broken_parts():
    values = np.arange(6, dtype=np.float32).reshape(2, 3)
    part = b"\x78\x05" + bulk_codec.encode_pull_response(values, 4)  # unknown field 15 first
    buffer = b"\x12\x02ab" + b"\x0a" + bulk_codec._varint(len(part)) + part  # unknown field 2
    ((decoded, step),) = bulk_codec.decode_pull_many_response(buffer)
    np.testing.assert_array_equal(decoded, values)
    assert step == 4
    with pytest.raises(bulk_codec.DecodeError, match="claims"):
        bulk_codec.decode_pull_many_response(buffer[:-5])
    with pytest.raises(bulk_codec.DecodeError, match="carries no values"):
        bulk_codec.decode_pull_many_response(b"\x0a\x02\x10\x01")


PUSH_MANY_HEADERS = [
    (bulk_codec.PushHeader("emb.v2", 3, 2**33, -2, 0.125, 1, 4, 2**63 + 5), 3, 2, np.float32),
    (bulk_codec.PushHeader("t", 0, 0, 0), 0, 4, np.float64),
    (bulk_codec.PushHeader("x" * 200, 1, 5, 1, 0.0, 0, 1, 7), 130, 1, np.float32),
]


def test_push_many_request_matches_protobuf_both_ways():
    writer = bulk_codec.PushManyRequestWriter(PUSH_MANY_HEADERS)
    assert len(writer.ids) == len(writer.grads) == 3
    for k, (_, rows, dim, dtype) in enumerate(PUSH_MANY_HEADERS):
        assert writer.ids[k].shape == (rows,) and writer.grads[k].shape == (rows, dim)
        assert writer.grads[k].dtype == np.dtype(dtype) and aligned(writer.grads[k])
        writer.ids[k][...] = np.arange(rows) * 7 - 3
        writer.grads[k][...] = np.arange(rows * dim).reshape(rows, dim) / (k + 1)
    message = ps_pb2.PushManyRequest.FromString(writer.data())
    fields = ("table", "shard_index", "step", "worker", "learning_rate", "chunk_index",
              "chunk_count", "session")
    for part, (header, *_), ids, grads in zip(message.parts, PUSH_MANY_HEADERS, writer.ids,
                                              writer.grads):
        for name in fields:
            assert getattr(part, name) == getattr(header, name), name
        np.testing.assert_array_equal(wire.decode(part.ids), ids)
        np.testing.assert_array_equal(wire.decode(part.grads), grads)
    for buffer in (writer.data(), message.SerializeToString()):
        decoded = bulk_codec.decode_push_many_request(buffer)
        assert decoded.error is None and len(decoded.parts) == 3
        for part, (header, *_), ids, grads in zip(decoded.parts, PUSH_MANY_HEADERS,
                                                  writer.ids, writer.grads):
            for name in fields:
                assert getattr(part, name) == getattr(header, name), name
            np.testing.assert_array_equal(part.ids, ids)
            np.testing.assert_array_equal(part.grads, grads)
            assert part.grads.dtype == grads.dtype and not part.grads.flags.writeable
    assert bulk_codec.decode_push_many_request(b"").parts == []


def _two_parts() -> bytes:
    writer = bulk_codec.PushManyRequestWriter(PUSH_MANY_HEADERS[:1] + PUSH_MANY_HEADERS[2:])
    return writer.data()


def _part_bytes(inner: bytes) -> bytes:
    return b"\x0a" + bulk_codec._varint(len(inner)) + inner


@pytest.mark.parametrize("buffer, message", [
    (_two_parts()[:-3], "malformed PushManyRequest part 1: field 1 claims"),
    (_two_parts()[:9], "malformed PushManyRequest part 0: field 1 claims"),
    (_two_parts() + b"\x80", "part 2: truncated or overlong varint"),
    # a field of a part may not run past the part, even where the buffer goes on
    (_part_bytes(b"\x0a\x10abc") + _part_bytes(b"\x0a\x01t" * 8), "part 0: field 1 claims 16"),
    (_part_bytes(b"\x10\x80") + _part_bytes(b"\x0a\x01t"), "part 0: truncated or overlong"),
    (_part_bytes(b"\x32\x04\x08\x01\x12\x00"), "part 0: grads: shape [] of float32 needs 4"),
    (_part_bytes(b"\x0a\x02\xff\xfe"), "malformed PushManyRequest part 0: 'utf-8' codec"),
])
def test_malformed_push_many_is_reported_with_its_part(buffer, message):
    decoded = bulk_codec.decode_push_many_request(buffer)
    assert decoded.error and message in decoded.error, decoded.error
