"""`ParallaxStrategy(wire_dtype=...)`: training with float16 / bfloat16 rows on the wire stays
within a small bound of float32, the default path is unchanged bit for bit, the plan shows
the wire dtype, and saving reads the float32 masters. One worker, the session's servers."""
from __future__ import annotations

import itertools
import time

import keras
import numpy as np
import pytest

import parallax
from parallax import native
from parallax.env import NATIVE_ENV
from parallax.errors import ConfigError

_ids = itertools.count()
TABLES, VOCAB, DIM, BATCH, EPOCHS = 3, 300, 8, 16, 3
# Adagrad 0.2 on this model, 3 epochs of 6 steps: the largest loss differences measured
# against float32 were 9.2e-6 (bfloat16) and 7.0e-7 (float16), at a final loss of 0.079;
# the bounds leave 10x.
LOSS_BOUND = {"bfloat16": 1e-4, "float16": 1e-5}


@pytest.fixture
def train(cluster):
    def run(**kwargs):
        strategy = parallax.ParallaxStrategy(
            ps_addresses=cluster.addresses, run_id=f"wd{next(_ids)}-{int(time.time())}",
            log_plan=False, search_partitions=False, **kwargs)
        rng = np.random.default_rng(0)
        x = np.minimum(rng.zipf(1.3, size=(96, TABLES)) - 1, VOCAB - 1).astype("int64")
        y = (x.sum(axis=1, keepdims=True) % 7 / 7.0).astype("float32")
        with strategy.scope():
            keras.utils.set_random_seed(5)
            ids = keras.Input((TABLES,), dtype="int64")
            rows = [keras.layers.Embedding(VOCAB, DIM, name=f"emb{i}")(ids[:, i]) for i in range(TABLES)]
            out = keras.layers.Dense(1)(keras.layers.Concatenate()(rows))
            model = keras.Model(ids, out)
            model.compile(keras.optimizers.Adagrad(0.2), loss="mse")
        history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
        with strategy.local_tables():
            weights = [w.numpy().copy() for w in model.weights]
        return strategy, np.array(history.history["loss"]), weights
    return run


def test_default_and_float32_wire_train_bit_for_bit_alike(train):
    _, loss, weights = train()
    strategy, loss32, weights32 = train(wire_dtype="float32")
    np.testing.assert_array_equal(loss, loss32)
    for a, b in zip(weights, weights32):
        np.testing.assert_array_equal(a, b)
    assert "wire" not in strategy.plan.format()


@pytest.mark.parametrize("wire_dtype", ["bfloat16", "float16"])
def test_narrow_wire_trains_within_a_small_bound_of_float32(train, wire_dtype):
    _, loss32, weights32 = train()
    strategy, loss, weights = train(wire_dtype=wire_dtype)
    diff = np.abs(loss - loss32).max()
    print(f"\n{wire_dtype}: losses {loss.round(5)} vs float32 {loss32.round(5)}, "
          f"max difference {diff:.2e}")
    assert 0 < diff < LOSS_BOUND[wire_dtype]
    assert loss[-1] < loss[0]  # it learns
    for a, b in zip(weights, weights32):
        np.testing.assert_allclose(a, b, atol=50 * LOSS_BOUND[wire_dtype])
    tables = strategy.plan.on_servers
    assert tables and all(v.wire_dtype == wire_dtype for v in tables)
    head, *lines = strategy.plan.format().splitlines()[1:]
    assert "wire" in head and all(wire_dtype in line for line in lines
                                  if "sparse" in line)


@pytest.mark.skipif(native.kernels() is None,
                    reason=f"compiled kernels not in use: {native.describe()}")
@pytest.mark.parametrize("wire_dtype", ["bfloat16", "float16"])
def test_the_compiled_and_numpy_paths_narrow_alike(train, monkeypatch, wire_dtype):
    runs = []
    for path in ("1", "0"):
        monkeypatch.setenv(NATIVE_ENV, path)
        runs.append(train(wire_dtype=wire_dtype)[1:])
    (loss, weights), (numpy_loss, numpy_weights) = runs
    np.testing.assert_array_equal(loss, numpy_loss)
    for a, b in zip(weights, numpy_weights):
        np.testing.assert_array_equal(a, b)


def test_a_mapping_names_variables_and_bad_values_are_refused(train):
    strategy, _, _ = train(wire_dtype="bfloat16")
    first = strategy.plan.on_servers[0].name
    strategy, _, _ = train(wire_dtype={first: "float16"})
    assert [v.wire_dtype for v in strategy.plan.on_servers][0] == "float16"
    assert {v.wire_dtype for v in strategy.plan.on_servers[1:]} == {""}
    with pytest.raises(ConfigError, match=r"wire_dtype is 'half'; use one of float32"):
        parallax.ParallaxStrategy(wire_dtype="half", log_plan=False)
