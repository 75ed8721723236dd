"""A server's CPU per data-plane request when W sync workers reach it at once, the server
held to a slice of a core (as `parallax bench --cpu-share` holds a host): what a request
costs under contention, beside its cost with one worker.

Each worker (a process of its own, not held) pulls its rows of the open step (waiting for
it), then pushes its gradient, `--steps` times, on one sync table of one shard: every step
the server answers W pulls, most of which wait for the step's last push, and W pushes.
Server CPU is its process's utime + stime (/proc) over the timed steps; the step time is the
wall time per step. The CPU group needs root and cgroup v1 (`--share 0` runs unheld).

    .venv/bin/python examples/benchmarks/request_contention.py [--share 0.125] [--rows 1]
        [--workers 1,8] [--requests 6000] [--rounds 2]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from request_cost import _cpu_seconds, write  # noqa: E402

from parallax.bench.cgroups import CpuGroups  # noqa: E402
from parallax.client import PSClient  # noqa: E402
from parallax.client.local_cluster import LocalCluster  # noqa: E402
from parallax.client.many import pull_many, push_many  # noqa: E402
from parallax.protocol.specs import SGD, Initializer, TableSpec  # noqa: E402

DIM, ROWS = 16, 400_000
WARMUP_STEPS = 20


def _spec(workers: int) -> TableSpec:
    return TableSpec(name="contention", vocabulary_size=ROWS, dim=DIM, shard_count=1,
                     num_workers=workers, initializer=Initializer("uniform", seed=1),
                     optimizer=SGD(learning_rate=0.1))


def _worker(address: str, workers: int, rank: int, steps: int, rows: int, queue) -> None:
    with PSClient([address]) as client:
        table = client.create_table(_spec(workers))
        ids = np.unique(np.random.default_rng(rank).integers(0, ROWS, 2 * rows))[:rows]
        grads = np.ones((len(ids), DIM), np.float32)
        for step in range(WARMUP_STEPS + steps):
            if step == WARMUP_STEPS:
                queue.put("warm")
            pull_many([table], [ids], [step])
            push_many([table], [ids], [grads], [step], rank, [0.1])
        queue.put("done")


def _run(workers: int, steps: int, rows: int, share: float) -> tuple[float, float]:
    """(server us per request, ms per step) of one run."""
    with LocalCluster(1) as cluster, CpuGroups(share or 1.0, prefix="pxrc") as groups:
        pid = cluster.servers[0].proc.pid
        if share:
            groups.add("server", pid)
        queue = mp.Queue()
        procs = [mp.Process(target=_worker, args=(cluster.addresses[0], workers, rank, steps,
                                                  rows, queue)) for rank in range(workers)]
        for proc in procs:
            proc.start()
        for _ in procs:  # every worker past its warm-up (the step they wait on is shared)
            queue.get()
        server, wall = _cpu_seconds([pid]), time.perf_counter()
        for _ in procs:
            queue.get()
        server, wall = _cpu_seconds([pid]) - server, time.perf_counter() - wall
        for proc in procs:
            proc.join()
    return server / (2 * workers * steps) * 1e6, wall / steps * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--share", type=float, default=0.125)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--workers", default="1,8")
    parser.add_argument("--requests", type=int, default=6000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path,
                        default=Path("bench-results/request_contention.json"))
    args = parser.parse_args()
    counts = [int(w) for w in args.workers.split(",")]
    runs: dict[int, list[tuple[float, float]]] = {w: [] for w in counts}
    for _ in range(args.rounds):  # alternating: every worker count sees the same noise
        for workers in counts:
            runs[workers].append(_run(workers, max(10, args.requests // (2 * workers)),
                                      args.rows, args.share))
    print(f"one sync table, {args.rows} row(s) of dim {DIM} per request, server held to "
          f"{args.share or 'all'} core(s), {args.rounds} alternating rounds (medians)")
    print(f"{'workers':>7s} {'server us/request':>18s} {'ms/step':>8s}")
    report = {}
    for workers, measured in runs.items():
        us = statistics.median(m[0] for m in measured)
        ms = statistics.median(m[1] for m in measured)
        report[str(workers)] = {"server_us_per_request": us, "ms_per_step": ms,
                                "rounds": measured}
        print(f"{workers:7d} {us:18.0f} {ms:8.2f}")
    write(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
