"""Trains small models the same way under three set-ups, for the equivalence tests:

  --setup plain     no parallax: one process, the whole global batch, table gradients made
                    dense before the optimizer (the mathematically plain update)
  --setup parallax  ParallaxStrategy (embedded servers, or the launcher's when launched)

Several cases run in one process (each with its own run id, so its own tables), which saves
the cost of starting TensorFlow and Horovod for every case. Worker 0 writes, per case, the
final values of every trainable variable (tables pulled from the servers) to OUT/<case>.npz.
`--setup`, `--cases` and `--out` may be given again: each group runs in turn in this one
process (the tests' two one-process references: one TensorFlow start-up instead of two). A
plain group comes before any parallax one, so parallax is not imported while it trains.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

VOCAB, DIM, FEATURES = 400, 4, 3
OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.5),
    "momentum": lambda: keras.optimizers.SGD(0.2, momentum=0.9),
    "adagrad": lambda: keras.optimizers.Adagrad(0.3),
    "adam": lambda: keras.optimizers.Adam(0.05),
    "lso": lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.5)),
}


def data(steps: int, batch: int):
    rng = np.random.default_rng(7)
    n = steps * batch
    ids = np.minimum(rng.zipf(1.3, size=(n, FEATURES)) - 1, VOCAB - 1).astype("int64")
    labels = rng.normal(size=(n, 1)).astype("float32")
    return ids, labels


class TableModel(tf.Module):
    """(b): a plain tf.Variable read with tf.nn.embedding_lookup, dense weights as well."""

    def __init__(self):
        super().__init__()
        rng = np.random.default_rng(3)
        self.table = tf.Variable(rng.normal(size=(VOCAB, DIM)).astype("float32") * 0.1,
                                 name="table")
        self.kernel = tf.Variable(rng.normal(size=(FEATURES * DIM, 1)).astype("float32") * 0.3,
                                  name="kernel")

    def __call__(self, ids):
        rows = tf.nn.embedding_lookup(self.table, ids)
        return tf.reshape(rows, [-1, FEATURES * DIM]) @ self.kernel


class SharedLookup(keras.layers.Layer):
    """(c): a second layer reading another layer's table."""

    def __init__(self, owner: keras.layers.Embedding):
        super().__init__()
        self.owner = owner

    def call(self, ids):
        return keras.ops.take(self.owner.embeddings, ids, axis=0)


