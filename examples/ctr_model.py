"""Click-through-rate model (DLRM-like) on synthetic Zipf-distributed categorical features,
trained with `ParallaxStrategy`: 10M embedding rows on the parameter servers, a small dense
network all-reduced.

Data (numpy, seeded, the same on every worker): 8 categorical features with vocabularies of
4M, 2.5M, 1.5M, 1M, 600k, 300k, 100k and 10k ids (10.01M rows in all) and 4 numeric features.
Each categorical id is a Zipf(1.1) rank folded into its vocabulary (`(rank - 1) % vocab`, as
hashing a long tail does; clipping to `vocab - 1` would pile 20-40% of every feature's mass
on its last id). Labels come from a hidden logistic model: every (feature, id) has a weight
drawn from a hash of the pair (no 10M-entry array is needed to generate data), numeric
features have fixed weights, plus one pairwise interaction; the bias gives ~25% positives.
Frequent ids recur often enough to be learned, the tail does not, as in real CTR data: AUC
rises well above 0.5 but stays below the generator's own.

Model (DLRM): each categorical id -> Embedding(vocab, 8): SPARSE, on the parameter servers;
numeric features -> bottom MLP (32, 8); the 9 vectors' pairwise dot products (36) and the
bottom output -> top MLP (64, 32, 1) -> logit. Dense weights are all-reduced with Horovod.
Loss: binary cross-entropy; metric: AUC (keras.metrics.AUC). Optimizer: Adagrad (applied by
the servers to the embedding rows, by Keras to the dense weights).

Memory: Keras creates the tables on the worker first (10M x 8 float32 = 320 MB, plus the
optimizer's slots of the same size); at the first step the chief streams them to the servers
and every worker frees its copies.

`--dynamic`: the ids arrive as raw 64-bit hashes (of feature and id), as CTR pipelines
produce them, and each table is a `parallax.layers.DynamicEmbedding` with no vocabulary: a
key gets a row on its `--admit-after`-th sighting, each shard holds at most `--dynamic-rows`
rows (LFU eviction; 0: unbounded).

    python examples/ctr_model.py                      # one worker, 2 embedded servers
    parallax run -np 2 --servers 2 python examples/ctr_model.py
    python examples/ctr_model.py --dynamic --dynamic-rows 200000
"""
from __future__ import annotations

import numpy as np

from common import (EpochReport, base_parser, chief_print, fit_verbosity, global_batches,
                    make_strategy, print_result, steps_per_epoch)

import keras  # noqa: E402  (after common, which quiets TensorFlow's logging)
import tensorflow as tf  # noqa: E402

VOCABULARIES = (4_000_000, 2_500_000, 1_500_000, 1_000_000, 600_000, 300_000, 100_000, 10_000)
NUMERIC = 4
ZIPF = 1.1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a well-spread 64-bit hash."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def hidden_weight(feature: int, ids: np.ndarray, seed: int) -> np.ndarray:
    """The generator's weight of each (feature, id): uniform in [-1.5, 1.5), from a hash."""
    with np.errstate(over="ignore"):
        key = ids.astype(np.uint64) * _GOLDEN + np.uint64((seed * 131 + feature + 1) * 0x632BE5)
    return ((_mix(key) >> np.uint64(11)).astype(np.float64) / 2.0**53 * 3.0 - 1.5)


