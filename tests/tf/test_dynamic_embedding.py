"""`parallax.layers.DynamicEmbedding` (issue 17 part 1): keys of any int64 value or strings,
trained locally (outside a strategy) and under `ParallaxStrategy` in hybrid, ps and async
modes against real servers on loopback; admission, the per-shard bound, a checkpoint and
an exact resume, a reshard, and a serving copy that loads without parallax."""
from __future__ import annotations

import itertools
import subprocess
import sys
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import parallax
from parallax.client.local_cluster import LocalCluster
from parallax.errors import ConfigError
from parallax.layers import DynamicEmbedding, hash_keys, serving_model
from test_fusion import make_strategy  # noqa: F401 (a fixture: strategies on `cluster`)

_ids = itertools.count()
DIM, COLUMNS, BATCH = 4, 3, 32
BIG = 10**15  # keys far outside any vocabulary


def stream(n=256, seed=0, distinct=None):
    """Zipf-skewed keys around BIG, and a target that depends on them."""
    rng = np.random.default_rng(seed)
    ranks = rng.zipf(1.3, size=(n, COLUMNS))
    if distinct is not None:
        ranks = np.minimum(ranks, distinct)
    x = (ranks * 7919 + BIG).astype("int64")
    return x, (ranks.sum(axis=1) % 3 / 3.0).astype("float32")[:, None]


def build(key_dtype="int64", **layer):
    keras.utils.set_random_seed(1)
    inputs = keras.Input((COLUMNS,), dtype="string" if key_dtype == "string" else "int64")
    rows = DynamicEmbedding(DIM, key_dtype=key_dtype, name="dyn", **layer)(inputs)
    out = keras.layers.Dense(1, name="dense")(keras.layers.Flatten()(rows))
    model = keras.Model(inputs, out)
    model.compile(keras.optimizers.Adagrad(0.1), loss="mse")
    return model


def shard_stats(strategy):
    """Stats of the dynamic table's shards on the job's servers."""
    name = next(v.table for v in strategy.plan.on_servers if v.dynamic is not None)
    return [t for reply in strategy.extended.client.stats([name]).values()
            for t in reply.tables]


def train_in(strategy, epochs=2, **layer):
    x, y = stream()
    with strategy.scope():
        model = build(**layer)
    history = model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0)
    return model, history.history["loss"]


# ---- locally ------------------------------------------------------------------------------

def test_locally_keys_get_rows_on_their_admit_after_th_sighting():
    layer = DynamicEmbedding(DIM, admit_after=2, local_rows=4)
    seen_once, seen_twice = BIG + 1, BIG + 2
    layer(tf.constant([[seen_once, seen_twice]]), training=True)
    assert len(layer.export_rows()[0]) == 0  # nobody seen twice yet
    rows = layer(tf.constant([[seen_twice, BIG + 3]]), training=True).numpy()
    keys, values, uses = layer.export_rows()
    assert keys.tolist() == [seen_twice] and uses.tolist() == [2]
    np.testing.assert_array_equal(rows[0, 1], np.zeros(DIM))  # unadmitted: zeros
    np.testing.assert_array_equal(rows[0, 0], values[0])
    many = tf.constant([[BIG + k for k in range(10, 20)] * 2])
    layer(many, training=True)  # a sighting per batch, whatever the repeats in it
    assert len(layer.export_rows()[0]) == 1
    layer(many, training=True)
    assert len(layer.export_rows()[0]) == 4  # local_rows holds at most 4 keys


def test_locally_a_model_trains_and_unadmitted_keys_get_no_gradient():
    x, y = stream()
    model = build(admit_after=3)
    losses = model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False,
                       verbose=0).history["loss"]
    assert losses[-1] < losses[0]
    layer = model.get_layer("dyn")
    keys, values, uses = layer.export_rows()
    assert len(keys) and (uses >= 3).all()
    held = int(layer._local.next_row.numpy())
    slots = [v for v in model.optimizer.variables if v.shape == layer._variable.shape]
    accumulator = slots[0].numpy()
    assert (accumulator[:held] > 0.1).any(axis=1).mean() > 0.9  # held rows were trained ...
    np.testing.assert_array_equal(accumulator[held:], 0.1)  # ... no other row got a gradient