def build(model: str, vocab: int = VOCAB) -> keras.Model:
    keras.utils.set_random_seed(11)
    if model == "custom":
        return TableModel()
    inputs = keras.Input((FEATURES,), dtype="int64")
    if model == "dynamic":  # keys far beyond any vocabulary; admitted at the 2nd sighting,
        # at most 12 rows a shard (LRU): admission and eviction happen within 20 steps
        from parallax.layers import DynamicEmbedding
        rows = DynamicEmbedding(DIM, max_rows_per_shard=12, admit_after=2, local_rows=vocab)(
            keras.ops.add(keras.ops.multiply(inputs, 7919), 10**15))
        h = keras.layers.Dense(5, activation="tanh")(keras.layers.Flatten()(rows))
        return keras.Model(inputs, keras.layers.Dense(1)(h))
    embedding = keras.layers.Embedding(vocab, DIM)
    if model == "three":  # three tables of one row shape: the two smaller ones are placed
        # on the same server, where they share one table (a table group)
        small = [keras.layers.Embedding(vocab // 2, DIM) for _ in range(2)]
        h = keras.layers.Concatenate(axis=1)([
            keras.layers.Flatten()(embedding(inputs[:, :1])),
            *[keras.layers.Flatten()(table(keras.ops.mod(inputs[:, i + 1:i + 2], vocab // 2)))
              for i, table in enumerate(small)]])
        h = keras.layers.Dense(5, activation="tanh")(h)
        return keras.Model(inputs, keras.layers.Dense(1)(h))
    if model == "keras":
        h = keras.layers.Flatten()(embedding(inputs))
    else:  # shared: the same table read by two layers, on two halves of the features
        a = embedding(inputs[:, :2])
        b = SharedLookup(embedding)(inputs[:, 2:])
        h = keras.layers.Flatten()(keras.layers.Concatenate(axis=1)([a, b]))
    h = keras.layers.Dense(5, activation="tanh")(h)
    return keras.Model(inputs, keras.layers.Dense(1)(h))


def train_custom(strategy, model, optimizer, ids, labels, batch: int, densify: bool,
                 between_steps=lambda step: None) -> None:
    dataset = tf.data.Dataset.from_tensor_slices((ids, labels)).batch(batch)
    dataset = strategy.experimental_distribute_dataset(dataset)
    variables = model.trainable_variables

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            per_example = tf.square(model(x) - y)[:, 0]
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=batch)
            loss = optimizer.scale_loss(loss)  # what fit does: LossScaleOptimizer scales
        grads = tape.gradient(loss, variables)
        if densify:
            grads = [tf.convert_to_tensor(g) for g in grads]
        optimizer.apply_gradients(zip(grads, variables))
        return loss

    @tf.function
    def step(x, y):
        losses = strategy.run(replica_step, args=(x, y))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    for i, (x, y) in enumerate(dataset):
        step(x, y)
        between_steps(i + 1)


def reshard_midway(strategy, steps: int):
    """Between steps: every table to 3 shards at a third of the run, then each table to 2
    shards on servers (1, 0) at two thirds (the "reshard" mode)."""
    def between_steps(step: int) -> None:
        if step == steps // 3:
            strategy.reshard(3)
        elif step == 2 * steps // 3:
            names = [v.name for v in strategy.plan.on_servers]
            strategy.reshard({n: 2 for n in names}, servers={n: [1, 0] for n in names})
    return between_steps


class BetweenSteps(keras.callbacks.Callback):
    def __init__(self, between_steps):
        super().__init__()
        self.between_steps = between_steps
        self.step = 0

    def on_train_batch_end(self, batch, logs=None):
        self.step += 1
        self.between_steps(self.step)


def export(strategy, model, ids, out: Path, case: str) -> None:
    """Chief only: predictions of the trained model, then the model saved both ways."""
    probe = ids[:32]
    np.save(out / f"{case}-probe.npy", probe)
    # model.predict would shard the probe across workers, as it does under MWMS.
    np.save(out / f"{case}-pred.npy", np.asarray(model(probe, training=False)))
    model.save(out / f"{case}.keras")
    with strategy.local_tables():
        model.export(str(out / f"{case}-savedmodel"), verbose=False)


def run_case(case: str, setup: str, steps: int, batch: int, out: Path, run_id: str,
             export_case: str = "", disagree: bool = False) -> None:
    model_kind, optimizer_name, loop, mode = (case.split("-") + ["hybrid"])[:4]
    ids, labels = data(steps, batch)
    if setup == "plain":
        strategy = tf.distribute.get_strategy()
    else:
        import parallax
        search = parallax.PartitionSearch(steps_per_sample=2, warmup_steps=1, settle_steps=1,
                                          max_samples=4, max_shards=4, stop_ratio=50.0,
                                          cache_dir="") \
            if mode == "tuned" else False
        strategy = parallax.ParallaxStrategy(
            mode="hybrid" if mode in ("localagg", "reshard", "tuned", "cache0",
                                      "cache0reshard") else mode,
            local_aggregation=mode == "localagg", run_id=f"{run_id}-{case}"[:48],
            log_plan=False, search_partitions=search,
            cache=parallax.RowCache(staleness=0) if mode.startswith("cache") else None)
    with strategy.scope():
        rank = strategy.worker.rank if setup != "plain" else 0
        model = build(model_kind, VOCAB + 1 if disagree and rank == 1 else VOCAB)
        optimizer = OPTIMIZERS[optimizer_name]()
        if loop == "fit" and setup != "plain":
            model.compile(optimizer=optimizer, loss="mse")  # in the scope: metrics too
    between_steps = reshard_midway(strategy, steps) if mode.endswith("reshard") and \
        setup != "plain" else (lambda step: None)
    if loop == "fit" and setup != "plain":
        history = model.fit(ids, labels, batch_size=batch, epochs=1, shuffle=False, verbose=0,
                            callbacks=[BetweenSteps(between_steps)])
        print(f"HISTORY {strategy.worker.rank} {case} {json.dumps(history.history)}",
              flush=True)
    else:
        train_custom(strategy, model, optimizer, ids, labels, batch, densify=setup == "plain",
                     between_steps=between_steps)
    rank = getattr(strategy, "worker", None)
    if rank is None or rank.is_chief:
        names = [v.path if hasattr(v, "path") else v.name for v in model.trainable_variables]
        values = [np.asarray(v.numpy()) for v in model.trainable_variables]
        if model_kind == "dynamic":  # its rows: the servers' keys and values, sorted by key
            keys, rows, _ = next(layer for layer in model.layers
                                 if hasattr(layer, "export_rows")).export_rows()
            names, values = names + ["keys", "rows"], values + [keys, rows]
        np.savez(out / f"{case}.npz", **{f"{i}:{n}": v for i, (n, v) in
                                         enumerate(zip(names, values))})
        if setup != "plain":
            from parallax import env
            summary = {"case": case, "plan": [(v.name, v.kind, v.placement, v.shards,
                                               v.servers, v.table, v.offset)
                                              for v in strategy.plan.variables],
                       "workers": strategy.worker.size,
                       "collectives": type(strategy.extended.workers).__name__,
                       "horovod_cycle_time": os.environ.get(env.HOROVOD_CYCLE_TIME_ENV),
                       "search": strategy.partition_search.report()
                       if strategy.partition_search else None}
            print("CASE " + json.dumps(summary), flush=True)
            if case == export_case:
                export(strategy, model, ids, out, case)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--setup", choices=("plain", "parallax"), required=True,
                        action="append", help="once per group (with --cases and --out)")
    parser.add_argument("--cases", required=True, action="append",
                        help="comma-separated model-optimizer-loop[-mode], mode: hybrid (default)"
                             ", ps, allreduce, localagg (hybrid with local aggregation), reshard "
                             "(hybrid, resharded twice midway), tuned (hybrid with a short "
                             "partition search), cache0 (hybrid with a row cache of "
                             "staleness 0), cache0reshard (both)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=16, help="global batch size")
    parser.add_argument("--out", type=Path, required=True, action="append")
    parser.add_argument("--export-case", default="", help="save this case's trained model")
    parser.add_argument("--disagree", action="store_true",
                        help="worker 1 builds a table one row larger (a broken job)")
    args = parser.parse_args(argv)
    if not len(args.setup) == len(args.cases) == len(args.out):
        parser.error("give --setup, --cases and --out once per group")
    if "parallax" in args.setup and "plain" in args.setup[args.setup.index("parallax"):]:
        parser.error("a plain group after a parallax one would train with parallax imported")
    run_id = os.environ.get("PARALLAX_RUN_ID", "eq")
    for setup, cases, out in zip(args.setup, args.cases, args.out):
        out.mkdir(parents=True, exist_ok=True)
        for case in cases.split(","):
            run_case(case, setup, args.steps, args.batch, out, run_id, args.export_case,
                     args.disagree)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
