"""The fixed cost of one data-plane request: server and client CPU per PullMany and PushMany
of one table part, by the part's size (1 row, 64 rows, a ctr step's ~3,300 rows of dim 16),
in alternating rounds (medians).

What it shows: with W workers and a server on every worker's host, each server answers 2W
requests a step (every worker's pull and push), and each worker sends 2W; a cost paid per
request, whatever its rows, grows with W while the rows per server do not. The 1-row figure
is that cost; the difference to the ctr-sized one is what the rows add. Server CPU comes
from /proc (utime + stime of the server process), the client's from time.process_time().

    .venv/bin/python examples/benchmarks/request_floor.py [--requests 1500] [--rounds 3]
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from request_cost import _cpu_seconds, write  # noqa: E402

from parallax.client import PSClient  # noqa: E402
from parallax.client.local_cluster import LocalCluster  # noqa: E402
from parallax.client.many import pull_many, push_many  # noqa: E402
from parallax.protocol.specs import SGD, Initializer, TableSpec  # noqa: E402

DIM, ROWS = 16, 400_000
SIZES = (1, 64, 3300)  # rows of the part: the floor, a small part, a ctr step's rows
WARMUP = 50


def _calls(table, sizes: tuple[int, ...]) -> dict:
    """{(kind, rows): a function sending one such request}; async table: pushes never wait."""
    rng, steps, calls = np.random.default_rng(0), itertools.count(), {}
    for rows in sizes:
        ids = np.unique(rng.integers(0, ROWS, 2 * rows))[:rows]
        grads = np.ones((len(ids), DIM), np.float32)
        calls[("pull", rows)] = lambda ids=ids: pull_many([table], [ids], [0])
        calls[("push", rows)] = lambda ids=ids, grads=grads: push_many(
            [table], [ids], [grads], [next(steps)], 0, [0.0])
    return calls


def _measure(call, n: int, pid: int) -> tuple[float, float, float]:
    """(server, client, wall) seconds per request over `n` requests."""
    server, client, wall = _cpu_seconds([pid]), time.process_time(), time.perf_counter()
    for _ in range(n):
        call()
    return ((_cpu_seconds([pid]) - server) / n, (time.process_time() - client) / n,
            (time.perf_counter() - wall) / n)


def run(requests: int, rounds: int, sizes: tuple[int, ...] = SIZES) -> dict:
    spec = TableSpec(name="floor", vocabulary_size=ROWS, dim=DIM, shard_count=1,
                     initializer=Initializer("uniform", seed=1),
                     optimizer=SGD(learning_rate=0.1), sync_mode="async")
    measured: dict = {}
    with LocalCluster(1) as cluster, PSClient(cluster.addresses) as client:
        pid = cluster.servers[0].proc.pid
        calls = _calls(client.create_table(spec), sizes)
        for call in calls.values():
            for _ in range(WARMUP):
                call()
        for _ in range(rounds):  # alternating: every kind and size sees the same noise
            for key, call in calls.items():
                n = requests if key[1] < 1000 else max(1, requests // 3)
                measured.setdefault(key, []).append(_measure(call, n, pid))
    return {f"{kind} {rows}": {name: statistics.median(r[i] for r in runs) * 1e6
                               for i, name in enumerate(("server_us", "client_us", "wall_us"))}
            for (kind, rows), runs in measured.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench-results/request_floor.json"))
    args = parser.parse_args()
    report = run(args.requests, args.rounds)
    print(f"one data-plane request of one part (dim {DIM}), 1 server, "
          f"{args.rounds} alternating rounds (medians)")
    print(f"{'request':12s} {'server us':>10s} {'client us':>10s} {'wall us':>9s}")
    for key, f in report.items():
        print(f"{key:12s} {f['server_us']:10.0f} {f['client_us']:10.0f} {f['wall_us']:9.0f}")
    write(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