def test_a_locally_trained_model_saves_reloads_and_exports_with_its_keys(tmp_path):
    x, y = stream()
    model = build(admit_after=2)
    model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0)
    expected = model.predict(x[:16], verbose=0)
    assert np.abs(expected - model.layers[-1].bias.numpy()).max() > 0  # rows matter
    model.save(tmp_path / "m.keras")
    reloaded = keras.models.load_model(tmp_path / "m.keras")
    np.testing.assert_array_equal(reloaded.predict(x[:16], verbose=0), expected)
    model.export(tmp_path / "served", verbose=False)
    loaded = tf.saved_model.load(str(tmp_path / "served"))  # (it owns the variables)
    np.testing.assert_array_equal(loaded.serve(tf.constant(x[:16])).numpy(), expected)
    np.testing.assert_allclose(serving_model(model).predict(x[:16], verbose=0), expected,
                               atol=1e-6)


def test_string_keys_are_hashed_in_the_graph_and_serve_alike():
    layer = DynamicEmbedding(DIM, key_dtype="string")
    out = layer(tf.constant([["apple", "pear"]]), training=True).numpy()
    keys, values, _ = layer.export_rows(keys=["pear"])
    assert keys.tolist() == hash_keys(tf.constant(["pear"])).numpy().tolist()
    np.testing.assert_array_equal(out[0, 1], values[0])
    served = layer.serving_layer()(tf.constant([["pear", "plum"]])).numpy()
    np.testing.assert_array_equal(served[0, 0], out[0, 1])
    np.testing.assert_array_equal(served[0, 1], np.zeros(DIM))
    with pytest.raises(ConfigError, match="takes string keys, got int32"):
        layer(tf.constant([[1]]))


@pytest.mark.parametrize("settings, message", [
    ({"admit_probability": 0.0}, "admit_probability must be in"),
    ({"eviction": "lru"}, "max_rows_per_shard is 0"),
    ({"eviction": "fifo", "max_rows_per_shard": 5}, "eviction 'fifo' is not supported"),
    ({"ttl_steps": -1}, "ttl_steps must be an int >= 0"),
    ({"key_dtype": "float32"}, "key_dtype 'float32' is not supported"),
])
def test_bad_settings_are_refused_naming_the_fix(settings, message):
    with pytest.raises(ConfigError, match=message):
        DynamicEmbedding(DIM, **settings)


# ---- under the strategy -------------------------------------------------------------------

@pytest.mark.parametrize("mode, sync", [("hybrid", True), ("ps", True), ("hybrid", False)],
                         ids=["hybrid", "ps", "async"])
def test_trains_under_the_strategy_within_the_bound(make_strategy, mode, sync):
    strategy = make_strategy(mode=mode, sync=sync)
    model, losses = train_in(strategy, epochs=3, max_rows_per_shard=20, eviction="lfu")
    assert np.isfinite(losses).all() and losses[-1] < losses[0]
    vp = strategy.plan.get("dyn/embeddings")
    assert vp.placement == "ps" and vp.dynamic.max_rows_per_shard == 20
    assert "dynamic: <= 20 rows/shard (lfu)" in strategy.plan.format()
    assert "keysx4" in strategy.plan.format()
    stats = shard_stats(strategy)
    assert len(stats) == 2 and all(0 < s.rows <= 20 for s in stats)
    assert sum(s.dynamic.evicted_capacity for s in stats) > 0  # the bound held by evicting
    keys, rows, uses = model.get_layer("dyn").export_rows()
    assert len(keys) == sum(s.rows for s in stats) and rows.shape == (len(keys), DIM)


def test_unadmitted_keys_read_their_default_row_and_drop_their_gradients(make_strategy):
    strategy = make_strategy()
    with strategy.scope():
        model = build(admit_after=3)
    x, y = stream(n=3 * BATCH)
    x[:, 0] = BIG - 5  # a key in every row of 3 batches: 3 sightings (one per step) ...
    x[:BATCH, 1] = BIG - 7  # ... and one in every row of the first batch only: 1 sighting
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    layer = model.get_layer("dyn")
    assert layer.export_rows(keys=[BIG - 7])[0].size == 0  # not admitted
    assert layer.export_rows(keys=[BIG - 5])[0].tolist() == [BIG - 5]
    assert sum(s.dynamic.dropped_gradients for s in shard_stats(strategy)) > 0
    default = layer(tf.constant([[BIG - 7]])).numpy()
    assert np.abs(default).max() > 0  # the initializer's row for the key, not zeros ...
    np.testing.assert_array_equal(layer(tf.constant([[BIG - 7]])).numpy(), default)  # ... kept


