"""Every bad request gets a precise gRPC status and leaves every table exactly as it was.

Requests are sent through the raw stub where the client would catch the mistake first, so the
server's own validation is what is tested. "Unchanged" is checked on rows, optimizer slots and
step, read back through a checkpoint.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import grpc
import numpy as np
import pytest

from parallax.errors import ServerError
from parallax.protocol import wire
from parallax.protocol.specs import Adam, Initializer, TableSpec
from parallax.ps.v1 import ps_pb2


@pytest.fixture
def table(client, table_name):
    spec = TableSpec(name=table_name, vocabulary_size=100, dim=4, shard_count=2,
                     optimizer=Adam(learning_rate=0.1), initializer=Initializer("uniform", seed=1))
    t = client.create_table(spec)
    t.push(np.arange(0, 100, 7), np.ones((15, 4)), step=0)  # give the slots some state
    return t


def _push(table, shard=0, ids=(0, 2), grads=None, step=1, worker=0, **kw):
    grads = np.ones((len(ids), 4), np.float32) if grads is None else grads
    request = ps_pb2.PushRequest(table=table.name, shard_index=shard, step=step, worker=worker,
                                 **kw)
    wire.encode(np.asarray(ids, np.int64), request.ids)
    wire.encode(grads, request.grads)
    return request


def _expect(table, method, request, code, pattern):
    stub = table.shards[0].stub()
    with pytest.raises(grpc.RpcError) as info:
        getattr(stub, method)(request, timeout=10)
    assert info.value.code() == code, info.value.details()
    assert pattern in info.value.details(), info.value.details()


BAD_PUSHES = [
    ("unknown table", dict(), lambda r: setattr(r, "table", "nope"), grpc.StatusCode.NOT_FOUND,
     "table 'nope' shard 0 does not exist"),
    ("negative id", dict(ids=(0, -2)), None, grpc.StatusCode.INVALID_ARGUMENT,
     "id -2 (position 1) is outside the vocabulary [0, 100)"),
    ("id beyond vocabulary", dict(ids=(100,)), None, grpc.StatusCode.INVALID_ARGUMENT,
     "id 100 (position 0) is outside the vocabulary"),
    ("id of another shard", dict(ids=(0, 3)), None, grpc.StatusCode.INVALID_ARGUMENT,
     "id 3 belongs to shard 1 of 2"),
    ("wrong row dim", dict(grads=np.ones((2, 5), np.float32)), None,
     grpc.StatusCode.INVALID_ARGUMENT, "grads must have shape [n, 4], got [2, 5]"),
    ("wrong dtype", dict(grads=np.ones((2, 4), np.float64)), None,
     grpc.StatusCode.INVALID_ARGUMENT,
     "grads dtype float64 does not match the table dtype float32"),
    ("length mismatch", dict(grads=np.ones((3, 4), np.float32)), None,
     grpc.StatusCode.INVALID_ARGUMENT, "grads has 3 rows but ids has 2"),
    ("NaN gradient", dict(grads=np.array([[0, 0, 0, 0], [0, np.nan, 0, 0]], np.float32)), None,
     grpc.StatusCode.INVALID_ARGUMENT, "grads row 1 column 1 is nan; NaN/Inf are rejected"),
    ("Inf gradient", dict(grads=np.array([[np.inf, 0, 0, 0], [0] * 4], np.float32)), None,
     grpc.StatusCode.INVALID_ARGUMENT, "grads row 0 column 0 is inf"),
    ("closed step", dict(step=0), None, grpc.StatusCode.FAILED_PRECONDITION,
     "step 0 is already closed (the shard has applied 1 steps); push step 1"),
    ("future step", dict(step=5), None, grpc.StatusCode.FAILED_PRECONDITION,
     "step 5 is ahead of the open step 1"),
    ("worker out of range", dict(worker=3), None, grpc.StatusCode.INVALID_ARGUMENT,
     "worker 3 is out of range; the table has num_workers=1"),
    ("2-D ids", dict(), lambda r: r.ids.CopyFrom(wire.encode(np.zeros((1, 2), np.int64))),
     grpc.StatusCode.INVALID_ARGUMENT, "ids must be 1-D, got shape [1, 2]"),
    ("float ids", dict(), lambda r: r.ids.CopyFrom(wire.encode(np.zeros(2, np.float32))),
     grpc.StatusCode.INVALID_ARGUMENT, "ids must be int32 or int64, got float32"),
    ("truncated tensor bytes", dict(), lambda r: setattr(r.grads, "content", b"\0" * 12),
     grpc.StatusCode.INVALID_ARGUMENT, "grads: shape [2, 4] of float32 needs 32 bytes, got 12"),
    ("negative learning rate", dict(learning_rate=-1.0), None, grpc.StatusCode.INVALID_ARGUMENT,
     "learning_rate -1.0 must be finite and >= 0"),
    ("bad chunk index", dict(chunk_index=2, chunk_count=2), None,
     grpc.StatusCode.INVALID_ARGUMENT, "chunk_index 2 is outside [0, chunk_count=2)"),
]


@pytest.mark.parametrize("case", BAD_PUSHES, ids=[c[0] for c in BAD_PUSHES])
def test_bad_push_is_rejected_and_changes_nothing(table, snapshot, case):
    _, kwargs, mutate, code, pattern = case
    before = snapshot(table.name)
    request = _push(table, **kwargs)
    if mutate:
        mutate(request)
    _expect(table, "Push", request, code, pattern)
    snapshot(table.name).assert_equal(before)
    table.push([0, 2], np.ones((2, 4)), step=1)  # the table still takes a good push


def test_bad_pull_is_rejected(table, snapshot):
    before = snapshot(table.name)
    request = ps_pb2.PullRequest(table=table.name, shard_index=1)
    wire.encode(np.array([1, 200], np.int64), request.ids)
    stub = table.shards[1].stub()
    with pytest.raises(grpc.RpcError) as info:
        stub.Pull(request, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "id 200 (position 1) is outside the vocabulary [0, 100)" in info.value.details()
    snapshot(table.name).assert_equal(before)


def test_client_rejects_out_of_range_ids_before_sending(table):
    with pytest.raises(ValueError, match=r"has 100 rows: id 100 is out of range \[0, 100\)"):
        table.pull([1, 100])


def test_recreate_with_different_shape_changes_nothing(client, table, snapshot):
    before = snapshot(table.name)
    with pytest.raises(ServerError, match="dim 4 != 16") as info:
        client.create_table(TableSpec(**{**table.spec.__dict__, "dim": 16}))
    assert info.value.code == grpc.StatusCode.ALREADY_EXISTS
    snapshot(table.name).assert_equal(before)


def test_bad_table_spec_on_the_wire_is_invalid_argument(table):
    spec = table.spec.to_proto()
    spec.dim = -3
    _expect(table, "CreateTable", ps_pb2.CreateTableRequest(spec=spec, shard_index=0),
            grpc.StatusCode.INVALID_ARGUMENT, "dim must be a positive int, got -3")
    spec = table.spec.to_proto()
    _expect(table, "CreateTable", ps_pb2.CreateTableRequest(spec=spec, shard_index=7),
            grpc.StatusCode.INVALID_ARGUMENT, "shard_index 7 is out of range [0, 2)")


def test_oversized_request_is_resource_exhausted(table, snapshot):
    before = snapshot(table.name)
    rows = 700_000  # 5.6 MB of ids + 11.2 MB of grads: over the servers' 8 MiB limit
    request = _push(table, ids=np.zeros(rows, np.int64), grads=np.zeros((rows, 4), np.float32))
    assert request.ByteSize() > 8 * 2**20
    _expect(table, "Push", request, grpc.StatusCode.RESOURCE_EXHAUSTED, "")
    snapshot(table.name).assert_equal(before)


def test_push_with_duplicate_ids_in_init_rows_is_rejected(table, snapshot):
    before = snapshot(table.name)
    stub = table.shards[0].stub()

    def chunks():
        for ids in ([0, 2], [2]):
            msg = ps_pb2.InitRowsChunk(table=table.name, shard_index=0, last=ids == [2])
            wire.encode(np.array(ids, np.int64), msg.ids)
            wire.encode(np.ones((len(ids), 4), np.float32), msg.values)
            yield msg
    with pytest.raises(grpc.RpcError) as info:
        stub.InitRows(chunks(), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sets id 2 more than once" in info.value.details()
    snapshot(table.name).assert_equal(before)


def _saved(client, data_dir, table, path):
    """The table's directory in the new checkpoint."""
    return Path(client.save(path, [table.name])[0].file).parent


