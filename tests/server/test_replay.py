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

import os
import signal

import grpc
import numpy as np
import pytest

from conftest import in_threads
from parallax.client import ClientOptions, PSClient
from parallax.client.local_cluster import SERVER_COMMAND, LocalCluster, ServerProcess
from parallax.client.replay import ReplayError
from test_replicas import OPTIONS, STEPS, WORKERS, _specs, _work

REPLAY = ClientOptions(**{**OPTIONS.__dict__, "replay_mb": 64})


def _train(cluster: LocalCluster, prefix: str, options: ClientOptions, kill=None):
    specs = _specs(prefix)
    clients = [PSClient(cluster.addresses, options) for _ in range(WORKERS)]
    try:
        for spec in specs:
            clients[0].create_table(spec)
        in_threads(lambda w: _work(clients[w], specs, w, kill if w == 0 else None), WORKERS)
        final = [clients[0].table(s) for s in specs]
        assert all(t.wait_step(STEPS) == STEPS for t in final)
        return [t.pull_all() for t in final]
    finally:
        for client in clients:
            client.close()


def _restart(cluster: LocalCluster, index: int, *args: str):
    """Kill server `index` (SIGKILL) and start another on its port; returns the dead one."""
    dead = cluster.servers[index]
    os.kill(dead.proc.pid, signal.SIGKILL)
    dead.proc.wait(10)
    port = dead.address.rsplit(":", 1)[1]
    command = [*SERVER_COMMAND, "--host", cluster.host, "--port", port, *args]
    if cluster.data_dir is not None:
        command += ["--data-dir", str(cluster.data_dir)]
    cluster.servers[index] = ServerProcess(index, command, None)
    assert cluster.servers[index].wait_ready(60) == dead.address
    return dead


@pytest.fixture(scope="module")
def baseline():
    with LocalCluster(2) as cluster:
        return _train(cluster, "plain", OPTIONS)


def test_a_server_started_again_is_rebuilt_from_the_workers_pushes(baseline):
    """No checkpoint: the replacement starts with the tables' initial rows (the servers draw
    them from the spec's seed) and the workers send it every push since step 0."""
    with LocalCluster(2) as cluster:
        dead = []
        rows = _train(cluster, "replayed", REPLAY,
                      kill=lambda: dead.append(_restart(cluster, 1)))
        assert dead[0].proc.returncode == -signal.SIGKILL
    for got, want in zip(rows, baseline):
        np.testing.assert_array_equal(got, want)


def test_pushes_that_do_not_reach_back_to_the_servers_step_fail_naming_why():
    """A log too small for one push keeps only the newest: the replacement (at step 0) needs
    the older ones, and the worker says so instead of training on wrong rows."""
    tiny = ClientOptions(**{**OPTIONS.__dict__, "replay_mb": 1, "timeout": 10})
    with LocalCluster(2) as cluster, PSClient(cluster.addresses, tiny) as client:
        spec = _specs("gap")[0]
        spec = type(spec)(**{**spec.__dict__, "num_workers": 1})
        table = client.create_table(spec)
        for conn in client._routes:  # noqa: SLF001 - a log of a few hundred bytes
            conn.log.max_bytes = 1
        for step in range(3):
            table.push(np.arange(100), np.ones((100, 4), np.float32), step=step)
        _restart(cluster, 1)
        with pytest.raises(ReplayError, match="kept its pushes only from step 2: it dropped "
                                              r"2 older push\(es\)") as err:
            table.pull_all()
        assert err.value.code == grpc.StatusCode.DATA_LOSS
