"""A bounded dynamic table against an unbounded one (issue 17's target: bounded at 10% of the
distinct keys of a Zipf stream, it trains to a loss within 2% of the unbounded table's, and
the servers' row count never exceeds the bound).

One process, 2 local `parallax server` processes, one `ParallaxStrategy` (its own run id, so
its own table) per setting, each training the same model from the same seed on the same
batches: keys are Zipf ranks (exponent --zipf) over --keys distinct 62-bit keys, 4 per
example; each key has a hidden weight, and the label is a Bernoulli draw of the sigmoid of
the example's summed weights. The model: DynamicEmbedding(8) -> Dense(1, sigmoid), binary
cross-entropy, Adagrad. The bounded tables hold at most 10% of the keys (--bound), as LFU or
LRU, and LRU again admitting a key at its second sighting. Every --poll steps the servers' rows per shard are read (Stats) and the largest kept.
Reported: the mean training loss over the last 10% of steps, the loss on fresh examples
from the same stream, and the largest row count of any shard against the bound. It prints a
table and writes bench-results/dynamic_bound.json.

    PYTHONPATH=.:servers .venv/bin/python examples/benchmarks/dynamic_bound.py \
        [--keys 50000] [--steps 1500] [--batch 256] [--zipf 1.1] [--bound 0.1]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

COLUMNS, DIM, SHARDS = 4, 8, 2


class Stream:
    """Zipf-ranked keys, a hidden weight per key, Bernoulli labels."""

    def __init__(self, keys: int, zipf: float, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.keys = rng.integers(1 << 40, 1 << 62, size=keys, dtype=np.int64)
        self.weights = rng.normal(0.0, 1.0, size=keys)
        self.zipf = zipf

    def batch(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        ranks = np.minimum(rng.zipf(self.zipf, size=(n, COLUMNS)), len(self.keys)) - 1
        logits = self.weights[ranks].sum(axis=1)
        labels = rng.random(n) < 1.0 / (1.0 + np.exp(-logits))
        return self.keys[ranks], labels.astype("float32")[:, None]


def _rows_per_shard(strategy) -> list[int]:
    table = next(v.table for v in strategy.plan.on_servers if v.dynamic is not None)
    return [t.rows for reply in strategy.extended.client.stats([table]).values()
            for t in reply.tables]


def train(setting: dict, stream: Stream, args, addresses) -> dict:
    import keras
    import tensorflow as tf

    import parallax
    from parallax.layers import DynamicEmbedding

    strategy = parallax.ParallaxStrategy(
        ps_addresses=addresses, log_plan=False, search_partitions=False,
        run_id=f"bound-{setting['name']}-{int(time.time())}", shards={"dyn/embeddings": SHARDS})
    with strategy.scope():
        keras.utils.set_random_seed(7)
        inputs = keras.Input((COLUMNS,), dtype="int64")
        rows = DynamicEmbedding(DIM, name="dyn", **setting["layer"])(inputs)
        out = keras.layers.Dense(1, activation="sigmoid")(keras.layers.Flatten()(rows))
        model = keras.Model(inputs, out)
        optimizer = keras.optimizers.Adagrad(0.2)
    loss_fn = keras.losses.BinaryCrossentropy()

    @tf.function
    def step(x, y):
        def replica(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                          model.trainable_variables))
            return loss
        return strategy.run(replica, args=(x, y))

    rng = np.random.default_rng(1)  # the same batches for every setting
    losses, largest, start = [], 0, time.perf_counter()
    for i in range(args.steps):
        losses.append(float(step(*stream.batch(rng, args.batch))))
        if i % args.poll == 0 or i == args.steps - 1:
            largest = max(largest, *_rows_per_shard(strategy))
    seconds = time.perf_counter() - start
    held = _rows_per_shard(strategy)
    x, y = stream.batch(np.random.default_rng(2), 20_000)
    fresh = float(loss_fn(y, model.predict(x, batch_size=2048, verbose=0)))
    tail = max(1, args.steps // 10)
    return {"name": setting["name"], "layer": setting["layer"], "steps_per_s":
            args.steps / seconds, "train_loss_tail": float(np.mean(losses[-tail:])),
            "fresh_loss": fresh, "rows_held": held, "largest_shard_rows": largest,
            "losses": losses}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=50_000, help="distinct keys in the stream")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of the ranks")
    parser.add_argument("--bound", type=float, default=0.1, help="bound / distinct keys")
    parser.add_argument("--poll", type=int, default=50, help="steps between row counts")
    parser.add_argument("--plot", default="", help="also draw the loss curves to this PNG")
    parser.add_argument("--from-json", default="", help="report (and plot) a saved run")
    args = parser.parse_args()
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        _report(argparse.Namespace(**{**saved["args"], "plot": args.plot}),
                saved["bound_per_shard"], saved["results"])
        return

    from parallax.client.local_cluster import LocalCluster

    stream = Stream(args.keys, args.zipf)
    per_shard = max(1, int(args.keys * args.bound) // SHARDS)
    settings = [{"name": "unbounded", "layer": {}}] + [
        {"name": f"bounded-{policy}", "layer": {"max_rows_per_shard": per_shard,
                                                "eviction": policy}}
        for policy in ("lfu", "lru")] + [
        {"name": "bounded-lru-admit2", "layer": {"max_rows_per_shard": per_shard,
                                                 "eviction": "lru", "admit_after": 2}}]
    with LocalCluster(SHARDS) as cluster:
        results = [train(s, stream, args, cluster.addresses) for s in settings]
    _report(args, per_shard, results)


def _report(args, per_shard: int, results: list[dict]) -> None:
    base = results[0]
    seen = sum(base["rows_held"])
    print(f"{args.keys} distinct keys (Zipf {args.zipf}; {seen} seen), {args.steps} steps of "
          f"{args.batch}, {SHARDS} shards; bound {per_shard} rows per shard "
          f"({args.bound:.0%} of the distinct keys)")
    print(f"{'table':16} {'rows held':>10} {'max/shard':>10} {'tail loss':>10} {'vs unb.':>8} "
          f"{'fresh loss':>11} {'vs unb.':>8} {'steps/s':>8}")
    for r in results:
        print(f"{r['name']:16} {sum(r['rows_held']):>10} {r['largest_shard_rows']:>10} "
              f"{r['train_loss_tail']:>10.4f} "
              f"{r['train_loss_tail'] / base['train_loss_tail'] - 1:>+8.2%} "
              f"{r['fresh_loss']:>11.4f} {r['fresh_loss'] / base['fresh_loss'] - 1:>+8.2%} "
              f"{r['steps_per_s']:>8.1f}")
    out = Path("bench-results")
    out.mkdir(exist_ok=True)
    (out / "dynamic_bound.json").write_text(json.dumps(
        {"args": {k: v for k, v in vars(args).items() if k not in ("plot", "from_json")},
         "bound_per_shard": per_shard, "results": results}, indent=1))
    if args.plot:
        _plot(results, per_shard, Path(args.plot))


def _plot(results: list[dict], per_shard: int, path: Path, window: int = 100) -> None:
    """Training loss (moving mean over `window` steps) of each table, one figure."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    kernel = np.ones(window) / window
    for r in results:
        smooth = np.convolve(r["losses"], kernel, mode="valid")
        ax.plot(np.arange(window, window + len(smooth)), smooth,
                label=f"{r['name']} ({sum(r['rows_held'])} rows)")
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss (mean of {window} steps)")
    ax.set_title(f"DynamicEmbedding bounded at {per_shard} rows/shard vs unbounded")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
