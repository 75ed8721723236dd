"""Tables with a wire dtype against the session's two real servers (no mocks).

Pulls answer float32 masters narrowed to float16/bfloat16 and pushes are widened before the
optimizer, over the data plane (packed) and over gRPC (protobuf) alike, single-table and
multi-table calls alike; a push in a third dtype is refused naming both, changing nothing;
an overflow is refused before anything is sent (gradients, client side) or answered
(rows, server side); `pull_all`, assign and checkpoints stay exact float32."""
from __future__ import annotations

import grpc
import numpy as np
import pytest

from parallax.client import ClientOptions, PSClient
from parallax.client.many import pull_many, push_many
from parallax.errors import ServerError
from parallax.protocol import bulk_codec, wire_dtypes
from parallax.protocol.specs import SGD, TableSpec
from parallax.protocol.wire_dtypes import WireOverflowError

DIM, VOCAB = 4, 50
PATHS = {"dataplane": ClientOptions(timeout=20), "grpc": ClientOptions(timeout=20,
                                                                      data_plane=False)}


def _wire(values: np.ndarray, name: str) -> np.ndarray:
    """What `values` (float32) become after a trip over the wire as `name`."""
    kind = wire_dtypes.get(name)
    return kind.decode(kind.encode(np.asarray(values, np.float32)))


def _masters(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((VOCAB, DIM)).astype(np.float32) / 3


@pytest.fixture(params=sorted(PATHS))
def path_client(request, cluster):
    with PSClient(cluster.addresses, PATHS[request.param]) as c:
        yield c


def _table(client, name, wire_dtype, shards=2):
    table = client.create_table(TableSpec(name=name, vocabulary_size=VOCAB, dim=DIM,
                                          shard_count=shards, wire_dtype=wire_dtype,
                                          optimizer=SGD(learning_rate=0.5)))
    table.assign(np.arange(VOCAB), _masters())
    return table


@pytest.mark.parametrize("wire_dtype", ["float16", "bfloat16"])
def test_pull_and_push_travel_narrow_and_the_server_keeps_float32(path_client, table_name,
                                                                  wire_dtype):
    table = _table(path_client, table_name, wire_dtype)
    masters = _masters()
    ids = np.array([3, 7, 3, 11, 48])
    rows = table.pull(ids)
    assert rows.dtype == np.float32
    np.testing.assert_array_equal(rows, _wire(masters, wire_dtype)[ids])
    np.testing.assert_array_equal(table.pull_all(), masters)  # exact: full precision
    grads = np.random.default_rng(1).standard_normal((5, DIM)).astype(np.float32)
    table.push(ids, grads, step=0)
    summed = np.zeros_like(masters)
    np.add.at(summed, ids, grads)
    touched = np.unique(ids)
    expected = masters.copy()
    expected[touched] -= np.float32(0.5) * _wire(summed[touched], wire_dtype)
    np.testing.assert_array_equal(table.pull_all(), expected)
    # the multi-table calls (one PullMany / PushMany per server) do the same
    (got,) = pull_many([table], [touched], [1])
    np.testing.assert_array_equal(got, _wire(expected[touched], wire_dtype))
    push_many([table], [touched], [grads[:len(touched)]], [1], 0, [0.0])
    expected[touched] -= np.float32(0.5) * _wire(grads[:len(touched)], wire_dtype)
    np.testing.assert_array_equal(table.pull_all(), expected)


def test_a_float32_table_is_unchanged_bit_for_bit(path_client, table_name):
    table = _table(path_client, table_name, "")
    masters = _masters()
    ids = np.array([1, 2, 2])
    np.testing.assert_array_equal(table.pull(ids), masters[ids])
    table.push(ids, np.full((3, DIM), 0.1, np.float32), step=0)
    masters[1] -= np.float32(0.5) * np.float32(0.1)
    masters[2] -= np.float32(0.5) * (np.float32(0.1) + np.float32(0.1))
    np.testing.assert_array_equal(table.pull([1, 2], min_step=1), masters[[1, 2]])


def test_a_float32_push_to_a_narrow_table_is_applied_in_full(client, table_name):
    table = _table(client, table_name, "bfloat16", shards=1)
    grads = np.full((1, DIM), 1 / 3, np.float32)
    data = bulk_codec.encode_push_request(table.name, 0, 0, 0, np.array([5]), grads)
    table.shards[0].stub().Push(data, timeout=10)
    expected = _masters()[5] - np.float32(0.5) * grads[0]
    np.testing.assert_array_equal(table.pull_all()[5], expected)


@pytest.mark.parametrize("wire_dtype, sent, named", [
    ("bfloat16", np.float16, "float16"), ("float16", np.uint16, "bfloat16"),
    ("bfloat16", np.float64, "float64")])
def test_a_push_in_another_dtype_is_refused_and_changes_nothing(client, table_name, snapshot,
                                                                wire_dtype, sent, named):
    table = _table(client, table_name, wire_dtype, shards=1)
    before = snapshot(table.name)
    data = bulk_codec.encode_push_request(table.name, 0, 0, 0, np.array([5]),
                                          np.ones((1, DIM), sent))
    with pytest.raises(grpc.RpcError) as err:
        table.shards[0].stub().Push(data, timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    message = err.value.details()
    assert f"table {table.name!r}" in message and f"grads dtype {named}" in message
    assert f"wire_dtype {wire_dtype}" in message and "dtype float32" in message
    snapshot(table.name).assert_equal(before)


def test_a_gradient_beyond_float16_is_refused_before_anything_is_sent(client, table_name,
                                                                      snapshot):
    table = _table(client, table_name, "float16")
    before = snapshot(table.name)
    grads = np.ones((2, DIM), np.float32)
    grads[1, 2] = 7e4
    with pytest.raises(WireOverflowError, match=rf"{table.name}.*70000.*'bfloat16'"):
        table.push([0, 1], grads, step=0)
    with pytest.raises(WireOverflowError, match="bfloat16"):  # a duplicate's sum overflows
        push_many([table], [np.array([4, 4])], [np.full((2, DIM), 4e4)], [0], 0, [0.0])
    snapshot(table.name).assert_equal(before)
    table.push([0, 1], np.ones((2, DIM)), step=0)  # the step was still open on every shard


def test_a_row_beyond_float16_is_refused_by_the_server_and_stays_exact(path_client,
                                                                       table_name):
    table = _table(path_client, table_name, "float16")
    table.assign([9], np.full((1, DIM), 1e5, np.float32))
    for pull in (lambda: table.pull([8, 9]), lambda: pull_many([table], [np.array([9])],
                                                                [0])):
        with pytest.raises(ServerError, match=rf"{table.name}.*100000.*'bfloat16'") as err:
            pull()
        assert err.value.code == grpc.StatusCode.OUT_OF_RANGE
    np.testing.assert_array_equal(table.pull_all()[9], np.full(DIM, 1e5, np.float32))


def test_checkpoints_keep_the_float32_masters(client, table_name, snapshot):
    table = _table(client, table_name, "bfloat16")
    table.push([1, 2], np.full((2, DIM), 1 / 7, np.float32), step=0)
    trained = table.pull_all()
    path = f"wire-{table_name}"
    client.save(path, [table.name])
    assert snapshot(table.name).arrays["values"].dtype == np.float32
    np.testing.assert_array_equal(snapshot(table.name).arrays["values"], trained)
    table.push([1], np.ones((1, DIM)), step=1)
    client.restore(path, [table.name])
    np.testing.assert_array_equal(table.pull_all(), trained)
