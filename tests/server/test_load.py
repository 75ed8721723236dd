"""Load test: 64 concurrent clients (4 processes of 16 threads) against 2 real servers for
10 s, with Pull/Push on async fixed and keyed tables, PullMany/PushMany over both, and
lockstep Pull/Push on sync tables of 8 workers each (examples/benchmarks/load.py).

It asserts correctness only: no request failed, every row equals minus the exact sum of what
was pushed to it, every sync table reached the step its workers stopped at, every process
exited 0. Latency (p50/p99 per method) is printed, not asserted: the machine is shared.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from parallax.client.local_cluster import LocalCluster

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "benchmarks"))
import load  # noqa: E402

pytestmark = pytest.mark.multiprocess


def test_64_clients_for_10_seconds_get_no_errors_and_exact_rows():
    config = load.LoadConfig(clients=64, processes=4, seconds=10.0)
    with LocalCluster(2) as cluster:
        result = load.run_load(cluster.addresses, config)
    print("\n" + load.report(result))
    assert not result.errors, "requests failed under load:\n" + "\n".join(result.errors[:5])
    assert not result.problems, "\n".join(result.problems)
    assert all(result.latencies.get(m) for m in load.METHODS), "a method was never called"
    assert cluster.exit_codes == [0, 0], f"servers exited with {cluster.exit_codes}"
