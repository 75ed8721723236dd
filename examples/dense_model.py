"""A dense-only model (an MLP classifier on synthetic data) trained with `ParallaxStrategy`.

No variable is read by a gather, so the default hybrid plan puts nothing on the parameter
servers: every weight is replicated and its gradient all-reduced with Horovod, exactly what
`MultiWorkerMirroredStrategy` or plain Horovod would do, and the plan summary says "no sparse
variables: running as pure all-reduce". (`--mode ps` moves every weight to the servers
instead, and each step pulls all of them: the slow case the hybrid plan avoids.)

Data (numpy, seeded, the same on every worker): 32 Gaussian features; the label is the argmax
of a fixed random two-layer tanh "teacher" network over 10 classes, with 5% of the labels
replaced at random. Model: Dense(256, relu) -> Dense(256, relu) -> Dense(10) logits,
cross-entropy, accuracy, Adam.

    python examples/dense_model.py                      # one worker (servers: none needed)
    parallax run -np 2 --servers 2 python examples/dense_model.py
"""
from __future__ import annotations

import numpy as np

from common import (EpochReport, base_parser, chief_print, fit_verbosity, global_batches,
                    make_strategy, print_result, steps_per_epoch)

import keras  # noqa: E402  (after common, which quiets TensorFlow's logging)
import tensorflow as tf  # noqa: E402

FEATURES, CLASSES, TEACHER_HIDDEN, LABEL_NOISE = 32, 10, 64, 0.05


def generate(n: int, seed: int, stream: int) -> tuple[np.ndarray, np.ndarray]:
    teacher = np.random.default_rng([seed, 7])
    w1 = teacher.normal(size=(FEATURES, TEACHER_HIDDEN)) / np.sqrt(FEATURES)
    w2 = teacher.normal(size=(TEACHER_HIDDEN, CLASSES)) * 2.0 / np.sqrt(TEACHER_HIDDEN)
    rng = np.random.default_rng([seed, stream])
    x = rng.normal(size=(n, FEATURES)).astype(np.float32)
    y = np.argmax(np.tanh(x @ w1) @ w2, axis=1)
    noisy = rng.random(n) < LABEL_NOISE
    y[noisy] = rng.integers(0, CLASSES, noisy.sum())
    return x, y.astype(np.int32)


def build_model(args) -> keras.Model:
    inputs = keras.Input((FEATURES,), name="features")
    x = keras.layers.Dense(args.hidden, activation="relu", name="hidden_1")(inputs)
    x = keras.layers.Dense(args.hidden, activation="relu", name="hidden_2")(x)
    logits = keras.layers.Dense(CLASSES, name="logits")(x)
    return keras.Model(inputs, logits, name="mlp")


def parse_args(argv=None):
    parser = base_parser(__doc__.split("\n")[0], epochs=5, batch_size=256,
                         steps_per_epoch=300, lr=1e-3)
    parser.add_argument("--train-examples", type=int, default=1 << 17)
    parser.add_argument("--eval-examples", type=int, default=1 << 13)
    parser.add_argument("--hidden", type=int, default=256)
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    x, y = generate(args.train_examples, args.seed, stream=0)
    x_eval, y_eval = generate(args.eval_examples, args.seed, stream=1)
    strategy = make_strategy(args)
    steps = steps_per_epoch(args, len(y), "training data")
    chief_print(strategy, f"synthetic teacher data: {FEATURES} features, {CLASSES} classes, "
                          f"{len(y)} training examples, {len(y_eval)} held out; "
                          f"{strategy.worker.size} worker(s), global batch {args.batch_size}, "
                          f"{steps} steps per epoch")
    data, eval_data, eval_batches = global_batches(args, (x, y), (x_eval, y_eval),
                                                   20_000)

    with strategy.scope():
        model = build_model(args)
        model.compile(optimizer=keras.optimizers.Adam(args.lr),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")])
    report = EpochReport(strategy, args.batch_size, log_dir=args.tensorboard)
    model.fit(data, epochs=args.epochs, steps_per_epoch=steps, callbacks=[report],
              shuffle=False, verbose=fit_verbosity(strategy, args))

    extra = {"parameters": int(model.count_params())}
    if eval_batches > 0:
        local = model.evaluate(eval_data, verbose=0, return_dict=True)
        names = sorted(local)
        total = strategy.reduce(tf.distribute.ReduceOp.SUM,
                                tf.constant([local[k] for k in names], tf.float64), axis=None)
        evaluated = {f"eval_{k}": float(v) / strategy.num_replicas_in_sync
                     for k, v in zip(names, total.numpy())}
        extra.update(evaluated)
        chief_print(strategy, f"held-out: loss {evaluated['eval_loss']:.4f}, accuracy "
                              f"{evaluated['eval_accuracy']:.4f}")
    print_result(report.result("dense_model", args, **extra))


if __name__ == "__main__":
    main()