def test_rows_unused_for_ttl_steps_are_dropped(make_strategy):
    strategy = make_strategy()
    with strategy.scope():
        model = build(ttl_steps=3)
    x, y = stream(n=8 * BATCH)
    x[:BATCH, 0] = BIG - 9  # used in the first step only
    model.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, verbose=0)
    layer = model.get_layer("dyn")
    assert layer.export_rows(keys=[BIG - 9])[0].tolist() == [BIG - 9]
    model.fit(x[BATCH:], y[BATCH:], batch_size=BATCH, shuffle=False, verbose=0)  # 7 steps
    assert layer.export_rows(keys=[BIG - 9])[0].size == 0
    assert sum(s.dynamic.evicted_ttl for s in shard_stats(strategy)) > 0


def test_allreduce_mode_and_unsupported_initializers_are_refused(make_strategy):
    with pytest.raises(ConfigError, match="DynamicEmbedding table.*mode is 'allreduce'"):
        train_in(make_strategy(mode="allreduce"), epochs=1)
    with pytest.raises(ConfigError, match="initializer GlorotUniform is not one they "):
        train_in(make_strategy(), epochs=1, embeddings_initializer="glorot_uniform")


def test_whole_value_assignments_are_refused(make_strategy):
    strategy = make_strategy()
    model, _ = train_in(strategy, epochs=1)
    layer = model.get_layer("dyn")
    with pytest.raises(ConfigError, match="DynamicEmbedding table.*cannot be assigned"):
        layer.set_weights([np.zeros(layer._variable.shape, np.float32)])
    np.testing.assert_array_equal(layer.get_weights()[0], 0)  # the stand-in reads zeros


def test_mixed_precision_trains_under_the_strategy(make_strategy):
    """The layer reads its float32 variable (no autocast copy), and LossScaleOptimizer's
    finite check reads the keyed gradient's values (it cannot densify any key)."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        strategy = make_strategy()
        model, losses = train_in(strategy, epochs=2, max_rows_per_shard=30)
        assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
        assert np.isfinite(losses).all() and losses[-1] < losses[0]
        assert model.get_layer("dyn").compute_dtype == "float16"
    finally:
        keras.mixed_precision.set_global_policy("float32")


def test_a_layer_built_after_the_plan_is_refused(make_strategy):
    strategy = make_strategy()
    train_in(strategy, epochs=1)
    with strategy.scope(), pytest.raises(ConfigError, match="built after its ParallaxStrategy"):
        build()


def test_a_file_saved_in_the_strategy_loads_with_plain_keras(make_strategy, tmp_path):
    strategy = make_strategy()
    model, _ = train_in(strategy, epochs=2, max_rows_per_shard=40)
    keys, _, _ = model.get_layer("dyn").export_rows()
    held = keys[:COLUMNS * 4].reshape(4, COLUMNS)  # served keys all held: same rows both ways
    expected = model.predict(held, verbose=0)
    model.save(tmp_path / "m.keras")
    plain = keras.models.load_model(tmp_path / "m.keras")  # no strategy: the local table
    np.testing.assert_allclose(plain.predict(held, verbose=0), expected, atol=1e-6)
    assert len(plain.get_layer("dyn").export_rows()[0]) == len(keys)


@pytest.mark.parametrize("shards, servers", [(1, None), (2, [1, 0])])
def test_a_reshard_moves_the_rows(make_strategy, shards, servers):
    strategy = make_strategy()
    model, _ = train_in(strategy, epochs=1, max_rows_per_shard=40)
    layer = model.get_layer("dyn")
    before = layer.export_rows()
    assert len(before[0]) == 80  # both shards full
    strategy.reshard({"dyn/embeddings": shards},  # 2 -> 1, or onto each other's server
                     servers=servers and {"dyn/embeddings": servers})
    vp = strategy.plan.get("dyn/embeddings")
    assert vp.shards == shards and (servers is None or list(vp.servers) == servers)
    after = layer.export_rows()  # every row kept: the bound per shard followed
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)
    x, y = stream(seed=1)
    assert np.isfinite(model.fit(x, y, batch_size=BATCH, verbose=0).history["loss"]).all()


@pytest.mark.parametrize("how", ["checkpoint", "keras-file"])
def test_a_resumed_run_equals_an_uninterrupted_one(tmp_path, how):
    """A tf.train.Checkpoint (or model.save) after 2 epochs; a new job on new servers (same
    data directory) restores it (load_model) and trains a third: losses, rows, counters as
    the uninterrupted job's."""
    x, y = stream()
    layer = dict(max_rows_per_shard=15, admit_after=2, ttl_steps=6)

    def job(steps_before, resume_from=None):
        with LocalCluster(2, data_dir=tmp_path / "data") as servers:
            strategy = parallax.ParallaxStrategy(
                ps_addresses=servers.addresses, log_plan=False, search_partitions=False,
                run_id=f"resume{next(_ids)}-{int(time.time())}")
            with strategy.scope():
                model = build(**layer) if how == "checkpoint" or resume_from is None else \
                    keras.models.load_model(resume_from)
            checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
            if resume_from is not None and how == "checkpoint":
                checkpoint.restore(resume_from)
            path = None
            if steps_before:
                model.fit(x, y, batch_size=BATCH, epochs=steps_before, shuffle=False,
                          verbose=0)
                path = checkpoint.save(tmp_path / "ckpt") if how == "checkpoint" else \
                    tmp_path / "m.keras"
                if how == "keras-file":
                    model.save(path)
            losses = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False,
                               verbose=0).history["loss"]
            counters = sorted((s.shard_index, s.rows, s.dynamic.admitted,
                               s.dynamic.evicted_capacity, s.dynamic.evicted_ttl)
                              for s in shard_stats(strategy))
            return losses, model.get_layer("dyn").export_rows(), counters, path

    full_losses, full_rows, full_counters, path = job(2)
    resumed_losses, resumed_rows, resumed_counters, _ = job(0, resume_from=path)
    np.testing.assert_allclose(resumed_losses, full_losses, rtol=0, atol=1e-6)
    for a, b in zip(resumed_rows, full_rows):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    assert resumed_counters == full_counters