def _reseal(table_dir):
    """Seal a checkpoint edited on purpose, so that only the edit itself is wrong."""
    from parallax_ps import versions
    versions.write_manifest(table_dir.parent, table_dir.parent.name)


def test_truncated_checkpoint_is_data_loss_and_changes_nothing(client, data_dir, table, snapshot):
    ckpt = _saved(client, data_dir, table, f"ckpt-trunc-{table.name}")
    part = ckpt / "shard-00001-of-00002.npz"
    part.write_bytes(part.read_bytes()[:-100])
    table.push([0], np.ones((1, 4)), step=1)
    before = snapshot(table.name)
    with pytest.raises(ServerError, match=r"DATA_LOSS: checkpoint file .*shard-00001-of-00002"
                                          r"\.npz is corrupt or truncated"):
        client.restore(f"ckpt-trunc-{table.name}", [table.name])
    snapshot(table.name).assert_equal(before)


def test_corrupt_checkpoint_is_data_loss(client, data_dir, table, snapshot):
    ckpt = _saved(client, data_dir, table, f"ckpt-corrupt-{table.name}")
    part = ckpt / "shard-00000-of-00002.npz"
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF
    part.write_bytes(bytes(data))
    before = snapshot(table.name)
    with pytest.raises(ServerError, match="DATA_LOSS.*corrupt or truncated"):
        client.restore(f"ckpt-corrupt-{table.name}", [table.name])
    snapshot(table.name).assert_equal(before)


