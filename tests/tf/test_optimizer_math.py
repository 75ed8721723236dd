"""Server-side optimizers reproduce Keras 3 on the rows they touch (within 1e-6 relative).

Each case builds the Keras optimizer first, derives the server spec from it (class and
hyper-parameters read from the Keras object), pushes each step's gradients, some ids repeated,
to a real server and gives Keras the same gradients summed per id (an IndexedSlices of unique
ids, which is what the server applies: see parallax_ps.optimizers), and compares rows and
optimizer slots. Where lazy sparse updates differ from Keras' dense ones, the same rows are
touched every step and untouched rows are checked to stay exactly as they were.
"""
from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from typing import get_args  # noqa: E402

from parallax.errors import ConfigError  # noqa: E402
from parallax.protocol.specs import (Initializer, Nadam, OptimizerSpec, TableSpec,  # noqa: E402
                            optimizer_from_keras)
from parallax_ps.optimizers import _UPDATES  # noqa: E402

VOCAB, DIM, STEPS, REPEATS = 64, 5, 6, 6
SLOT_ATTRS = {"momentum": ("momentums", "_momentums", "_m"), "accumulator": ("_accumulators",),
              "velocity": ("_velocities",), "velocity_hat": ("_velocity_hats",),
              "linear": ("_linears",), "average_gradient": ("_average_gradients",),
              "norm": ("_u",)}

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
    "rmsprop": (lambda: keras.optimizers.RMSprop(learning_rate=0.05, rho=0.8, epsilon=1e-6),
                True),
    "rmsprop_momentum": (lambda: keras.optimizers.RMSprop(learning_rate=0.02, momentum=0.7),
                         True),
    "rmsprop_centered": (lambda: keras.optimizers.RMSprop(learning_rate=0.02, momentum=0.5,
                                                          centered=True), True),
    "adamax": (lambda: keras.optimizers.Adamax(learning_rate=0.05, beta_1=0.8, beta_2=0.95,
                                               epsilon=1e-6), True),
    "nadam": (lambda: keras.optimizers.Nadam(learning_rate=0.05, beta_1=0.85, beta_2=0.97,
                                             epsilon=1e-6), True),
    "lion": (lambda: keras.optimizers.Lion(learning_rate=0.03, beta_1=0.8, beta_2=0.95), True),
}


def _steps(lazy: bool) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each step's (ids, gradients): 20 distinct ids (the same every step when `lazy`), of
    which REPEATS appear twice more, shuffled. Gradients are multiples of 2**-10, so a per-id
    sum is exact in float32 whatever order the client and server add occurrences in."""
    rng = np.random.default_rng(42)
    fixed = np.sort(rng.choice(VOCAB, size=20, replace=False))
    steps = []
    for _ in range(STEPS):
        distinct = fixed if lazy else np.sort(rng.choice(VOCAB, size=20, replace=False))
        ids = rng.permutation(np.concatenate([distinct, np.repeat(distinct[:REPEATS], 2)]))
        grads = np.round(rng.normal(size=(len(ids), DIM)) * 1024) / 1024
        steps.append((ids, grads.astype(np.float32)))
    return steps


def _summed(ids: np.ndarray, grads: np.ndarray) -> tf.IndexedSlices:
    """The gradient summed per id, as Keras' IndexedSlices over the table."""
    unique, inverse = np.unique(ids, return_inverse=True)
    summed = np.zeros((len(unique), grads.shape[1]), grads.dtype)
    np.add.at(summed, inverse, grads)
    return tf.IndexedSlices(tf.constant(summed), tf.constant(unique),
                            tf.constant([VOCAB, grads.shape[1]]))


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
        optimizer.apply_gradients([(_summed(ids, grads), variable)])
        table.push(ids, grads, step=step)
    touched = np.unique(np.concatenate([ids for ids, _ in steps]))
    rows = table.pull_all()
    expected = variable.numpy()
    _assert_close(case, rows[touched], expected[touched], "rows")
    assert not np.array_equal(rows[touched], initial[touched]), "nothing was trained"
    untouched = np.setdiff1d(np.arange(VOCAB), touched)
    if lazy:
        np.testing.assert_array_equal(rows[untouched], initial[untouched])
    else:
        _assert_close(case, rows, expected, "rows")
    saved = snapshot(table_name).arrays
    keras_slots = _keras_slots(optimizer)
    assert {k[len("slot_"):] for k in saved if k.startswith("slot_")} == set(keras_slots)
    for name, value in keras_slots.items():
        _assert_close(case, saved[f"slot_{name}"][touched], value[touched], name)


