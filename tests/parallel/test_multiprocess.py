"""2 server processes (the `parallax server` CLI) and 2 worker processes on loopback.

Synchronous training on two workers must equal one client pushing the workers' averaged
gradients step by step, and every worker must have seen exactly the rows that client saw.
Every process is checked to exit 0.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from parallax.client import PSClient
from parallax.client.local_cluster import LocalCluster
from parallax.protocol.routing import sum_duplicates

import ps_worker  # tests/helpers/ (pyproject.toml's pythonpath)

WORKERS, STEPS = 2, 8
PARALLAX_CLI = (str(Path(sys.executable).parent / "parallax"), "server")


@pytest.mark.multiprocess
def test_two_workers_two_servers_match_single_client(tmp_path):
    with LocalCluster(2, command=PARALLAX_CLI, data_dir=tmp_path / "data") as cluster:
        servers = ",".join(cluster.addresses)
        workers = [subprocess.Popen(
            [sys.executable, str(Path(ps_worker.__file__)), "--servers", servers,
             "--rank", str(rank), "--workers", str(WORKERS), "--steps", str(STEPS),
             "--table", "mp", "--out", str(tmp_path / f"worker{rank}.npz")],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for rank in range(WORKERS)]
        try:
            outputs = [w.communicate(timeout=240)[0] for w in workers]
        finally:
            for w in workers:
                if w.poll() is None:
                    w.kill()
                    w.wait()
        for rank, (w, out) in enumerate(zip(workers, outputs)):
            assert w.returncode == 0, f"worker {rank} exited {w.returncode}:\n{out}"
        with PSClient(cluster.addresses) as client:
            trained = client.table(ps_worker.table_spec("mp", WORKERS, 3)).pull_all()
            reference = client.create_table(ps_worker.table_spec("ref", 1, 2))
            for step in range(STEPS):
                parts = []
                for rank in range(WORKERS):
                    ids = ps_worker.batch(rank, step)
                    rows = reference.pull(ids, min_step=step)
                    seen = np.load(tmp_path / f"worker{rank}.npz")[f"step{step}"]
                    np.testing.assert_array_equal(seen, rows, err_msg=f"rank {rank} step {step}")
                    parts.append(sum_duplicates(ids, ps_worker.gradient(rank, rows)))
                ids, summed = sum_duplicates(np.concatenate([p[0] for p in parts]),
                                             np.concatenate([p[1] for p in parts]))
                reference.push(ids, summed / np.float32(WORKERS), step=step)
            np.testing.assert_allclose(trained, reference.pull_all(), rtol=1e-6, atol=1e-7)
    assert cluster.exit_codes == [0, 0]
