"""Checkpoints are indexed by global row id: save with S shards, restore with S' shards."""
from __future__ import annotations

import numpy as np
import pytest

from parallax.protocol.specs import Adam, Ftrl, Initializer, TableSpec


def _train(table, steps=3, seed=0):
    rng = np.random.default_rng(seed)
    for step in range(steps):
        ids = rng.integers(0, 1000, size=300) if not table.spec.hashed_keys else \
            rng.integers(-10**12, 10**12, size=50)
        table.push(ids, rng.normal(size=(len(ids), table.spec.dim)), step=step)


@pytest.mark.parametrize("saved_shards, restored_shards, partition", [
    (2, 3, "mod"), (3, 2, "range"), (1, 4, "mod")])
def test_restore_into_a_different_shard_count(client, snapshot, table_name, saved_shards,
                                              restored_shards, partition):
    base = dict(vocabulary_size=1000, dim=6, partition=partition, optimizer=Adam(0.1),
                initializer=Initializer("normal", seed=4))
    table = client.create_table(TableSpec(name=table_name, shard_count=saved_shards, **base))
    _train(table)
    saved = snapshot(table_name)
    client.save(f"reshard-{table_name}", [table_name])
    client.delete_table(table)
    restored = client.create_table(TableSpec(name=table_name, shard_count=restored_shards,
                                             **base))
    assert not np.array_equal(restored.pull_all(), saved.arrays["values"])  # fresh init
    shards = client.restore(f"reshard-{table_name}", [table_name])
    assert len(shards) == restored_shards and {s.step for s in shards} == {3}
    np.testing.assert_array_equal(restored.pull_all(), saved.arrays["values"])
    after = snapshot(table_name)
    for key in ("ids", "values", "slot_momentum", "slot_velocity"):
        np.testing.assert_array_equal(after.arrays[key], saved.arrays[key], err_msg=key)
    restored.push([1], np.ones((1, 6)), step=3)  # training resumes at the saved step


def test_hashed_keys_table_reshards_too(client, snapshot, table_name):
    spec = dict(name=table_name, hashed_keys=True, dim=3, optimizer=Ftrl(0.1),
                initializer=Initializer("uniform", seed=8))
    table = client.create_table(TableSpec(shard_count=2, **spec))
    _train(table)
    saved = snapshot(table_name)
    client.save(f"hashed-{table_name}", [table_name])
    client.delete_table(table)
    client.create_table(TableSpec(shard_count=3, **spec))
    client.restore(f"hashed-{table_name}", [table_name])
    after = snapshot(table_name)
    for key, value in saved.arrays.items():
        np.testing.assert_array_equal(after.arrays[key], value, err_msg=key)


def test_saving_a_sync_table_mid_step_is_refused(client, table_name):
    from parallax.errors import ConfigError
    spec = TableSpec(name=table_name, vocabulary_size=100, dim=2, shard_count=2, num_workers=2)
    table = client.create_table(spec)
    table.push([0, 1], np.ones((2, 2)), step=0, worker=0)
    from parallax.protocol import bulk_codec
    data = bulk_codec.encode_push_request(table_name, 0, 0, 1, np.array([0]),
                                          np.ones((1, 2), np.float32))
    table.shards[0].stub().Push(data, timeout=10)  # worker 1 reached shard 0 only
    with pytest.raises(ConfigError, match=r"caught sync tables mid-step \(shard steps "
                                          r"\{'" + table_name + r"': \[0, 1\]\}\)"):
        client.save(f"midstep-{table_name}", [table_name])
