"""packed_codec, the data plane's layout of PullMany and PushMany (fast tier: no servers).

Round trips of every request and answer, the same requests as the protobuf path, and one
refusal per way a body can disagree with its headers."""
from __future__ import annotations

import struct

import numpy as np
import pytest

from parallax.protocol import bulk_codec, packed_codec
from parallax.protocol.bulk_codec import DecodeError, PushHeader

DIM = 3


def _ids(rng, sizes):
    return [np.sort(rng.choice(1000, n, replace=False)).astype(np.int64) for n in sizes]


def _pull_body(sizes=(4, 0, 7)):
    ids = _ids(np.random.default_rng(0), sizes)
    names = [f"table-{i}" for i in range(len(sizes))] if sizes else []
    return packed_codec.encode_pull_many(names, list(range(len(sizes))), [5] * len(sizes),
                                         ids), ids


def _push_parts(sizes=(2, 0, 5), dtype=np.float32):
    rng = np.random.default_rng(1)
    ids = _ids(rng, sizes)
    grads = [rng.standard_normal((n, DIM)).astype(dtype) for n in sizes]
    heads = [(PushHeader(f"t{i}", i, 7, 2, 0.25, 1, 3, 2**64 - 1), n, DIM, dtype)
             for i, n in enumerate(sizes)]

    def fill(i, ids_out, grads_out):
        ids_out[...], grads_out[...] = ids[i], grads[i]
    return packed_codec.PushManyParts(heads, fill), ids, grads


def test_pull_request_round_trip_with_empty_and_unicode_parts():
    ids = _ids(np.random.default_rng(2), (3, 0, 2))
    body = packed_codec.encode_pull_many(["a", "über", "c"], [0, 1, 2], [0, 4, 9], ids)
    parts = packed_codec.decode_pull_many(body).parts
    assert [(p.table, p.shard_index, p.min_step) for p in parts] == \
        [("a", 0, 0), ("über", 1, 4), ("c", 2, 9)]
    for part, expected in zip(parts, ids):
        np.testing.assert_array_equal(part.ids, expected)


def test_a_request_with_no_parts_round_trips():
    assert packed_codec.decode_pull_many(packed_codec.encode_pull_many([], [], [], [])).parts \
        == []


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_pull_answer_round_trip_is_aligned(dtype):
    shapes = [(4, DIM), (0, DIM), (9, 1)]
    writer = packed_codec.PullManyAnswerWriter([(n, d, dtype, 11 + i)
                                                for i, (n, d) in enumerate(shapes)])
    rng = np.random.default_rng(3)
    expected = [rng.standard_normal(s).astype(dtype) for s in shapes]
    for out, values in zip(writer.values, expected):
        out[...] = values
    body = writer.data()
    assert isinstance(body, bytes)
    answer = packed_codec.decode_pull_many_answer(body)
    for i, ((values, step), want) in enumerate(zip(answer, expected)):
        assert step == 11 + i
        np.testing.assert_array_equal(values, want)
        assert values.ctypes.data % 16 == 0 or values.size == 0


def test_pull_answer_over_the_limit_is_refused_before_allocating():
    with pytest.raises(bulk_codec.MessageTooLarge):
        packed_codec.PullManyAnswerWriter([(10**12, 64, np.float32, 0)], max_bytes=1 << 20)


def test_push_request_round_trip_and_the_same_parts_as_protobuf():
    request, ids, grads = _push_parts()
    packed = packed_codec.decode_push_many(request.packed()).parts
    proto = bulk_codec.decode_push_many_request(request.protobuf()).parts
    assert len(packed) == len(proto) == 3
    for a, b, i, g in zip(packed, proto, ids, grads):
        for field in ("table", "shard_index", "step", "worker", "learning_rate",
                      "chunk_index", "chunk_count", "session"):
            assert getattr(a, field) == getattr(b, field), field
        np.testing.assert_array_equal(a.ids, i)
        np.testing.assert_array_equal(a.grads, g)
        assert a.grads.shape == (len(i), DIM)


def test_protobuf_requests_convert_to_packed_ones():
    """What a caller hands the data plane as a protobuf message (or its bytes) goes out
    packed with the same meaning."""
    request, ids, grads = _push_parts()
    convert_push = packed_codec.CLIENT_CODECS["PushMany"][0]
    parts = packed_codec.decode_push_many(convert_push(request.protobuf())).parts
    for part, i, g in zip(parts, ids, grads):
        np.testing.assert_array_equal(part.ids, i)
        np.testing.assert_array_equal(part.grads, g)
    pull = packed_codec.PullManyParts(["x", "y"], [0, 1], [3, 0], _ids(np.random.default_rng(4),
                                                                      (2, 5)))
    convert_pull = packed_codec.CLIENT_CODECS["PullMany"][0]
    decoded = packed_codec.decode_pull_many(convert_pull(pull.protobuf())).parts
    assert [(p.table, p.shard_index, p.min_step, list(p.ids)) for p in decoded] == \
        [(t, s, m, list(i)) for t, s, m, i in zip(pull.tables, pull.shards, pull.min_steps,
                                                  pull.ids)]


def test_padding_is_zeroed():
    """Never send what the allocator left in a new buffer."""
    body = _push_parts((1,))[0].packed()
    records = 8 + packed_codec.PUSH_PART.itemsize
    names_end = records + 2
    assert body[names_end:names_end + (-names_end % 16)] == bytes(-names_end % 16)
    assert body[-4:] == bytes(4)  # one float32 row of dim 3: 12 bytes, padded to 16


