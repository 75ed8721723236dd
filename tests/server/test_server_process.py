"""The server as a process: CLI arguments, graceful SIGTERM, message-size limits."""
from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from parallax.client import ClientOptions, PSClient
from parallax.client.local_cluster import LocalCluster
from parallax.errors import ServerError
from parallax.protocol.specs import TableSpec

PARALLAX = str(Path(sys.executable).parent / "parallax")


@pytest.mark.parametrize("args, message", [
    (["--port", "70000"], "--port 70000 is not a TCP port"),
    (["--max-message-mb", "0"], "--max-message-mb 0 must be >= 1"),
    (["--host", "203.0.113.9", "--port", "0"], "cannot listen on 203.0.113.9:0"),
])
def test_bad_server_arguments_fail_clearly(args, message):
    result = subprocess.run([PARALLAX, "server", *args], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2
    assert message in result.stderr


def test_port_in_use_is_reported():
    with LocalCluster(1) as cluster:
        port = cluster.addresses[0].rsplit(":", 1)[1]
        result = subprocess.run([PARALLAX, "server", "--port", port], capture_output=True,
                                text=True, timeout=60)
        assert result.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in result.stderr


def test_sigterm_ends_waiting_requests_and_exits_zero():
    cluster = LocalCluster(1, extra_args=["--grace-seconds", "2"]).start()
    try:
        with PSClient(cluster.addresses, ClientOptions(timeout=30, retries=0)) as client:
            table = client.create_table(TableSpec(name="t", vocabulary_size=10, dim=2,
                                                  num_workers=2))
            table.push([1], [[1, 1]], step=0, worker=0)
            errors = []

            def waiting_pull():
                try:
                    table.pull([1], min_step=1)  # can never complete: worker 1 never pushes
                except ServerError as exc:
                    errors.append(exc)
            reader = threading.Thread(target=waiting_pull)
            reader.start()
            time.sleep(0.5)
            t0 = time.monotonic()
            cluster.servers[0].proc.send_signal(signal.SIGTERM)
            assert cluster.servers[0].proc.wait(15) == 0
            reader.join(15)
            assert time.monotonic() - t0 < 10
            assert errors and "UNAVAILABLE" in str(errors[0])
    finally:
        cluster.stop()
    assert cluster.exit_codes == [0]


def test_large_pulls_and_pushes_are_chunked_below_the_limit():
    with LocalCluster(1, extra_args=["--max-message-mb", "1"]) as cluster, \
            PSClient(cluster.addresses, ClientOptions(max_message_mb=1)) as client:
        table = client.create_table(TableSpec(name="big", vocabulary_size=100_000, dim=16))
        ids = np.arange(100_000)  # 6.4 MB of rows: several chunks each way
        grads = np.ones((100_000, 16), np.float32)
        start = table.pull(ids)
        assert table.push(ids, grads, step=0) is True
        np.testing.assert_allclose(table.pull(ids, min_step=1), start - 0.01, rtol=1e-6)


def test_waiting_workers_do_not_starve_the_push_that_closes_the_step():
    """A server with 4 threads, a sync table with 2 shards on it, and a worker whose big pull
    for the next step is split into many chunks: the other worker's push must still get a
    thread and close the step (each waiting worker holds one thread per shard, not per chunk)."""
    with LocalCluster(1, extra_args=["--threads", "4"]) as cluster, \
            PSClient(cluster.addresses, ClientOptions(chunk_mb=1, timeout=20)) as client:
        spec = TableSpec(name="starve", vocabulary_size=200_000, dim=8, shard_count=2,
                         num_workers=2)
        table = client.create_table(spec, placement=[0, 0])
        ids = np.arange(200_000)  # 6.4 MB of rows: several 1 MB chunks per shard
        assert len(ids) // 2 > 2 * table.chunk_rows
        table.push([1], [[1] * 8], step=0, worker=0)
        result = {}
        reader = threading.Thread(target=lambda: result.update(rows=table.pull(ids, min_step=1)))
        reader.start()
        time.sleep(0.5)
        table.push([1], [[1] * 8], step=0, worker=1)
        reader.join(30)
        assert result["rows"][1, 0] == pytest.approx(-0.02) and result["rows"][0, 0] == 0


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_large_tables_are_initialised_lazily():
    """A 20M x 16 table (1.3 GB of rows, 2.6 GB with Adagrad slots) is created at once and
    the server's memory grows with the rows used, while every row reads as if initialised."""
    from parallax.protocol.initial_values import initial_rows
    from parallax.protocol.specs import Adagrad, Initializer
    with LocalCluster(1) as cluster, PSClient(cluster.addresses) as client:
        pid = cluster.servers[0].proc.pid
        before = _rss_mb(pid)
        spec = TableSpec(name="huge", vocabulary_size=20_000_000, dim=16,
                         initializer=Initializer("normal", seed=5), optimizer=Adagrad(0.1))
        t0 = time.monotonic()
        table = client.create_table(spec)
        assert time.monotonic() - t0 < 5
        ids = np.array([0, 7, 19_999_999, 12_345_678])
        np.testing.assert_array_equal(table.pull(ids), initial_rows(spec.initializer, ids, 16,
                                                                    "float32"))
        table.push(ids, np.ones((4, 16)), step=0)
        after = table.pull(ids, min_step=1)
        assert (after < initial_rows(spec.initializer, ids, 16, "float32")).all()
        assert _rss_mb(pid) - before < 200, (before, _rss_mb(pid))


def test_readme_quickstart_example_runs():
    example = Path(__file__).resolve().parents[2] / "examples" / "ps_quickstart.py"
    result = subprocess.run([sys.executable, str(example)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "pulled (2, 2, 64); row 3 moved by 0.0010" in result.stdout
