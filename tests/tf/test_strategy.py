"""ParallaxStrategy in one worker process, against the session's two real parameter servers:
the tf.distribute contract, the plan, run modes, and every bad input the issue lists."""
from __future__ import annotations

import itertools
import socket
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import parallax
from parallax import native
from parallax.errors import ConfigError, ParallaxError
from parallax.tf.graph.variables import ParallaxVariable

_ids = itertools.count()
VOCAB, DIM = 300, 4


@pytest.fixture
def make_strategy(cluster):
    def make(**kwargs):
        kwargs.setdefault("ps_addresses", cluster.addresses)
        kwargs.setdefault("log_plan", False)
        return parallax.ParallaxStrategy(run_id=f"st{next(_ids)}-{int(time.time())}", **kwargs)
    return make


def data(n=128, vocab=VOCAB, seed=0):
    rng = np.random.default_rng(seed)
    ids = np.minimum(rng.zipf(1.3, size=(n, 3)) - 1, vocab - 1).astype("int64")
    return ids, (ids.sum(axis=1, keepdims=True) % 7 / 7.0).astype("float32")


def embedding_model(vocab=VOCAB, dense=True):
    keras.utils.set_random_seed(5)
    inputs = keras.Input((3,), dtype="int64")
    h = keras.layers.Embedding(vocab, DIM, name="embedding")(inputs)
    if dense:
        out = keras.layers.Dense(1, name="dense")(keras.layers.Flatten()(h))
    else:
        out = keras.ops.mean(h, axis=[1, 2])[:, None]
    return keras.Model(inputs, out)


def test_is_a_tf_distribute_strategy(make_strategy):
    strategy = make_strategy()
    assert isinstance(strategy, tf.distribute.Strategy)
    assert strategy.num_replicas_in_sync == 1
    assert strategy.plan is None
    with strategy.scope():
        model = embedding_model()
        assert tf.distribute.get_strategy() is strategy
    assert all(isinstance(v.value, ParallaxVariable) for v in model.weights)


def test_fit_evaluate_predict_and_the_plan(make_strategy, capsys):
    strategy = make_strategy(log_plan=True)
    x, y = data()
    with strategy.scope():
        model = embedding_model()
        model.compile(keras.optimizers.Adagrad(0.2), loss="mse")
    history = model.fit(x, y, batch_size=16, epochs=3, verbose=0)
    losses = history.history["loss"]
    assert losses[-1] < losses[0]
    plan = strategy.plan
    table = plan.get("embedding/embeddings")
    assert (table.kind, table.placement, table.shards) == ("sparse", "ps", 1)  # < 16 MiB
    assert "gather on axis 0" in table.reason and "IndexedSlices" in table.reason
    kernel = plan.get("dense/kernel")
    assert (kernel.kind, kernel.placement) == ("dense", "allreduce")
    assert "MatMul" in kernel.reason
    assert table.bytes == VOCAB * DIM * 4 and table.shape == (VOCAB, DIM)
    logged = capsys.readouterr().err
    assert logged.count("parallax plan (hybrid") == 1  # logged once
    assert f"worker data path: {native.describe()}" in logged  # native, or python and why
    assert model.evaluate(x, y, verbose=0) == pytest.approx(losses[-1], rel=0.5)
    assert model.predict(x[:5], verbose=0).shape == (5, 1)
    traffic = strategy.tables["embedding/embeddings"].traffic
    assert traffic.pushes == 3 * 8 and traffic.pulled_rows > 0
    # The worker keeps no copy of the table: its storage was released.
    storage = model.layers[1].embeddings.value
    assert storage.remote is not None and storage.handle is not None


def test_custom_loop_written_for_multi_worker_mirrored(make_strategy):
    strategy = make_strategy()
    x, y = data()
    global_batch = 16

    def dataset_fn(context: tf.distribute.InputContext):
        batch = context.get_per_replica_batch_size(global_batch)
        ds = tf.data.Dataset.from_tensor_slices((x, y))
        return ds.shard(context.num_input_pipelines, context.input_pipeline_id).batch(batch)

    with strategy.scope():
        model = embedding_model()
        optimizer = keras.optimizers.SGD(0.5)
    dist = strategy.distribute_datasets_from_function(dataset_fn)

    @tf.function
    def train_step(batch):
        def step_fn(inputs):
            features, labels = inputs
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(
                    keras.losses.mean_squared_error(labels, model(features)),
                    global_batch_size=global_batch)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss
        per_replica = strategy.run(step_fn, args=(batch,))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    epochs = [float(np.mean([train_step(b) for b in dist])) for _ in range(3)]
    assert epochs[-1] < epochs[0]
    assert strategy.plan.get("embedding/embeddings").placement == "ps"


def test_placement_override(make_strategy):
    strategy = make_strategy(placement={"embedding/embeddings": "allreduce"})
    x, y = data()
    with strategy.scope():
        model = embedding_model()
        model.compile(keras.optimizers.SGD(0.1), loss="mse")
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    entry = strategy.plan.get("embedding/embeddings")
    assert (entry.kind, entry.placement) == ("sparse", "allreduce")
    assert "by the user" in entry.reason
    assert strategy.tables == {}
    assert "no sparse variables" in strategy.plan.summary() or not strategy.plan.on_servers


def test_override_of_unknown_variable_is_refused(make_strategy):
    strategy = make_strategy(placement={"no/such/variable": "ps"})
    x, y = data()
    with strategy.scope():
        model = embedding_model()
        model.compile(keras.optimizers.SGD(0.1), loss="mse")
    with pytest.raises(ConfigError, match="no/such/variable"):
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)


