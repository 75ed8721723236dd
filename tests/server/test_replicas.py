"""Replicated shards (`ClientOptions(replicas=2)`, `parallax.client.replicas`) against real
servers on loopback: a server killed with SIGKILL in the middle of a 2-worker sync job costs
no step, and the job's tables end bit for bit as an uninterrupted run's without copies; a
checkpoint written after the loss restores; what cannot be replicated is refused.

The workers are threads with a client each, pulling through PullMany (the data plane) and
pushing through PushMany and per-table pushes, as the strategy does.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading

import grpc
import numpy as np
import pytest

from conftest import in_threads
from parallax.client import ClientOptions, PSClient
from parallax.client.local_cluster import LocalCluster
from parallax.client.many import pull_many, push_many
from parallax.errors import ConfigError, ServerError
from parallax.protocol.specs import Adagrad, Adam, Initializer, TableSpec

STEPS, WORKERS, KILL_AT = 12, 2, 5
OPTIONS = ClientOptions(timeout=30, retries=3, backoff=0.05)


def _specs(prefix: str) -> list[TableSpec]:
    base = dict(vocabulary_size=500, dim=4, initializer=Initializer("uniform", seed=3),
                num_workers=WORKERS)
    return [TableSpec(name=f"{prefix}_a", shard_count=3, optimizer=Adagrad(0.1), **base),
            TableSpec(name=f"{prefix}_b", shard_count=2, optimizer=Adam(0.01), **base,
                      hashed_keys=False)]


def _ids(worker: int, step: int) -> np.ndarray:
    rng = np.random.default_rng(1000 * step + worker)
    return np.unique(rng.integers(0, 500, size=60))


def _work(client: PSClient, specs, worker: int, kill=None, steps: range = range(STEPS),
          kill_at: int = KILL_AT) -> None:
    """One worker: pull its ids at each step, push a gradient made of the rows it read;
    `kill()` after its push of step `kill_at`."""
    tables = [client.table(spec) for spec in specs]
    for step in steps:
        ids = [_ids(worker, step), _ids(worker + 7, step)]
        rows = pull_many(tables, ids, [step, step])
        grads = [r * 0.5 + 0.01 * (worker + 1) for r in rows]
        if step % 2:
            push_many(tables, ids, grads, [step, step], worker, [0.0, 0.0])
        else:
            for table, i, g in zip(tables, ids, grads):
                table.push(i, g, step=step, worker=worker)
        if kill is not None and step == kill_at:
            kill()


def _train(addresses, prefix: str, replicas: int, kill=None, *, options=None, pause_at=0,
           pause=None) -> list[np.ndarray]:
    """The 2-worker job (`kill` called by worker 0 after its push of step KILL_AT); with
    `pause`, its first `pause_at` steps, then `pause(client, specs)`, then the others."""
    options = options or ClientOptions(**{**OPTIONS.__dict__, "replicas": replicas})
    specs = _specs(prefix)
    clients = [PSClient(addresses, options) for _ in range(WORKERS)]
    try:
        for spec in specs:
            clients[0].create_table(spec)
        if pause is not None:
            in_threads(lambda w: _work(clients[w], specs, w, steps=range(pause_at)), WORKERS)
            assert all(clients[0].table(s).wait_step(pause_at) == pause_at for s in specs)
            pause(clients[0], specs)
        in_threads(lambda w: _work(clients[w], specs, w, kill if w == 0 else None,
                                   range(pause_at, STEPS)), WORKERS)
        final = [clients[0].table(s) for s in specs]
        assert all(t.wait_step(STEPS) == STEPS for t in final)
        return [t.pull_all() for t in final]
    finally:
        for client in clients:
            client.close()


@pytest.fixture(scope="module")
def baseline():
    with LocalCluster(3) as cluster:
        return _train(cluster.addresses, "plain", replicas=1)


def test_a_server_killed_mid_job_costs_no_step_and_changes_no_row(baseline):
    with LocalCluster(3) as cluster:
        victim = cluster.servers[1].proc
        rows = _train(cluster.addresses, "copied", replicas=2,
                      kill=lambda: os.kill(victim.pid, signal.SIGKILL))
        assert victim.wait(10) == -signal.SIGKILL
    for got, want in zip(rows, baseline):
        np.testing.assert_array_equal(got, want)


def test_a_save_after_the_loss_writes_each_shard_once_and_restores(tmp_path, baseline):
    with LocalCluster(3, data_dir=tmp_path) as cluster:
        victim = cluster.servers[0].proc
        _train(cluster.addresses, "saved", replicas=2,
               kill=lambda: os.kill(victim.pid, signal.SIGKILL))
        options = ClientOptions(**{**OPTIONS.__dict__, "replicas": 2})
        with PSClient(cluster.addresses, options) as client:
            specs = _specs("saved")
            tables = [client.table(s) for s in specs]
            tables[0].pull_all()  # finds the lost server (its reads fail over)
            assert client.liveness.lost == {cluster.addresses[0]}
            saved = client.save("ckpt", [s.name for s in specs])
            assert sorted((s.table, s.shard_index) for s in saved) == \
                [("saved_a", 0), ("saved_a", 1), ("saved_a", 2), ("saved_b", 0), ("saved_b", 1)]
            want = [t.pull_all() for t in tables]
            for table in tables:
                table.push([1, 2], np.ones((2, 4), np.float32), step=STEPS, worker=0)
                table.push([3], np.ones((1, 4), np.float32), step=STEPS, worker=1)
            client.restore("ckpt", [s.name for s in specs])
            for table, rows in zip(tables, want):
                np.testing.assert_array_equal(table.pull_all(), rows)
                assert table.wait_step(0) == STEPS
    for got, want_rows in zip(want, baseline):
        np.testing.assert_array_equal(got, want_rows)


def test_what_cannot_be_replicated_is_refused():
    with LocalCluster(1) as cluster:
        with pytest.raises(ConfigError, match="replicas=2 needs at least 2 servers"):
            PSClient(cluster.addresses, ClientOptions(replicas=2))
    with pytest.raises(ConfigError, match="give 1 .* or 2"):
        PSClient(["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"], ClientOptions(replicas=3))
    with PSClient(["127.0.0.1:1", "127.0.0.1:2"], ClientOptions(replicas=2)) as client:
        spec = TableSpec(name="async_t", vocabulary_size=10, dim=2, sync_mode="async")
        with pytest.raises(ConfigError, match="needs sync tables"):
            client.table(spec)


def _trained_copies(client: PSClient, prefix: str, shards: int = 3):
    """A table of `shards` shards with replicas=2, trained one step (every row touched)."""
    spec = TableSpec(name=f"{prefix}_t", vocabulary_size=90, dim=4, shard_count=shards,
                     optimizer=Adagrad(0.1), initializer=Initializer("uniform", seed=3),
                     num_workers=1)
    table = client.create_table(spec)
    table.push(np.arange(90), np.ones((90, 4), np.float32), step=0, worker=0)
    return spec, table


def test_a_checkpoint_restores_with_a_data_directory_per_server(tmp_path):
    """Servers that do not share a data directory each write their copies (else a copy has
    nothing to restore from in its own directory); servers that share one write each shard
    once (the first to claim it)."""
    options = ClientOptions(**{**OPTIONS.__dict__, "replicas": 2})
    with LocalCluster(1, data_dir=tmp_path / "s0") as c0, \
            LocalCluster(1, data_dir=tmp_path / "s1") as c1, \
            PSClient(c0.addresses + c1.addresses, options) as client:
        spec, table = _trained_copies(client, "own_dirs")
        want = table.pull_all()
        client.save("ckpt", [spec.name])
        table.push([1, 2], np.ones((2, 4), np.float32), step=1, worker=0)
        client.restore("ckpt", [spec.name])
        np.testing.assert_array_equal(table.pull_all(), want)
        assert table.wait_step(0) == 1
    with LocalCluster(3, data_dir=tmp_path / "shared") as cluster, \
            PSClient(cluster.addresses, options) as client:
        spec, _ = _trained_copies(client, "shared_dir")
        from parallax.protocol import checkpoint_names
        from parallax.ps.v1 import ps_pb2
        replies = client._each("Save", ps_pb2.SaveRequest(  # noqa: SLF001
            path="p", tables=[spec.name], checkpoint=checkpoint_names.new_name(),
            phase=ps_pb2.SAVE_PREPARE))
        assert sorted(s.shard_index for r in replies for s in r.shards) == [0, 1, 2]


@pytest.mark.parametrize("when", ["prepare", "commit"])
def test_a_server_killed_during_a_save_leaves_a_whole_checkpoint(tmp_path, when):
    """SIGKILL of a server as the shards are to be written (after the save asked which shards
    there are), or once they are written (before the commit): the save starts again without
    it, and the checkpoint holds every shard and restores."""
    from parallax.ps.v1 import ps_pb2

    options = ClientOptions(**{**OPTIONS.__dict__, "replicas": 2})
    with LocalCluster(3, data_dir=tmp_path) as cluster, \
            PSClient(cluster.addresses, options) as client:
        spec, table = _trained_copies(client, "killed_save")
        want = table.pull_all()
        victim = cluster.servers[0].proc

        def kill() -> None:
            if victim.poll() is None:
                os.kill(victim.pid, signal.SIGKILL)
                victim.wait(10)

        answers, in_turn = client._answers, client._in_turn  # noqa: SLF001

        def answers_then(method, request, *args):
            if when == "prepare" and method == "Save" and \
                    request.phase == ps_pb2.SAVE_PREPARE:
                kill()
            return answers(method, request, *args)

        def in_turn_then(method, request):
            if when == "commit":
                kill()
            return in_turn(method, request)

        client._answers, client._in_turn = answers_then, in_turn_then
        saved = client.save("ckpt", [spec.name])
        assert sorted(s.shard_index for s in saved) == [0, 1, 2]
        assert client.liveness.lost == {cluster.addresses[0]}
        table.push([1, 2], np.ones((2, 4), np.float32), step=1, worker=0)
        client.restore("ckpt", [spec.name])
        np.testing.assert_array_equal(table.pull_all(), want)


def test_a_server_killed_as_it_wrote_a_tables_only_shard_leaves_a_whole_checkpoint(tmp_path):
    """Servers sharing a data directory: the one that claimed a 1-shard table's shard dies
    before it answers the save (its copy's server, seeing the claim, wrote nothing). The
    round's answers then hold no shard of that table: the save starts again without the
    dead server, as for any shard left out. It was refused as a table no server holds
    (ConfigError, never retried), which failed the Keras backup of a --replicas 2 job whose
    server was killed during it."""
    from parallax.ps.v1 import ps_pb2

    options = ClientOptions(**{**OPTIONS.__dict__, "replicas": 2})
    with LocalCluster(3, data_dir=tmp_path) as cluster, \
            PSClient(cluster.addresses, options) as client:
        spec, table = _trained_copies(client, "claimed_then_killed", shards=1)
        want = table.pull_all()
        index, server = next((i, s) for i, s in enumerate(client.servers) if s.call(
            "Stats", ps_pb2.StatsRequest(tables=[spec.name])).tables)
        victim = cluster.servers[index].proc
        answers = client._answers  # noqa: SLF001

        def claim_then_die(method, request, *args):
            if method == "Save" and request.phase == ps_pb2.SAVE_PREPARE and \
                    victim.poll() is None:
                server.call("Save", request)  # it claims the shard, then dies unanswered
                os.kill(victim.pid, signal.SIGKILL)
                victim.wait(10)
            return answers(method, request, *args)

        client._answers = claim_then_die
        saved = client.save("ckpt", [spec.name])
        assert [s.shard_index for s in saved] == [0]
        assert client.liveness.lost == {cluster.addresses[index]}
        table.push([1, 2], np.ones((2, 4), np.float32), step=1, worker=0)
        client.restore("ckpt", [spec.name])
        np.testing.assert_array_equal(table.pull_all(), want)


def test_progress_lines_count_each_row_once_and_never_go_back(caplog):
    """`parallax run --progress-seconds`: with copies, rows pushed are counted once (not on
    each copy, nor once per shard a server holds), and a lost server's counts are kept: the
    totals never go back, the rates are never negative, and the loss is reported once."""
    import logging

    from parallax.launch.progress import ProgressReporter

    options = ClientOptions(**{**OPTIONS.__dict__, "replicas": 2})
    with LocalCluster(3) as cluster, PSClient(cluster.addresses, options) as client:
        table = client.create_table(TableSpec(
            name="run.t", vocabulary_size=90, dim=4, shard_count=3, num_workers=1,
            optimizer=Adagrad(0.1), initializer=Initializer("uniform", seed=3)))
        reporter = ProgressReporter(cluster.addresses, "run", 0, print,
                                    ClientOptions(timeout=5, retries=0, replicas=2))
        for step in range(2):
            table.pull(np.arange(90), min_step=step)
            table.push(np.arange(90), np.ones((90, 4), np.float32), step=step, worker=0)
        assert "t step 2; rows pulled 180, pushed 180" in reporter.snapshot()
        victim = cluster.servers[1].proc
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(10)
        table.pull(np.arange(90), min_step=2)  # 90 more, shard 1's from its copy
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="parallax"):
            lines = [reporter.snapshot(), reporter.snapshot()]
        reporter.stop()
    assert all("t step 2; rows pulled 270, pushed 180" in line for line in lines), lines
    assert "-" not in "".join(line.split(";")[1] for line in lines), lines
    assert sum("is lost" in r.getMessage() for r in caplog.records) == 1, caplog.records


def test_a_server_dead_before_the_first_call_is_left_out(baseline):
    """A worker that starts after a server's death (killed while the workers started): its
    wait for the servers leaves the dead one out, and its tables are created, filled and
    trained on the copies (as an uninterrupted run without copies)."""
    with LocalCluster(3) as cluster:
        victim = cluster.servers[2].proc
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(10)
        options = ClientOptions(**{**OPTIONS.__dict__, "replicas": 2})
        with PSClient(cluster.addresses, options) as client:
            client.wait_ready(timeout=1)
            assert client.liveness.lost == {cluster.addresses[2]}
        rows = _train(cluster.addresses, "late", replicas=2)
    for got, want in zip(rows, baseline):
        np.testing.assert_array_equal(got, want)


def test_a_barrier_outlives_the_first_server():
    """`PSClient.barrier` is held by the first server: once it is dead, the ranks meet on the
    next one instead of failing."""
    options = ClientOptions(**{**OPTIONS.__dict__, "replicas": 2})
    with LocalCluster(3) as cluster:
        victim = cluster.servers[0].proc
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(10)
        clients = [PSClient(cluster.addresses, options) for _ in range(2)]
        try:
            results = in_threads(lambda rank: clients[rank].barrier("after", rank, 2,
                                                                    timeout=20), 2, 30)
        finally:
            for client in clients:
                client.close()
    assert len(set(results)) == 1, results


class _Unavailable(grpc.RpcError):
    """What a first attempt whose connection reset raises (the network's part, stood in)."""

    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "connection reset"


def test_a_retry_refused_as_ahead_of_the_step_is_not_taken_for_landed():
    """A push sent again after a transient UNAVAILABLE and refused because the shard is not
    at its step yet (a copy a push behind) did not land: the refusal stands. "Already closed"
    on a retry still means the first attempt landed."""
    from concurrent.futures import Future

    from parallax.protocol import bulk_codec

    with LocalCluster(1) as cluster, PSClient(cluster.addresses, OPTIONS) as client:
        spec = TableSpec(name="ahead_t", vocabulary_size=10, dim=2, num_workers=2)
        client.create_table(spec)
        conn = client.servers[0]

        def push(step: int) -> bytes:
            writer = bulk_codec.PushRequestWriter(spec.name, 0, step, 0, 1, 2,
                                                  np.dtype(np.float32), 0.0, 0, 1, 0)
            writer.ids[...] = [3]
            writer.grads[...] = 1.0
            return writer.data()

        failed: Future = Future()
        failed.set_exception(_Unavailable())
        done = (grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.FAILED_PRECONDITION)
        with pytest.raises(ServerError, match="step 1 is ahead of the open step 0"):
            conn.call("Push", push(1), spec.name, done_on_retry=done, pending=failed)
        failed = Future()
        failed.set_exception(_Unavailable())
        conn.call("Push", push(0), spec.name)  # worker 0's push of step 0 landed ...
        assert conn.call("Push", push(0), spec.name, done_on_retry=done,  # ... its retry:
                         pending=failed) is None  # ALREADY_EXISTS, taken for landed


def test_a_step_pushes_one_request_per_server_for_both_copies():
    """A multi-table push reaches each server once per worker and step, carrying the shards
    placed on it and the copies it keeps (`replica_push`), not once per copy set."""
    options = ClientOptions(**{**OPTIONS.__dict__, "replicas": 2})
    with LocalCluster(3) as cluster, PSClient(cluster.addresses, options) as client:
        specs = _specs("merged")
        tables = [client.create_table(spec) for spec in specs]
        steps = 3
        for step in range(steps):
            for worker in range(WORKERS):
                ids = [_ids(worker, step), _ids(worker + 7, step)]
                grads = [np.full((len(i), 4), 0.1, np.float32) for i in ids]
                push_many(tables, ids, grads, [step, step], worker, [0.0, 0.0])
        for address, reply in client.stats().items():
            pushes = {m.method: m.requests for m in reply.methods}.get("PushMany", 0)
            assert pushes == steps * WORKERS, (address, pushes)
        for spec in specs:  # every copy got every push: equal, bit for bit
            for shard in range(spec.shard_count):
                holders = [client.servers[s] for s in (shard % 3, (shard + 1) % 3)]
                first, second = (_shard_rows(conn, spec, shard) for conn in holders)
                np.testing.assert_array_equal(first, second)


def _shard_rows(conn, spec: TableSpec, shard: int) -> np.ndarray:
    """Every row of one shard as one server holds it (a Pull straight to that server)."""
    from parallax.protocol import wire
    from parallax.ps.v1 import ps_pb2

    ids = np.arange(spec.vocabulary_size, dtype=np.int64)
    request = ps_pb2.PullRequest(table=spec.name, shard_index=shard, full_precision=True)
    wire.encode(ids[ids % spec.shard_count == shard], request.ids)
    values, _ = conn.call("Pull", request, spec.name)
    return values



@contextlib.contextmanager
def _lagging_copy(tmp_path):
    """Two servers with a data directory each, a 1-shard table of 2 workers with its copy on
    the second: worker 0's push of step 0 reached both copies, worker 1's the first only
    (its request to the second still on its way). Yields (client, table, send the rest)."""
    from parallax.protocol import bulk_codec

    options = ClientOptions(**{**OPTIONS.__dict__, "replicas": 2})
    with LocalCluster(1, data_dir=tmp_path / "s0") as c0, \
            LocalCluster(1, data_dir=tmp_path / "s1") as c1, \
            PSClient(c0.addresses + c1.addresses, options) as client:
        spec = TableSpec(name="lag_t", vocabulary_size=10, dim=2, num_workers=2,
                         initializer=Initializer("uniform", seed=3))
        table = client.create_table(spec)
        table.push([1], np.ones((1, 2), np.float32), step=0, worker=0)
        writer = bulk_codec.PushRequestWriter(spec.name, 0, 0, 1, 1, 2, np.dtype(np.float32),
                                              0.0, 0, 1, table.session)
        writer.ids[...] = [2]
        writer.grads[...] = 1.0
        late = writer.data()
        client.servers[0].call("Push", late, spec.name)
        yield client, table, lambda: client.servers[1].call("Push", late, spec.name)


def _step_of(conn, table) -> int:
    from parallax.ps.v1 import ps_pb2
    return conn.call("WaitStep", ps_pb2.StepRequest(table=table.name, shard_index=0),
                     table.name).step


def test_a_step_wait_waits_for_every_copy_so_a_save_after_it_is_whole(tmp_path):
    """`wait_step(k)` (what a worker's `land_pushes` does before a checkpoint, an assign or
    an export) returns once every live copy applied step k, not the first alone: else a save
    wrote the copy a push behind at the step before, and a restore left the copies apart."""
    with _lagging_copy(tmp_path) as (client, table, send_late):
        timer = threading.Timer(0.5, send_late)
        timer.start()
        try:
            assert table.wait_step(1) == 1
            assert _step_of(client.servers[1], table) == 1
        finally:
            timer.join()
        saved = client.save("ckpt", [table.name])
        assert [s.step for s in saved] == [1]


def test_a_save_that_catches_a_copy_a_push_behind_is_refused(tmp_path):
    """A save not preceded by a step wait, with one copy a push behind: refused as caught
    mid-step (it wrote each copy at its own step: a restore left them apart)."""
    with _lagging_copy(tmp_path) as (client, table, send_late):
        with pytest.raises(ConfigError, match="mid-step"):
            client.save("ckpt", [table.name])
        send_late()
        assert [s.step for s in client.save("ckpt", [table.name])] == [1]


def test_a_pull_of_several_requests_to_a_copied_server_waits_in_each():
    """A pull too large for one request per server: with copies, every request carries its
    step (a request sent again to the copy after a loss waits there too); without, one
    empty request waits first and the pulls do not."""
    from parallax.client.many import pull_requests
    from parallax.client.many_calls import PullPart

    spec = TableSpec(name="big_t", vocabulary_size=100, dim=4, shard_count=1)
    parts = [PullPart(0, 0, lo, lo + 10, 40 << 20) for lo in (0, 10)]  # 2 requests (no RPC)
    for replicas, waiting in ((2, [5, 5]), (1, [0, 0])):
        with PSClient(["127.0.0.1:1", "127.0.0.1:2"],
                      ClientOptions(replicas=replicas)) as client:
            table = client.table(spec)
            ids = np.arange(20, dtype=np.int64)
            waits, requests = pull_requests([table], [ids], parts, [5])
            assert [r.min_steps[0] for _, _, r in requests] == waiting
            assert len(waits) == (replicas == 1)
