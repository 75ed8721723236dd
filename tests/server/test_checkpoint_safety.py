"""A checkpoint is never rewritten in place: a refused, torn or failed save leaves the previous
one restorable, and a restore refuses anything inconsistent (issue 13, defect 1).

Real server processes on loopback; the disk-full case runs a server whose data directory is a
small tmpfs (real ENOSPC), or, where mounting is not allowed, under a file-size rlimit (EFBIG).
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest

from parallax.client import ClientOptions, PSClient
from parallax.client.local_cluster import SERVER_COMMAND, LocalCluster, ServerProcess
from parallax.errors import ConfigError, ServerError
from parallax.protocol import bulk_codec, checkpoint_names
from parallax.protocol.specs import SGD, Adagrad, Initializer, TableSpec
from parallax.ps.v1 import ps_pb2


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


def test_saves_on_a_clock_behind_the_newest_checkpoints_name_sort_after_it(
        cluster, client, table_name, monkeypatch, caplog):
    """A chief moved to a host whose clock is behind the one that named the newest
    checkpoint (names sort by the naming host's clock): every save was refused ("would sort
    before") until its clock caught up, failing the job at each. Now a client that restored
    a checkpoint names its saves after it, and one that saw none saves again, once, under a
    name after the one the refusal names."""
    table = client.create_table(_sync_spec(table_name))
    path = f"skew-{table_name}"
    clock = checkpoint_names.time.time_ns
    monkeypatch.setattr(checkpoint_names.time, "time_ns", lambda: clock() + 3600 * 10**9)
    _full_step(table, 0)
    ahead, = {s.checkpoint for s in client.save(path, [table_name])}  # a host an hour ahead
    monkeypatch.undo()
    options = ClientOptions(timeout=20)
    with PSClient(cluster.addresses, options) as resumed, caplog.at_level("WARNING", "parallax"):
        assert {s.checkpoint for s in resumed.restore(path, [table_name])} == {ahead}
        _full_step(table, 1)
        after_restore, = {s.checkpoint for s in resumed.save(path, [table_name])}
        assert after_restore > ahead and not caplog.records, caplog.text
    with PSClient(cluster.addresses, options) as fresh, caplog.at_level("WARNING", "parallax"):
        _full_step(table, 2)
        refused_once, = {s.checkpoint for s in fresh.save(path, [table_name])}
        assert refused_once > after_restore
        assert [r.getMessage() for r in caplog.records if "newer than this host's clock"
                in r.getMessage()] == [f"checkpoint {path!r}: the servers hold {after_restore}, "
                                       "newer than this host's clock; saving again under a "
                                       "name after it"]
    assert _steps(client.restore(path, [table_name])) == {table_name: [3, 3]}
    assert {s.checkpoint for s in client.restore(path, [table_name])} == {refused_once}


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


# ---- a server or client dying mid-commit, concurrent saves --------------------------------


def _tiny(name: str) -> TableSpec:
    return TableSpec(name=name, vocabulary_size=10, dim=2, shard_count=1, num_workers=1,
                     optimizer=SGD(0.1), initializer=Initializer("zeros"))


class _Servers:
    """Two real servers, with one data directory each or a shared one; table A on server 0,
    table B on server 1; `restart(i)` starts server i again on its directory."""

    def __init__(self, tmp_path, shared: bool) -> None:
        self.dirs = [tmp_path / "ps0"] * 2 if shared else [tmp_path / "ps0", tmp_path / "ps1"]
        for d in self.dirs:
            d.mkdir(exist_ok=True)
        self.procs = [self._start(i) for i in range(2)]

    def _start(self, index: int) -> ServerProcess:
        proc = ServerProcess(index, [*SERVER_COMMAND, "--port", "0", "--data-dir",
                                     str(self.dirs[index])], None)
        proc.wait_ready(30)
        return proc

    def restart(self, index: int) -> None:
        self.procs[index] = self._start(index)

    def client(self) -> PSClient:
        client = PSClient([p.address for p in self.procs], ClientOptions(timeout=20, retries=1))
        client.create_table(_tiny("A"), placement=[0])
        client.create_table(_tiny("B"), placement=[1])
        return client

    def kill(self, index: int) -> None:
        self.procs[index].proc.send_signal(signal.SIGKILL)
        self.procs[index].proc.wait()

    def close(self) -> None:
        for index in range(2):
            self.kill(index)


@pytest.fixture(params=["shared", "separate"])
def two_servers(request, tmp_path):
    servers = _Servers(tmp_path, shared=request.param == "shared")
    yield servers
    servers.close()


def _train_and_save(client, path: str, steps: range, keep: int) -> list[str]:
    """Push one step to A and B and save, for each step; the checkpoint names."""
    names = []
    for step in steps:
        for name in ("A", "B"):
            client.table(_tiny(name), [0 if name == "A" else 1]).push(
                [1], np.ones((1, 2)), step=step)
        names.append(client.save(path, keep=keep)[0].checkpoint)
    return names


def _restored(client, path: str, checkpoint: str = "") -> dict[str, tuple[int, str]]:
    return {s.table: (s.step, s.checkpoint) for s in client.restore(path, checkpoint=checkpoint)}


def _save_killing_server_1_at_commit(servers: _Servers, client: PSClient, keep: int) -> None:
    """A save of "p" during which server 1 is killed -9 as the client commits on it (its
    shards staged, after server 0 committed); closes `client`."""
    call = client.servers[1].call

    def dying(method, request, *args, **kwargs):
        if method == "Save" and request.phase == ps_pb2.SAVE_COMMIT:
            servers.kill(1)
        return call(method, request, *args, **kwargs)

    client.servers[1].call = dying
    with pytest.raises(ServerError, match="UNAVAILABLE"):
        client.save("p", keep=keep)
    client.close()


@pytest.mark.parametrize("keep", [1, 2])
def test_a_server_killed_during_commit_loses_no_complete_checkpoint(two_servers, keep):
    """Server 1 is killed -9 as the client commits on it, after server 0 committed: every
    checkpoint complete before stays restorable, on every server, even with keep=1."""
    client = two_servers.client()
    good = _train_and_save(client, "p", range(2), keep)
    _save_killing_server_1_at_commit(two_servers, client, keep)
    two_servers.restart(1)
    with two_servers.client() as client:
        assert _restored(client, "p") == {"A": (2, good[-1]), "B": (2, good[-1])}
        if keep == 2:
            assert _restored(client, "p", good[0]) == {"A": (1, good[0]), "B": (1, good[0])}


def _stagings(directory) -> list[str]:
    return sorted(p.name for p in directory.rglob(".staging-*"))


def test_a_save_killed_midway_leaves_no_staging_behind(tmp_path):
    """Issue 29, item 11: server 1 killed -9 as its save's files are staged (before the
    commit) left `.staging-<name>` forever: later saves never removed it. Now the next
    complete save removes it, and a server starting removes the stagings older than a
    complete checkpoint beside them."""
    servers = _Servers(tmp_path, shared=False)
    try:
        client = servers.client()
        _train_and_save(client, "p", range(1), keep=3)
        _save_killing_server_1_at_commit(servers, client, keep=3)
        killed = _stagings(servers.dirs[1])
        assert len(killed) == 1, killed  # the defect's state: the staged files are left
        servers.restart(1)  # newer than every complete checkpoint: it may be a live save
        assert _stagings(servers.dirs[1]) == killed
        with servers.client() as client:
            _restored(client, "p")  # (server 1 came back empty)
            _train_and_save(client, "p", range(1, 2), keep=3)
        assert _stagings(servers.dirs[1]) == [], "the next complete save removes it"

        # a staging older than a complete checkpoint beside it (a killed save that a later
        # one overtook): removed when the server starts
        old = servers.dirs[1] / "p" / killed[0]
        (old / "A").mkdir(parents=True)
        (old / "A" / "shard-0.json").write_text("{}")
        servers.kill(1)
        servers.restart(1)
        assert _stagings(servers.dirs[1]) == []
        assert len(list((servers.dirs[1] / "p").glob("ckpt-*"))) == 2  # the checkpoints stay
    finally:
        servers.close()


_DIES_MID_COMMIT = """
import os, signal, sys
from parallax.client import PSClient
from parallax.ps.v1 import ps_pb2
client = PSClient(sys.argv[3:])
call = client.servers[1].call
second_round = sys.argv[1] == "2"  # round 2: the COMMIT with keep >= 1 (complete, prune)
def dying(method, request, *args, **kwargs):
    if method == "Save" and request.phase == ps_pb2.SAVE_COMMIT and \\
            (request.keep >= 1) == second_round:
        os.kill(os.getpid(), signal.SIGKILL)
    return call(method, request, *args, **kwargs)