def test_bad_configuration_values_are_named():
    with pytest.raises(ConfigError, match="'fastest'"):
        parallax.ParallaxStrategy(mode="fastest")
    with pytest.raises(ConfigError, match="'gpu'"):
        parallax.ParallaxStrategy(placement={"x": "gpu"})
    with pytest.raises(ConfigError, match="'localhost' is not host:port"):
        parallax.ParallaxStrategy(ps_addresses="localhost")
    with pytest.raises(ConfigError, match="shards must be positive"):
        parallax.ParallaxStrategy(shards=0)


def test_dense_only_model_runs_as_pure_allreduce(make_strategy):
    strategy = make_strategy()
    rng = np.random.default_rng(1)
    x = rng.normal(size=(64, 5)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    with strategy.scope():
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.05), loss="mse")
    model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    assert "pure all-reduce" in strategy.plan.summary()
    assert strategy.tables == {}


def test_embedding_only_model_runs_as_pure_parameter_server(make_strategy):
    strategy = make_strategy()
    x, y = data()
    with strategy.scope():
        model = embedding_model(dense=False)
        model.compile(keras.optimizers.SGD(0.5), loss="mse")
    history = model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    assert "pure parameter server" in strategy.plan.summary()
    assert history.history["loss"][-1] < history.history["loss"][0]


def test_async_training_learns(make_strategy):
    strategy = make_strategy(sync=False)
    x, y = data()
    with strategy.scope():
        model = embedding_model()
        model.compile(keras.optimizers.Adagrad(0.2), loss="mse")
    history = model.fit(x, y, batch_size=16, epochs=3, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]
    assert not strategy.plan.sync


def test_id_out_of_range_names_table_and_id_and_changes_nothing(make_strategy):
    strategy = make_strategy()
    x, y = data()
    with strategy.scope():
        model = embedding_model()
        model.compile(keras.optimizers.SGD(0.1), loss="mse")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    before = model.get_weights()
    bad = x.copy()
    bad[5, 1] = VOCAB + 17
    with pytest.raises(Exception, match=rf"embedding/embeddings.*id {VOCAB + 17} is out of range"):
        model.fit(bad, y, batch_size=128, epochs=1, verbose=0)
    after = model.get_weights()
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_server_is_named_after_a_bounded_wait():
    port = _closed_port()
    strategy = parallax.ParallaxStrategy(ps_addresses=[f"127.0.0.1:{port}"], run_id="unreach",
                                         connect_timeout=2.0, log_plan=False)
    x, y = data()
    with strategy.scope():
        model = embedding_model()
        model.compile(keras.optimizers.SGD(0.1), loss="mse")
    start = time.monotonic()
    with pytest.raises(ParallaxError, match=f"127.0.0.1:{port}"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert time.monotonic() - start < 30


def test_model_built_outside_the_scope_is_refused(make_strategy):
    strategy = make_strategy()
    model = embedding_model()  # outside the scope
    optimizer = keras.optimizers.SGD(0.1)
    x, y = data()

    @tf.function
    def step(features, labels):
        def replica(features, labels):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(features) - labels))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss
        return strategy.run(replica, args=(features, labels))

    # (autograph re-raises errors from a traced tf.function as StagingError, same message)
    with pytest.raises(Exception, match=r"ConfigError: .*outside strategy.scope\(\)"):
        step(tf.constant(x[:16]), tf.constant(y[:16]))


def test_dataset_sharding_matches_multi_worker_mirrored():
    """Worker r of W gets the r-th slice of every global batch; a partial last global batch
    is dropped, so every worker runs the same steps."""
    from parallax.tf.strategy.datasets import shard_for_worker

    ds = tf.data.Dataset.from_tensor_slices((np.arange(36), np.arange(36) * 10)).batch(16)
    parts = [[b[0].numpy().tolist() for b in shard_for_worker(ds, r, 2)] for r in range(2)]
    assert parts[0] == [list(range(0, 8)), list(range(16, 24))]
    assert parts[1] == [list(range(8, 16)), list(range(24, 32))]
    by_dict = tf.data.Dataset.from_tensor_slices({"a": np.arange(32)}).batch(16)
    assert [b["a"].numpy()[0] for b in shard_for_worker(by_dict, 1, 2)] == [8, 24]
    with pytest.raises(ConfigError, match="global batch size 15 is not divisible by the 2"):
        shard_for_worker(tf.data.Dataset.range(30).batch(15), 0, 2)


def test_a_dataset_split_by_hand_is_not_split_again():
    """Horovod's `.shard(hvd.size(), hvd.rank()).batch(local)` left in: splitting it again
    would train each worker on 1/W of its own part; refused, naming the fix. A shard by
    another count (a subsample) is left alone."""
    from parallax.tf.strategy.datasets import cover_for_worker, shard_for_worker

    by_hand = tf.data.Dataset.range(64).shard(2, 1).map(lambda i: i * 2).batch(8).prefetch(1)
    for split in (shard_for_worker, cover_for_worker):
        with pytest.raises(ConfigError, match=r"already split among the 2 workers "
                                              r"\(`\.shard\(2, 1\)`.*distribute_datasets_from"):
            split(by_hand, 1, 2)
    subsample = tf.data.Dataset.range(64).shard(4, 0).batch(8)
    assert len(list(shard_for_worker(subsample, 0, 2))) == 2
    assert len(list(shard_for_worker(by_hand, 0, 1))) == 4  # one worker: nothing to split


def test_checkpoint_restore_puts_rows_back_on_the_servers(make_strategy, tmp_path):
    strategy = make_strategy()
    x, y = data()
    with strategy.scope():
        model = embedding_model()
        model.compile(keras.optimizers.SGD(0.5), loss="mse")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    saved = model.get_weights()
    checkpoint = tf.train.Checkpoint(model=model)
    path = checkpoint.save(str(tmp_path / "ckpt"))
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert np.abs(model.get_weights()[0] - saved[0]).max() > 1e-3
    checkpoint.restore(path)
    for want, got in zip(saved, model.get_weights()):
        np.testing.assert_allclose(got, want, rtol=0, atol=0)
    assert model.layers[1].embeddings.value.remote is not None  # still on the servers


