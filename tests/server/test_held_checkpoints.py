"""Held checkpoints (`PSClient.save(held=True)`): marks in the servers' memory, copy on write,
rolled back to bit for bit, on the session's two real server processes."""
from __future__ import annotations

import numpy as np
import pytest

from parallax.errors import ServerError
from parallax.protocol.specs import Adagrad, Adam, Initializer, TableSpec


def _spec(name: str, **extra) -> TableSpec:
    return TableSpec(**{"name": name, "vocabulary_size": 2000, "dim": 4, "shard_count": 3,
                        "optimizer": Adam(0.05), "initializer": Initializer("normal", seed=2),
                        **extra})


def _steps(table, start: int, count: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for step in range(start, start + count):
        ids = rng.integers(0, 2000, size=400)
        table.push(ids, rng.normal(size=(400, 4)), step=step)


def test_rolling_back_to_a_held_checkpoint_gives_its_rows_slots_and_step(
        client, snapshot, table_name):
    table = client.create_table(_spec(table_name))
    _steps(table, 0, 3, seed=1)
    first = client.save("held", [table_name], held=True)[0].checkpoint
    at_first = snapshot(table_name)
    _steps(table, 3, 2, seed=2)
    second = client.save("held", [table_name], held=True)[0].checkpoint
    at_second = snapshot(table_name)
    _steps(table, 5, 2, seed=3)
    table.assign([7, 8], np.full((2, 4), 3.0))  # an assign is copied on write too

    shards = client.restore("", [table_name], second, held=True)
    assert {s.step for s in shards} == {5} and len(shards) == 3
    snapshot(table_name).assert_equal(at_second)
    _steps(table, 5, 1, seed=4)  # training goes on from the mark's step
    client.restore("", [table_name], first, held=True)  # past two marks at once
    snapshot(table_name).assert_equal(at_first)
    with pytest.raises(ServerError, match=f"holds no checkpoint '{second}'.*restore one "
                                          f"from disk"):
        client.restore("", [table_name], second, held=True)  # a later mark, now gone
    _steps(table, 3, 2, seed=2)  # the same steps again: the same rows as the first time
    snapshot(table_name).assert_equal(at_second)
    client.restore("", [table_name], first, held=True)  # a mark stays after its restore
    snapshot(table_name).assert_equal(at_first)


def test_keep_bounds_the_held_checkpoints_and_their_copies(client, table_name):
    table = client.create_table(_spec(table_name, optimizer=Adagrad(0.1)))
    names = []
    for round_ in range(3):
        _steps(table, round_ * 2, 2, seed=round_)
        names.append(client.save("held", [table_name], keep=2, held=True)[0].checkpoint)
    with pytest.raises(ServerError, match="holds no checkpoint"):
        client.restore("", [table_name], names[0], held=True)
    assert {s.step for s in client.restore("", [table_name], names[1], held=True)} == {4}


def test_a_held_restore_drops_a_dead_attempts_half_pushed_step(client, snapshot, table_name):
    table = client.create_table(_spec(table_name, num_workers=2))
    for worker in (0, 1):
        table.push([5, 6], np.ones((2, 4)), step=0, worker=worker)
    table.push([1, 2, 3], np.ones((3, 4)), step=1, worker=1)  # ahead of worker 0, which saves
    mark = client.save("held", [table_name], held=True)[0].checkpoint
    at_mark = snapshot(table_name)
    assert set(at_mark.step.values()) == {1}
    table.push([3, 4], np.ones((2, 4)), step=1, worker=0)  # step 1 applied: copied on write
    table.push([4], np.ones((1, 4)), step=2, worker=0)  # then worker 1 died
    client.restore("", [table_name], mark, held=True)
    snapshot(table_name).assert_equal(at_mark)
    for worker in (0, 1):  # the new attempt's step 1, from both workers
        table.push([1, 2], np.ones((2, 4)), step=1, worker=worker)
    assert table.wait_step(2) == 2


def test_held_checkpoints_refuse_keyed_tables(client, table_name):
    keyed = client.create_table(TableSpec(name=table_name, hashed_keys=True, dim=2,
                                          shard_count=2))
    with pytest.raises(ServerError, match="keyed: held checkpoints keep fixed-vocabulary "
                                          "sync tables only"):
        client.save("held", [keyed.name], held=True)
    with pytest.raises(ServerError, match="holds no checkpoint"):  # the refused save held none
        client.restore("", [keyed.name], "ckpt-00000000000000000001-0000abcd", held=True)


def test_dropped_held_checkpoints_stop_copying(client, table_name):
    table = client.create_table(_spec(table_name))
    name = client.save("held", [table_name], held=True)[0].checkpoint
    assert client.holds([table_name], name)
    client.drop_held([table_name], name)
    assert not client.holds([table_name], name)
    assert not client.holds([f"{table_name}_none"], name)  # a table no server holds
    _steps(table, 0, 1, seed=5)
    with pytest.raises(ServerError, match="holds no checkpoint"):
        client.restore("", [table_name], name, held=True)