client.servers[1].call = dying
client.save("p", keep=int(sys.argv[2]))
"""


def test_a_client_killed_between_commits_leaves_the_complete_checkpoints(tmp_path):
    """The saving process is killed -9 after server 0 committed and before server 1 did (no
    ABORT reaches anyone): restore takes the newest checkpoint every server completed, and
    the half-committed one does not push a complete one out at the next save."""
    servers = _Servers(tmp_path, shared=False)
    try:
        with servers.client() as client:
            good = _train_and_save(client, "p", range(2), keep=2)
            dying = subprocess.run([sys.executable, "-c", _DIES_MID_COMMIT, "1", "2",
                                    *client.addresses], capture_output=True, text=True)
            assert dying.returncode == -signal.SIGKILL, dying.stderr
            assert _restored(client, "p") == {"A": (2, good[-1]), "B": (2, good[-1])}
            newest = _train_and_save(client, "p", range(2, 3), keep=2)
            assert _restored(client, "p", good[-1]) == {"A": (2, good[-1]), "B": (2, good[-1])}
            assert _restored(client, "p") == {"A": (3, newest[0]), "B": (3, newest[0])}
    finally:
        servers.close()


def test_a_client_killed_in_the_second_commit_round_restores_the_new_checkpoint(tmp_path):
    """keep=1, a data directory per server: the saving process is killed -9 after server 0
    marked the new checkpoint complete and pruned the old one, before server 1 did. Every
    server holds the new one committed, so restore takes it (the old one is gone from
    server 0: restoring it failed with NOT_FOUND)."""
    servers = _Servers(tmp_path, shared=False)
    try:
        with servers.client() as client:
            good = _train_and_save(client, "p", range(2), keep=1)
            for name in ("A", "B"):
                client.table(_tiny(name), [0 if name == "A" else 1]).push(
                    [1], np.ones((1, 2)), step=2)
            dying = subprocess.run([sys.executable, "-c", _DIES_MID_COMMIT, "2", "1",
                                    *client.addresses], capture_output=True, text=True)
            assert dying.returncode == -signal.SIGKILL, dying.stderr
            restored = _restored(client, "p")
            assert {step for step, _ in restored.values()} == {3}, restored
            [name] = {checkpoint for _, checkpoint in restored.values()}
            assert name > good[-1]
    finally:
        servers.close()


def test_a_table_sharded_over_servers_with_their_own_data_dirs_restores(tmp_path):
    """A data directory per server (as `parallax k8s` gives each server its own volume):
    each holds its own shards of a table spread over both, and each restores those. Moving
    shards elsewhere needs every shard's files, and is refused naming the fix."""
    servers = _Servers(tmp_path, shared=False)
    spec = TableSpec(name="T", vocabulary_size=10, dim=2, shard_count=2, num_workers=1,
                     optimizer=SGD(0.1), initializer=Initializer("zeros"))
    try:
        with PSClient([p.address for p in servers.procs], ClientOptions(timeout=20)) as client:
            table = client.create_table(spec, placement=[0, 1])
            table.push([1, 2, 3], np.ones((3, 2)), step=0)
            saved = client.save("p")
            rows = table.pull(np.arange(10))
            table.push([1, 2, 3], np.ones((3, 2)), step=1)
            assert {(s.shard_index, s.step) for s in client.restore("p")} == {(0, 1), (1, 1)}
            np.testing.assert_array_equal(table.pull(np.arange(10)), rows)
            client.delete_tables("T")
            client.create_table(dataclasses.replace(spec, shard_count=1), placement=[1])
            with pytest.raises(ServerError, match=r"DATA_LOSS: .*shards \[1\] of \[2\].*"
                                                  r"shared data directory"):
                client.restore("p", checkpoint=saved[0].checkpoint)
    finally:
        servers.close()


