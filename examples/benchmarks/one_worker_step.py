"""One worker's step, broken down: wall time, the worker's CPU and its embedded servers' CPU
per step, for the benchmark's models (`parallax.bench.workloads`) trained by the benchmark's
own trainer, in one process with its two embedded servers on this machine's cores.

A quick check of the one-worker row of `make compare` (hybrid against parallax's allreduce
mode) while working on the sparse path; `parallax bench` remains the reference.

    .venv/bin/python examples/benchmarks/one_worker_step.py hybrid ctr [--steps 200] [--rounds 2]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import psutil  # noqa: E402

from parallax.bench import worker, workloads  # noqa: E402


def _servers_cpu_s() -> float:
    return sum(sum(c.cpu_times()[:2]) for c in psutil.Process().children(recursive=True))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=["hybrid", "ps", "allreduce"])
    parser.add_argument("workload", choices=["lm", "ctr", "dense"])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=20)
    args = parser.parse_args()
    trainer = worker.parallax_trainer(args.mode, workloads.get(args.workload))
    for _ in range(args.warmup):
        trainer.step()
    trainer.sync()
    for _ in range(args.rounds):
        wall, cpu, servers = time.perf_counter(), time.process_time(), _servers_cpu_s()
        for _ in range(args.steps):
            trainer.step()
        trainer.sync()
        per_step = 1e3 / args.steps
        print(f"{args.mode} {args.workload}: {(time.perf_counter() - wall) * per_step:.2f} "
              f"ms/step, worker CPU {(time.process_time() - cpu) * per_step:.2f} ms, servers "
              f"CPU {(_servers_cpu_s() - servers) * per_step:.2f} ms", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
