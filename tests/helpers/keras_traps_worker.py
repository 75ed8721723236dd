"""The Keras habits of issue 29 on one worker or under `parallax run -np N`, each worker
writing what it got to `<out>/rank<r>.npz` and `<out>/rank<r>.json`
(tests/parallel/test_keras_traps.py compares N workers with one process):

- rows: `fit` (192 rows, global batch 16: every global batch full, so one process and N
  workers train alike), then `predict` and `evaluate` on 201 rows (a last global batch of 9)
  and 193 rows (a last global batch of 1: one worker's part is empty).
- baseline: the same `predict` and `evaluate` before `fit` too, in a new strategy.
- multistep: `fit(validation_data=..., steps_per_execution=4)`, 2 epochs, in a new strategy.
- outside: a model built and compiled outside `strategy.scope()`, then `fit`.
- presharded: `fit` on a dataset split by hand, Horovod's `.shard(size, rank)`, in a new
  strategy.
- backup: `fit` with one `BackupAndRestore` directory on every worker, in a new strategy.
A phase that raises is recorded as `<phase>_error` and the next one runs.
"""
from __future__ import annotations

import argparse
import json
import os

import parallax  # noqa: I001 (the strategy before any other TensorFlow work)

VOCAB, DIM, BATCH = 300, 4, 16


def build():
    import keras

    keras.utils.set_random_seed(5)
    inputs = keras.Input((3,), dtype="int64")
    h = keras.layers.Embedding(VOCAB, DIM, name="embedding")(inputs)
    out = keras.layers.Dense(1, name="dense")(keras.layers.Flatten()(h))
    return keras.Model(inputs, out)


def data(n, seed):
    import numpy as np

    rng = np.random.default_rng(seed)
    ids = np.minimum(rng.zipf(1.3, size=(n, 3)) - 1, VOCAB - 1).astype("int64")
    return ids, (ids.sum(axis=1, keepdims=True) % 7 / 7.0).astype("float32")


def compiled(strategy, **compile_args):
    import keras

    with strategy.scope():
        model = build()
        model.compile(keras.optimizers.Adagrad(0.2), loss="mse", metrics=["mae"],
                      **compile_args)
    return model


def strategy_for(phase: str):
    job = os.environ.get("PARALLAX_RUN_ID")  # each phase's tables under a run id of its own
    return parallax.ParallaxStrategy(log_plan=False, run_id=job and f"{job}-{phase}")


def predict_and_evaluate(model, prefix: str, arrays: dict, summary: dict) -> None:
    for name, (x, y) in (("odd", data(201, 1)), ("one", data(193, 2))):
        arrays[f"{prefix}{name}_pred"] = model.predict(x, batch_size=BATCH, verbose=0)
        summary[f"{prefix}{name}_eval"] = model.evaluate(x, y, batch_size=BATCH, verbose=0)


def rows(strategy, arrays: dict, summary: dict) -> None:
    """fit, then predict and evaluate on rows that leave a partial last global batch."""
    model = compiled(strategy)
    model.fit(*data(192, 0), batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    predict_and_evaluate(model, "", arrays, summary)
    arrays["on_batch_pred"] = model.predict_on_batch(data(5, 3)[0])  # this worker's alone
    summary["table_on_servers"] = strategy.plan.get("embedding/embeddings").placement


def baseline(arrays: dict, summary: dict) -> None:
    """predict and evaluate before fit (a baseline), then fit, predict and evaluate."""
    strategy = strategy_for("b")
    model = compiled(strategy)
    predict_and_evaluate(model, "before_", arrays, summary)
    model.fit(*data(192, 0), batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    predict_and_evaluate(model, "after_", arrays, summary)


def multistep(summary: dict) -> None:
    model = compiled(strategy_for("m"), steps_per_execution=4)
    history = model.fit(*data(192, 0), batch_size=BATCH, epochs=2, shuffle=False,
                        validation_data=data(201, 1), verbose=0)
    summary["multistep_history"] = history.history


def outside(summary: dict) -> None:
    import keras

    model = build()  # outside the scope
    model.compile(keras.optimizers.Adagrad(0.2), loss="mse")
    try:
        model.fit(*data(192, 0), batch_size=BATCH, epochs=1, verbose=0)
        summary["outside"] = "trained"
    except parallax.ParallaxError as exc:
        summary["outside"] = f"{type(exc).__name__}: {exc}"


def presharded(strategy, summary: dict) -> None:
    import tensorflow as tf

    size, rank = strategy.worker.size, strategy.worker.rank
    by_hand = tf.data.Dataset.from_tensor_slices(data(64, 0)).shard(size, rank)
    model = compiled(strategy_for("s"))
    try:
        model.fit(by_hand.batch(BATCH // size), epochs=1, verbose=0)
        summary["presharded"] = "trained"
    except parallax.ParallaxError as exc:
        summary["presharded"] = f"{type(exc).__name__}: {exc}"


def backup(out: str, summary: dict) -> None:
    import keras

    model = compiled(strategy_for("k"))
    shared = keras.callbacks.BackupAndRestore(os.path.join(out, "backup"))
    try:
        model.fit(*data(64, 0), batch_size=BATCH, epochs=1, callbacks=[shared], verbose=0)
        summary["backup"] = "trained"
    except parallax.ParallaxError as exc:
        summary["backup"] = f"{type(exc).__name__}: {exc}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    strategy = parallax.ParallaxStrategy(log_plan=False)
    import numpy as np

    arrays: dict = {}
    summary: dict = {"workers": strategy.num_replicas_in_sync,
                     "collectives": type(strategy.extended.workers).__name__}
    phases = (("rows", lambda: rows(strategy, arrays, summary)),
              ("baseline", lambda: baseline(arrays, summary)),
              ("multistep", lambda: multistep(summary)), ("outside", lambda: outside(summary)),
              ("presharded", lambda: presharded(strategy, summary)),
              ("backup", lambda: backup(args.out, summary)))
    for phase, run in phases:  # one failing phase fails its own tests only
        try:
            run()
        except Exception as exc:  # noqa: BLE001 (recorded for the test to show)
            summary[f"{phase}_error"] = f"{type(exc).__name__}: {str(exc)[-2000:]}"
    rank = strategy.worker.rank
    os.makedirs(args.out, exist_ok=True)
    np.savez(os.path.join(args.out, f"rank{rank}.npz"), **arrays)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(summary, f)


if __name__ == "__main__":
    main()
