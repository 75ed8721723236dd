"""What the three training examples share: flags, the strategy, the per-epoch report and the
final `RESULT {json}` line.

The report is a Keras callback. Every worker measures its own epoch (time, steps, rows and
bytes pulled from / pushed to the parameter servers), then the workers combine their figures
with `strategy.reduce` (metrics: mean over workers, bytes: sum), and the chief prints one line
per epoch. Throughput counts global examples (every worker's share of each global batch).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TensorFlow is imported

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import keras  # noqa: E402

import parallax  # noqa: E402

MB = 1e6


def base_parser(description: str, *, epochs: int, batch_size: int, steps_per_epoch: int,
                lr: float) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--mode", choices=("hybrid", "ps", "allreduce"), default="hybrid",
                        help="ParallaxStrategy(mode=...): sparse tables on the servers and "
                             "dense weights all-reduced, everything on the servers, or "
                             "everything replicated")
    parser.add_argument("--async", dest="async_", action="store_true",
                        help="asynchronous pushes to the parameter servers (default: sync)")
    parser.add_argument("--servers", type=int, default=2,
                        help="parameter servers to start when none are given by `parallax "
                             "run` (the embedded single-process default)")
    parser.add_argument("--epochs", type=int, default=epochs)
    parser.add_argument("--steps-per-epoch", type=int, default=steps_per_epoch,
                        help="training steps per epoch (0: one pass over the data)")
    parser.add_argument("--batch-size", type=int, default=batch_size,
                        help="GLOBAL batch size: each of W workers gets 1/W of every batch")
    parser.add_argument("--lr", type=float, default=lr, help="learning rate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--verbose", type=int, choices=(0, 1, 2), default=0,
                        help="Keras progress output on the chief (the per-epoch report "
                             "below is printed regardless)")
    parser.add_argument("--tensorboard", metavar="DIR", default=None,
                        help="the chief writes per-epoch TensorBoard scalars (loss, metrics, "
                             "examples/s, MB/s pulled and pushed) under DIR")
    return parser


def make_strategy(args) -> "parallax.ParallaxStrategy":
    keras.utils.set_random_seed(args.seed)  # same initial weights on every worker
    return parallax.ParallaxStrategy(mode=args.mode, sync=not args.async_,
                                     embedded_servers=args.servers)


def steps_per_epoch(args, examples: int, what: str) -> int:
    one_pass = examples // args.batch_size
    if one_pass < 1:
        sys.exit(f"{what}: {examples} examples is less than one global batch of "
                 f"{args.batch_size}; lower --batch-size or use more data")
    return min(args.steps_per_epoch, one_pass) if args.steps_per_epoch > 0 else one_pass


def global_batches(args, train: tuple, held_out: tuple, shuffle_buffer: int):
    """Training data as endless shuffled global batches (the shuffle seed is fixed, so every
    worker sees the same order and the strategy gives each its share of every batch), and
    the held-out data as whole global batches with their count."""
    data = (tf.data.Dataset.from_tensor_slices(train)
            .shuffle(shuffle_buffer, seed=args.seed, reshuffle_each_iteration=True)
            .batch(args.batch_size, drop_remainder=True).repeat().prefetch(2))
    eval_data = (tf.data.Dataset.from_tensor_slices(held_out)
                 .batch(args.batch_size, drop_remainder=True))
    return data, eval_data, len(held_out[1]) // args.batch_size


def chief_print(strategy, *lines: str) -> None:
    if strategy.worker.is_chief:
        print(*lines, sep="\n", flush=True)


def _table_bytes(strategy) -> tuple[float, float]:
    pulled = pushed = 0.0
    for table in strategy.tables.values():
        row_bytes = table.dim * table.dtype.size
        pulled += table.traffic.pulled_rows * row_bytes
        pushed += table.traffic.pushed_rows * row_bytes
    return pulled, pushed


class EpochReport(keras.callbacks.Callback):
    """Per-epoch loss, metrics, examples/s and parameter-server traffic, combined over the
    workers and printed by the chief; prints the plan summary once, after the first step.

    `derived(logs) -> dict` adds figures computed from the combined logs (e.g. perplexity).
    Keys of the Keras logs starting with `val_` are reported as they are. With `log_dir`, the
    chief also writes every figure as a TensorBoard scalar `epoch/<name>` (step: epoch).
    """

    def __init__(self, strategy, global_batch: int, *, derived=None,
                 log_dir: str | None = None) -> None:
        super().__init__()
        self.strategy = strategy
        self.global_batch = global_batch
        self.derived = derived or (lambda logs: {})
        self.epochs: list[dict] = []
        self.steps = 0
        self._epoch_steps = 0
        self._start = 0.0
        self._traffic = (0.0, 0.0)
        self._train_start = 0.0
        self.log_dir = log_dir
        self._writer = None

    def on_train_begin(self, logs=None) -> None:
        self._train_start = time.perf_counter()

    def on_epoch_begin(self, epoch, logs=None) -> None:
        self._start = time.perf_counter()
        self._epoch_steps = 0
        self._traffic = _table_bytes(self.strategy)

    def on_train_batch_end(self, batch, logs=None) -> None:
        self.steps += 1
        self._epoch_steps += 1
        if self.steps == 1 and self.strategy.plan is not None:
            chief_print(self.strategy, f"plan: {self.strategy.plan.summary()}")

    def _combined(self, logs: dict) -> dict:
        """Metrics (already aggregated over the workers by the strategy, so this average
        changes nothing) and traffic summed over the workers, in one collective."""
        names = sorted(k for k, v in logs.items() if np.isscalar(v) or np.ndim(v) == 0)
        pulled, pushed = _table_bytes(self.strategy)
        local = [float(logs[k]) for k in names] + [pulled - self._traffic[0],
                                                  pushed - self._traffic[1]]
        total = self.strategy.reduce(tf.distribute.ReduceOp.SUM,
                                     tf.constant(local, tf.float64), axis=None).numpy()
        workers = self.strategy.num_replicas_in_sync
        combined = {k: float(v) / workers for k, v in zip(names, total)}
        combined["pulled_mb"], combined["pushed_mb"] = total[-2] / MB, total[-1] / MB
        return combined

    def on_epoch_end(self, epoch, logs=None) -> None:
        seconds = time.perf_counter() - self._start
        figures = self._combined(dict(logs or {}))
        figures.update(self.derived(figures))
        figures["seconds"] = seconds
        figures["steps"] = self._epoch_steps
        figures["examples_per_s"] = self._epoch_steps * self.global_batch / seconds
        figures["pulled_mb_per_s"] = figures["pulled_mb"] / seconds
        figures["pushed_mb_per_s"] = figures["pushed_mb"] / seconds
        self.epochs.append(figures)
        shown = [f"{k} {figures[k]:.4f}" for k in figures if k not in _NOT_SHOWN]
        line = (f"epoch {epoch + 1}: " + ", ".join(shown) +
                f" | {figures['steps']} steps in {seconds:.1f} s, "
                f"{figures['examples_per_s']:.0f} examples/s")
        if self.strategy.tables:
            line += (f", pulled {figures['pulled_mb_per_s']:.1f} MB/s, "
                     f"pushed {figures['pushed_mb_per_s']:.1f} MB/s (all workers)")
        chief_print(self.strategy, line)
        self._write_scalars(epoch, figures)

    def _write_scalars(self, epoch: int, figures: dict) -> None:
        if self.log_dir is None or not self.strategy.worker.is_chief:
            return
        if self._writer is None:
            self._writer = tf.summary.create_file_writer(self.log_dir)
        with self._writer.as_default(step=epoch):
            for name, value in figures.items():
                tf.summary.scalar(f"epoch/{name}", value)
        self._writer.flush()

    def on_train_end(self, logs=None) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def result(self, example: str, args, **extra) -> dict:
        """The RESULT record: per-epoch figures, final metrics and last-epoch throughput."""
        last = self.epochs[-1] if self.epochs else {}
        plan = self.strategy.plan
        return {
            "example": example,
            "rank": self.strategy.worker.rank,
            "workers": self.strategy.worker.size,
            "mode": args.mode,
            "sync": not args.async_,
            "steps": self.steps,
            "global_batch": self.global_batch,
            "epochs": [{k: round(v, 6) for k, v in e.items()} for e in self.epochs],
            "final": {k: v for k, v in last.items() if k not in _NOT_SHOWN},
            "examples_per_s": last.get("examples_per_s"),
            "pulled_mb_per_s": last.get("pulled_mb_per_s"),
            "train_seconds": time.perf_counter() - self._train_start,
            "plan": plan.summary() if plan is not None else None,
            "tables_on_servers": sorted(self.strategy.tables),
            **extra,
        }


_NOT_SHOWN = {"seconds", "steps", "examples_per_s", "pulled_mb", "pushed_mb",
              "pulled_mb_per_s", "pushed_mb_per_s"}


def print_result(record: dict) -> None:
    """One line per worker, `RESULT ` + JSON, for scripts and tests to parse."""
    print("RESULT " + json.dumps(record, sort_keys=True), flush=True)


def fit_verbosity(strategy, args) -> int:
    return args.verbose if strategy.worker.is_chief else 0