def test_incomplete_or_mismatched_checkpoint(client, data_dir, table, snapshot, table_name):
    ckpt = _saved(client, data_dir, table, f"ckpt-missing-{table.name}")
    (ckpt / "shard-00001-of-00002.json").unlink()
    before = snapshot(table.name)
    with pytest.raises(ServerError, match=r"DATA_LOSS.*shard-00001-of-00002\.json is missing"):
        client.restore(f"ckpt-missing-{table.name}", [table.name])
    snapshot(table.name).assert_equal(before)
    ckpt = _saved(client, data_dir, table, f"ckpt-dim-{table.name}")
    for manifest in ckpt.glob("*.json"):
        data = json.loads(manifest.read_text())
        manifest.write_text(json.dumps({**data, "dim": 8}))
    _reseal(ckpt)
    with pytest.raises(ServerError, match="FAILED_PRECONDITION.*dim: checkpoint 8, table 4"):
        client.restore(f"ckpt-dim-{table.name}", [table.name])
    with pytest.raises(ServerError, match="NOT_FOUND: no checkpoint under"):
        client.restore("does-not-exist", [table.name])
    with pytest.raises(ServerError, match="leaves the server's data directory"):
        client.save("../../escape", [table.name])
    shutil.rmtree(ckpt)
    snapshot(table.name).assert_equal(before)


def test_checkpoint_with_a_malformed_slot_changes_nothing(client, data_dir, table, snapshot):
    import hashlib
    ckpt = _saved(client, data_dir, table, f"ckpt-slot-{table.name}")
    part = ckpt / "shard-00000-of-00002.npz"
    arrays = dict(np.load(part))
    arrays["slot_velocity"] = arrays["slot_velocity"][:, :3].copy()
    np.savez(part, **arrays)
    manifest = ckpt / "shard-00000-of-00002.json"
    meta = json.loads(manifest.read_text())
    meta.update(bytes=part.stat().st_size, sha256=hashlib.sha256(part.read_bytes()).hexdigest())
    manifest.write_text(json.dumps(meta))
    _reseal(ckpt)
    before = snapshot(table.name)
    with pytest.raises(ServerError, match=r"DATA_LOSS.*slot_velocity is float32\[50, 3\], "
                                          r"expected float32\[50, 4\]"):
        client.restore(f"ckpt-slot-{table.name}", [table.name])
    snapshot(table.name).assert_equal(before)


def test_hashed_checkpoint_over_the_row_limit_is_refused(client, table_name, snapshot):
    spec = TableSpec(name=table_name, hashed_keys=True, dim=2)
    table = client.create_table(spec)
    table.pull(np.arange(10))
    client.save(f"limit-{table_name}", [table_name])
    client.delete_table(table)
    client.create_table(TableSpec(name=table_name, hashed_keys=True, dim=2,
                                  max_rows_per_shard=4))
    before = snapshot(table_name)
    with pytest.raises(ServerError, match="puts 10 rows on shard 0, above max_rows_per_shard=4"):
        client.restore(f"limit-{table_name}", [table_name])
    snapshot(table_name).assert_equal(before)


def test_unknown_table_on_a_server_with_many_tables_stays_not_found():
    """NOT_FOUND names some of the tables a server holds, not all: gRPC turns status details
    over 8 KB into RESOURCE_EXHAUSTED, which once hid the real error on a busy server."""
    from parallax.client import PSClient
    from parallax.client.local_cluster import LocalCluster
    with LocalCluster(1) as cluster, PSClient(cluster.addresses) as client:
        for i in range(200):
            client.create_table(TableSpec(name=f"{'a-long-table-name-' * 3}{i:04d}",
                                          vocabulary_size=4, dim=1))
        missing = client.table(TableSpec(name="missing", vocabulary_size=4, dim=1))
        with pytest.raises(ServerError) as info:
            missing.pull([1])
    assert info.value.code == grpc.StatusCode.NOT_FOUND
    assert "and 192 more" in str(info.value) and len(str(info.value)) < 2000


def test_server_answers_malformed_push_bytes_with_invalid_argument(cluster):
    with grpc.insecure_channel(cluster.addresses[0]) as channel:
        push = channel.unary_unary("/parallax.ps.v1.ParameterServer/Push")
        with pytest.raises(grpc.RpcError) as info:
            push(b"\x0a\x01t\x2a\x05\x08\x05\x1a\x10", timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed PushRequest" in info.value.details()
