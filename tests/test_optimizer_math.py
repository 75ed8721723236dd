"""Server-side optimizers reproduce Keras 3 on the rows they touch (within 1e-6 relative).

Each case builds the Keras optimizer first, derives the server spec from it (class and
hyper-parameters read from the Keras object), runs the same IndexedSlices gradients through
Keras on a tf.Variable and through a real server, and compares rows and optimizer slots.
Where lazy sparse updates differ from Keras' dense ones (see parallax_ps.optimizers), the same
rows are touched every step and untouched rows are checked to stay exactly as they were.
"""
from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from parallax.errors import ConfigError  # noqa: E402
from parallax.specs import Initializer, TableSpec, optimizer_from_keras  # noqa: E402

VOCAB, DIM, STEPS = 64, 5, 6
SLOT_ATTRS = {"momentum": ("momentums", "_momentums"), "accumulator": ("_accumulators",),
              "velocity": ("_velocities",), "velocity_hat": ("_velocity_hats",),
              "linear": ("_linears",)}

CASES = {
    "sgd": (lambda: keras.optimizers.SGD(learning_rate=0.3), False),
    "sgd_momentum": (lambda: keras.optimizers.SGD(learning_rate=0.1, momentum=0.9), True),
    "sgd_nesterov": (lambda: keras.optimizers.SGD(learning_rate=0.1, momentum=0.8,
                                                  nesterov=True), True),
    "adagrad": (lambda: keras.optimizers.Adagrad(learning_rate=0.2, epsilon=1e-6,
                                                 initial_accumulator_value=0.3), False),
    "adam": (lambda: keras.optimizers.Adam(learning_rate=0.05, beta_1=0.8, beta_2=0.95,
                                           epsilon=1e-6), True),
    "adam_amsgrad": (lambda: keras.optimizers.Adam(learning_rate=0.05, amsgrad=True), True),
    "ftrl": (lambda: keras.optimizers.Ftrl(learning_rate=0.2, l1_regularization_strength=0.01,
                                           l2_regularization_strength=0.02,
                                           l2_shrinkage_regularization_strength=0.03,
                                           beta=0.1, initial_accumulator_value=0.2), True),
    "ftrl_power": (lambda: keras.optimizers.Ftrl(learning_rate=0.1, learning_rate_power=-0.7),
                   True),
}


def _steps(lazy: bool) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(42)
    fixed = np.sort(rng.choice(VOCAB, size=20, replace=False))
    steps = []
    for _ in range(STEPS):
        ids = fixed if lazy else np.sort(rng.choice(VOCAB, size=20, replace=False))
        steps.append((ids, rng.normal(size=(len(ids), DIM)).astype(np.float32)))
    return steps


def _keras_slots(optimizer) -> dict[str, np.ndarray]:
    slots = {}
    for name, attrs in SLOT_ATTRS.items():
        for attr in attrs:
            found = getattr(optimizer, attr, None)
            if found:
                slots[name] = found[0].numpy()
    return slots


@pytest.mark.keras
@pytest.mark.parametrize("case", sorted(CASES))
def test_server_matches_keras(client, snapshot, table_name, case):
    make, lazy = CASES[case]
    optimizer = make()
    spec = TableSpec(name=table_name, vocabulary_size=VOCAB, dim=DIM, shard_count=2,
                     initializer=Initializer("uniform", minval=-1, maxval=1, seed=9),
                     optimizer=optimizer_from_keras(optimizer))
    assert spec.optimizer.kind == type(optimizer).__name__.lower()
    table = client.create_table(spec)
    initial = table.pull_all()
    variable = tf.Variable(initial)
    steps = _steps(lazy)
    for step, (ids, grads) in enumerate(steps):
        optimizer.apply_gradients([(tf.IndexedSlices(tf.constant(grads), tf.constant(ids),
                                                     tf.constant([VOCAB, DIM])), variable)])
        table.push(ids, grads, step=step)
    touched = np.unique(np.concatenate([ids for ids, _ in steps]))
    rows = table.pull_all()
    expected = variable.numpy()
    np.testing.assert_allclose(rows[touched], expected[touched], rtol=1e-6, atol=1e-7)
    assert not np.array_equal(rows[touched], initial[touched]), "nothing was trained"
    untouched = np.setdiff1d(np.arange(VOCAB), touched)
    if lazy:
        np.testing.assert_array_equal(rows[untouched], initial[untouched])
    else:
        np.testing.assert_allclose(rows, expected, rtol=1e-6, atol=1e-7)
    saved = snapshot(table_name).arrays
    keras_slots = _keras_slots(optimizer)
    assert {k[len("slot_"):] for k in saved if k.startswith("slot_")} == set(keras_slots)
    for name, value in keras_slots.items():
        np.testing.assert_allclose(saved[f"slot_{name}"][touched], value[touched], rtol=1e-6,
                                   atol=1e-7, err_msg=name)


def test_keras_options_the_server_cannot_apply_are_refused():
    with pytest.raises(ConfigError, match="weight_decay=0.01 is not applied on the parameter"):
        optimizer_from_keras(keras.optimizers.Adam(weight_decay=0.01))
    with pytest.raises(ConfigError, match="RMSprop has no server-side version"):
        optimizer_from_keras(keras.optimizers.RMSprop())
