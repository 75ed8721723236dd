"""Replayed servers (`ClientOptions(replay_mb=N)`, `parallax.client.replay`) against real
servers on loopback: a server killed with SIGKILL in the middle of a 2-worker sync job and
started again on the same port is rebuilt from the workers' kept pushes, and the job's
tables end bit for bit as an uninterrupted run's; pushes that do not reach back far enough
fail the job, naming why.

The workers are threads with a client each, pulling through PullMany (the data plane) and
pushing through PushMany and per-table pushes, as the strategy does (the job and its tables
are test_replicas.py's).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import threading
import time

import grpc
import numpy as np
import pytest

from parallax.client import ClientOptions, PSClient
from parallax.client.local_cluster import SERVER_COMMAND, LocalCluster, ServerProcess
from conftest import in_threads
from parallax.client.replay import ReplayError
from parallax.errors import ServerError
from test_replicas import OPTIONS, _specs
from test_replicas import _train as replicated_job

REPLAY = ClientOptions(**{**OPTIONS.__dict__, "replay_mb": 64})
ONES = np.ones((100, 4), np.float32)
SAVE_AT = 4  # a checkpoint once 4 steps are applied (server 1 is killed at step 5)


def _train(cluster: LocalCluster, prefix: str, options: ClientOptions, kill=None):
    """The 2-worker job of test_replicas: SAVE_AT steps, a checkpoint (with a data
    directory), the other steps (`kill` called by worker 0 after its push of step KILL_AT);
    the tables' rows at the end."""
    def save(client: PSClient, specs) -> None:
        if cluster.data_dir is not None:
            client.save("ckpt", [s.name for s in specs])
    return replicated_job(cluster.addresses, prefix, 1, kill, options=options,
                          pause_at=SAVE_AT, pause=save)


def _restart(cluster: LocalCluster, index: int, *args: str):
    """Kill server `index` (SIGKILL) and start another on its port; returns the dead one."""
    dead = _kill(cluster, index)
    _start_again(cluster, dead, *args)
    return dead


def _kill(cluster: LocalCluster, index: int):
    dead = cluster.servers[index]
    os.kill(dead.proc.pid, signal.SIGKILL)
    dead.proc.wait(10)
    return dead


def _start_again(cluster: LocalCluster, dead, *args: str) -> None:
    port = dead.address.rsplit(":", 1)[1]
    command = [*SERVER_COMMAND, "--host", cluster.host, "--port", port, *args]
    if cluster.data_dir is not None:
        command += ["--data-dir", str(cluster.data_dir)]
    cluster.servers[dead.index] = ServerProcess(dead.index, command, None)
    assert cluster.servers[dead.index].wait_ready(60) == dead.address


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    with LocalCluster(2, data_dir=tmp_path_factory.mktemp("plain")) as cluster:
        return _train(cluster, "plain", OPTIONS)


@pytest.mark.parametrize("kills", [1, 2])
def test_a_server_started_again_from_its_checkpoint_is_rebuilt_from_the_workers_pushes(
        tmp_path, baseline, kills):
    """The replacement restores its shards from the checkpoint at step SAVE_AT; each worker
    sends it its pushes of the steps since; the job ends bit for bit as the uninterrupted
    one, with no step redone. kills=2: the replacement is killed too as soon as it serves
    (while worker 1 may be rebuilding its shards there), and another started."""
    with LocalCluster(2, data_dir=tmp_path) as cluster:
        dead = []

        def kill() -> None:
            for _ in range(kills):
                dead.append(_restart(cluster, 1, "--restore-newest"))
        rows = _train(cluster, "plain", REPLAY, kill=kill)
        assert [d.proc.returncode for d in dead] == [-signal.SIGKILL] * kills
    for got, want in zip(rows, baseline):
        np.testing.assert_array_equal(got, want)


POD = ("--restore-newest-on-restart", "pod-1")  # parallax k8s --replay-mb: the pod's uid