def test_a_full_disk_at_commit_is_resource_exhausted(small_disk, table_name):
    """The disk fills between PREPARE and COMMIT: the manifest's write is refused with
    RESOURCE_EXHAUSTED naming it, the server logs no traceback, the earlier checkpoint stays."""
    data, command = small_disk
    if command is not SERVER_COMMAND:
        pytest.skip("needs a tmpfs (mount not allowed here)")
    with LocalCluster(1, data_dir=data, command=command) as cluster:
        with PSClient(cluster.addresses, ClientOptions(timeout=30)) as client:
            table = client.create_table(_tiny(table_name))
            table.push([1], np.ones((1, 2)), step=0)
            first = client.save("ckpt")[0].checkpoint
            call = client.servers[0].call

            def filling(method, request, *args, **kwargs):
                if method == "Save" and request.phase == ps_pb2.SAVE_COMMIT:
                    _fill(data / "filler")
                return call(method, request, *args, **kwargs)

            client.servers[0].call = filling
            with pytest.raises(ServerError, match=r"RESOURCE_EXHAUSTED: .*MANIFEST\.json.*"
                                                  r"free space"):
                client.save("ckpt")
            (data / "filler").unlink()
            client.servers[0].call = call
            assert {s.checkpoint for s in client.restore("ckpt")} == {first}
            log = "\n".join(cluster.servers[0].lines)
    assert "Traceback" not in log, log
    assert sorted(os.listdir(data / "ckpt")) == [first]


