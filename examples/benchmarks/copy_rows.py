"""What a copy of every shard (`--replicas 2`) must receive each step, on the benchmark's
workloads: the rows the workers push (each worker's unique rows, summed over the workers:
what the copies get today, a push sent to both) against the rows the step changes (their
union: the least any way of keeping a copy equal must carry, be it the workers' pushes, the
primary's summed gradient or its new rows).

No servers, no TensorFlow: the ids of `parallax.bench.workloads.local_batch`, as the
benchmark's workers draw them (Zipf ids; ctr's 26 tables, lm's two).

    .venv/bin/python examples/benchmarks/copy_rows.py [--workers 2,4,8] [--steps 8]

Prints, per workload and worker count, both row counts a step and their ratio. A ratio near
1 means a copy fed anything but the workers' pushes saves little: its bytes and its
optimizer's work are per changed row.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from parallax.bench import workloads


def table_ids(spec: workloads.WorkloadSpec, batch: dict) -> list[np.ndarray]:
    """The ids a worker's batch pushes, per table (lm: context; targets and negatives)."""
    if spec.name == "lm":
        return [batch["context"].ravel(), np.concatenate([batch["targets"],
                                                          batch["negatives"]])]
    return [batch["ids"][:, t] for t in range(len(spec.table_rows))]


def rows_per_step(spec: workloads.WorkloadSpec, workers: int, steps: int) -> tuple[int, int]:
    """(the workers' unique rows summed, their union), per step, averaged over `steps`."""
    pushed = changed = 0
    for step in range(steps):
        per_worker = [table_ids(spec, workloads.local_batch(spec, rank, step))
                      for rank in range(workers)]
        for table in range(len(per_worker[0])):
            unique = [np.unique(ids[table]) for ids in per_worker]
            pushed += sum(u.size for u in unique)
            changed += np.unique(np.concatenate(unique)).size
    return pushed // steps, changed // steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", default="2,4,8", help="worker counts, comma-separated")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--workloads", default="ctr,lm")
    args = parser.parse_args()
    for name in args.workloads.split(","):
        spec = workloads.get(name)
        for count in (int(w) for w in args.workers.split(",")):
            pushed, changed = rows_per_step(spec, count, args.steps)
            print(f"{name} {count} workers: pushed {pushed} rows a step, changed {changed} "
                  f"(changed / pushed {changed / pushed:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