def test_second_job_with_the_same_run_id_changes_nothing(cluster):
    x, y = data()
    run_id = f"same{int(time.time())}"
    first = parallax.ParallaxStrategy(ps_addresses=cluster.addresses, run_id=run_id,
                                      log_plan=False)
    with first.scope():
        model = embedding_model()
        model.compile(keras.optimizers.SGD(0.5), loss="mse")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    trained = model.get_weights()[0]
    second = parallax.ParallaxStrategy(ps_addresses=cluster.addresses, run_id=run_id,
                                       log_plan=False)
    with second.scope():
        other = embedding_model()
        other.compile(keras.optimizers.SGD(0.5), loss="mse")
    with pytest.raises(ConfigError, match="already exists on the servers and has applied 8"):
        other.fit(x, y, batch_size=16, epochs=1, verbose=0)
    np.testing.assert_array_equal(model.get_weights()[0], trained)


def test_evaluate_and_predict_before_fit_work_after_it(make_strategy):
    """A baseline evaluation before training: the plan (at fit) moves the table to the
    servers and drops the functions evaluate and predict traced before, so their next calls
    read the trained rows."""
    strategy = make_strategy()
    x, y = data()
    with strategy.scope():
        model = embedding_model()
        model.compile(keras.optimizers.SGD(0.5), loss="mse")
    early = model.predict(x[:8], verbose=0)  # runs locally, before any plan
    before = model.evaluate(x, y, verbose=0)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert model.layers[1].embeddings.value.remote is not None
    got = model.predict(x[:8], verbose=0)
    np.testing.assert_allclose(got, model(x[:8]).numpy(), rtol=1e-6)
    assert not np.allclose(got, early)
    after = model.evaluate(x, y, verbose=0)
    assert after == pytest.approx(float(np.mean((model(x).numpy() - y) ** 2)), rel=1e-5)
    assert after < before


def test_a_function_traced_before_the_plan_says_so(make_strategy):
    strategy = make_strategy()
    x, y = data()
    with strategy.scope():
        model = embedding_model()
        model.compile(keras.optimizers.SGD(0.5), loss="mse")
    serve = tf.function(lambda ids: model(ids))
    serve(tf.constant(x[:8]))  # traced before the plan: reads the table locally
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    with pytest.raises(Exception, match="moved to the parameter servers after this function"):
        serve(tf.constant(x[:8]))


