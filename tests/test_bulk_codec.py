"""The bulk codec writes and reads exactly the protobuf wire format of ps.proto."""
from __future__ import annotations

import grpc
import numpy as np
import pytest

from parallax import bulk_codec, wire
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


def test_server_answers_malformed_push_bytes_with_invalid_argument(cluster):
    with grpc.insecure_channel(cluster.addresses[0]) as channel:
        push = channel.unary_unary("/parallax.ps.v1.ParameterServer/Push")
        with pytest.raises(grpc.RpcError) as info:
            push(b"\x0a\x01t\x2a\x05\x08\x05\x1a\x10", timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed PushRequest" in info.value.details()


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
