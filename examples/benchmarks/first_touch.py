"""What rows never touched before cost a server: its CPU per sync step when every step's ids
are new (a long-tailed stream: the initial values drawn, the rows' pages first written)
against the same load on rows already touched, in alternating rounds (medians).

W worker processes (default 4) each pull and push P parts (tables, default 13) of R unique
ids (default 130, dim 16, Adagrad, the Keras `Embedding` default `uniform` initializer or
--initializer) a step to one server; `fresh` draws every step's ids at random from ROWS
(default 1M) a table, `warm` cycles 16 sets of ids already touched. Server CPU is utime +
stime from /proc. The first-touch kernels (`parallax/native/src/server_init.cc`) measured
with an earlier build of this harness: 11.7 -> 7.95 ms a step (fresh, 4 workers).

    .venv/bin/python examples/benchmarks/first_touch.py [--steps 300] [--rounds 2]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from request_cost import _cpu_seconds, write  # noqa: E402

from parallax.client import PSClient  # noqa: E402
from parallax.client.local_cluster import LocalCluster  # noqa: E402
from parallax.client.many import pull_many, push_many  # noqa: E402
from parallax.protocol.specs import Adagrad, Initializer, TableSpec  # noqa: E402

DIM, POOL = 16, 16


def _specs(args, prefix: str) -> list[TableSpec]:
    return [TableSpec(name=f"{prefix}{i}", vocabulary_size=args.rows, dim=DIM, shard_count=1,
                      initializer=Initializer(args.initializer, seed=i + 1),
                      optimizer=Adagrad(learning_rate=0.1), sync_mode="sync",
                      num_workers=args.workers) for i in range(args.parts)]


def _worker(address: str, args, prefix: str, fresh: bool, rank: int, first: int,
            steps: int) -> None:
    with PSClient([address]) as client:
        tables = [client.table(spec) for spec in _specs(args, prefix)]

        def ids(rng) -> list[np.ndarray]:
            return [np.unique(rng.integers(0, args.rows, 2 * args.ids))[:args.ids]
                    for _ in tables]
        pooled = np.random.default_rng([rank, 0])  # the same pool in every call
        pool = [ids(pooled) for _ in range(POOL)]
        new = np.random.default_rng([rank, 1, first])
        for step in range(first, first + steps):
            step_ids = ids(new) if fresh else pool[step % POOL]
            grads = [np.full((len(i), DIM), 0.01, np.float32) for i in step_ids]
            pull_many(tables, step_ids, [step] * len(tables))
            push_many(tables, step_ids, grads, [step] * len(tables), rank,
                      [0.1] * len(tables))


def _steps(address: str, args, prefix: str, fresh: bool, first: int, steps: int) -> None:
    procs = [mp.get_context("spawn").Process(
        target=_worker, args=(address, args, prefix, fresh, rank, first, steps))
        for rank in range(args.workers)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
        if proc.exitcode:
            raise SystemExit(f"a worker failed (exit code {proc.exitcode})")


def run(args) -> dict:
    measured: dict[str, list[float]] = {"fresh": [], "warm": []}
    with LocalCluster(1) as cluster, PSClient(cluster.addresses) as client:
        pid, address = cluster.servers[0].proc.pid, cluster.addresses[0]
        for rnd in range(args.rounds):
            for mode in measured:  # new tables each round: every fresh step meets new rows
                prefix = f"{mode}{rnd}_"
                for spec in _specs(args, prefix):
                    client.create_table(spec)
                _steps(address, args, prefix, False, 0, POOL)  # warm: the pool's rows touched
                before = _cpu_seconds([pid])
                _steps(address, args, prefix, mode == "fresh", POOL, args.steps)
                measured[mode].append((_cpu_seconds([pid]) - before) / args.steps * 1e3)
                client.delete_tables(prefix)  # (a fresh round's tables are resident now)
                print(f"round {rnd} {mode}: server {measured[mode][-1]:.2f} ms a step",
                      flush=True)
    return {mode: {"server_ms_per_step": statistics.median(v), "rounds": v}
            for mode, v in measured.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--parts", type=int, default=13)
    parser.add_argument("--ids", type=int, default=130)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--initializer", default="uniform",
                        choices=("uniform", "normal", "truncated_normal"))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("bench-results/first_touch.json"))
    args = parser.parse_args()
    report = run(args)
    for mode, figures in report.items():
        print(f"{mode}: server {figures['server_ms_per_step']:.2f} ms a step (median)")
    write(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
