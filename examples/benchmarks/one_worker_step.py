"""One worker's step, broken down: wall time, the worker's CPU and its embedded servers' CPU
per step, for the benchmark's models (`parallax.bench.workloads`) trained by the benchmark's
own trainer, in one process with its two embedded servers on this machine's cores.

A quick check of the one-worker row of `make compare` (hybrid against parallax's allreduce
mode) while working on the sparse path; `parallax bench` remains the reference.

    .venv/bin/python examples/benchmarks/one_worker_step.py hybrid ctr [--steps 200] [--rounds 2]

`--paths native,python` times both worker data paths (PARALLAX_NATIVE=1 and 0) in turn in
each round, in one process on one model, and splits out the worker CPU spent inside the
fused pull and push ops (their threads' CPU).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import psutil  # noqa: E402

from parallax.bench import worker, workloads  # noqa: E402
from parallax.env import NATIVE_ENV  # noqa: E402
from parallax.client import step as step_traffic  # noqa: E402

PATHS = {"native": "1", "python": "0", "auto": "auto"}  # --paths: PARALLAX_NATIVE of each
_FUSED_CPU = {"pull": 0.0, "push": 0.0}  # thread CPU seconds inside the fused ops


def _timed(cls, key: str) -> None:
    """Count the thread CPU spent inside `cls.__call__` (a fused op's numpy body)."""
    original = cls.__call__

    def call(self, *args):
        start = time.thread_time()
        try:
            return original(self, *args)
        finally:
            _FUSED_CPU[key] += time.thread_time() - start
    cls.__call__ = call


def _switches() -> int:
    """This process's context switches so far, voluntary and not, over all its threads."""
    total = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/status") as status:
                total += sum(int(line.split()[1]) for line in status if "ctxt_switches" in line)
        except OSError:  # a thread that ended meanwhile
            pass
    return total


def _servers_cpu_s() -> float:
    return sum(sum(c.cpu_times()[:2]) for c in psutil.Process().children(recursive=True))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=["hybrid", "ps", "allreduce"])
    parser.add_argument("workload", choices=["lm", "ctr", "dense"])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--paths", default="auto",
                        help="worker data paths to alternate in each round: native, python, "
                             "auto (comma-separated)")
    args = parser.parse_args()
    paths = args.paths.split(",")
    if any(p not in PATHS for p in paths):
        parser.error(f"--paths {args.paths!r}: each must be one of {', '.join(PATHS)}")
    _timed(step_traffic.FusedPull, "pull")
    _timed(step_traffic.FusedPush, "push")
    trainer = worker.parallax_trainer(args.mode, workloads.get(args.workload))
    for path in paths:  # each path's first steps (and their tracing) before any timing
        os.environ[NATIVE_ENV] = PATHS[path]
        for _ in range(args.warmup):
            trainer.step()
        trainer.sync()
    for _ in range(args.rounds):
        for path in paths:
            os.environ[NATIVE_ENV] = PATHS[path]
            _window(trainer, args, path)
    return 0


def _window(trainer, args, path: str) -> None:
    _FUSED_CPU.update(pull=0.0, push=0.0)
    wall, cpu, servers = time.perf_counter(), time.process_time(), _servers_cpu_s()
    switches = _switches()
    for _ in range(args.steps):
        trainer.step()
    trainer.sync()
    per_step = 1e3 / args.steps
    print(f"{args.mode} {args.workload} [{path}]: "
          f"{(time.perf_counter() - wall) * per_step:.2f} ms/step, worker CPU "
          f"{(time.process_time() - cpu) * per_step:.2f} ms (fused pull "
          f"{_FUSED_CPU['pull'] * per_step:.2f}, push {_FUSED_CPU['push'] * per_step:.2f}), "
          f"servers CPU {(_servers_cpu_s() - servers) * per_step:.2f} ms, worker context "
          f"switches {(_switches() - switches) / args.steps:.1f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
