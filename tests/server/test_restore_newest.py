"""A server started with --restore-newest (a replacement for a lost one, `parallax run
--replay-mb`): each shard created on it starts from the newest complete checkpoint of its
table in its data directory, at that checkpoint's step, as a Restore of it would, and its
CreateTable answer names that checkpoint (restored_from); a table with no checkpoint there
is created fresh at step 0 with restored_from empty, as without the flag (a worker refuses
itself to replay onto it); a shard that exists is untouched.

Real server processes on loopback, killed with SIGKILL and replaced on the same data
directory.
"""
from __future__ import annotations

import os
import shutil
import signal

import numpy as np
import pytest

from conftest import Snapshot
from parallax.client import ClientOptions, PSClient
from parallax.client.local_cluster import LocalCluster
from parallax.protocol.specs import Adam, Initializer, TableSpec
from parallax.ps.v1 import ps_pb2

OPTIONS = ClientOptions(timeout=20, retries=2, backoff=0.05)
SHARDS = 2


def _spec(name: str) -> TableSpec:
    return TableSpec(name=name, vocabulary_size=200, dim=4, shard_count=SHARDS,
                     optimizer=Adam(0.05), initializer=Initializer("normal", seed=5))


def _train(table, first: int, last: int) -> None:
    """Steps first..last-1 of one worker, every step touching different rows."""
    for step in range(first, last):
        rng = np.random.default_rng(step)
        ids = np.unique(rng.integers(0, 200, size=50))
        table.push(ids, rng.normal(size=(len(ids), 4)), step=step)


def _kill(cluster: LocalCluster) -> None:
    victim = cluster.servers[0].proc
    os.kill(victim.pid, signal.SIGKILL)
    assert victim.wait(10) == -signal.SIGKILL


def _create(client: PSClient, spec: TableSpec) -> list[ps_pb2.CreateTableResponse]:
    """Each shard's own CreateTable answer (PSClient.create_table keeps none of them)."""
    table = client.table(spec)
    return [conn.stub().CreateTable(ps_pb2.CreateTableRequest(spec=spec.to_proto(),
                                                              shard_index=i), timeout=30)
            for i, conn in enumerate(table.shards)]


@pytest.fixture
def replacement(tmp_path):
    """`start()`: a server with --restore-newest on `tmp_path`, and a client of it."""
    opened = []

    def start():
        cluster = LocalCluster(1, data_dir=tmp_path, extra_args=["--restore-newest"]).start()
        client = PSClient(cluster.addresses, OPTIONS)
        opened.append((cluster, client))
        return client
    yield start
    for cluster, client in opened:
        client.close()
        cluster.stop()


def _dynamic(name: str) -> TableSpec:
    """A keyed table whose rows are admitted and evicted: per-row use history, counters and
    an admission sketch are saved with it."""
    return TableSpec(name=name, hashed_keys=True, dim=4, shard_count=SHARDS,
                     optimizer=Adam(0.05), initializer=Initializer("normal", seed=5),
                     max_rows_per_shard=40, eviction="lru", admit_after=2)


@pytest.mark.parametrize("make", [_spec, _dynamic], ids=["fixed", "dynamic"])
def test_a_replacement_starts_each_shard_at_the_checkpoint(tmp_path, replacement, make):
    spec = make("kept")
    with LocalCluster(1, data_dir=tmp_path) as cluster, \
            PSClient(cluster.addresses, OPTIONS) as client:
        table = client.create_table(spec)
        _train(table, 0, 3)
        saved = Snapshot(client, tmp_path, spec.name)  # a checkpoint at step 3
        _train(table, 3, 6)  # lost with the server
        _kill(cluster)
    client = replacement()
    answers = _create(client, spec)
    assert [(a.created, a.step, a.restored_from) for a in answers] == \
        [(True, 3, saved.checkpoint)] * SHARDS
    assert saved.checkpoint.startswith("ckpt-")
    restored = Snapshot(client, tmp_path, spec.name)
    restored.assert_equal(saved)  # rows, slots, step, a dynamic table's row state
    assert spec.dynamic == ("dyn_uses" in restored.arrays)
    _train(client.table(spec), 3, 4)  # training goes on at the checkpoint's step


