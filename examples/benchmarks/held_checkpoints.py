"""A checkpoint of the tables every step: held in the servers' memory (`save(held=True)`,
copy on write) against written to their disks (`save()`), and against none.

Two real server processes (LocalCluster, one data directory on this machine's disk), one
fixed-vocabulary table (--rows x --dim, Adagrad: one slot), one client pushing --ids Zipf
ids a step (a worker's push, one worker), rounds alternating the three ways:

    .venv/bin/python examples/benchmarks/held_checkpoints.py [--rows 1000000] [--rounds 3]

Prints one JSON line per round and way: ms a step (the push, the wait for its apply, the
save), ms of the save alone (median), the rows the held copies hold at the end (the rows the
steps since the oldest of the `keep` marks changed) and ms to roll back to the oldest held
mark (held only).
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time

import numpy as np

from parallax.client.local_cluster import LocalCluster
from parallax.client.ps_client import PSClient
from parallax.protocol.specs import Adagrad, TableSpec


def _ids(rng, rows: int, count: int) -> np.ndarray:
    return np.minimum(rng.zipf(1.2, size=count) - 1, rows - 1).astype(np.int64)


def run(client, way: str, args, round_: int) -> dict:
    name = f"held_{way}_{round_}"
    table = client.create_table(TableSpec(name=name, vocabulary_size=args.rows, dim=args.dim,
                                          shard_count=2, optimizer=Adagrad(0.1)))
    rng = np.random.default_rng(round_)
    table.push(np.arange(args.rows), np.ones((args.rows, args.dim), np.float32), step=0)
    steps, saves, marks = [], [], []
    for step in range(1, args.steps + 1):
        ids = _ids(rng, args.rows, args.ids)
        start = time.perf_counter()
        table.push(ids, rng.normal(size=(len(ids), args.dim)).astype(np.float32), step=step)
        table.wait_step(step + 1)
        saved = time.perf_counter()
        if way != "none":
            shards = client.save(f"bench-{name}", [name], keep=args.keep, held=way == "held")
            marks.append(shards[0].checkpoint)
        steps.append(time.perf_counter() - start)
        saves.append(time.perf_counter() - saved)
    result = {"way": way, "round": round_, "rows": args.rows, "dim": args.dim,
              "ids_a_step": args.ids, "step_ms": round(1e3 * float(np.median(steps)), 2),
              "save_ms": round(1e3 * float(np.median(saves)), 2)}
    if way == "held":
        oldest = marks[-args.keep]
        start = time.perf_counter()
        client.restore("", [name], oldest, held=True)
        result["rollback_ms"] = round(1e3 * (time.perf_counter() - start), 2)
    client.delete_table(table)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--ids", type=int, default=8192, help="ids pushed a step")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--keep", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as data, \
            LocalCluster(2, data_dir=data, extra_args=["--max-message-mb", "256"]) as cluster, \
            PSClient(cluster.addresses) as client:
        for round_ in range(args.rounds):
            ways = ["none", "held", "disk"] if round_ % 2 == 0 else ["disk", "held", "none"]
            for way in ways:
                print(json.dumps(run(client, way, args, round_)), flush=True)


if __name__ == "__main__":
    main()