def test_a_model_compiled_outside_the_scope_is_refused_naming_the_fix(make_strategy):
    """Instead of TF's "Mixing different tf.distribute.Strategy objects"."""
    strategy = make_strategy()
    x, y = data()
    with strategy.scope():
        model = embedding_model()
    model.compile("adam", loss="mse")
    with pytest.raises(ConfigError, match=r"compiled outside it: its optimizer \(Adam\).*"
                                          r"Call model.compile\(...\) inside"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert strategy.plan is None  # refused before anything ran


def test_a_model_built_outside_the_scope_and_fit_inside_it_is_refused(make_strategy):
    strategy = make_strategy()
    x, y = data()
    model = embedding_model()
    with strategy.scope():
        model.compile(keras.optimizers.SGD(0.5), loss="mse")
        with pytest.raises(ConfigError, match=r"variables \['embedding/embeddings'.*created "
                                              r"outside strategy.scope\(\)"):
            model.fit(x, y, batch_size=16, epochs=1, verbose=0)


def test_a_model_built_outside_the_scope_is_refused_in_a_launched_job(make_strategy,
                                                                        monkeypatch, caplog):
    """Fit outside the scope runs under TF's default strategy: in a job started by
    `parallax run` (here: its run id in the environment) that is refused; in a process
    started by hand, with a plain Keras model beside the strategy, it is a warning, as are
    evaluate and predict in a job (a serving copy's: right, if on each worker alone)."""
    strategy = make_strategy()  # noqa: F841 (the job: alive while the model is fit)
    x, y = data()
    model = embedding_model()
    model.compile(keras.optimizers.SGD(0.5), loss="mse")
    with caplog.at_level("WARNING", logger="parallax"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert any("built outside strategy.scope()" in r.getMessage() for r in caplog.records)
    monkeypatch.setenv("PARALLAX_RUN_ID", "launched")
    with pytest.raises(ConfigError, match="built outside strategy.scope\\(\\).*Build and "
                                          "compile the model inside"):
        model.fit(x, y, verbose=0)
    caplog.clear()
    with caplog.at_level("WARNING", logger="parallax"):  # right, if on this worker alone
        assert model.predict(x[:4], verbose=0).shape == (4, 1)
    assert any("model.predict() runs without" in r.getMessage() for r in caplog.records)


def test_a_second_optimizer_cannot_update_server_tables(make_strategy):
    strategy = make_strategy()
    x, y = data()
    with strategy.scope():
        model = embedding_model()
        model.compile(keras.optimizers.SGD(0.5), loss="mse")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    with strategy.scope():
        model.compile(keras.optimizers.Adam(0.01), loss="mse")
    with pytest.raises(Exception, match="servers, which apply the optimizer the first"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)


def test_recompiling_to_fine_tune_names_the_ways_that_work(make_strategy):
    """Keras' fine-tuning pattern (change `trainable`, compile again with a new optimizer)
    is refused naming two ways out, and both train: the same optimizer (a frozen layer
    then stays as it was), or the weights copied into the model built in a new strategy."""
    strategy = make_strategy()
    x, y = data(n=64)
    with strategy.scope():
        model = embedding_model()
        model.compile(keras.optimizers.SGD(0.5), loss="mse")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    first = model.optimizer
    model.get_layer("dense").trainable = False
    with strategy.scope():
        model.compile(keras.optimizers.SGD(0.1), loss="mse")
    with pytest.raises(Exception, match=r"second model.compile.*optimizer=first.*"
                                        r"set_weights\(weights\)"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    with strategy.scope():
        model.compile(optimizer=first, loss="mse")
    first.learning_rate = 0.1
    frozen, table = model.get_layer("dense").get_weights(), model.get_weights()[0]
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    np.testing.assert_array_equal(model.get_layer("dense").get_weights()[0], frozen[0])
    assert np.abs(model.get_weights()[0] - table).max() > 1e-4
    weights = model.get_weights()
    with make_strategy().scope():
        again = embedding_model()
        again.set_weights(weights)
        again.compile(keras.optimizers.Adagrad(0.1), loss="mse")
    again.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert np.abs(again.get_weights()[0] - weights[0]).max() > 1e-4


def test_mode_and_sync_come_from_the_launcher_environment(monkeypatch, cluster):
    monkeypatch.setenv("PARALLAX_MODE", "ps")
    monkeypatch.setenv("PARALLAX_SYNC", "async")
    strategy = parallax.ParallaxStrategy(ps_addresses=cluster.addresses, log_plan=False)
    assert (strategy.extended.config.mode, strategy.extended.config.sync) == ("ps", False)
    explicit = parallax.ParallaxStrategy("hybrid", sync=True, ps_addresses=cluster.addresses)
    assert (explicit.extended.config.mode, explicit.extended.config.sync) == ("hybrid", True)
    monkeypatch.setenv("PARALLAX_SYNC", "sometimes")
    with pytest.raises(ConfigError, match="PARALLAX_SYNC='sometimes'"):
        parallax.ParallaxStrategy(ps_addresses=cluster.addresses)


def test_big_tables_with_known_initializers_are_drawn_by_the_servers(make_strategy):
    from parallax.protocol.specs import Initializer
    from parallax.tf.strategy.binding import server_initializer

    with make_strategy().scope():
        normal = keras.layers.Embedding(
            1000, 8, embeddings_initializer=keras.initializers.RandomNormal(stddev=0.2, seed=3))
        glorot = keras.layers.Embedding(1000, 8, embeddings_initializer="glorot_uniform")
        uniform = keras.layers.Embedding(1000, 8)
        for layer in (normal, glorot, uniform):
            layer.build((None,))
    assert server_initializer(normal.embeddings.value, "k", 1000) == \
        Initializer("normal", mean=0.0, stddev=0.2, seed=3)
    assert server_initializer(glorot.embeddings.value, "k", 1000) is None  # streamed
    assert server_initializer(normal.embeddings.value, "k", 10**6) is None  # small: exact
    drawn = server_initializer(uniform.embeddings.value, "0:words", 1000)
    assert (drawn.kind, drawn.minval, drawn.maxval) == ("uniform", -0.05, 0.05)
    assert drawn == server_initializer(uniform.embeddings.value, "0:words", 1000)  # same seed


def _fitted_once(strategy):
    """An embedding model compiled with SGD in `strategy`'s scope, after one epoch: (model,
    its ids)."""
    ids, labels = data()
    with strategy.scope():
        model = embedding_model()
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(ids, labels, batch_size=32, epochs=1, verbose=0)
    return model, ids


def test_export_outside_local_tables_is_refused_and_inside_serves(make_strategy, tmp_path):
    """A SavedModel traced while the table is on the servers would call back into this
    process (a py_func) and fail when served elsewhere; export is refused with the fix."""
    strategy = make_strategy()
    model, ids = _fitted_once(strategy)
    assert strategy.plan.on_servers
    with pytest.raises(ConfigError, match=r"local_tables\(\)"):
        model.export(str(tmp_path / "refused"))
    assert not (tmp_path / "refused" / "saved_model.pb").exists()
    with strategy.local_tables():
        model.export(str(tmp_path / "served"))
    served = tf.saved_model.load(str(tmp_path / "served"))
    np.testing.assert_allclose(served.serve(tf.constant(ids[:8])), model.predict(ids[:8],
                                                                               verbose=0),
                               rtol=1e-5, atol=1e-6)


def test_a_second_model_in_the_same_scope_is_warned_about_and_refused(make_strategy, caplog):
    """The plan is made at the first model's first step: a second model's table is not read
    there, and the log says so, naming it; training it (or a model built after the plan) is
    refused, naming the fix, rather than all-reducing its table as dense."""
    strategy = make_strategy()
    ids, labels = data()
    with strategy.scope():
        first = embedding_model()
        keras.utils.set_random_seed(6)
        second = keras.Sequential([keras.Input((3,), dtype="int64"),
                                   keras.layers.Embedding(VOCAB, DIM, name="second_table"),
                                   keras.layers.Flatten(), keras.layers.Dense(1)])
        first.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    with caplog.at_level("WARNING", logger="parallax"):
        first.fit(ids, labels, batch_size=32, epochs=1, verbose=0)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("second_table" in w and "own ParallaxStrategy" in w for w in warnings), warnings
    assert second.built
    with strategy.scope():
        second.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        third = embedding_model()
        third.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    for model, name in ((second, "second_table/embeddings"), (third, "embedding/embeddings")):
        with pytest.raises(ConfigError, match=f"'[^']*{name}' gets a sparse gradient .*"
                                              f"own ParallaxStrategy"):
            model.fit(ids, labels, batch_size=32, epochs=1, verbose=0)
    assert second.layers[0].embeddings.value.remote is None


def test_compile_with_rmsprop_by_name_trains_on_the_servers(make_strategy):
    """`compile(optimizer="rmsprop")`, as many Keras examples write it: the servers apply
    RMSprop with Keras' defaults to the table, and the model learns."""
    strategy = make_strategy()
    x, y = data()
    with strategy.scope():
        model = embedding_model()
        model.compile(optimizer="rmsprop", loss="mse")
    losses = model.fit(x, y, batch_size=16, epochs=3, verbose=0).history["loss"]
    assert losses[-1] < losses[0]
    assert strategy.plan.get("embedding/embeddings").placement == "ps"
    optimizer = strategy.tables["embedding/embeddings"].table.spec.optimizer
    assert optimizer == parallax.RMSprop(learning_rate=optimizer.learning_rate)
    assert optimizer.learning_rate == pytest.approx(0.001)


def test_an_optimizer_the_servers_lack_names_the_ways_out(make_strategy):
    """Adadelta is refused at the first step, naming the table; the placement the message
    suggests then trains the same model with Adadelta on the workers."""
    x, y = data()
    strategy = make_strategy()
    with strategy.scope():
        model = embedding_model()
        model.compile(optimizer="adadelta", loss="mse")
    with pytest.raises(ConfigError, match=r"Adadelta has no server-side version .*RMSprop, "
                       r"Adamax, Nadam, Lion\).*placement=\{'embedding/embeddings': "
                       r"'allreduce'\}\).*mode='allreduce'"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    strategy = make_strategy(placement={"embedding/embeddings": "allreduce"})
    with strategy.scope():
        model = embedding_model()
        model.compile(optimizer=keras.optimizers.Adadelta(1.0), loss="mse")
    losses = model.fit(x, y, batch_size=16, epochs=3, verbose=0).history["loss"]
    assert losses[-1] < losses[0]
    assert strategy.plan.get("embedding/embeddings").placement == "allreduce"


def test_a_failed_weights_save_leaves_the_previous_file_loadable(tmp_path):
    """BackupAndRestore keeps one weights file: a save that fails half-way (here a layer
    refusing, as the servers refuse a checkpoint on a full disk) must not truncate it."""
    from parallax.tf.keras_patches import make_weight_saves_atomic
    make_weight_saves_atomic()  # what every ParallaxStrategy does

    class Flaky(keras.layers.Layer):
        fail = False

        def build(self, shape):
            self.w = self.add_weight(shape=(2,), initializer="ones")

        def call(self, x):
            return x * self.w

        def save_own_variables(self, store):
            if Flaky.fail:
                raise OSError("no space left on device")
            super().save_own_variables(store)

    model = keras.Sequential([keras.Input((2,)), Flaky()])
    path = tmp_path / "latest.weights.h5"
    model.save_weights(path)
    model.layers[0].w.assign([5.0, 6.0])
    Flaky.fail = True
    with pytest.raises(OSError, match="no space left"):
        model.save_weights(path)
    Flaky.fail = False
    model.load_weights(path)
    np.testing.assert_array_equal(model.layers[0].w.numpy(), [1.0, 1.0])
    assert [p.name for p in tmp_path.iterdir()] == ["latest.weights.h5"]


@pytest.mark.parametrize("value, on", [("", False), ("0", False), ("1", True), ("+3", True),
                                       (" 2x", True), ("true", False), ("-1", False)])
def test_horovod_autotune_is_read_as_horovod_reads_it(value, on):
    """With the autotuner on, parallax leaves HOROVOD_CYCLE_TIME unset: a cycle time from the
    environment is fixed, never tuned. Horovod reads HOROVOD_AUTOTUNE with strtol, > 0."""
    from parallax.tf.collectives.horovod import _autotuned
    assert _autotuned({"HOROVOD_AUTOTUNE": value}) is on


def _minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def test_keras_patches_name_the_installed_and_the_pinned_keras():
    """`keras_patches.KERAS_VERSIONS` is the one place naming the Keras versions parallax's
    monkeypatches are written for: the Keras this run has (each CI run installs one pinned
    set) and every requirements file's pin are among them."""
    from pathlib import Path

    from parallax.tf.keras_patches import KERAS_VERSIONS
    assert _minor(keras.__version__) in KERAS_VERSIONS, keras.__version__
    for path in sorted((Path(__file__).resolve().parents[2] / "requirements").glob("*.txt")):
        pins = [line.split("==", 1)[1].strip() for line in path.read_text().splitlines()
                if line.startswith("keras==")]
        assert all(_minor(pin) in KERAS_VERSIONS for pin in pins), (path.name, pins)


def test_every_collectives_choice_has_a_backend_implementing_workers():
    from parallax.env import COLLECTIVES
    from parallax.tf.collectives import BACKENDS
    from parallax.tf.collectives.workers import Workers
    assert set(COLLECTIVES) - {"auto"} <= set(BACKENDS)
    methods = [name for name, value in vars(Workers).items()
               if callable(value) and not name.startswith("_")]
    assert len(methods) == 6
    for backend in BACKENDS.values():
        assert all(callable(getattr(backend, m, None)) for m in methods), backend


# ---- sparse Adagrad: parallax sums a step's repeated ids first, as the dense update does -----
def _adagrad_run(strategy, ids, labels, densify=False):
    """Losses of one embedding model trained with Keras' Adagrad, one step per batch."""
    with strategy.scope():
        model = embedding_model(dense=False)
        optimizer = keras.optimizers.Adagrad(0.5)

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        if densify:
            grads = [tf.convert_to_tensor(g) for g in grads]
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def train(x, y):
        return strategy.run(step, args=(x, y))
    return np.array([float(train(tf.constant(x), tf.constant(y)))
                     for x, y in zip(ids, labels)])


@pytest.mark.parametrize("repeats", [False, True])
def test_adagrad_follows_the_dense_update_where_keras_sparse_update_does_not(
        make_strategy, repeats):
    """The 4.5e-4 between parallax and MirroredStrategy after 30 Adagrad steps (issue 16) is
    Keras' sparse Adagrad, not TensorFlow's version: for IndexedSlices it adds each repeat of
    an id's squared gradient to the accumulator, where the dense update (and parallax's
    servers, which sum a step's repeats first) adds the square of their sum. Without repeated
    ids in a step all three agree; with them parallax still equals the dense update."""
    rng = np.random.default_rng(3)
    steps, batch = 30, 16
    if repeats:
        ids = rng.integers(0, 40, size=(steps, batch, 3))
    else:  # every id at most once per step
        ids = np.stack([rng.permutation(VOCAB)[:batch * 3].reshape(batch, 3)
                        for _ in range(steps)])
    labels = rng.normal(size=(steps, batch, 1)).astype("float32")
    dense = _adagrad_run(tf.distribute.get_strategy(), ids, labels, densify=True)
    ours = _adagrad_run(make_strategy(), ids, labels)
    mirrored = _adagrad_run(tf.distribute.MirroredStrategy(["/cpu:0"]), ids, labels)
    np.testing.assert_allclose(ours, dense, rtol=0, atol=1e-6)
    gap = np.abs(mirrored - dense).max()
    assert (gap > 1e-5) if repeats else (gap < 1e-6), gap  # (1.9e-4 with repeats here)


class _WarmupSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """The TF Transformer tutorial's kind of schedule: __call__ only, no get_config()."""

    def __call__(self, step):
        step = tf.cast(step, tf.float32) + 1.0
        return 0.5 * tf.math.minimum(step / 4.0, 4.0 / step)


def test_a_learning_rate_schedule_without_get_config_trains_as_in_keras(make_strategy):
    """Issue 29, item 6: reading the optimizer's config serialized the schedule, which
    raised NotImplementedError at the first step. The servers now get the schedule's rate
    of each step, as Keras applies it: the losses equal plain Keras' step for step."""
    x, y = data(n=96)

    def fit(strategy):
        with strategy.scope():
            model = embedding_model()
            model.compile(optimizer=keras.optimizers.SGD(_WarmupSchedule()), loss="mse")
        return model.fit(x, y, batch_size=16, epochs=2, shuffle=False,
                         verbose=0).history["loss"]

    plain = fit(tf.distribute.get_strategy())
    ours = fit(make_strategy())
    np.testing.assert_allclose(ours, plain, rtol=1e-5)
    assert plain[-1] < plain[0]



def test_a_learning_rate_of_zero_is_applied_as_zero(make_strategy):
    """A rate of 0 (a warmup schedule's first steps, a schedule decayed to 0): the servers'
    spec was refused at the first step ("learning_rate must be a finite number > 0"), and a
    push's rate of 0, which the wire reads as "the table's spec rate", trained the table at
    its starting rate. Now each epoch's rate is Keras' own: the weights equal plain Keras'
    and the table does not move in an epoch at rate 0."""
    x, y = data(n=64)
    rates = [0.0, 0.5, 0.0]

    def fit(strategy, optimizer):
        with strategy.scope():
            model = embedding_model()
            model.compile(optimizer=optimizer(), loss="mse")
        tables = []
        callbacks = [keras.callbacks.LearningRateScheduler(lambda epoch, lr: rates[epoch]),
                     keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: tables.append(
                         model.layers[1].get_weights()[0]))]
        model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0, callbacks=callbacks)
        return model.get_weights(), tables

    plain, _ = fit(tf.distribute.get_strategy(), lambda: keras.optimizers.SGD(0.5))
    ours, tables = fit(make_strategy(), lambda: keras.optimizers.SGD(0.5))
    for want, got in zip(plain, ours):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(tables[2], tables[1])
    _, tables = fit(make_strategy(), lambda: keras.optimizers.Adagrad(0.5))  # slots change
    np.testing.assert_array_equal(tables[2], tables[1])
    assert np.abs(tables[1] - tables[0]).max() > 1e-3

def test_tf_saved_model_save_inside_local_tables_serves_and_outside_names_the_fix(
        make_strategy, tmp_path):
    """Issue 29, item 5: `tf.saved_model.save(model, path)` (the TF tutorials' way) failed
    with "'SymbolicTensor' object has no attribute 'numpy'" from the servers' tables'
    restore function, traced by the save. Inside local_tables() it saves and serves; outside
    it is refused naming local_tables(), as model.export is."""
    strategy = make_strategy()
    model, ids = _fitted_once(strategy)
    with strategy.local_tables():
        tf.saved_model.save(model, str(tmp_path / "saved"))
    loaded = tf.saved_model.load(str(tmp_path / "saved"))
    served = loaded.signatures["serving_default"](tf.constant(ids[:8]))
    np.testing.assert_allclose(next(iter(served.values())), model.predict(ids[:8], verbose=0),
                               rtol=1e-5, atol=1e-6)
    with pytest.raises(ConfigError, match=r"local_tables\(\)"):
        tf.saved_model.save(model, str(tmp_path / "refused"))


def _fit_weights(strategy, optimizer, x, y):
    with strategy.scope():
        model = embedding_model()
        model.compile(optimizer=optimizer(), loss="mse")
    losses = model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0).history["loss"]
    return losses, model.get_weights()


def test_gradient_accumulation_trains_as_in_keras(make_strategy):
    """`SGD(gradient_accumulation_steps=2)`: the `fit` scope check read Keras' `iterations`,
    a tensor with accumulation ("Tensor.name is undefined"), and the accumulator's update (an
    IndexedSlices into an optimizer variable) was refused as a second model's table. Keras
    makes the table's gradient dense, so the plan keeps it on the workers, and the weights
    equal plain Keras'."""
    x, y = data(n=64)

    def optimizer():
        return keras.optimizers.SGD(0.1, gradient_accumulation_steps=2)

    plain = _fit_weights(tf.distribute.get_strategy(), optimizer, x, y)
    strategy = make_strategy()
    ours = _fit_weights(strategy, optimizer, x, y)
    np.testing.assert_allclose(ours[0], plain[0], rtol=1e-6)
    for mine, keras_weight in zip(ours[1], plain[1]):
        np.testing.assert_allclose(mine, keras_weight, rtol=1e-6, atol=1e-7)
    assert strategy.plan.get("embedding/embeddings").placement == "allreduce"


@pytest.mark.parametrize("option, value", [("gradient_accumulation_steps", 2),
                                           ("use_ema", True)])
def test_worker_side_optimizer_options_on_a_server_table_are_refused(make_strategy, option,
                                                                     value):
    """Both keep a worker copy of every variable in the optimizer (its accumulated gradient,
    its moving average), which parallax released for a table on the servers as one of the
    servers' slots: accumulation trained silently with half the gradient of the first
    step, EMA failed at the end of fit in "'<lambda>' tried to update". Refused at the
    first step, naming the option and the placement that trains it as Keras does."""
    x, y = data(n=32)
    strategy = make_strategy(placement={"embedding/embeddings": "ps"})
    with strategy.scope():
        model = embedding_model()
        model.compile(optimizer=keras.optimizers.SGD(0.1, **{option: value}), loss="mse")
    with pytest.raises(ConfigError, match=rf"option {option}={value} of SGD .*placement="
                                          r"\{'embedding/embeddings': 'allreduce'\}"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)


def test_horovods_distributed_optimizer_is_refused_naming_the_one_it_wraps(make_strategy):
    """`hvd.DistributedOptimizer(SGD)` left from a Horovod Keras script failed at the first
    step inside Horovod ("'list' object is not callable": its `variables` under Keras 3).
    Refused by `fit` and by a custom loop's first step, naming SGD."""
    hvd = pytest.importorskip("horovod.tensorflow.keras")
    x, y = data(n=32)
    strategy = make_strategy()
    with strategy.scope():
        model = embedding_model()
        optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1))
        model.compile(optimizer=optimizer, loss="mse")
    refused = r"Horovod's DistributedOptimizer around SGD .*Use the SGD optimizer it wraps"
    with pytest.raises(ConfigError, match=refused):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)

    @tf.function
    def step(ids, labels):
        def replica(ids, labels):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(keras.losses.mean_squared_error(labels, model(ids)))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
        strategy.run(replica, args=(ids, labels))
    with pytest.raises(Exception, match=refused):
        step(tf.constant(x[:16]), tf.constant(y[:16]))


