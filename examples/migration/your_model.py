"""Stand-ins for your own model and data in the migration guide's snippets
(docs/migration.md): a tiny embedding model and a fixed synthetic data set, the same in
every snippet, so that the snippets' losses can be compared (tests/integration/test_migration.py).

`build_model()` makes the same initial weights on every call (a fixed Keras seed), and
`load_data()` the same examples, so a run of any snippet, on one worker or several, trains
the same model on the same global batches.
"""
from __future__ import annotations

import keras
import numpy as np

VOCAB = 1000        # rows of the embedding table: read by gather, so sparse
DIM = 8
FEATURES = 3        # ids per example
EXAMPLES = 512
GLOBAL_BATCH = 32   # examples per training step, over all workers
EPOCHS = 3
STEPS_PER_EPOCH = EXAMPLES // GLOBAL_BATCH
LEARNING_RATE = 0.5


def build_model() -> keras.Model:
    """Embedding table -> flatten -> one dense unit; the same weights every time."""
    keras.utils.set_random_seed(7)
    ids = keras.Input((FEATURES,), dtype="int64")
    rows = keras.layers.Embedding(VOCAB, DIM, name="embedding")(ids)
    score = keras.layers.Dense(1, name="dense")(keras.layers.Flatten()(rows))
    return keras.Model(ids, score)


def load_data() -> tuple[np.ndarray, np.ndarray]:
    """(ids [EXAMPLES, FEATURES] int64, labels [EXAMPLES, 1] float32): Zipf-distributed ids,
    as real categorical features are, so a batch repeats some of them."""
    rng = np.random.default_rng(0)
    ids = np.minimum(rng.zipf(1.2, size=(EXAMPLES, FEATURES)) - 1, VOCAB - 1).astype("int64")
    labels = (np.sin(ids).sum(axis=1, keepdims=True) / FEATURES).astype("float32")
    return ids, labels
