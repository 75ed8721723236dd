"""A worker process for the multi-process test: synchronous steps against real servers.

Each step pulls the rows its batch needs for that step (waiting for the previous step to
close), computes the gradient of 0.5 * ||row - target||^2 scaled per worker, and pushes it.
The pulled rows are written to an .npz so the test can check what every worker saw.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from parallax.client import PSClient
from parallax.protocol.specs import Adam, Initializer, TableSpec


def table_spec(name: str, num_workers: int, shard_count: int) -> TableSpec:
    return TableSpec(name=name, vocabulary_size=5000, dim=8, shard_count=shard_count,
                     num_workers=num_workers, aggregation="mean",
                     initializer=Initializer("normal", stddev=0.5, seed=3),
                     optimizer=Adam(learning_rate=0.05))


def batch(rank: int, step: int) -> np.ndarray:
    rng = np.random.default_rng(1000 * rank + step)
    return np.minimum(rng.zipf(1.3, size=256) - 1, 4999)


def gradient(rank: int, rows: np.ndarray) -> np.ndarray:
    return ((rows - 1.0) * (rank + 1) / len(rows)).astype(np.float32)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--servers", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--workers", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--table", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    with PSClient(args.servers.split(",")) as client:
        client.wait_ready(30)
        table = client.create_table(table_spec(args.table, args.workers, 3))
        client.barrier(f"{args.table}-start", args.rank, args.workers)
        seen = {}
        for step in range(args.steps):
            ids = batch(args.rank, step)
            rows = table.pull(ids, min_step=step)
            seen[f"step{step}"] = rows
            table.push(ids, gradient(args.rank, rows), step=step, worker=args.rank)
        table.wait_step(args.steps)
        client.barrier(f"{args.table}-end", args.rank, args.workers)
    np.savez(args.out, **seen)
    print(f"worker {args.rank}: {args.steps} steps done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