def test_only_horovods_own_optimizer_classes_are_refused():
    """The refusal matched any module name starting with "horovod": a user's optimizer
    defined in their own `horovod_compat.py` was refused as Horovod's DistributedOptimizer."""
    from parallax.tf.keras_support import refuse_horovod_optimizer

    users = type("MySGD", (keras.optimizers.SGD,), {"__module__": "horovod_compat"})
    refuse_horovod_optimizer(users(0.1))
    horovods = type("SGD", (keras.optimizers.SGD,), {"__module__": "horovod._keras"})
    with pytest.raises(ConfigError, match="DistributedOptimizer around SGD"):
        refuse_horovod_optimizer(horovods(0.1))


def test_a_constrained_variable_on_the_servers_is_refused_naming_the_way_out(make_strategy):
    """A Keras constraint (here MaxNorm on the table, placed on the servers by hand) is
    applied by assigning the whole variable inside the step: it failed there with "assign()
    a new value eagerly", naming neither the constraint nor the fix. Refused at the first
    step; the placement the message names trains as plain Keras (the plan's default, since
    the constraint reads the whole table)."""
    x, y = data(n=32)

    def model_and_fit(strategy):
        with strategy.scope():
            keras.utils.set_random_seed(5)
            inputs = keras.Input((3,), dtype="int64")
            rows = keras.layers.Embedding(VOCAB, DIM, name="embedding",
                                          embeddings_constraint=keras.constraints.MaxNorm(0.05))
            out = keras.layers.Dense(1, name="dense")(keras.layers.Flatten()(rows(inputs)))
            model = keras.Model(inputs, out)
            model.compile(keras.optimizers.SGD(0.1), loss="mse")
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        return model.get_weights()

    strategy = make_strategy(placement={"embedding/embeddings": "ps"})
    with pytest.raises(ConfigError, match=r"\{'embedding/embeddings': 'MaxNorm'\} .*placement="
                                          r"\{'embedding/embeddings': 'allreduce'\}"):
        model_and_fit(strategy)
    plain = model_and_fit(tf.distribute.get_strategy())
    strategy = make_strategy()
    for mine, keras_weight in zip(model_and_fit(strategy), plain):
        np.testing.assert_allclose(mine, keras_weight, rtol=1e-6, atol=1e-7)
    assert strategy.plan.get("embedding/embeddings").placement == "allreduce"