def test_a_pod_restarted_in_place_is_rebuilt_from_the_workers_pushes(tmp_path, baseline):
    """`parallax k8s --replay-mb`: server 1 runs with the same command on every start, as a
    container in its pod; its first start creates fresh, its start again after a SIGKILL
    restores the job's checkpoint and the workers replay: the uninterrupted run's rows."""
    with LocalCluster(2, data_dir=tmp_path) as cluster:
        _restart(cluster, 1, *POD)  # (the pod's first start, before the job)
        dead = []
        rows = _train(cluster, "plain", REPLAY,
                      kill=lambda: dead.append(_restart(cluster, 1, *POD)))
        assert [d.proc.returncode for d in dead] == [-signal.SIGKILL]
    for got, want in zip(rows, baseline):
        np.testing.assert_array_equal(got, want)


def test_a_pod_restarted_before_its_jobs_first_save_takes_no_earlier_checkpoint(tmp_path):
    """An earlier run's checkpoint of the same table on the data dir (a kept claim): the
    pod's first start creates fresh beside it, and its restart before the job saved does
    not restore it either (it predates the pod): the worker refuses, naming that."""
    with LocalCluster(2, data_dir=tmp_path) as cluster:  # the earlier run
        client, spec, table = _one_worker_job(cluster, OPTIONS)
        with client:
            table.push(np.arange(100), ONES, step=0)
            client.save("ckpt", [spec.name])
    with LocalCluster(2, data_dir=tmp_path) as cluster:
        _restart(cluster, 1, *POD)
        client, spec, table = _one_worker_job(cluster, REPLAY)
        with client:
            table.push(np.arange(100), ONES, step=0)
            _restart(cluster, 1, *POD)
            with pytest.raises(ReplayError, match=r"it was not restored from a checkpoint"):
                table.pull_all()


def _one_worker_job(cluster: LocalCluster, options: ClientOptions):
    client = PSClient(cluster.addresses, options)
    spec = dataclasses.replace(_specs("one")[0], num_workers=1)
    table = client.create_table(spec)
    return client, spec, table


def test_a_server_started_again_without_its_checkpoint_is_refused():
    """A replacement that did not restore its shards holds them at step 0, without the rows
    the job wrote when it began: the worker says so instead of training on other rows. Its
    watch, which met that first, stops watching (waiting cannot mend it) instead of trying
    again for as long as the client lives."""
    with LocalCluster(2) as cluster:
        client, _, table = _one_worker_job(cluster, REPLAY)
        with client:
            table.push(np.arange(100), ONES, step=0)
            _restart(cluster, 1)
            watch = f"parallax-replay-watch {cluster.addresses[1]}"
            deadline = time.monotonic() + 10
            while any(t.name == watch for t in threading.enumerate()):
                assert time.monotonic() < deadline, "the watch goes on trying"
                time.sleep(0.1)
            with pytest.raises(ReplayError, match=r"shard 1 there cannot be rebuilt from this "
                                                  r"worker's pushes: it was not restored from "
                                                  r"a checkpoint \(created anew\)") as err:
                table.pull_all()
        assert err.value.code == grpc.StatusCode.DATA_LOSS


def test_pushes_that_do_not_reach_back_to_the_checkpoint_fail_naming_why(tmp_path):
    """A log with room for one push keeps only the newest: the replacement (restored at
    step 1) needs the older ones, and the worker says so."""
    tiny = ClientOptions(**{**OPTIONS.__dict__, "replay_mb": 1, "timeout": 10})
    with LocalCluster(2, data_dir=tmp_path) as cluster:
        client, spec, table = _one_worker_job(cluster, tiny)
        with client:
            for conn in client._routes:  # noqa: SLF001 - room for the newest push only
                conn.log.max_bytes = 1
            table.push(np.arange(100), ONES, step=0)
            client.save("ckpt", [spec.name])
            for step in range(1, 4):
                table.push(np.arange(100), ONES, step=step)
            _restart(cluster, 1, "--restore-newest")
            with pytest.raises(ReplayError, match="kept its pushes only from step 3: it "
                                                  r"dropped 3 older push\(es\)") as err:
                table.pull_all()
        assert err.value.code == grpc.StatusCode.DATA_LOSS