def _set(body: bytes, record: np.dtype, part: int, field: str, value) -> bytes:
    records = np.frombuffer(body, record, count=struct.unpack_from("<I", body)[0],
                            offset=8).copy()
    records[field][part] = value
    return body[:8] + records.tobytes() + body[8 + records.nbytes:]


PULL_DEFECTS = [
    ("short", lambda b: b[:5], "shorter than its 8-byte prefix"),
    ("parts past the end", lambda b: struct.pack("<I", 10**6) + b[4:], "need"),
    ("truncated ids", lambda b: b[:-8], "describe"),
    ("trailing bytes", lambda b: b + bytes(8), "describe"),
    ("negative count", lambda b: _set(b, packed_codec.PULL_PART, 0, "count", -1), "negative"),
    ("huge count", lambda b: _set(b, packed_codec.PULL_PART, 2, "count", 2**62), "describe"),
    ("shard past int32", lambda b: _set(b, packed_codec.PULL_PART, 1, "shard", 2**40),
     "outside int32"),
    ("name lengths", lambda b: _set(b, packed_codec.PULL_PART, 0, "name_len", 3),
     "do not add up"),
    ("negative name length", lambda b: _set(b, packed_codec.PULL_PART, 0, "name_len", -7),
     "do not add up"),
]


@pytest.mark.parametrize("spoil, text", [d[1:] for d in PULL_DEFECTS],
                         ids=[d[0] for d in PULL_DEFECTS])
def test_a_pull_request_that_disagrees_with_its_headers_is_refused(spoil, text):
    body, _ = _pull_body()
    with pytest.raises(DecodeError, match=text):
        packed_codec.decode_pull_many(spoil(body))


def test_a_table_name_that_is_not_utf8_is_refused():
    body = packed_codec.encode_pull_many(["ab"], [0], [0], [np.arange(2, dtype=np.int64)])
    at = 8 + packed_codec.PULL_PART.itemsize
    with pytest.raises(DecodeError, match="not UTF-8"):
        packed_codec.decode_pull_many(body[:at] + b"\xff\xfe" + body[at + 2:])


PUSH_DEFECTS = [
    ("truncated grads", lambda b: b[:-16], "describe"),
    ("negative dim", lambda b: _set(b, packed_codec.PUSH_PART, 0, "dim", -3), "negative"),
    ("bigger dim", lambda b: _set(b, packed_codec.PUSH_PART, 2, "dim", DIM + 2), "describe"),
    ("unknown dtype", lambda b: _set(b, packed_codec.PUSH_PART, 1, "dtype", 99), "dtype"),
    ("worker past int32", lambda b: _set(b, packed_codec.PUSH_PART, 2, "worker", 2**31),
     "outside int32"),
    ("chunk past int32", lambda b: _set(b, packed_codec.PUSH_PART, 2, "chunk", -2**40),
     "outside int32"),
    ("names past the end", lambda b: b[:4] + struct.pack("<I", 10**9) + b[8:], "need"),
]


@pytest.mark.parametrize("spoil, text", [d[1:] for d in PUSH_DEFECTS],
                         ids=[d[0] for d in PUSH_DEFECTS])
def test_a_push_request_that_disagrees_with_its_headers_is_refused(spoil, text):
    body = _push_parts()[0].packed()
    with pytest.raises(DecodeError, match=text):
        packed_codec.decode_push_many(spoil(body))


def test_an_answer_that_disagrees_with_its_headers_is_refused():
    writer = packed_codec.PullManyAnswerWriter([(2, DIM, np.float32, 1)])
    writer.values[0][...] = 1
    body = writer.data()
    with pytest.raises(DecodeError, match="describe"):
        packed_codec.decode_pull_many_answer(body[:-16])
    with pytest.raises(DecodeError, match="dtype"):
        packed_codec.decode_pull_many_answer(_set(body, packed_codec.PULL_ANSWER_PART, 0,
                                                  "dtype", 0))


def test_the_packed_layout_is_what_the_docstring_says():
    """Record sizes are part of the protocol: a change needs a new data-plane version."""
    assert (packed_codec.PULL_PART.itemsize, packed_codec.PULL_ANSWER_PART.itemsize,
            packed_codec.PUSH_PART.itemsize) == (32, 32, 88)


def test_an_empty_part_with_a_huge_width_is_refused_not_a_numpy_error():
    """Found by a reviewer's fuzzer: count 0 with dim 2**62 passed the size checks (nothing
    to hold) and numpy's reshape raised ValueError."""
    request, _, _ = _push_parts((0, 2))
    with pytest.raises(DecodeError, match="outside int32"):
        packed_codec.decode_push_many(_set(request.packed(), packed_codec.PUSH_PART, 0, "dim",
                                           2**62))
    writer = packed_codec.PullManyAnswerWriter([(0, DIM, np.float32, 1)])
    with pytest.raises(DecodeError, match="outside int32"):
        packed_codec.decode_pull_many_answer(_set(writer.data(), packed_codec.PULL_ANSWER_PART,
                                                  0, "dim", 2**62))
    with pytest.raises(DecodeError, match="an answer has none"):
        packed_codec.decode_pull_many_answer(writer.data()[:4] + struct.pack("<I", 3) +
                                             writer.data()[8:])
