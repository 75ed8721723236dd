"""A Keras `fit` job for tests/integration/test_chaos.py: Adagrad on an embedding table (on the
servers) and a dense layer (all-reduced), with `BackupAndRestore` saving every epoch, run
under `parallax run --max-restarts N` while the test kills processes.

The checkpoint interval is one epoch of --interval steps, or --save-freq N steps
(`BackupAndRestore(save_freq=N)`: a resumed fit starts after the batches its backup trained,
parallax.tf.state.batch_resume; plain Keras 3 would start the epoch again from its first
batch). Every epoch sees the same --interval batches (`shuffle=False`), so a restarted fit
sees exactly what an uninterrupted one does from where it resumed on.

Every worker prints one JSON line per event, flushed, for the test to time its kills:
{"chaos": "start", "attempt", "rank", "step", "time", "pid", "workers"} when training
(re)starts at `step` (steps already done, at its first step; workers: the class that sums the dense
gradients), {"chaos": "step", "attempt", "rank", "step", "time"} after each step (steps
done; time: time.time()), and {"chaos": "end", ..., "cache_hits", "wire"} after fit (rows
the row cache served, null without one; the tables' wire dtypes). --step-delay paces the
steps so that a kill lands inside an epoch (in the first --paced-attempts attempts only).
Worker 0 writes the final weights (the whole embedding table, pulled from the servers, and
the dense layer) to --out as an .npz. --cache-staleness turns the worker row cache on
(`parallax.RowCache`), --wire-dtype narrows the rows on the wire
(`ParallaxStrategy(wire_dtype=...)`).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from resume_worker import BATCH, build, data

import keras  # noqa: E402  (resume_worker set TF's log level first)
import numpy as np  # noqa: E402

import parallax  # noqa: E402


class Progress(keras.callbacks.Callback):
    """Prints where training (re)starts and every step done, as JSON lines."""

    def __init__(self, interval: int, rank: int, delay: float, workers: str) -> None:
        super().__init__()
        self.interval, self.rank, self.delay, self.workers = interval, rank, delay, workers
        self.attempt = int(os.environ.get("PARALLAX_RESTART_COUNT", "0"))
        self.started = False
        self.epoch = 0

    def _say(self, event: str, step: int, **extra) -> None:
        print(json.dumps({"chaos": event, "attempt": self.attempt, "rank": self.rank,
                          "step": step, "time": time.time(), **extra}), flush=True)

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if not self.started:  # BackupAndRestore chose the first epoch (and batch)
            self.started = True
            self._say("start", self.epoch * self.interval + batch, pid=os.getpid(),
                      workers=self.workers)

    def on_train_batch_end(self, batch, logs=None):
        self._say("step", self.epoch * self.interval + batch + 1)
        time.sleep(self.delay)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--interval", type=int, default=4, help="steps per epoch = per save")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--step-delay", type=float, default=0.0)
    parser.add_argument("--paced-attempts", type=int, default=1 << 30,
                        help="--step-delay paces only the first N attempts (those with kills)")
    parser.add_argument("--save-freq", type=int, default=None,
                        help="BackupAndRestore saves every N steps (default: every epoch)")
    parser.add_argument("--backup", required=True, help="BackupAndRestore's directory")
    parser.add_argument("--out", required=True, help="worker 0's final weights (.npz)")
    parser.add_argument("--cache-staleness", type=int, default=None)
    parser.add_argument("--wire-dtype", default=None)
    args = parser.parse_args()
    cache = None if args.cache_staleness is None else parallax.RowCache(
        staleness=args.cache_staleness)
    strategy = parallax.ParallaxStrategy(log_plan=False, cache=cache, wire_dtype=args.wire_dtype)
    ids, labels = data(args.interval)
    with strategy.scope():
        model = build("adagrad")
    rank = strategy.worker.rank
    attempt = int(os.environ.get("PARALLAX_RESTART_COUNT", "0"))
    progress = Progress(args.interval, rank,
                        args.step_delay if attempt < args.paced_attempts else 0.0,
                        type(strategy.extended.workers).__name__)
    callbacks = [keras.callbacks.BackupAndRestore(os.path.join(args.backup, f"worker-{rank}"),
                                                  save_freq=args.save_freq or "epoch"),
                 progress]
    model.fit(x=ids, y=labels, batch_size=BATCH, epochs=args.epochs,
              steps_per_epoch=args.interval, shuffle=False, verbose=0, callbacks=callbacks)
    stats = strategy.cache_stats()
    progress._say("end", args.epochs * args.interval, cache_hits=stats and stats.hits,
                  wire=sorted({vp.wire_dtype for vp in strategy.plan.on_servers}))
    if rank == 0:
        np.savez(args.out, **{w.path: w.numpy() for w in model.weights})
    sys.stdout.flush()


if __name__ == "__main__":
    main()