def _a_checkpoint_and_a_step(client: PSClient, spec, table, then=None) -> np.ndarray:
    """A one-worker job's step 0, a checkpoint, `then()`, step 1; the rows after it."""
    table.push(np.arange(100), ONES, step=0)
    client.save("ckpt", [spec.name])
    if then is not None:
        then()
    table.push(np.arange(100), ONES, step=1)
    return table.pull_all()


def test_a_save_that_meets_a_server_started_again_waits_for_its_rebuild(tmp_path):
    """A save right after a server was started again (before any pull or push reached it)
    would find it holding no shard: it rebuilds the server first and saves every shard,
    instead of committing a checkpoint without them."""
    with LocalCluster(2, data_dir=tmp_path) as cluster:
        client, spec, table = _one_worker_job(cluster, REPLAY)
        with client:
            want = _a_checkpoint_and_a_step(client, spec, table)
            _restart(cluster, 1, "--restore-newest")
            saved = client.save("ckpt", [spec.name])
            assert sorted((s.shard_index, s.step) for s in saved) == [(0, 2), (1, 2), (2, 2)]
            _restart(cluster, 1, "--restore-newest")  # restores the save above: no replay
            np.testing.assert_array_equal(table.pull_all(), want)
            assert table.wait_step(0) == 2


@pytest.mark.parametrize("whose", ["abandoned", "another run's"])
def test_a_replacement_restored_from_a_checkpoint_the_pushes_do_not_follow_is_refused(
        tmp_path, whose):
    """abandoned: checkpoint B was saved, then the job restored the older A and went on, so
    the replacement's newest checkpoint is B, of steps taken again since; another run's:
    a run that saved nothing yet meets a checkpoint of the same table left by an earlier
    run in the data directory. Replaying on either would train on other rows: refused."""
    with LocalCluster(2, data_dir=tmp_path) as cluster:
        client, spec, table = _one_worker_job(cluster, REPLAY)
        with client:
            table.push(np.arange(100), ONES, step=0)
            client.save("ckpt", [spec.name])
            if whose == "abandoned":
                table.push(np.arange(100), ONES, step=1)
                client.save("ckpt", [spec.name])  # B
                client.restore("ckpt", [spec.name], checkpoint=_oldest(tmp_path / "ckpt"))
            else:  # (the earlier run's tables dropped, as the launcher drops them)
                client.delete_table(table)
                client.close()
                client = PSClient(cluster.addresses, REPLAY)
                table = client.create_table(spec)
                table.push(np.arange(100), ONES, step=0)
            table.push(np.arange(100), ONES, step=1)
            _restart(cluster, 1, "--restore-newest")
            why = "neither saved nor restored" if whose == "abandoned" else \
                "older than this worker's start"
            with pytest.raises(ReplayError, match=why):
                table.pull_all()
            client.close()


def _oldest(path) -> str:
    return sorted(p.name for p in path.iterdir() if p.name.startswith("ckpt-"))[0]


def test_a_death_right_after_a_restore_sends_nothing_from_before_it(tmp_path):
    with LocalCluster(2, data_dir=tmp_path) as cluster:
        client, spec, table = _one_worker_job(cluster, REPLAY)
        with client:
            table.push(np.arange(100), ONES, step=0)
            client.save("ckpt", [spec.name])
            want = table.pull_all()
            for step in (1, 2):
                table.push(np.arange(100), ONES, step=step)
            client.restore("ckpt", [spec.name])
            _restart(cluster, 1, "--restore-newest")
            np.testing.assert_array_equal(table.pull_all(), want)
            assert table.wait_step(0) == 1


def test_rows_written_since_the_last_save_refuse_a_replay(tmp_path):
    with LocalCluster(2, data_dir=tmp_path) as cluster:
        client, spec, table = _one_worker_job(cluster, REPLAY)
        with client:
            _a_checkpoint_and_a_step(client, spec, table, then=lambda: table.assign(
                np.arange(4), np.zeros((4, 4), np.float32)))
            _restart(cluster, 1, "--restore-newest")
            with pytest.raises(ReplayError, match="rows were written into it"):
                table.pull_all()


