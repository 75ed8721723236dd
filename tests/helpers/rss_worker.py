"""Trains a Keras model with one large table on the embedded servers (`rss_worker.py ROWS`: a
Keras Embedding of ROWS rows; `rss_worker.py dynamic KEYS`: a DynamicEmbedding fed KEYS
distinct keys) and prints this worker's resident memory once training reached a steady
state: `RSS_MB <number>`."""
from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras  # noqa: E402
import numpy as np  # noqa: E402

import parallax  # noqa: E402


def rss_mb() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) // 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def main(vocabulary: int, dim: int = 64) -> None:
    strategy = parallax.ParallaxStrategy(log_plan=False)
    with strategy.scope():
        inputs = keras.Input((8,), dtype="int64")
        rows = keras.layers.Embedding(vocabulary, dim)(inputs)
        model = keras.Model(inputs, keras.layers.Dense(1)(keras.layers.Flatten()(rows)))
        model.compile(keras.optimizers.Adagrad(0.1), "mse")
    rng = np.random.default_rng(0)
    x = np.minimum(rng.zipf(1.2, (4096, 8)) - 1, vocabulary - 1)
    y = rng.random((4096, 1)).astype("float32")
    model.fit(x, y, batch_size=256, epochs=3, verbose=0)
    table = strategy.plan.get(model.layers[1].embeddings.path)
    assert table.placement == "ps", table
    print(f"RSS_MB {rss_mb()} TABLE_MB {table.bytes >> 20}", flush=True)


def main_dynamic(keys: int, dim: int = 64) -> None:
    """A DynamicEmbedding trained on `keys` distinct keys of any value, each seen about
    equally often (so the servers end up holding all of them); prints the rows held."""
    from parallax.layers import DynamicEmbedding
    strategy = parallax.ParallaxStrategy(log_plan=False, search_partitions=False)
    with strategy.scope():
        inputs = keras.Input((8,), dtype="int64")
        rows = DynamicEmbedding(dim, name="dynamic")(inputs)
        model = keras.Model(inputs, keras.layers.Dense(1)(keras.layers.Flatten()(rows)))
        model.compile(keras.optimizers.Adagrad(0.1), "mse")
    rng = np.random.default_rng(0)
    batch, steps = 1024, 96
    distinct = rng.integers(1 << 40, 1 << 62, size=keys, dtype=np.int64)
    x = distinct[np.arange(batch * 8 * steps) % keys].reshape(-1, 8)
    y = rng.random((len(x), 1)).astype("float32")
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0)
    held = sum(t.rows for reply in strategy.extended.client.stats().values()
               for t in reply.tables if t.table.startswith(strategy.extended.cluster.run_id))
    print(f"RSS_MB {rss_mb()} TABLE_MB {held * dim * 4 * 2 >> 20} ROWS {held}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "dynamic":
        main_dynamic(int(sys.argv[2]))
    else:
        main(int(sys.argv[1]))
