"""The server's CPU per step in its request handlers alone: one sync step of T one-shard tables
(default 13, what one of the benchmark's two servers holds of ctr's 26) applied through the
real `PushManyPacked` and `PullManyPacked` handlers, in this process, with no socket and no
thread: what is left of a step's server CPU once the transport is gone.

Each step: every worker's push (packed PushMany, decoded as the data plane decodes it), then
the next step's pull. Prints the CPU per step (median of the rounds); `--profile` adds
cProfile's top functions. `--grouped`: the T tables as one table group does it, one table
holding every table's rows at its offset, so a request has one part instead of T.

    .venv/bin/python examples/benchmarks/server_handlers.py [--tables 13] [--workers 1]
        [--optimizer sgd|adagrad|adam] [--steps 1000] [--rounds 3] [--grouped] [--profile]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "servers"))

from parallax.protocol import bulk_codec  # noqa: E402
from parallax.protocol.packed_codec import PullManyParts, PushManyParts  # noqa: E402
from parallax.protocol.specs import SGD, Adagrad, Adam, Initializer, TableSpec  # noqa: E402
from parallax.ps.v1 import ps_pb2  # noqa: E402
from parallax_ps.dataplane import _Context  # noqa: E402
from parallax_ps.service import ParameterServerService, request_deserializer  # noqa: E402

DIM, ROWS, DRAWS = 16, 400_000, 256
OPTIMIZERS = {"sgd": SGD(0.1), "adagrad": Adagrad(0.1), "adam": Adam(0.01)}


class Step:
    """T tables on one in-process service, and one step's requests as a worker sends them."""

    def __init__(self, tables: int, workers: int, optimizer, grouped: bool = False) -> None:
        self.service = ParameterServerService(None, 64 << 20)
        rng = np.random.default_rng(0)
        self.ids = [np.unique(rng.integers(0, ROWS, DRAWS)) for _ in range(tables)]
        self.names, self.workers = [f"t{t}" for t in range(tables)], workers
        rows = ROWS
        if grouped:  # one table, table t's rows at offset t * ROWS
            self.ids = [np.concatenate([ids + t * ROWS for t, ids in enumerate(self.ids)])]
            self.names, rows = ["group"], ROWS * tables
        for name in self.names:
            spec = TableSpec(name=name, vocabulary_size=rows, dim=DIM, shard_count=1,
                             num_workers=workers, optimizer=optimizer,
                             initializer=Initializer("uniform", seed=1))
            self.service.CreateTable(ps_pb2.CreateTableRequest(spec=spec.to_proto()),
                                     _Context(0))
        self.grads = [np.full((len(i), DIM), 1e-3, np.float32) for i in self.ids]
        self.pull_decode = request_deserializer("PullManyPacked")
        self.push_decode = request_deserializer("PushManyPacked")

    def requests(self, step: int) -> tuple[list, object]:
        """(every worker's decoded push of `step`, the decoded pull of the step after)."""
        pushes = []
        for worker in range(self.workers):
            headers = [(bulk_codec.PushHeader(name, 0, step, worker, 0.0, 0, 1, 0), len(ids),
                        DIM, np.dtype(np.float32)) for name, ids in zip(self.names, self.ids)]

            def fill(i, ids, rows):
                ids[...], rows[...] = self.ids[i], self.grads[i]
            pushes.append(self.push_decode(PushManyParts(headers, fill).packed()))
        pull = PullManyParts(self.names, [0] * len(self.names), [step + 1] * len(self.names),
                             self.ids).packed()
        return pushes, self.pull_decode(pull)

    def run(self, requests) -> None:
        context = _Context(30)
        for pushes, pull in requests:
            for push in pushes:
                self.service.PushManyPacked(push, context)
            self.service.PullManyPacked(pull, context)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tables", type=int, default=13)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="sgd")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--grouped", action="store_true")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    step = Step(args.tables, args.workers, OPTIMIZERS[args.optimizer], args.grouped)
    done = 0

    def requests(n: int) -> list:  # made before the clock starts: the client's work
        nonlocal done
        made = [step.requests(k) for k in range(done, done + n)]
        done += n
        return made
    step.run(requests(20))  # warm-up
    per_step = []
    for _ in range(args.rounds):
        batch = requests(args.steps)
        start = time.process_time()
        step.run(batch)
        per_step.append((time.process_time() - start) / args.steps)
    shape = "in one table group" if args.grouped else "each its own table"
    print(f"{args.tables} tables {shape}, {args.workers} worker(s), {args.optimizer}: server "
          f"handler CPU {statistics.median(per_step) * 1e3:.3f} ms per step (median of "
          f"{args.rounds} x {args.steps} steps; {args.workers} push(es) and 1 pull each)")
    if args.profile:
        profile = cProfile.Profile()
        batch = requests(args.steps)
        profile.enable()
        step.run(batch)
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    sys.exit(main())