def test_compile_with_jit_compile_runs_without_xla_as_plain_keras_trains(make_strategy,
                                                                         caplog):
    """`model.compile(jit_compile=True)` (the Keras tutorials' XLA switch): Keras' steps
    failed at their first call in XLA's "No registered 'Timestamp' OpKernel for XLA_CPU_JIT"
    (fit) or "'PyFunc'" (evaluate before fit), naming none of the user's code. They now run
    without XLA with one warning, as Keras does for a model XLA cannot compile, and train as
    plain Keras does."""
    x, y = data(n=64)

    def run(strategy, jit):
        with strategy.scope():
            model = embedding_model()
            model.compile(keras.optimizers.SGD(0.5), loss="mse", jit_compile=jit)
        before = model.evaluate(x, y, batch_size=16, verbose=0)
        history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        return [before, *history.history["loss"]]

    plain = run(tf.distribute.get_strategy(), False)
    with caplog.at_level("WARNING", logger="parallax"):
        ours = run(make_strategy(), True)
    np.testing.assert_allclose(ours, plain, rtol=1e-5)
    assert sum("jit_compile=True" in r.getMessage() for r in caplog.records) == 1


def test_a_custom_step_in_a_jit_compiled_function_names_the_fix(make_strategy):
    """A custom loop's `tf.function(jit_compile=True)` around `strategy.run`: the step with a
    table on the servers cannot be compiled by XLA; it is refused while traced, naming the
    option to drop, instead of XLA's error about a parallax op at the first call."""
    strategy = make_strategy()
    x, y = data(n=16)
    with strategy.scope():
        model = embedding_model()
        optimizer = keras.optimizers.SGD(0.5)

    def step(ids, labels):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(keras.losses.mean_squared_error(labels, model(ids)))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    jitted = tf.function(lambda a, b: strategy.run(step, args=(a, b)), jit_compile=True)
    with pytest.raises(Exception, match=r"Drop jit_compile=True from that tf.function"):
        jitted(tf.constant(x), tf.constant(y))
    plain = tf.function(lambda a, b: strategy.run(step, args=(a, b)))
    assert np.isfinite(float(plain(tf.constant(x), tf.constant(y))))