def _assert_close(case: str, actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    """Within 1e-6 relative (1e-7 absolute). Ftrl: within 1e-6 of the array's largest
    magnitude. TF's float32 pow differs from numpy's by one ulp in about a fifth of elements,
    and Ftrl subtracts two such powers and scales the difference by the row, so one ulp of a
    power can be a large relative error of an element near zero (1.3e-5 of a `linear` element
    in ftrl_power). With TF's pow swapped in, the servers' Ftrl gives Keras' result bit for
    bit."""
    atol = 1e-6 * float(np.abs(expected).max()) if case.startswith("ftrl") else 1e-7
    np.testing.assert_allclose(actual, expected, rtol=1e-6, atol=atol, err_msg=what)


def test_keras_options_the_server_cannot_apply_are_refused():
    with pytest.raises(ConfigError, match=r"weight_decay=0.01 of Adam decays every variable "
                       r".*placement=\{'t': 'allreduce'\}"):
        optimizer_from_keras(keras.optimizers.Adam(weight_decay=0.01), ["t"])
    for option, value in [("clipnorm", 1.0), ("clipvalue", 0.5), ("global_clipnorm", 1.0),
                          ("use_ema", True), ("gradient_accumulation_steps", 2)]:
        with pytest.raises(ConfigError, match=rf"option {option}={value} of SGD .*Remove the "
                           r"option, or keep the tables on the workers"):
            optimizer_from_keras(keras.optimizers.SGD(**{option: value}))
    with pytest.raises(ConfigError) as refused:
        optimizer_from_keras(keras.optimizers.Adadelta(), ["embedding/embeddings"])
    message = str(refused.value)
    assert message.startswith("Keras optimizer Adadelta has no server-side version (the "
                              "parameter servers apply SGD, Adagrad, Adam, Ftrl, RMSprop, "
                              "Adamax, Nadam, Lion)")
    assert "ParallaxStrategy(placement={'embedding/embeddings': 'allreduce'})" in message
    assert "ParallaxStrategy(mode='allreduce')" in message


def test_every_server_optimizer_has_an_update():
    assert set(_UPDATES) == set(get_args(OptimizerSpec))


@pytest.mark.keras
def test_a_repeated_id_is_updated_with_its_summed_gradient(client, table_name):
    """Adagrad, id 0 three times a step: the servers add the square of the summed gradient
    (Keras' update from a dense gradient); Keras 3 given the raw IndexedSlices adds each
    occurrence's square instead, and ends elsewhere (docs/parameter-server.md, "Server-side
    optimizers")."""
    ids, grads = np.array([0, 0, 0, 1]), np.array([[0.5], [0.25], [-0.125], [1.0]], np.float32)
    spec = TableSpec(name=table_name, vocabulary_size=4, dim=1,
                     optimizer=optimizer_from_keras(keras.optimizers.Adagrad(0.1)))
    table = client.create_table(spec)
    dense, raw = (tf.Variable(np.zeros((4, 1), np.float32)) for _ in range(2))
    dense_keras, raw_keras = keras.optimizers.Adagrad(0.1), keras.optimizers.Adagrad(0.1)
    slices = tf.IndexedSlices(tf.constant(grads), tf.constant(ids), tf.constant([4, 1]))
    for step in range(3):
        table.push(ids, grads, step=step)
        dense_keras.apply_gradients([(tf.convert_to_tensor(slices), dense)])
        raw_keras.apply_gradients([(slices, raw)])
    rows = table.pull_all()
    np.testing.assert_allclose(rows, dense.numpy(), rtol=1e-6)
    assert rows[1] == pytest.approx(raw.numpy()[1], rel=1e-6)  # once a step: the same
    assert abs(rows[0, 0] - raw.numpy()[0, 0]) > 0.01, (rows[0], raw.numpy()[0])


def test_nadam_u_product_is_multiplied_up_again_after_a_step_back():
    """The running product a shard keeps gives the same scalar as one computed from scratch,
    going forward one step at a time or back (a restored checkpoint)."""
    spec = Nadam(beta_1=0.85)
    kept = _UPDATES[Nadam]()
    forward = [kept.u_product(spec, steps, np.float32) for steps in range(1, 40)]
    assert kept.u_product(spec, 7, np.float32) == forward[6]
    assert [_UPDATES[Nadam]().u_product(spec, n, np.float32) for n in (1, 7, 39)] == \
        [forward[0], forward[6], forward[38]]
    assert forward[0] == np.float32(0.85) * (np.float32(1) - np.float32(0.5) * np.float32(0.96))
    stuck = kept.u_product(spec, 10**4, np.float32)  # underflowed to a fixed point
    assert stuck < 1e-40 and kept.u_product(spec, 10**9, np.float32) == stuck  # at once
