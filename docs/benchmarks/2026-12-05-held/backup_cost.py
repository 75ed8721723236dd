"""What a Keras backup every step costs with a large table: `BackupAndRestore(save_freq=1)`
under `parallax run` on disk (the default), with `--held-backups N` (one backup in N on disk,
the others' tables held in the servers' memory), and with no backup at all.

The job (this file, run as the worker): one embedding table of --rows x 16 (Adagrad, on 2
servers, which draw its initial rows) looked up by 8 ids a sample, a dense layer, 64 samples
a step, --steps steps of Keras `fit`. One worker. Rounds alternate the three settings:

    python docs/benchmarks/2026-12-05-held/backup_cost.py [--rows 1000000] [--rounds 3] \
        [--settings none,held,disk]

Prints one JSON line per run: the median ms a step (steps 5 on, backups included) and the
held backups' N.
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


def worker(rows: int, steps: int, backup: str) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import numpy as np
    import parallax
    strategy = parallax.ParallaxStrategy()
    rng = np.random.default_rng(1)
    ids = rng.integers(0, rows, size=(steps * BATCH, IDS)).astype("int64")
    labels = rng.normal(size=(steps * BATCH, 1)).astype("float32")
    with strategy.scope():
        inputs = keras.Input((IDS,), dtype="int64")
        looked_up = keras.layers.Embedding(rows, DIM)(inputs)
        model = keras.Model(inputs, keras.layers.Dense(1)(keras.layers.Flatten()(looked_up)))
        model.compile(keras.optimizers.Adagrad(0.1), loss="mse")
    ends: list[float] = []
    timer = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: ends.append(time.perf_counter()))
    callbacks = [timer] if not backup else \
        [keras.callbacks.BackupAndRestore(backup, save_freq=1), timer]
    model.fit(ids, labels, batch_size=BATCH, epochs=1, shuffle=False, callbacks=callbacks,
              verbose=0)
    print(json.dumps({"step_ms": round(1e3 * float(np.median(np.diff(ends[4:]))), 1)}))


def run(setting: str, args, tmp: str) -> dict:
    backup = "" if setting == "none" else os.path.join(tmp, f"backup-{time.time_ns()}")
    held = setting.split("=")[1] if setting.startswith("held") else "0"
    command = [sys.executable, "-m", "parallax", "run", "-np", "1", "--servers", "2",
               "--data-dir", os.path.join(tmp, "data"), "--held-backups", held, "--",
               sys.executable, os.path.abspath(__file__), "--worker", "--rows", str(args.rows),
               "--steps", str(args.steps), "--backup", backup]
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
    parser.add_argument("--settings", default="none,held,disk",
                        help="which of none, held, disk to run, comma-separated (disk "
                             "takes ~2 s a step with 1M rows)")
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--backup", default="")
    args = parser.parse_args()
    if args.worker:
        return worker(args.rows, args.steps, args.backup)
    chosen = args.settings.split(",")
    unknown = sorted(set(chosen) - {"none", "held", "disk"})
    if unknown:
        parser.error(f"--settings {args.settings}: {unknown} unknown; pick from none, held, "
                     f"disk")
    settings = [f"held={args.held}" if s == "held" else s for s in chosen]
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for setting in settings if round_ % 2 == 0 else settings[::-1]:
                print(json.dumps({"round": round_, **run(setting, args, tmp)}), flush=True)


if __name__ == "__main__":
    main()