def test_a_jit_compiled_function_inside_the_step_that_reads_a_table_names_the_fix(
        make_strategy):
    """The refusal above said XLA "may still compile functions the step calls, such as the
    model's own layers": a `tf.function(jit_compile=True)` forward pass inside the step (the
    table's lookup in it), first traced once the plan was made, failed at its first call in
    XLA ("No registered 'PyFunc' OpKernel for XLA_CPU_JIT", naming a parallax_pull op). The
    lookup is refused when traced, naming the option."""
    strategy = make_strategy()
    x, y = data(n=16)
    with strategy.scope():
        model = embedding_model()
        optimizer = keras.optimizers.SGD(0.5)

    def step_of(forward):
        def step(ids, labels):
            with tf.GradientTape() as tape:
                loss = forward(ids, labels)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss
        return tf.function(lambda a, b: strategy.run(step, args=(a, b)))

    def forward(ids, labels):
        return tf.reduce_mean(keras.losses.mean_squared_error(labels, model(ids)))

    assert np.isfinite(float(step_of(forward)(tf.constant(x), tf.constant(y))))  # the plan
    jitted = step_of(tf.function(forward, jit_compile=True))
    with pytest.raises(Exception, match=r"'.*embedding.*' is read inside a tf.function\(jit_"
                                        r"compile=True\).*Drop jit_compile=True"):
        jitted(tf.constant(x), tf.constant(y))


