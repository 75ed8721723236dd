"""A Keras `fit` job for tests/integration/test_chaos.py: Adagrad on an embedding table (on the
servers) and a dense layer (all-reduced), with `BackupAndRestore` saving every epoch, run
under `parallax run --max-restarts N` while the test kills processes.

The checkpoint interval is one epoch of --interval steps, or --save-freq N steps
(`BackupAndRestore(save_freq=N)`: a resumed fit starts after the batches its backup trained,
parallax.tf.state.batch_resume; plain Keras 3 would start the epoch again from its first
batch). Every epoch sees the same --interval batches (`shuffle=False`), so a restarted fit
sees exactly what an uninterrupted one does from where it resumed on. --loop custom trains
the same steps in a custom loop with a `tf.train.CheckpointManager` instead (`custom_loop`).

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


def custom_loop(strategy, model, args, ids, labels, progress) -> None:
    """The same training as `fit`'s in the MWMS tutorial's shape: every worker restores the
    chief's `CheckpointManager.latest_checkpoint` (BACKUP/worker-0), the chief saves there
    every --save-freq steps (max_to_keep=2), the others into BACKUP/worker-RANK."""
    import tensorflow as tf
    optimizer, rank = model.optimizer, strategy.worker.rank
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
    chiefs = tf.train.CheckpointManager(checkpoint, os.path.join(args.backup, "worker-0"),
                                        max_to_keep=2)
    checkpoint.restore(chiefs.latest_checkpoint)
    manager = chiefs if rank == 0 else tf.train.CheckpointManager(
        checkpoint, os.path.join(args.backup, f"worker-{rank}"), max_to_keep=2)

    @tf.function
    def step(x, y):
        def replica(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss
        return strategy.run(replica, (x, y))

    done = int(optimizer.iterations.numpy())
    progress._say("start", done, pid=os.getpid(), workers=progress.workers)
    for k in range(done, args.epochs * args.interval):
        batch = slice((k % args.interval) * BATCH, (k % args.interval + 1) * BATCH)
        step(tf.constant(ids[batch]), tf.constant(labels[batch]))
        if (k + 1) % (args.save_freq or args.interval) == 0:
            manager.save()
        progress._say("step", k + 1)
        time.sleep(progress.delay)


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
    parser.add_argument("--loop", choices=["fit", "custom"], default="fit",
                        help="custom: a tf.function step and a CheckpointManager (custom_loop)")
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
    if args.loop == "custom":
        custom_loop(strategy, model, args, ids, labels, progress)
    else:
        callbacks = [keras.callbacks.BackupAndRestore(
            os.path.join(args.backup, f"worker-{rank}"), save_freq=args.save_freq or "epoch"),
            progress]
        model.fit(x=ids, y=labels, batch_size=BATCH, epochs=args.epochs,
                  steps_per_epoch=args.interval, shuffle=False, verbose=0,
                  callbacks=callbacks)
    stats = strategy.cache_stats()
    progress._say("end", args.epochs * args.interval, cache_hits=stats and stats.hits,
                  wire=sorted({vp.wire_dtype for vp in strategy.plan.on_servers}))
    if rank == 0:
        np.savez(args.out, **{w.path: w.numpy() for w in model.weights})
    sys.stdout.flush()


if __name__ == "__main__":
    main()