def test_the_newest_complete_checkpoint_is_chosen_whatever_its_path(tmp_path, replacement):
    spec = _spec("newer")
    with LocalCluster(1, data_dir=tmp_path) as cluster, \
            PSClient(cluster.addresses, OPTIONS) as client:
        table = client.create_table(spec)
        _train(table, 0, 2)
        client.save("z-older", [spec.name])
        _train(table, 2, 4)
        newer = Snapshot(client, tmp_path, spec.name)  # at step 4, under path snap-...
        _train(table, 4, 5)
        client.save("a/nested", [spec.name])
        unfinished = next((tmp_path / "a" / "nested").glob("ckpt-*"))
        (unfinished / "COMPLETE").unlink()  # committed by some servers only: never chosen
        _kill(cluster)
    client = replacement()
    assert {(a.step, a.restored_from) for a in _create(client, spec)} == {(4, newer.checkpoint)}
    Snapshot(client, tmp_path, spec.name).assert_equal(newer)


def test_a_table_without_a_checkpoint_is_created_fresh(tmp_path, replacement):
    """A table first created after the server was started again (a reshard target, say):
    created as without the flag, at step 0, restored from nothing."""
    with LocalCluster(1, data_dir=tmp_path) as cluster, \
            PSClient(cluster.addresses, OPTIONS) as client:
        saved = client.save("other", [client.create_table(_spec("saved")).spec.name])
        _kill(cluster)
    client = replacement()
    fresh = _spec("never_saved")
    assert [(a.created, a.step, a.restored_from) for a in _create(client, fresh)] == \
        [(True, 0, "")] * SHARDS
    table = client.table(fresh)
    _train(table, 0, 2)  # trains as any new table does
    assert [(a.created, a.step, a.restored_from) for a in _create(client, fresh)] == \
        [(False, 2, "")] * SHARDS
    assert {(a.step, a.restored_from) for a in _create(client, _spec("saved"))} == \
        {(0, saved[0].checkpoint)}  # its table restores


def test_an_empty_data_directory_creates_fresh_too(tmp_path, replacement):
    shutil.rmtree(tmp_path)
    client = replacement()
    assert [(a.created, a.step, a.restored_from) for a in _create(client, _spec("nothing"))] \
        == [(True, 0, "")] * SHARDS


def test_an_existing_shard_is_left_as_it_is(tmp_path, replacement):
    spec = _spec("existing")
    with LocalCluster(1, data_dir=tmp_path) as cluster, \
            PSClient(cluster.addresses, OPTIONS) as client:
        _train(client.create_table(spec), 0, 2)
        client.save("p", [spec.name])
        _kill(cluster)
    client = replacement()
    first = _create(client, spec)
    assert {(a.step, bool(a.restored_from)) for a in first} == {(2, True)}
    table = client.table(spec)
    _train(table, 2, 4)  # (the replayed pushes)
    rows = table.pull_all()
    answers = _create(client, spec)  # (another worker's: told what the shard came from too)
    assert [(a.created, a.step, a.restored_from) for a in answers] == \
        [(False, 4, a.restored_from) for a in first]
    np.testing.assert_array_equal(table.pull_all(), rows)


def test_without_the_flag_a_created_shard_answers_step_0(tmp_path):
    with LocalCluster(1, data_dir=tmp_path) as cluster, \
            PSClient(cluster.addresses, OPTIONS) as client:
        spec = _spec("plain")
        _train(client.create_table(spec), 0, 2)
        client.save("p", [spec.name])
        client.delete_table(client.table(spec))
        assert [(a.created, a.step, a.restored_from) for a in _create(client, spec)] == \
            [(True, 0, "")] * SHARDS


def test_the_flag_needs_a_data_directory():
    from parallax_ps.server import parse_args
    with pytest.raises(SystemExit):
        parse_args(["--restore-newest"])
    assert parse_args(["--restore-newest", "--data-dir", "/tmp/d"]).restore_newest


def test_a_server_started_again_answers_at_its_address_with_its_shards(tmp_path):
    """LocalCluster.replace, as `parallax run --replay-mb` uses it: same flags, same port."""
    from parallax.errors import ParallaxError
    spec = _spec("again")
    with LocalCluster(2, data_dir=tmp_path) as cluster:
        addresses = cluster.addresses
        with PSClient(addresses, OPTIONS) as client:
            table = client.create_table(spec)  # a shard on each server
            _train(table, 0, 3)
            saved = Snapshot(client, tmp_path, spec.name)
            _train(table, 3, 5)
        for _ in range(2):  # (the replacement's death: the same again)
            victim = cluster.servers[1].proc
            os.kill(victim.pid, signal.SIGKILL)
            victim.wait(10)
            cluster.replace(1, ["--restore-newest"])
            assert cluster.addresses == addresses
        with PSClient(addresses, OPTIONS) as client:
            assert [(a.created, a.step, a.restored_from) for a in _create(client, spec)] == \
                [(False, 5, ""), (True, 3, saved.checkpoint)]
            rows = client.table(spec).pull_all()  # (partition "mod": odd ids on shard 1)
            np.testing.assert_array_equal(rows[1::2], saved.arrays["values"][1::2])
            assert not np.array_equal(rows[0::2], saved.arrays["values"][0::2])  # lived on
        os.kill(cluster.servers[0].proc.pid, signal.SIGKILL)
        cluster.servers[0].proc.wait(10)
        with pytest.raises(ParallaxError, match="exited with code 2 before it was ready; its "
                                                "output:(.|\n)*--no-such-flag"):
            cluster.replace(0, ["--no-such-flag"])
        assert cluster.servers[0].address == addresses[0]