@pytest.mark.parametrize("optimizer", [keras.optimizers.Adagrad, keras.optimizers.Adam])
def test_a_checkpoint_restores_into_plain_keras_with_the_tables_optimizer_slots(
        make_strategy, tmp_path, optimizer):
    """TF's tutorial: "a model checkpointed with a tf.distribute.Strategy can be restored with
    or without a strategy". The tables' optimizer slots were saved as their initial fill
    (the workers release them; the servers keep the real ones), so a model restored without
    parallax went on training from a fresh accumulator, silently. Every step here touches
    every row once (the servers' lazy update is then Keras' dense one): the slots a
    checkpoint and a .keras file restore in plain Keras are plain Keras' own."""
    vocab, steps, batch = 48, 4, 16
    rng = np.random.default_rng(4)
    ids = np.stack([rng.permutation(vocab).reshape(batch, 3) for _ in range(steps)])
    x, y = ids.reshape(-1, 3), rng.normal(size=(steps * batch, 1)).astype("float32")

    def trained(strategy):
        with strategy.scope():
            model = embedding_model(vocab)
            model.compile(optimizer(0.1), loss="mse")
        model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
        return model

    plain = trained(tf.distribute.get_strategy())
    ours = trained(make_strategy())
    tf.train.Checkpoint(model=ours, optimizer=ours.optimizer).write(str(tmp_path / "ckpt"))
    ours.save(tmp_path / "model.keras")
    restored = embedding_model(vocab)
    restored.compile(optimizer(0.1), loss="mse")
    restored.optimizer.build(restored.trainable_variables)
    tf.train.Checkpoint(model=restored, optimizer=restored.optimizer).read(
        str(tmp_path / "ckpt")).expect_partial()
    loaded = keras.models.load_model(tmp_path / "model.keras")
    for opt in (restored.optimizer, loaded.optimizer):
        assert len(opt.variables) == len(plain.optimizer.variables)
        for got, want in zip(opt.variables, plain.optimizer.variables):
            np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-7,
                                       err_msg=want.path)


def test_a_table_read_after_its_update_in_the_same_step_names_the_fix(make_strategy):
    """A step that updates a table and then looks it up again (metrics from a second forward
    pass after `apply_gradients`, two updates in one `strategy.run`) read the rows from before
    the update: the step's rows are pulled before it and its update pushed at its end. The
    losses and the table then differed from TensorFlow's silently (32% after two steps of
    two updates); such a step is now refused when traced, naming the way out."""
    strategy = make_strategy()
    x, y = data(n=16)
    with strategy.scope():
        model = embedding_model()
        optimizer = keras.optimizers.SGD(0.5)

    def update():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(keras.losses.mean_squared_error(y, model(x)))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    def update_twice():
        update()
        return update()

    twice = tf.function(lambda: strategy.run(update_twice))
    with pytest.raises(Exception, match="read after the optimizer updated it in the same step"):
        twice()
    once = tf.function(lambda: strategy.run(update))
    losses = [float(once()) for _ in range(2)]  # one update per step: still trains
    assert losses[1] < losses[0]