def test_a_restore_into_fewer_shards_keeps_every_row(tmp_path):
    """Saved over 2 full shards of 15 rows, restored into 1: the shard is bounded to hold
    them all (not refused, not evicted)."""
    x, y = stream()

    def job(servers, restore_from=None, held=None):
        with LocalCluster(servers, data_dir=tmp_path / "data") as cluster:
            strategy = parallax.ParallaxStrategy(
                ps_addresses=cluster.addresses, log_plan=False, search_partitions=False,
                run_id=f"fewer{next(_ids)}-{int(time.time())}")
            with strategy.scope():
                model = build(max_rows_per_shard=15)
            checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
            if restore_from is not None:  # then a step on held keys only (plans, evicts none)
                checkpoint.restore(restore_from)
                model.fit(held[:COLUMNS * 8].reshape(8, COLUMNS), np.zeros((8, 1)), verbose=0)
            else:
                model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0)
            keys = model.get_layer("dyn").export_rows()[0]
            bound = strategy.plan.get("dyn/embeddings").dynamic.max_rows_per_shard
            path = checkpoint.save(tmp_path / "ckpt") if restore_from is None else None
            return keys, bound, path

    saved_keys, _, path = job(2)
    assert len(saved_keys) == 30
    keys, bound, _ = job(1, restore_from=path, held=saved_keys)
    assert bound >= 30
    np.testing.assert_array_equal(keys, saved_keys)


SERVE = """
import sys, numpy as np, tensorflow as tf
loaded = tf.saved_model.load(sys.argv[1])
keys = np.load(sys.argv[2])
out = loaded.serve(tf.constant(keys)).numpy()
np.save(sys.argv[3], out)
assert not [m for m in sys.modules if m.startswith("parallax")], "parallax was imported"
"""


def test_a_serving_copy_exports_a_savedmodel_that_serves_without_parallax(make_strategy,
                                                                          tmp_path):
    strategy = make_strategy()
    model, _ = train_in(strategy, epochs=2)
    layer = model.get_layer("dyn")
    keys, _, uses = layer.export_rows(top_n=6)
    assert len(keys) == 6 and (np.diff(uses) <= 0).all()  # most used first
    served_keys = np.array([keys[:COLUMNS], keys[COLUMNS:]], np.int64)
    expected = model.predict(served_keys, verbose=0)
    copy = serving_model(model, top_n=6)
    np.testing.assert_allclose(copy.predict(served_keys, verbose=0), expected, atol=1e-6)
    copy.export(tmp_path / "served")
    np.save(tmp_path / "keys.npy", served_keys)
    proc = subprocess.run([sys.executable, "-c", SERVE, str(tmp_path / "served"),
                           str(tmp_path / "keys.npy"), str(tmp_path / "out.npy")],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    np.testing.assert_allclose(np.load(tmp_path / "out.npy"), expected, atol=1e-6)
    with pytest.raises(ConfigError, match="serving_model top_n names"):
        serving_model(model, top_n={"nope": 3})
    inputs = keras.Input((COLUMNS,), dtype="int64")  # the trained model nested in another
    outer = keras.Model(inputs, model(inputs))
    nested = serving_model(outer, top_n=6)
    np.testing.assert_allclose(nested.predict(served_keys, verbose=0), expected, atol=1e-6)
