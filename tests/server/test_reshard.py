"""Live resharding on real servers: rows, optimizer slots and the step move bit-for-bit into
any shard count and placement; a bad request or a pending push changes nothing."""
from __future__ import annotations

import dataclasses

import grpc
import numpy as np
import pytest

from parallax.client.row_mover import move_rows
from parallax.errors import ConfigError, ServerError
from parallax.protocol import wire
from parallax.protocol.specs import Adam, Initializer, TableSpec
from parallax.ps.v1 import ps_pb2

WORKERS = 2


def _spec(name, **kw) -> TableSpec:
    base = dict(name=name, vocabulary_size=600, dim=4, shard_count=3, num_workers=WORKERS,
                initializer=Initializer(kind="uniform", seed=11),
                optimizer=Adam(learning_rate=0.01))
    return TableSpec(**{**base, **kw})


def _train(table, steps, first_step=0, seed=0):
    """Sync steps from two workers on Zipf-like ids (repeats within and across workers)."""
    rng = np.random.default_rng(seed + first_step)
    for step in range(first_step, first_step + steps):
        for worker in range(WORKERS):
            ids = np.minimum(rng.zipf(1.3, 50), table.spec.vocabulary_size or 10**6) - 1
            if table.spec.hashed_keys:
                ids = ids * 7919 + 3
            grads = rng.standard_normal((len(ids), table.spec.dim)).astype(np.float32)
            table.push(ids, grads, step=step, worker=worker)
        table.wait_step(step + 1)


def _same_rows(a, b) -> None:
    """Two snapshots hold the same rows, slots and step (any shard counts)."""
    assert set(a.step.values()) == set(b.step.values())
    assert a.arrays.keys() == b.arrays.keys()
    for key, value in a.arrays.items():
        np.testing.assert_array_equal(value, b.arrays[key], err_msg=key)


@pytest.mark.parametrize("shards,placement", [(1, [1]), (5, [1, 0, 1, 0, 0]), (3, [1, 1, 0])])
def test_rows_slots_and_step_move_bit_for_bit(client, table_name, snapshot, shards, placement):
    source = client.create_table(_spec(table_name))
    _train(source, 4)
    target, report = client.reshard(source, table_name + ".r1", shards, placement)
    assert report.step == 4 and target.wait_step(0) == 4
    assert 0 < report.rows < 600  # only touched rows travel; the rest is the initializer's
    assert [c.address for c in target.shards] == [client.addresses[p] for p in placement]
    # (a snapshot initialises every row: on the target, untouched rows come from the seed)
    _same_rows(snapshot(table_name), snapshot(target.name))
    # Training goes on identically in both layouts.
    _train(source, 3, first_step=4, seed=1)
    _train(target, 3, first_step=4, seed=1)
    _same_rows(snapshot(table_name), snapshot(target.name))


def test_hashed_keys_move_in_small_pages(client, table_name, snapshot):
    spec = _spec(table_name, vocabulary_size=0, hashed_keys=True, shard_count=2)
    source = client.create_table(spec)
    _train(source, 3)
    target = client.create_table(dataclasses.replace(spec, name=table_name + ".r",
                                                     shard_count=3))
    report = move_rows(source, target, page_rows=7)  # many pages per shard
    held = sum(t.rows for r in client.stats([target.name]).values() for t in r.tables)
    assert report.rows == held > 7
    _same_rows(snapshot(table_name), snapshot(target.name))
    assert target.wait_step(0) == 3


def test_a_pending_push_refuses_the_move_and_changes_nothing(client, table_name, snapshot):
    source = client.create_table(_spec(table_name))
    _train(source, 2)
    source.push([1, 2], np.ones((2, 4), np.float32), step=2, worker=0)  # half a step
    with pytest.raises(ServerError, match="restore between steps|pushed part of step") as info:
        client.reshard(source, table_name + ".r1", 2)
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert not client.stats([table_name + ".r1"]) or all(
        not r.tables for r in client.stats([table_name + ".r1"]).values())
    source.push([3], np.ones((1, 4), np.float32), step=2, worker=1)
    assert source.wait_step(3) == 3  # the step closes as if nothing had happened


def _import(conn, name, shard, ids, values, slots, names=("momentum", "velocity"), step=0):
    request = ps_pb2.ShardRows(table=name, shard_index=shard, step=step, slot_names=list(names))
    wire.encode(np.asarray(ids, np.int64), request.ids)
    wire.encode(np.asarray(values, np.float32), request.values)
    for slot in slots:
        wire.encode(np.asarray(slot, np.float32), request.slots.add())
    return conn.call("ImportRows", request, name)


@pytest.mark.parametrize("case,match", [
    ("wrong_shard", "belongs to shard"),
    ("slot_names", "optimizer keeps"),
    ("slot_shape", "must have shape"),
    ("duplicate", "repeat an id"),
    ("missing_slot", "slot tensors"),
])
def test_bad_import_pages_are_refused_and_change_nothing(client, table_name, snapshot, case,
                                                         match):
    table = client.create_table(_spec(table_name))
    _train(table, 1)
    before = snapshot(table_name)
    ones = np.ones((2, 4))
    args = {"wrong_shard": ([3, 1], ones, [ones, ones]),
            "slot_names": ([3, 6], ones, [ones, ones], ("momentum", "accumulator")),
            "slot_shape": ([3, 6], ones, [ones, np.ones((2, 3))]),
            "duplicate": ([3, 3], ones, [ones, ones]),
            "missing_slot": ([3, 6], ones, [ones])}[case]
    with pytest.raises(ServerError, match=match) as info:
        _import(table.shards[0], table_name, 0, *args, step=9)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    snapshot(table_name).assert_equal(before)


def test_tables_must_match_in_everything_but_layout(client, table_name):
    source = client.create_table(_spec(table_name))
    target = client.create_table(_spec(table_name + ".x", dim=8))
    with pytest.raises(ConfigError, match="dim 4 != 8"):
        move_rows(source, target)