def test_a_table_another_client_deleted_is_not_created_again(tmp_path):
    """NOT_FOUND from the same server (its identity unchanged) is the table's deletion, not
    a restart: the error stands and the table stays deleted."""
    with LocalCluster(2, data_dir=tmp_path) as cluster:
        client, spec, table = _one_worker_job(cluster, REPLAY)
        with client, PSClient(cluster.addresses, OPTIONS) as other:
            table.push(np.arange(100), ONES, step=0)
            other.delete_table(other.table(spec))
            with pytest.raises(ServerError, match="does not exist") as err:
                table.pull(np.arange(4))
            assert not isinstance(err.value, ReplayError)
            with pytest.raises(ServerError, match="does not exist"):
                other.table(spec).wait_step(0)


@pytest.mark.parametrize("then", ["pull", "save", "held save"])
def test_a_worker_that_reaches_a_replacement_after_another_rebuilt_it_rebuilds_too(
        tmp_path, then):
    """Worker 1 finds the replacement first and sends it its pushes; worker 0's next
    request reaches it over a gRPC channel that reconnected without a word (a per-table
    pull, WaitStep before a save): worker 0 sees the server is another process and sends
    its pushes too, instead of waiting there for a step only they close."""
    specs = [dataclasses.replace(_specs("late")[0], num_workers=2)]
    with LocalCluster(2, data_dir=tmp_path) as cluster:
        clients = [PSClient(cluster.addresses, REPLAY) for _ in range(2)]
        tables = [c.create_table(specs[0]) for c in clients]
        try:
            def step(worker: int, at: int) -> None:
                tables[worker].pull(np.arange(worker, 100, 2), min_step=at)
                tables[worker].push(np.arange(worker, 100, 2), ONES[:50], step=at,
                                    worker=worker)
            for at in range(2):
                in_threads(lambda w: step(w, at), 2)
            tables[0].wait_step(2)
            clients[0].save("ckpt", [specs[0].name])
            for at in range(2, 4):
                in_threads(lambda w: step(w, at), 2)
            tables[0].wait_step(4)
            _restart(cluster, 1, "--restore-newest")
            first = threading.Thread(target=step, args=(1, 4))
            first.start()
            time.sleep(1.0)  # (worker 1 rebuilds first, then waits for worker 0's pushes)
            if then == "pull":
                step(0, 4)
            else:
                saved = clients[0].save("ckpt", [specs[0].name], held=then == "held save")
                assert sorted((s.shard_index, s.step) for s in saved) == \
                    [(0, 4), (1, 4), (2, 4)]
                step(0, 4)
            first.join(30)
            assert not first.is_alive()
            assert tables[0].wait_step(5) == 5
        finally:
            for c in clients:
                c.close()


@pytest.mark.parametrize("request_", ["pull", "push"])
def test_a_request_made_while_the_server_is_dead_waits_for_its_replacement(
        tmp_path, request_):
    """The replacement comes 2 s after the kill, as a launcher's does: a request made in
    between (its channel lost, the server's identity not to be had) waits for it."""
    with LocalCluster(2, data_dir=tmp_path) as cluster:
        client, spec, table = _one_worker_job(cluster, REPLAY)
        with client:
            want = _a_checkpoint_and_a_step(client, spec, table)
            dead = _kill(cluster, 1)
            time.sleep(0.5)  # (the channel sees its connection go)
            later = threading.Timer(2.0, _start_again, (cluster, dead, "--restore-newest"))
            later.start()
            try:
                if request_ == "pull":
                    np.testing.assert_array_equal(table.pull_all(), want)
                else:
                    table.push(np.arange(100), ONES, step=2)
                    assert table.wait_step(0) == 3
            finally:
                later.join()


