"""The worker row cache's own cost per pull, without servers or TensorFlow: one worker's
unique ids per table of the benchmark's batches (`parallax.bench.workloads`, Zipf ids), pulled
through `CachingClient` in front of a table client that answers at once (zeros), against that
client alone. What is left is the cache's numpy work: lookups, the sketch, admission.

    .venv/bin/python examples/benchmarks/row_cache_pull.py ctr [--steps 200] [--staleness 4]
        [--mb 64] [--rounds 2] [--profile]
    .venv/bin/python examples/benchmarks/row_cache_pull.py ctr --ideal [--fresh-batches]

Prints CPU ms per pull for each round, both clients alternating, and the cache's hit rate.
--ideal prints instead the hit rate of an unbounded cache at staleness 0, 1, 4 and 16 (a row
fetched at step j serves steps up to j + staleness, then is fetched again): what any cache
could save on these ids. --fresh-batches draws every step's batch anew instead of cycling
the benchmark's pool of workloads.POOL_BATCHES.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from types import SimpleNamespace

import numpy as np

from parallax.bench import workloads
from parallax.client.row_cache import CachingClient, RowCache
from parallax.client.table_client import TableClient
from parallax.protocol.routing import Runs, ShardRouter

SHARDS = 2  # shards per table, as two servers would hold them


class Instant(TableClient):
    """Answers every pull at once with zero rows (what the servers' time is not)."""

    name = "instant"

    def start_pull(self, tables, min_steps, runs, clocks=None):
        rows = [np.zeros((n, t.spec.dim), t.dtype) for t, n in zip(tables, runs.lengths)]
        return SimpleNamespace(result=lambda: rows, abandon=lambda: None)

    def start_push(self, tables, grads, steps, worker, learning_rates, runs):
        raise NotImplementedError("pulls only")


def tables_of(spec: workloads.WorkloadSpec) -> list[SimpleNamespace]:
    """Stand-ins for the workload's `ShardedTable`s: what the cache reads of them."""
    return [SimpleNamespace(name=f"table_{k}", dtype=np.dtype(np.float32),
                            spec=SimpleNamespace(dim=spec.table_dim, vocabulary_size=rows,
                                                 hashed_keys=False),
                            router=ShardRouter(min(SHARDS, rows), rows, "mod"))
            for k, rows in enumerate(spec.table_rows)]


def step_ids(spec: workloads.WorkloadSpec, index: int, cycle: bool = True
             ) -> list[np.ndarray]:
    """Worker 0's unique ids per table of batch `index`: of the pool cycled, as the
    benchmark's data does, or (cycle=False) batch `index` itself."""
    batch = workloads.local_batch(spec, 0, index % workloads.POOL_BATCHES if cycle else index)
    if spec.name == "lm":
        per_table = [batch["context"], np.concatenate([batch["targets"], batch["negatives"]])]
    else:
        per_table = [batch["ids"][:, t] for t in range(len(spec.table_rows))]
    return [np.unique(ids) for ids in per_table]


def ideal_hit_rate(batch_ids, staleness: int, steps: int) -> float:
    """Rows answered by an unbounded cache of `staleness` over the second half of `steps`
    steps of `batch_ids(step)` (each table's unique ids), as a fraction of rows asked."""
    fetched: dict[tuple[int, int], int] = {}  # (table, id) -> step it was fetched at
    hits = asked = 0
    for step in range(steps):
        counted = step >= steps // 2
        for table, ids in enumerate(batch_ids(step)):
            for i in ids.tolist():
                last = fetched.get((table, i))
                if last is not None and step - last <= staleness:
                    hits += counted
                else:
                    fetched[(table, i)] = step
            asked += len(ids) if counted else 0
    return hits / asked if asked else 0.0


def timed(client: TableClient, tables, batches, first_step: int) -> float:
    """Seconds per pull over the batches, each at its own step (a sync pull's clock)."""
    start = time.process_time()
    for i, ids in enumerate(batches):
        step = first_step + i
        runs = Runs([t.router for t in tables], ids)
        client.start_pull(tables, [step] * len(tables), runs, [step] * len(tables)).result()
    return (time.process_time() - start) / len(batches)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("workload", choices=["lm", "ctr"])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--staleness", type=int, default=4)
    parser.add_argument("--mb", type=int, default=64, help="RowCache bytes, MiB")
    parser.add_argument("--profile", action="store_true", help="cProfile one cached round")
    parser.add_argument("--ideal", action="store_true",
                        help="an unbounded cache's hit rate at staleness 0, 1, 4, 16 instead")
    parser.add_argument("--fresh-batches", action="store_true",
                        help="--ideal: a new batch every step, not the cycled pool")
    args = parser.parse_args()
    spec = workloads.get(args.workload)
    if args.ideal:
        cycled = [step_ids(spec, i) for i in range(workloads.POOL_BATCHES)]
        batch_ids = (lambda step: step_ids(spec, step, cycle=False)) if args.fresh_batches \
            else (lambda step: cycled[step % len(cycled)])
        for staleness in (0, 1, 4, 16):
            print(f"{args.workload}: staleness {staleness}: ideal hit rate "
                  f"{ideal_hit_rate(batch_ids, staleness, args.steps):.1%}", flush=True)
        return 0
    tables = tables_of(spec)
    batches = [step_ids(spec, i) for i in range(workloads.POOL_BATCHES)]
    plan = [batches[i % len(batches)] for i in range(args.steps)]
    cache = CachingClient(RowCache(args.mb << 20, args.staleness), Instant())
    direct = Instant()
    timed(cache, tables, plan[:20], 0)  # the stores are made, the sketch starts
    step = 20
    for r in range(args.rounds):
        plain = timed(direct, tables, plan, step)
        cached = timed(cache, tables, plan, step)
        step += args.steps
        print(f"round {r}: {args.workload} uncached {plain * 1e3:.3f} ms/pull, cached "
              f"{cached * 1e3:.3f} ms/pull, hit rate {cache.stats().hit_rate:.1%}", flush=True)
    if args.profile:
        profile = cProfile.Profile(time.process_time)
        profile.runcall(timed, cache, tables, plan, step)
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    sys.exit(main())