# --restore-newest-on-restart INSTANCE (`parallax k8s --replay-mb`: the pod's uid): a
# container restarted in its pod restores; a first start never does, whatever is on disk.

def _on_restart(tmp_path, instance: str) -> LocalCluster:
    return LocalCluster(1, data_dir=tmp_path,
                        extra_args=["--restore-newest-on-restart", instance]).start()


def _restart(cluster: LocalCluster) -> PSClient:
    """The same command again on the same port and data dir (a container's restart)."""
    _kill(cluster)
    cluster.replace(0)
    return PSClient(cluster.addresses, OPTIONS)


def test_a_first_start_creates_fresh_and_its_restart_restores_newest(tmp_path):
    spec = _spec("pod")
    with LocalCluster(1, data_dir=tmp_path) as cluster, \
            PSClient(cluster.addresses, OPTIONS) as client:
        _train(client.create_table(spec), 0, 2)
        earlier = Snapshot(client, tmp_path, spec.name)  # an earlier run's, same table name
    with _on_restart(tmp_path, "pod-uid-1") as cluster:
        with PSClient(cluster.addresses, OPTIONS) as client:
            assert [(a.created, a.step, a.restored_from) for a in _create(client, spec)] \
                == [(True, 0, "")] * SHARDS  # the earlier run's checkpoint is not taken
            _train(client.table(spec), 0, 3)
        with _restart(cluster) as client:  # before this instance saved: nothing of its own
            assert {(a.step, a.restored_from) for a in _create(client, spec)} == {(0, "")}
            _train(client.table(spec), 0, 3)
            saved = Snapshot(client, tmp_path, spec.name)
            _train(client.table(spec), 3, 5)
        with _restart(cluster) as client:
            assert [(a.created, a.step, a.restored_from) for a in _create(client, spec)] \
                == [(True, 3, saved.checkpoint)] * SHARDS
            Snapshot(client, tmp_path, spec.name).assert_equal(saved)
    assert saved.checkpoint != earlier.checkpoint


def test_another_instance_on_the_same_data_dir_is_a_first_start(tmp_path):
    """A pod recreated on a kept volume (a new uid): fresh, and its own restarts skip what
    the one before saved."""
    spec = _spec("moved")
    with _on_restart(tmp_path, "pod-uid-1") as cluster, \
            PSClient(cluster.addresses, OPTIONS) as client:
        _train(client.create_table(spec), 0, 2)
        Snapshot(client, tmp_path, spec.name)
    with _on_restart(tmp_path, "pod-uid-2") as cluster:
        with PSClient(cluster.addresses, OPTIONS) as client:
            assert {(a.step, a.restored_from) for a in _create(client, spec)} == {(0, "")}
        with _restart(cluster) as client:
            assert {(a.step, a.restored_from) for a in _create(client, spec)} == {(0, "")}
    markers = sorted(p.name for p in tmp_path.glob(".instance-*.json"))
    assert len(markers) == 2  # one per instance


def test_a_damaged_marker_is_a_first_start(tmp_path):
    from parallax_ps.instance import marker_path
    spec = _spec("damaged")
    with _on_restart(tmp_path, "pod-uid-1") as cluster:
        with PSClient(cluster.addresses, OPTIONS) as client:
            _train(client.create_table(spec), 0, 2)
            Snapshot(client, tmp_path, spec.name)
        marker_path(tmp_path, "pod-uid-1").write_text("{not json")
        with _restart(cluster) as client:
            assert {(a.step, a.restored_from) for a in _create(client, spec)} == {(0, "")}


def test_the_restart_flag_needs_an_instance_and_a_data_directory():
    from parallax_ps.server import parse_args
    for argv in (["--restore-newest-on-restart", "pod"],
                 ["--restore-newest-on-restart", " ", "--data-dir", "/tmp/d"],
                 ["--restore-newest-on-restart", "pod", "--restore-newest",
                  "--data-dir", "/tmp/d"]):
        with pytest.raises(SystemExit):
            parse_args(argv)
    config = parse_args(["--restore-newest-on-restart", "pod", "--data-dir", "/tmp/d"])
    assert (config.restore_newest_on_restart, config.restore_newest) == ("pod", False)
