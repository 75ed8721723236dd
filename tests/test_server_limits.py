"""A server under a stuck step (issue 13, defect 8): waiting pulls cannot take the threads of
pushes and health checks, --threads is checked against workers x shards, and a timeout names
the workers that have not pushed. Real server processes on loopback, free ports."""
from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from parallax.client import ClientOptions, PSClient
from parallax.client.connection import ServerConnection
from parallax.errors import ServerError
from parallax.local_cluster import LocalCluster
from parallax.specs import TableSpec

PARALLAX = str(Path(sys.executable).parent / "parallax")


def sync_spec(name: str, shards: int = 1) -> TableSpec:
    return TableSpec(name=name, vocabulary_size=16, dim=2, shard_count=shards, num_workers=2)


def test_waiting_pulls_leave_threads_for_pushes_and_health_checks():
    """Both of the server's 2 threads for waiting RPCs hold a pull of step 1; worker 0's push,
    a health check and Stats are still answered at once, and worker 1's push frees the pulls."""
    with LocalCluster(1, extra_args=["--threads", "2"]) as cluster, \
            PSClient(cluster.addresses, ClientOptions(timeout=20, retries=0)) as waiting, \
            PSClient(cluster.addresses, ClientOptions(timeout=3, retries=0)) as quick:
        table = waiting.create_table(sync_spec("stuck"))
        pulled, pullers = [], []
        for _ in range(2):
            pullers.append(threading.Thread(
                target=lambda: pulled.append(table.pull([1], min_step=1))))
            pullers[-1].start()
        time.sleep(0.5)  # both pulls are in, waiting for step 1
        started = time.monotonic()
        assert quick.table(sync_spec("stuck")).push([1], [[1, 1]], step=0, worker=0) is False
        assert ServerConnection(cluster.addresses[0], quick.options).healthy(timeout=2)
        assert quick.stats()
        assert time.monotonic() - started < 2.5
        assert pulled == []  # still waiting: worker 1 has not pushed
        quick.table(sync_spec("stuck")).push([1], [[1, 1]], step=0, worker=1)
        for puller in pullers:
            puller.join(10)
        assert len(pulled) == 2 and all(p[0, 0] != 0 for p in pulled)


def test_a_timed_out_pull_names_the_workers_that_have_not_pushed():
    with LocalCluster(1) as cluster, \
            PSClient(cluster.addresses, ClientOptions(timeout=1.5, retries=0)) as client:
        table = client.create_table(sync_spec("late"))
        table.push([1], [[1, 1]], step=0, worker=0)
        with pytest.raises(ServerError) as caught:
            table.pull([1], min_step=1)
    message = str(caught.value)
    assert "DEADLINE_EXCEEDED" in message, message
    assert "worker(s) [1] of 2 have not pushed step 0" in message, message
    assert "complete pushes: [0]" in message, message


def test_threads_below_workers_times_sync_shards_are_refused_at_create():
    """2 workers x 2 shards fit 4 threads; one more shard of another sync table would need 6,
    the issue's 4 shards 8: refused, naming the flag and what to set."""
    with LocalCluster(1, extra_args=["--threads", "4"]) as cluster, \
            PSClient(cluster.addresses, ClientOptions(timeout=10, retries=0)) as client:
        client.create_table(sync_spec("fits", shards=2), placement=[0, 0])
        with pytest.raises(ServerError) as caught:
            client.create_table(sync_spec("more"))
        assert "--threads 4" in str(caught.value) and "--threads 6 or more" in str(caught.value), caught.value
        assert "FAILED_PRECONDITION" in str(caught.value)
        with pytest.raises(ServerError, match="--threads 12 or more"):
            client.create_table(sync_spec("four", shards=4), placement=[0, 0, 0, 0])
        async_spec = TableSpec(name="async", vocabulary_size=16, dim=2, num_workers=8,
                               sync_mode="async")
        client.create_table(async_spec)  # async pulls never wait for a step


def test_reserved_threads_must_be_positive():
    result = subprocess.run([PARALLAX, "server", "--reserved-threads", "0"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "--reserved-threads 0 must be >= 1" in result.stderr