def _fill(path) -> None:
    """Write zeros to `path` until the disk is full."""
    with open(path, "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass


def test_a_read_only_data_dir_is_internal_not_precondition(small_disk, table_name):
    """EROFS (a disk remounted read-only after I/O errors) is an I/O failure with its reason,
    not the FAILED_PRECONDITION a server without --data-dir answers."""
    data, command = small_disk
    if command is not SERVER_COMMAND:
        pytest.skip("needs a tmpfs (mount not allowed here)")
    with LocalCluster(1, data_dir=data, command=command) as cluster:
        with PSClient(cluster.addresses, ClientOptions(timeout=30)) as client:
            client.create_table(_tiny(table_name))
            first = client.save("ckpt")[0].checkpoint
            subprocess.run(["mount", "-o", "remount,ro", str(data)], check=True)
            try:
                with pytest.raises(ServerError, match=r"INTERNAL: cannot write checkpoint .*"
                                                      r"Read-only file system \(EROFS\)") as info:
                    client.save("ckpt")
                assert "no data directory" not in str(info.value)
                assert {s.checkpoint for s in client.restore("ckpt")} == {first}
            finally:
                subprocess.run(["mount", "-o", "remount,rw", str(data)], check=True)


def test_a_server_without_data_dir_says_so_with_a_stable_prefix(table_name, caplog):
    """...once: servers that cannot save staged nothing, so the abort that follows a refused
    save does not add a warning per server (it did, at every ModelCheckpoint save)."""
    with LocalCluster(2) as cluster:
        with PSClient(cluster.addresses, ClientOptions(timeout=30)) as client:
            client.create_table(_tiny(table_name))
            for call in (client.save, client.restore):
                with pytest.raises(ServerError, match="FAILED_PRECONDITION: this server has "
                                                      "no data directory"):
                    call("ckpt")
    assert not [r for r in caplog.records if "could not abort" in r.getMessage()]


def test_concurrent_saves_to_one_path_fail_cleanly_or_succeed(client, data_dir, table_name):
    """Three clients save to one path at once, keep=1: each save succeeds or is refused as
    having lost the race to a newer one (never INTERNAL, never 'not prepared'), and the path
    ends with one restorable checkpoint."""
    client.create_table(_sync_spec(table_name))
    path = f"race-{table_name}"
    errors: list[str] = []

    def saves(peer: PSClient) -> None:
        for _ in range(8):
            try:
                peer.save(path, [table_name], keep=1)
            except ServerError as err:
                errors.append(str(err))

    peers = [PSClient(client.addresses, ClientOptions(timeout=20)) for _ in range(3)]
    threads = [threading.Thread(target=saves, args=(p,)) for p in peers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for peer in peers:
        peer.close()
    assert all("FAILED_PRECONDITION" in e and "another save" in e for e in errors), errors
    assert len(client.restore(path, [table_name])) == 2
    left = [p.name for p in (data_dir / path).iterdir()]
    assert len([n for n in left if n.startswith("ckpt-")]) == 1, left


def test_a_checkpoint_pruned_during_a_restore_is_retried_with_the_newest(client, table_name):
    """A save with keep=1 removes the checkpoint a restore has just verified: the restore
    starts again with the new newest (and says so) instead of failing NOT_FOUND."""
    table = client.create_table(_sync_spec(table_name))
    path = f"pruned-{table_name}"
    _full_step(table, 0)
    client.save(path, [table_name], keep=1)
    _full_step(table, 1)
    answers = client._answers
    with PSClient(client.addresses, ClientOptions(timeout=20)) as other:
        raced = []

        def racing(method, request):
            replies = answers(method, request)
            if method == "Restore" and request.verify_only and not raced:
                raced.append(other.save(path, [table_name], keep=1))
            return replies

        client._answers = racing
        restored = client.restore(path, [table_name])
    assert _steps(restored) == {table_name: [2, 2]}
