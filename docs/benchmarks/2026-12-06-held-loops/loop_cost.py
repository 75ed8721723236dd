"""What a custom loop's checkpoint every step costs with a large table: a
`tf.train.CheckpointManager.save()` after every step under `parallax run` on disk (the
default), with `--held-backups N` (one save in N on disk, the others' tables held in the
servers' memory: `parallax.tf.state.held_checkpoints`), and with no checkpoint at all.

The job (this file, run as the worker): one embedding table of --rows x 16 (Adagrad, on 2
servers, which draw its initial rows) looked up by 8 ids a sample, a dense layer, 64 samples
a step, --steps steps of a `tf.function` step under `strategy.run` (the MWMS tutorial's
shape), `max_to_keep=2`. One worker. Rounds alternate the three settings:

    python docs/benchmarks/2026-12-06-held-loops/loop_cost.py [--rows 1000000] [--rounds 3]

Prints one JSON line per run: the median ms a step (steps 5 on, saves included).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

BATCH, IDS, DIM = 64, 8, 16


def worker(rows: int, steps: int, directory: str) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import numpy as np
    import tensorflow as tf
    import parallax
    strategy = parallax.ParallaxStrategy()
    rng = np.random.default_rng(1)
    ids = rng.integers(0, rows, size=(steps, BATCH, IDS)).astype("int64")
    labels = rng.normal(size=(steps, BATCH, 1)).astype("float32")
    with strategy.scope():
        inputs = keras.Input((IDS,), dtype="int64")
        looked_up = keras.layers.Embedding(rows, DIM)(inputs)
        model = keras.Model(inputs, keras.layers.Dense(1)(keras.layers.Flatten()(looked_up)))
        optimizer = keras.optimizers.Adagrad(0.1)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
    manager = tf.train.CheckpointManager(checkpoint, directory, max_to_keep=2) \
        if directory else None

    @tf.function
    def step(x, y):
        def replica(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss
        return strategy.run(replica, (x, y))

    ends: list[float] = []
    for k in range(steps):
        step(tf.constant(ids[k]), tf.constant(labels[k]))
        if manager is not None:
            manager.save()
        ends.append(time.perf_counter())
    print(json.dumps({"step_ms": round(1e3 * float(np.median(np.diff(ends[4:]))), 1)}))


def run(setting: str, args, tmp: str) -> dict:
    directory = "" if setting == "none" else os.path.join(tmp, f"ckpt-{time.time_ns()}")
    held = setting.split("=")[1] if setting.startswith("held") else "0"
    command = [sys.executable, "-m", "parallax", "run", "-np", "1", "--servers", "2",
               "--data-dir", os.path.join(tmp, "data"), "--held-backups", held, "--",
               sys.executable, os.path.abspath(__file__), "--worker", "--rows", str(args.rows),
               "--steps", str(args.steps), "--directory", directory]
    out = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    line = next((x for x in out.stdout.splitlines() if x.startswith('{"step_ms"')), None)
    if out.returncode or line is None:
        raise SystemExit(f"{setting}: exit {out.returncode}\n{out.stderr[-3000:]}")
    return {"setting": setting, "rows": args.rows, **json.loads(line)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--held", type=int, default=100, help="--held-backups N")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--directory", default="")
    args = parser.parse_args()
    if args.worker:
        return worker(args.rows, args.steps, args.directory)
    settings = ["none", f"held={args.held}", "disk"]
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for setting in settings if round_ % 2 == 0 else settings[::-1]:
                print(json.dumps({"round": round_, **run(setting, args, tmp)}), flush=True)


if __name__ == "__main__":
    main()
