"""A checkpoint is never rewritten in place: a refused, torn or failed save leaves the previous
one restorable, and a restore refuses anything inconsistent (issue 13, defect 1).

Real server processes on loopback; the disk-full case runs a server whose data directory is a
small tmpfs (real ENOSPC), or, where mounting is not allowed, under a file-size rlimit (EFBIG).
"""
from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import pytest

from parallax import bulk_codec
from parallax.client import ClientOptions, PSClient
from parallax.errors import ConfigError, ServerError
from parallax.local_cluster import SERVER_COMMAND, LocalCluster
from parallax.specs import Adagrad, Initializer, TableSpec


def _sync_spec(name: str) -> TableSpec:
    return TableSpec(name=name, vocabulary_size=50, dim=3, shard_count=2, num_workers=2,
                     optimizer=Adagrad(0.1), initializer=Initializer("uniform", seed=3))


def _full_step(table, step: int) -> None:
    """Both workers push `step` to every shard."""
    for worker in (0, 1):
        table.push([1, 2, 3, 4], np.full((4, 3), step + 1.0), step=step, worker=worker)


def _half_step(table, step: int) -> None:
    """Worker 0 pushes `step` everywhere, worker 1 only to shard 0: shard 0 closes the step,
    shard 1 does not (the shards are then at different steps)."""
    table.push([1, 2, 3, 4], np.ones((4, 3)), step=step, worker=0)
    data = bulk_codec.encode_push_request(table.name, 0, step, 1, np.array([2]),
                                          np.ones((1, 3), np.float32))
    table.shards[0].stub().Push(data, timeout=10)


def _steps(shards) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for shard in sorted(shards, key=lambda s: (s.table, s.shard_index)):
        out.setdefault(shard.table, []).append(shard.step)
    return out


def test_refused_save_leaves_the_previous_checkpoint_restorable(client, table_name):
    table = client.create_table(_sync_spec(table_name))
    _full_step(table, 0)
    path = f"refused-{table_name}"
    client.save(path, [table_name])
    saved = table.pull_all()
    _half_step(table, 1)
    with pytest.raises(ConfigError, match=r"caught sync tables mid-step"):
        client.save(path, [table_name])
    client.delete_table(table)  # as after a crash: a fresh table, restored
    table = client.create_table(_sync_spec(table_name))
    restored = client.restore(path, [table_name])
    assert _steps(restored) == {table_name: [1, 1]}
    np.testing.assert_array_equal(table.pull_all(), saved)


def test_torn_save_is_refused_by_a_client_without_table_handles(cluster, client, table_name):
    table = client.create_table(_sync_spec(table_name))
    _full_step(table, 0)
    _half_step(table, 1)
    with PSClient(cluster.addresses, ClientOptions(timeout=20)) as fresh:  # never called table()
        with pytest.raises(ConfigError, match=rf"'{table_name}': \[1, 2\]"):
            fresh.save(f"torn-{table_name}", [table_name])
        with pytest.raises(ServerError, match="NOT_FOUND: no checkpoint"):
            fresh.restore(f"torn-{table_name}", [table_name])


def test_an_edited_manifest_is_refused(client, data_dir, table_name, snapshot):
    table = client.create_table(_sync_spec(table_name))
    _full_step(table, 0)
    path = f"edited-{table_name}"
    client.save(path, [table_name])
    edited = 0
    for manifest in (data_dir / path).rglob("*.json"):
        text = manifest.read_text()
        if '"step"' in text:
            manifest.write_text(text.replace('"step": 1', '"step": 999'))
            edited += 1
    assert edited
    before = snapshot(table_name)
    with pytest.raises(ServerError, match=r"DATA_LOSS: .*checksum"):
        client.restore(path, [table_name])
    snapshot(table_name).assert_equal(before)


def test_a_missing_file_is_refused_by_name(client, data_dir, table_name, snapshot):
    table = client.create_table(_sync_spec(table_name))
    _full_step(table, 0)
    path = f"missing-{table_name}"
    shards = client.save(path, [table_name])
    victim = sorted(shards, key=lambda s: s.shard_index)[1].file
    os.unlink(victim)
    before = snapshot(table_name)
    with pytest.raises(ServerError, match=rf"DATA_LOSS: .*{os.path.basename(victim)}.* missing"):
        client.restore(path, [table_name])
    snapshot(table_name).assert_equal(before)


def test_only_the_newest_k_checkpoints_are_kept(client, data_dir, table_name):
    table = client.create_table(_sync_spec(table_name))
    path = f"keep-{table_name}"
    for step in range(5):
        _full_step(table, step)
        client.save(path, [table_name], keep=3)
    kept = sorted(p.name for p in (data_dir / path).iterdir())
    assert len(kept) == 3 and all(name.startswith("ckpt-") for name in kept), kept
    newest = table.pull_all()
    _full_step(table, 5)
    assert _steps(client.restore(path, [table_name])) == {table_name: [5, 5]}
    np.testing.assert_array_equal(table.pull_all(), newest)
    oldest = client.restore(f"{path}/{kept[0]}", [table_name])  # an older one, by name
    assert _steps(oldest) == {table_name: [3, 3]}


# ---- a full disk --------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """(data directory, server command): a 2 MiB tmpfs where mounting is allowed (ENOSPC),
    else a plain directory and a 2 MiB file-size limit on the server (EFBIG)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)],
                             capture_output=True).returncode == 0
    command = SERVER_COMMAND if mounted else ("prlimit", f"--fsize={2 << 20}", *SERVER_COMMAND)
    yield mount, command
    if mounted:
        assert subprocess.run(["umount", str(mount)]).returncode == 0


def test_a_full_disk_fails_the_save_and_keeps_the_previous_one(small_disk, table_name):
    data, command = small_disk
    small = TableSpec(name=f"{table_name}_a", vocabulary_size=20, dim=2, shard_count=1)
    large = TableSpec(name=f"{table_name}_b", hashed_keys=True, dim=64, shard_count=1,
                      optimizer=Adagrad(0.1))
    with LocalCluster(1, data_dir=data, command=command) as cluster:
        with PSClient(cluster.addresses, ClientOptions(timeout=30)) as client:
            a, b = client.create_table(small), client.create_table(large)
            a.push([1], np.ones((1, 2)), step=0)
            b.push(np.arange(100), np.ones((100, 64)), step=0)
            client.save("ckpt")
            saved = a.pull_all(), b.pull(np.arange(100))
            a.push([1], np.ones((1, 2)), step=1)
            b.push(np.arange(20_000), np.ones((20_000, 64)), step=1)  # ~10 MiB with slots
            with pytest.raises(ServerError, match=r"RESOURCE_EXHAUSTED: .*checkpoint"):
                client.save("ckpt")
            restored = client.restore("ckpt")
            assert {s.table: s.step for s in restored} == {small.name: 1, large.name: 1}
            np.testing.assert_array_equal(a.pull_all(), saved[0])
            np.testing.assert_array_equal(b.pull(np.arange(100)), saved[1])
            rows = {t.table: t.rows for t in client.stats()[cluster.addresses[0]].tables}
            assert rows[large.name] == 100
    assert cluster.exit_codes == [0], cluster.exit_codes
    left = sorted(p.name for p in (data / "ckpt").iterdir())
    assert len(left) == 1 and left[0].startswith("ckpt-"), left  # no staging left behind