def generate(n: int, vocabularies, seed: int, stream: int) -> tuple[dict, np.ndarray]:
    """`n` examples: {"c0".."c7": int32 ids, "numeric": float32 [n, 4]}, labels float32 [n].
    `stream` separates the training and held-out draws; the hidden model depends on `seed`."""
    rng = np.random.default_rng([seed, stream])
    features, logit = {}, np.full(n, -2.7)
    for f, vocab in enumerate(vocabularies):
        ids = ((rng.zipf(ZIPF, n) - 1) % vocab).astype(np.int32)
        features[f"c{f}"] = ids
        logit += hidden_weight(f, ids, seed)
    numeric = rng.normal(size=(n, NUMERIC)).astype(np.float32)
    beta = np.random.default_rng([seed, 99]).normal(size=NUMERIC)
    logit += numeric @ beta + 0.8 * np.sign(hidden_weight(0, features["c0"], seed + 1)) \
        * numeric[:, 0]
    features["numeric"] = numeric
    labels = (rng.random(n) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
    return features, labels, logit


class PairwiseDot(keras.layers.Layer):
    """DLRM's interaction: the dot products of every pair of the input vectors."""

    def call(self, vectors):
        stacked = keras.ops.stack(vectors, axis=1)                       # [B, n, d]
        dots = keras.ops.matmul(stacked, keras.ops.transpose(stacked, (0, 2, 1)))
        n = len(vectors)
        rows, cols = np.triu_indices(n, k=1)
        flat = keras.ops.reshape(dots, (-1, n * n))
        return keras.ops.take(flat, (rows * n + cols).astype("int32"), axis=1)


def raw_keys(features: dict) -> dict:
    """The categorical ids as raw 64-bit keys: a hash of (feature, id), as int64."""
    out = dict(features)
    for f in range(sum(1 for k in features if k.startswith("c"))):
        salted = features[f"c{f}"].astype(np.uint64) + np.uint64((f + 1) << 40)
        out[f"c{f}"] = _mix(salted).view(np.int64)
    return out


def _table(f: int, vocab: int, args):
    """Feature f's embedding: a Keras Embedding of its vocabulary, or a DynamicEmbedding."""
    if not args.dynamic:
        return keras.layers.Embedding(vocab, args.dim, name=f"table_c{f}")
    from parallax.layers import DynamicEmbedding
    return DynamicEmbedding(args.dim, max_rows_per_shard=args.dynamic_rows,
                            eviction="lfu" if args.dynamic_rows else "none",
                            admit_after=args.admit_after, name=f"table_c{f}")


def build_model(vocabularies, args) -> keras.Model:
    key_dtype = "int64" if args.dynamic else "int32"
    inputs = {f"c{f}": keras.Input((), dtype=key_dtype, name=f"c{f}")
              for f in range(len(vocabularies))}
    inputs["numeric"] = keras.Input((NUMERIC,), dtype="float32", name="numeric")
    bottom = keras.layers.Dense(32, activation="relu", name="bottom_1")(inputs["numeric"])
    bottom = keras.layers.Dense(args.dim, activation="relu", name="bottom_2")(bottom)
    vectors = [bottom] + [_table(f, vocab, args)(inputs[f"c{f}"])
                          for f, vocab in enumerate(vocabularies)]
    x = keras.layers.Concatenate()([bottom, PairwiseDot(name="interactions")(vectors)])
    x = keras.layers.Dense(64, activation="relu", name="top_1")(x)
    x = keras.layers.Dense(32, activation="relu", name="top_2")(x)
    logit = keras.layers.Dense(1, name="logit")(x)
    return keras.Model(inputs, logit, name="dlrm")


def parse_args(argv=None):
    parser = base_parser(__doc__.split("\n")[0], epochs=3, batch_size=1024,
                         steps_per_epoch=100, lr=0.05)
    parser.add_argument("--train-examples", type=int, default=1 << 18)
    parser.add_argument("--eval-examples", type=int, default=1 << 15)
    parser.add_argument("--dim", type=int, default=8, help="embedding dimension")
    parser.add_argument("--vocab-sizes", default=",".join(map(str, VOCABULARIES)),
                        help="comma-separated vocabulary size of each categorical feature")
    parser.add_argument("--dynamic", action="store_true",
                        help="raw 64-bit keys into DynamicEmbedding tables (no vocabulary)")
    parser.add_argument("--dynamic-rows", type=int, default=0,
                        help="--dynamic: rows per table shard, LFU-evicted (0: unbounded)")
    parser.add_argument("--admit-after", type=int, default=2,
                        help="--dynamic: sightings before a key gets a row")
    return parser.parse_args(argv)


def _auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Exact ROC AUC (Mann-Whitney), for the generator's own reference figure."""
    order = np.argsort(scores, kind="stable")
    ranks = np.empty(len(scores))
    ranks[order] = np.arange(1, len(scores) + 1)
    positives = labels > 0.5
    n_pos, n_neg = positives.sum(), (~positives).sum()
    return float((ranks[positives].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def main(argv=None) -> None:
    args = parse_args(argv)
    vocabularies = tuple(int(v) for v in args.vocab_sizes.split(","))
    x, y, _ = generate(args.train_examples, vocabularies, args.seed, stream=0)
    x_eval, y_eval, eval_logit = generate(args.eval_examples, vocabularies, args.seed,
                                          stream=1)
    if args.dynamic:
        x, x_eval = raw_keys(x), raw_keys(x_eval)
    strategy = make_strategy(args)
    steps = steps_per_epoch(args, len(y), "training data")
    chief_print(strategy,
                f"synthetic CTR data: {len(vocabularies)} categorical features, "
                f"{sum(vocabularies):,} embedding rows x {args.dim}, {NUMERIC} numeric; "
                f"{len(y)} training examples ({y.mean():.1%} positive), {len(y_eval)} held "
                f"out; {strategy.worker.size} worker(s), global batch {args.batch_size}, "
                f"{steps} steps per epoch")

    data, eval_data, eval_batches = global_batches(args, (x, y), (x_eval, y_eval),
                                                   50_000)

    with strategy.scope():
        model = build_model(vocabularies, args)
        model.compile(optimizer=keras.optimizers.Adagrad(args.lr),
                      loss=keras.losses.BinaryCrossentropy(from_logits=True),
                      metrics=[keras.metrics.AUC(from_logits=True, name="auc")])
    report = EpochReport(strategy, args.batch_size, log_dir=args.tensorboard)
    model.fit(data, epochs=args.epochs, steps_per_epoch=steps, callbacks=[report],
              shuffle=False, verbose=fit_verbosity(strategy, args))

    extra = {"embedding_rows": sum(vocabularies), "tables": len(vocabularies),
             "embedding_dim": args.dim, "positive_rate": float(y.mean()),
             "generator_auc": _auc(y_eval, eval_logit)}
    if eval_batches > 0:
        local = model.evaluate(eval_data, verbose=0, return_dict=True)
        names = sorted(local)
        total = strategy.reduce(tf.distribute.ReduceOp.SUM,
                                tf.constant([local[k] for k in names], tf.float64), axis=None)
        evaluated = {f"eval_{k}": float(v) / strategy.num_replicas_in_sync
                     for k, v in zip(names, total.numpy())}
        extra.update(evaluated)
        chief_print(strategy, f"held-out: loss {evaluated['eval_loss']:.4f}, AUC "
                              f"{evaluated['eval_auc']:.4f} (the generator's own AUC: "
                              f"{extra['generator_auc']:.4f})")
    print_result(report.result("ctr_model", args, **extra))


if __name__ == "__main__":
    main()