def _steps_of_two_workers(clients: list, tables: list, steps) -> None:
    """Each worker pushes its half of the rows at each of `steps`; the chief saves after
    step 0."""
    for step in steps:
        for worker, table in enumerate(tables):
            table.push(np.arange(worker, 100, 2), ONES[:50], step=step, worker=worker)
        tables[0].wait_step(step + 1)
        if step == 0:
            clients[0].save("ckpt", [tables[0].name])


@contextlib.contextmanager
def _save_while_the_other_worker_sends_nothing(tmp_path, options: ClientOptions):
    """The chief saves right after server 1 was started again, while the other worker sends
    nothing (it would wait for the chief in a collective); the chief's client first."""
    spec = dataclasses.replace(_specs("alone")[0], num_workers=2)
    with LocalCluster(2, data_dir=tmp_path) as cluster:
        clients = [PSClient(cluster.addresses, options) for _ in range(2)]
        tables = [c.create_table(spec) for c in clients]
        try:
            _steps_of_two_workers(clients, tables, range(2))
            expected = tables[0].pull(np.arange(100))
            _restart(cluster, 1, "--restore-newest")
            yield clients[0], spec.name, expected, tables[0]
        finally:
            for client in clients:
                client.close()


def test_a_save_while_the_other_worker_sends_nothing_is_rebuilt_by_its_watch(tmp_path):
    """Each worker watches its servers (an idle data-plane connection a thread sleeps on):
    the other worker sends its pushes to the replacement by itself, so the chief's save
    goes on, and holds the rows before the kill."""
    with _save_while_the_other_worker_sends_nothing(tmp_path, REPLAY) as job:
        chief, name, expected, table = job
        shards = chief.save("ckpt", [name])
        assert {s.step for s in shards} == {2}
        np.testing.assert_array_equal(table.pull(np.arange(100)), expected)


def test_a_save_whose_other_workers_never_come_fails_naming_why(tmp_path, monkeypatch):
    """Without a data plane nothing watches: the other worker finds the loss only at its
    next request there, so the save fails within SAVE_WAIT_S, saying so, instead of
    waiting for ever or writing shards behind."""
    from parallax.client import replay
    monkeypatch.setattr(replay, "SAVE_WAIT_S", 1.0)
    grpc_only = ClientOptions(**{**REPLAY.__dict__, "data_plane": False})
    with _save_while_the_other_worker_sends_nothing(tmp_path, grpc_only) as (chief, name, _, _):
        with pytest.raises(ReplayError, match="did not send it their pushes within 1s"):
            chief.save("ckpt", [name])


def test_an_idle_worker_rebuilds_by_itself_each_time_and_a_save_waits_for_a_late_one(
        tmp_path, monkeypatch):
    """Server 1 dies twice while worker 1 sends nothing: its watch rebuilds it both times
    (the data plane of each replacement used and watched after), and the chief's save
    waits for worker 1's pushes even when the chief's own watch rebuilt first and worker
    1's rebuild comes 2 s later: the checkpoint holds the job's step, not the restored
    one (a table whose shards are all on server 1 has no other shard to disagree with)."""
    spec = dataclasses.replace(_specs("alone")[0], num_workers=2)
    with LocalCluster(2, data_dir=tmp_path) as cluster:
        clients = [PSClient(cluster.addresses, REPLAY) for _ in range(2)]
        tables = [c.create_table(spec, [1] * spec.shard_count) for c in clients]
        idle = clients[1]._routes[1]  # noqa: SLF001 - worker 1's route to server 1
        try:
            for step in range(4):
                _steps_of_two_workers(clients, tables, [step])
                if step in (1, 3):
                    if step == 3:  # (worker 1 late: the chief's watch rebuilds first)
                        late = idle.recover
                        monkeypatch.setattr(idle, "recover", lambda err, wait_s=None: (
                            time.sleep(2.0), late(err, wait_s))[1])
                    _restart(cluster, 1, "--restore-newest")
                    time.sleep(0.5)
                    assert {s.step for s in clients[0].save("ckpt", [spec.name])} == {step + 1}
                    assert idle.conn.data_plane_of(idle.server_id) is not None
        finally:
            for client in clients:
                client.close()
