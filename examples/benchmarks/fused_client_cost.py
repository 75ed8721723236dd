"""The worker's CPU for one step's multi-table pull and push of a CTR-shaped model (26 tables of
dim 16, 256 Zipf ids each, two shards), with both worker data paths (PARALLAX_NATIVE=1 and 0)
in alternating rounds in one process, against two local servers. Tables are not grouped here
(`ParallaxStrategy` groups same-shaped tables into one server table): every table is a part
per shard, the per-part work the compiled path takes over.

    .venv/bin/python examples/benchmarks/fused_client_cost.py [--steps 200] [--rounds 3]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from parallax import native
from parallax.client import ClientOptions, PSClient
from parallax.client.local_cluster import LocalCluster
from parallax.client.many import _checked_runs, pull_many, start_push_many
from parallax.env import NATIVE_ENV
from parallax.protocol.specs import SGD, TableSpec

TABLES, DIM, IDS, ROWS = 26, 16, 256, 10_000_000  # rows of the largest table; 0.8x each next
PATHS = {"native": "1", "python": "0"}


def _window(tables, steps: int, rng, first: int = 0) -> tuple[float, float]:
    """(client CPU ms, wall ms) per step of `steps` pulls and pushes, sync step by step from
    step `first`."""
    cpu = wall = 0.0
    for step in range(first, first + steps):
        ids = [np.unique(rng.zipf(1.2, IDS) % t.spec.vocabulary_size) for t in tables]
        grads = [rng.normal(size=(len(i), DIM)).astype(np.float32) for i in ids]
        start_cpu, start_wall = time.process_time(), time.perf_counter()
        runs = _checked_runs(tables, ids)
        runs.expect_push = True  # a training step's pull: the push reuses its routing
        pull_many(tables, ids, [step] * len(tables), checked=runs)
        start_push_many(tables, ids, grads, [step] * len(tables), 0, [0.1] * len(tables),
                        checked=runs).result()
        cpu += time.process_time() - start_cpu
        wall += time.perf_counter() - start_wall
    return cpu / steps * 1e3, wall / steps * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if native.kernels() is None:
        print(f"the compiled kernels are missing: {native.describe()}", file=sys.stderr)
        return 1
    rng = np.random.default_rng(0)
    with LocalCluster(2) as cluster, PSClient(cluster.addresses, ClientOptions()) as client:
        for round_ in range(args.rounds):
            for path, value in PATHS.items():
                os.environ[NATIVE_ENV] = value
                tables = [client.create_table(TableSpec(
                    name=f"r{round_}{path}_{k}", vocabulary_size=int(ROWS * 0.8 ** k) + 1000,
                    dim=DIM, shard_count=2, optimizer=SGD(0.1))) for k in range(TABLES)]
                _window(tables, 10, rng)  # connections, first steps
                cpu, wall = _window(tables, args.steps, rng, first=10)
                print(f"round {round_} [{path}]: client CPU {cpu:.2f} ms/step, wall "
                      f"{wall:.2f} ms/step", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
