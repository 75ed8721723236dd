"""A job that trains, checkpoints through TF's or Keras' own API, and resumes, for
tests/tf/test_resume.py (under `parallax run`, one worker or several) and
tests/tf/test_embedded_resume.py (a plain process: the embedded servers).

  custom  the MWMS custom-loop tutorial's shape: `strategy.cluster_resolver` decides the
          chief, which saves into OUT/ckpt with a CheckpointManager; the other workers save
          into their own temporary directory (deleted afterwards)
  fit     Keras fit with BackupAndRestore (a directory per worker, as Keras 3 has no chief
          logic) saving every epoch (one epoch = --save-every steps)

Every epoch of fit sees the same --save-every batches, so a resumed fit sees what an
uninterrupted one does. --stop-at K ends the job after K steps (saved), like a preemption.
--resume restores the latest checkpoint first, then trains up to --steps. Several cases
(`<loop>-<optimizer>`) run in one process, each with its own strategy, run id and --out
subdirectory. Worker 0 writes, per case, the loss of every step (custom) or epoch (fit) it
ran and the model's predictions on a probe batch to OUT/<case>/<phase>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import parallax  # noqa: E402

VOCAB, DIM, BATCH = 300, 4, 16
OPTIMIZERS = {"sgd": lambda: keras.optimizers.SGD(0.05),
              "adagrad": lambda: keras.optimizers.Adagrad(0.3),
              "adam": lambda: keras.optimizers.Adam(0.01)}


def data(steps: int):
    rng = np.random.default_rng(11)
    ids = np.minimum(rng.zipf(1.3, size=(steps * BATCH, 3)) - 1, VOCAB - 1).astype("int64")
    return ids, rng.normal(size=(steps * BATCH, 1)).astype("float32")


def build(optimizer: str):
    keras.utils.set_random_seed(5)
    inputs = keras.Input((3,), dtype="int64")
    rows = keras.layers.Embedding(VOCAB, DIM, name="embedding")(inputs)
    # two smaller tables of the same row shape, placed on one server, where they share one
    # server table (a table group)
    more = [keras.layers.Flatten()(keras.layers.Embedding(VOCAB // 2, DIM, name=name)(
        keras.ops.mod(inputs, VOCAB // 2))) for name in ("embedding_b", "embedding_c")]
    out = keras.layers.Dense(1, name="dense")(
        keras.layers.Concatenate()([keras.layers.Flatten()(rows), *more]))
    model = keras.Model(inputs, out)
    model.compile(OPTIMIZERS[optimizer](), loss="mse")
    return model


def is_chief(strategy) -> bool:
    """The tutorials' `_is_chief`, from the strategy's cluster resolver."""
    task_type, task_id = (strategy.cluster_resolver.task_type,
                          strategy.cluster_resolver.task_id)
    return (task_type == "worker" and task_id == 0) or task_type is None


def custom_loop(strategy, model, args, ids, labels) -> list[float]:
    optimizer = model.optimizer
    dataset = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((ids, labels)).batch(BATCH))
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
    directory = os.path.join(args.out, "ckpt") if is_chief(strategy) else tempfile.mkdtemp()
    manager = tf.train.CheckpointManager(checkpoint, directory, max_to_keep=2)
    if args.resume:
        checkpoint.restore(tf.train.latest_checkpoint(os.path.join(args.out, "ckpt")))

    @tf.function
    def step(x, y):
        def replica(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss
        return strategy.reduce("MEAN", strategy.run(replica, (x, y)), axis=None)

    losses = []
    iterator = iter(dataset)
    for _ in range(int(optimizer.iterations.numpy())):
        next(iterator)  # the steps the checkpoint already holds
    for _ in range(int(optimizer.iterations.numpy()), args.stop_at or args.steps):
        losses.append(float(step(*next(iterator))))
    manager.save()
    if not is_chief(strategy):
        shutil.rmtree(directory)
    return losses


class StopAt(keras.callbacks.Callback):
    """Ends fit at the start of an epoch, as a preemption would (BackupAndRestore keeps its
    backup: on_train_end does not run)."""

    def __init__(self, epoch: int) -> None:
        super().__init__()
        self.epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            raise KeyboardInterrupt


def fit_loop(strategy, model, args, ids, labels) -> list[float]:
    ids, labels = ids[:args.save_every * BATCH], labels[:args.save_every * BATCH]
    backup = keras.callbacks.BackupAndRestore(
        os.path.join(args.out, f"backup-{strategy.worker.rank}"))
    callbacks = [backup] + ([StopAt(args.stop_at // args.save_every)] if args.stop_at else [])
    model.fit(x=ids, y=labels, batch_size=BATCH, epochs=args.steps // args.save_every,
              steps_per_epoch=args.save_every, shuffle=False, verbose=0, callbacks=callbacks)
    return model.history.history.get("loss", [])


def run_case(case: str, args) -> None:
    loop_name, optimizer = case.split("-")
    out = os.path.join(args.out, case)
    os.makedirs(out, exist_ok=True)
    strategy = parallax.ParallaxStrategy(log_plan=False, run_id=f"{case}-{args.phase}")
    ids, labels = data(args.steps)
    with strategy.scope():
        model = build(optimizer)
    loop = custom_loop if loop_name == "custom" else fit_loop
    try:
        losses = loop(strategy, model, argparse.Namespace(**{**vars(args), "out": out}),
                      ids, labels)
    except KeyboardInterrupt:
        losses = model.history.history.get("loss", [])
    resolver = strategy.cluster_resolver
    if strategy.worker.rank == 0:
        result = {"losses": losses, "prediction": model(ids[:64]).numpy().tolist(),
                  "task": [resolver.task_type, resolver.task_id],
                  "cluster": resolver.cluster_spec().as_dict(),
                  "grouped": strategy.plan.grouped}
        with open(os.path.join(out, f"{args.phase}.json"), "w") as f:
            json.dump(result, f)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", required=True, help="comma-separated <loop>-<optimizer>")
    parser.add_argument("--phase", choices=["full", "stop", "resume"], required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument("--stop-at", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    args.resume = args.phase == "resume"
    for case in args.cases.split(","):
        run_case(case, args)


if __name__ == "__main__":
    main()
