"""Step fusion (parallax.tf.graph.fusion) in one worker process, against the session's two real
parameter servers: one PullMany and one PushMany per server per step, counted by the
servers; the same training, bit for bit, as the per-table path (fuse=False); lookups that
cannot be grouped keep their own pull and say why; several steps in one graph stay ordered."""
from __future__ import annotations

import itertools
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import parallax
from parallax import native
from parallax.client import native_many
from parallax.env import NATIVE_ENV
from parallax.tf.graph.variables import remote_of

_ids = itertools.count()
TABLES, VOCAB, DIM, BATCH = 5, 400, 4, 16


@pytest.fixture
def make_strategy(cluster):
    def make(**kwargs):
        kwargs.setdefault("ps_addresses", cluster.addresses)
        kwargs.setdefault("log_plan", False)
        kwargs.setdefault("search_partitions", False)
        return parallax.ParallaxStrategy(run_id=f"fu{next(_ids)}-{int(time.time())}", **kwargs)
    return make


def data(n=96, seed=0):
    rng = np.random.default_rng(seed)
    ids = np.minimum(rng.zipf(1.3, size=(n, TABLES, 2)) - 1, VOCAB - 1).astype("int64")
    return ids, (ids.sum(axis=(1, 2))[:, None] % 5 / 5.0).astype("float32")


class Tables(keras.Model):
    """TABLES embedding tables, one lookup each, then a dense layer; `shared=True` looks the
    first table up twice; `dependent=True` takes the last table's ids from the first table's rows."""

    def __init__(self, shared=False, dependent=False):
        super().__init__()
        keras.utils.set_random_seed(3)
        self.tables = [keras.layers.Embedding(VOCAB, DIM, name=f"table{i}")
                       for i in range(TABLES)]
        self.dense = keras.layers.Dense(1, name="dense")
        self.shared, self.dependent = shared, dependent

    def call(self, ids):
        rows = [table(ids[:, i]) for i, table in enumerate(self.tables[:-1])]
        last_ids = ids[:, -1]
        if self.dependent:
            last_ids = tf.cast(tf.argmax(rows[0], axis=-1), tf.int64)
        last = self.tables[-1](last_ids)
        rows.append(last)
        if self.shared:
            rows.append(self.tables[0](ids[:, -1]))
        h = tf.concat([tf.reshape(r, [tf.shape(ids)[0], -1]) for r in rows], axis=1)
        return self.dense(h)


def train_fit(strategy, epochs=2, optimizer=None, **model_kwargs):
    x, y = data()
    with strategy.scope():
        model = Tables(**model_kwargs)
        model.compile(optimizer() if optimizer else keras.optimizers.Adagrad(0.2), loss="mse")
    history = model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0)
    return model, history.history["loss"]


def weights_of(strategy, model):
    variables = model.weights if isinstance(model, keras.Model) else model.variables
    with strategy.local_tables():
        return [w.numpy().copy() for w in variables]


def report(strategy, suffix: str):
    """The lookup report of the variable whose name ends with `suffix` (Keras prefixes the
    model's name, which differs between models of one process)."""
    found = [r for r in strategy.plan.lookups if r.variable.endswith(suffix)]
    assert found, f"no lookup of *{suffix} in {strategy.plan.lookups}"
    return found[0]


def server_requests(strategy) -> dict[str, int]:
    """Requests each method got, summed over the job's servers (server-wide counters)."""
    totals: dict[str, int] = {}
    for reply in strategy.extended._binder.client.stats().values():
        for method in reply.methods:
            totals[method.method] = totals.get(method.method, 0) + method.requests
    return totals


def test_one_pull_and_one_push_request_per_server_per_step(make_strategy):
    strategy = make_strategy()
    model, _ = train_fit(strategy, epochs=1)
    servers = {s for v in strategy.plan.on_servers for s in v.servers}
    assert len(servers) == 2  # five one-shard tables spread over both servers
    before = server_requests(strategy)
    x, y = data(n=BATCH * 4, seed=1)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    after = server_requests(strategy)
    delta = {m: after.get(m, 0) - before.get(m, 0) for m in after}
    steps = 4
    assert delta.get("PullMany") == steps * len(servers)
    assert delta.get("PushMany") == steps * len(servers)
    assert delta.get("Pull", 0) == 0 and delta.get("Push", 0) == 0
    lookups = strategy.plan.lookups
    assert len(lookups) == TABLES and all(r.fused for r in lookups)
    assert "fused into one pull and one push per server per step" in strategy.plan.format()


def test_a_registered_table_client_carries_every_fused_pull_and_push(make_strategy):
    """The extension point a worker row cache plugs into: a `TableClient` registered in
    TABLE_CLIENTS and given to the strategy carries the step's one pull and one push (here
    one that counts, then sends them on as `DirectClient` does); training is unchanged."""
    from parallax.client.table_client import TABLE_CLIENTS, DirectClient, table_client
    calls = []

    class Counting(DirectClient):
        name = "counting"

        def start_pull(self, tables, min_steps, runs, clocks):
            calls.append(("pull", len(tables)))
            return super().start_pull(tables, min_steps, runs, clocks)

        def start_push(self, tables, grads, steps, worker, learning_rates, runs):
            calls.append(("push", len(tables)))
            return super().start_push(tables, grads, steps, worker, learning_rates, runs)

    TABLE_CLIENTS[Counting.name] = Counting
    try:
        counted, plain = make_strategy(), make_strategy()
        counted.extended.table_client = table_client("counting")
        _, loss = train_fit(counted, epochs=1)
        _, expected = train_fit(plain, epochs=1)
    finally:
        del TABLE_CLIENTS[Counting.name]
    steps = len(data()[0]) // BATCH
    assert [kind for kind, _ in calls].count("push") == steps
    assert [kind for kind, _ in calls].count("pull") >= steps  # (a final read may add one)
    assert loss == expected


def test_same_shaped_tables_share_one_server_table_and_train_the_same(make_strategy):
    """Table groups: the five one-shard tables are spread over the two servers, and those on
    one server share one server table (at offsets 0, 400, ...), so every step's request
    carries one part per server; training is bit for bit what five tables of their own
    give."""
    grouped = make_strategy()
    model, loss = train_fit(grouped, epochs=1)
    plan = grouped.plan
    tables = sorted({v.table for v in plan.on_servers})
    assert len(tables) == 2 and plan.grouped
    assert {plan.members(t)[0].servers for t in tables} == {(0,), (1,)}
    for table in tables:
        members = plan.members(table)
        assert [v.offset for v in members] == [i * VOCAB for i in range(len(members))]
    held = [t for reply in grouped.extended._binder.client.stats(tables).values()
            for t in reply.tables]
    assert sum(t.rows for t in held) == TABLES * VOCAB and len(held) == 2
    alone = make_strategy(group_tables=False)
    model_alone, loss_alone = train_fit(alone, epochs=1)
    assert len({v.table for v in alone.plan.on_servers}) == TABLES
    assert loss == loss_alone
    for a, b in zip(weights_of(grouped, model), weights_of(alone, model_alone)):
        np.testing.assert_array_equal(a, b)
    # a variable's own rows, read and assigned through its group's table
    table = model.tables[2].embeddings
    with grouped.local_tables():
        before = table.numpy()
    table.assign(before + 1.0)
    with grouped.local_tables():
        np.testing.assert_array_equal(table.numpy(), before + 1.0)
        for i in (0, 1, 3, 4):
            np.testing.assert_array_equal(model.tables[i].embeddings.numpy(),
                                          weights_of(alone, model_alone)[i])


def _group_member_layer(strategy, model, head: bool):
    """The layer of a table group's first member (`head`) or of another member."""
    plan = strategy.plan
    vp = next(v for v in plan.on_servers if len(plan.members(v.table)) > 1
              and (v.offset == 0) == head)
    return next(t for t in model.tables
                if remote_of(t.embeddings.value) is strategy.tables[vp.name]), vp


def _moved_by_one_update(strategy, layer, optimizer, ids):
    """How much one traced step that updates `layer` alone, loss sum(rows), moves its rows."""
    @tf.function
    def step(ids):
        def replica(ids):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(layer(ids))
            grads = tape.gradient(loss, [layer.embeddings])
            optimizer.apply_gradients(zip(grads, [layer.embeddings]))
        strategy.run(replica, args=(ids,))

    with strategy.local_tables():
        before = layer.embeddings.numpy()[ids]
    step(tf.constant(ids, tf.int64))
    with strategy.local_tables():
        return before - layer.embeddings.numpy()[ids]


def test_a_group_member_updated_alone_gets_the_steps_learning_rate(make_strategy):
    """A step that updates one member of a group, not its first: the group's push carries
    the step's learning rate, not the empty pushes' 0 ("the table's own", the rate the plan
    was made with)."""
    moved = {}
    for grouped in (True, False):
        strategy = make_strategy(group_tables=grouped)
        model, _ = train_fit(strategy, epochs=1, optimizer=lambda: keras.optimizers.SGD(0.1))
        layer = model.tables[2]
        if grouped:
            assert _group_member_layer(strategy, model, head=False)[0] is layer
        model.optimizer.learning_rate.assign(1.0)
        moved[grouped] = _moved_by_one_update(strategy, layer, model.optimizer, [1, 2, 3])
    np.testing.assert_allclose(moved[True], moved[False], rtol=1e-6)
    np.testing.assert_allclose(moved[True], 1.0, rtol=1e-6)  # rate 1.0 x gradient 1


def test_an_id_past_a_group_members_rows_is_refused_not_read_from_the_next(make_strategy):
    strategy = make_strategy()
    model, _ = train_fit(strategy, epochs=1)
    layer, vp = _group_member_layer(strategy, model, head=True)  # the next member follows

    @tf.function
    def lookup(ids):
        return strategy.run(layer, args=(ids,))

    with pytest.raises(Exception, match=rf"{vp.name}.*has {VOCAB} rows: id {VOCAB} is out "):
        lookup(tf.constant([VOCAB], tf.int64))


def test_no_table_groups_where_updates_are_in_a_branch(make_strategy):
    """LossScaleOptimizer applies its updates in a tf.cond branch: each is a push of its own,
    which a table group would turn into a step (and a wait) per member."""
    strategy = make_strategy()
    train_fit(strategy, epochs=1, optimizer=lambda: keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.1)))
    assert not strategy.plan.grouped


def test_resharding_a_group_member_onto_given_servers_moves_its_group(make_strategy):
    strategy = make_strategy()
    model, _ = train_fit(strategy, epochs=1)
    _, vp = _group_member_layer(strategy, model, head=True)
    target = (1 - vp.servers[0],)
    strategy.reshard({vp.name: 1}, servers={vp.name: list(target)})
    table = strategy.plan.get(vp.name).table
    assert len(strategy.plan.members(table)) > 1
    assert {v.servers for v in strategy.plan.members(table)} == {target}
    x, y = data(n=BATCH * 2, seed=5)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)  # still trains


def test_no_table_groups_under_an_optimizer_that_counts_steps(make_strategy):
    strategy = make_strategy()
    train_fit(strategy, epochs=1, optimizer=lambda: keras.optimizers.Adam(0.01))
    assert not strategy.plan.grouped
    assert len({v.table for v in strategy.plan.on_servers}) == TABLES


@pytest.mark.parametrize("model_kwargs", [{}, {"shared": True}, {"dependent": True}],
                         ids=["plain", "shared", "dependent"])
def test_fused_training_equals_the_per_table_path(make_strategy, model_kwargs):
    fused_strategy = make_strategy()
    fused_model, fused_loss = train_fit(fused_strategy, **model_kwargs)
    plain_strategy = make_strategy(fuse=False)
    plain_model, plain_loss = train_fit(plain_strategy, **model_kwargs)
    assert fused_loss == plain_loss
    for a, b in zip(weights_of(fused_strategy, fused_model),
                    weights_of(plain_strategy, plain_model)):
        np.testing.assert_array_equal(a, b)
    assert plain_strategy.plan.lookups == ()
    last = report(fused_strategy, f"table{TABLES - 1}/embeddings")
    if model_kwargs.get("dependent"):
        assert not last.fused and "depend on the rows of" in last.reason
        assert "table0/embeddings" in last.reason
    else:
        assert last.fused
    assert report(fused_strategy, "table0/embeddings").fused


@pytest.mark.skipif(native.kernels() is None,
                    reason=f"compiled kernels not in use: {native.describe()}")
@pytest.mark.parametrize("model_kwargs", [{}, {"shared": True}], ids=["plain", "shared"])
def test_the_compiled_and_numpy_data_paths_train_bit_for_bit_alike(make_strategy, monkeypatch,
                                                                   model_kwargs):
    """PARALLAX_NATIVE=1 and 0 on the same model and data: the same losses and weights (a
    shared table pushes duplicate ids: their sums too)."""
    runs = []
    for path in ("1", "0"):
        monkeypatch.setenv(NATIVE_ENV, path)
        before = dict(native_many.ran)
        strategy = make_strategy()
        model, loss = train_fit(strategy, **model_kwargs)
        runs.append((loss, weights_of(strategy, model)))
        made = {k: native_many.ran[k] - before.get(k, 0) for k in ("pull", "push")}
        assert (made["pull"] > 0 and made["push"] > 0) == (path == "1"), made
    (loss, weights), (numpy_loss, numpy_weights) = runs
    assert loss == numpy_loss
    for a, b in zip(weights, numpy_weights):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("shared", [False, True], ids=["plain", "shared"])
def test_a_push_of_the_pulled_ids_reuses_the_pulls_routing(make_strategy, monkeypatch,
                                                           shared):
    """The gradients' ids are the pulled ids: the push routes them with the pull's `Runs`
    (one id check and one sort per step, not two). A table read by two lookups pushes
    other ids than its merged pull and is routed afresh (the training is the per-table
    path's either way: test_fused_training_equals_the_per_table_path)."""
    from parallax.client import step as step_traffic
    strategy = make_strategy()
    model, _ = train_fit(strategy, epochs=1, shared=shared)
    made = []
    real = step_traffic.checked_runs
    monkeypatch.setattr(step_traffic, "checked_runs",
                        lambda *args: made.append(1) or real(*args))
    x, y = data(n=BATCH * 3, seed=2)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert len(made) == 3 * (2 if shared else 1)


class CondTables(tf.Module):
    """Plain tf.Variable tables read by tf.nn.embedding_lookup, the second inside a tf.cond
    branch (a nested graph: that lookup keeps its own pull; as before fusion, a table read
    only inside a branch gets no gradient through the tape, so it is pulled, not trained)."""

    def __init__(self):
        super().__init__()
        rng = np.random.default_rng(4)
        self.a = tf.Variable(rng.normal(size=(VOCAB, DIM)).astype("float32"), name="a")
        self.b = tf.Variable(rng.normal(size=(VOCAB, DIM)).astype("float32"), name="b")
        self.kernel = tf.Variable(rng.normal(size=(2 * DIM, 1)).astype("float32"), name="k")

    def __call__(self, ids):
        a = tf.reduce_sum(tf.nn.embedding_lookup(self.a, ids[:, 0]), axis=1)
        b = tf.cond(tf.reduce_sum(ids) >= 0,
                    lambda: tf.nn.embedding_lookup(self.b, ids[:, 1]),
                    lambda: tf.nn.embedding_lookup(self.b, ids[:, 1] + 1))
        return tf.concat([a, tf.reduce_sum(b, axis=1)], axis=1) @ self.kernel


def test_a_lookup_in_a_nested_graph_keeps_its_own_pull(make_strategy):
    losses, weights = [], []
    for fuse in (True, False):
        strategy = make_strategy(fuse=fuse)
        with strategy.scope():
            model = CondTables()
            optimizer = keras.optimizers.SGD(0.1)
        losses.append(custom_loop(strategy, model, optimizer, steps_per_call=1))
        weights.append(weights_of(strategy, model))
        if fuse:
            assert report(strategy, "a").fused
            nested = report(strategy, "b")
            assert not nested.fused and "nested graph" in nested.reason, nested
    assert losses[0] == losses[1]
    for a, b in zip(*weights):
        np.testing.assert_array_equal(a, b)


def custom_loop(strategy, model, optimizer, steps_per_call: int) -> list[float]:
    """Train on data() with a custom loop that traces `steps_per_call` steps into each call
    of one tf.function."""
    x, y = data(n=BATCH * 4)

    def step(ids, target):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(ids) - target) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def run(ids, target):
        losses = []
        for k in range(steps_per_call):
            part = slice(k * BATCH, (k + 1) * BATCH)
            losses.append(strategy.run(step, (ids[part], target[part])))
        return tf.stack(losses)

    losses = []
    for start in range(0, len(x), BATCH * steps_per_call):
        chunk = slice(start, start + BATCH * steps_per_call)
        losses += [float(v) for v in run(tf.constant(x[chunk]), tf.constant(y[chunk]))]
    return losses


def test_steps_sharing_one_graph_stay_in_order(make_strategy):
    """Two training steps traced into one tf.function: the second step's (stateless) fused
    pull must see the first step's push, as two separate calls do."""
    results = []
    for steps_per_call in (1, 2):
        strategy = make_strategy()
        with strategy.scope():
            model = Tables()
            optimizer = keras.optimizers.SGD(0.5)
        losses = custom_loop(strategy, model, optimizer, steps_per_call)
        results.append((losses, weights_of(strategy, model)))
    (one_losses, one_weights), (two_losses, two_weights) = results
    assert one_losses == two_losses
    for a, b in zip(one_weights, two_weights):
        np.testing.assert_array_equal(a, b)


def test_ps_mode_whole_variable_reads_are_fused_not_folded(make_strategy):
    """In ps mode dense variables are read whole (constant ids): the fused pull must run at
    every step, never be folded into a constant at trace time."""
    fused_strategy = make_strategy(mode="ps")
    fused_model, fused_loss = train_fit(fused_strategy)
    plain_strategy = make_strategy(mode="ps", fuse=False)
    plain_model, plain_loss = train_fit(plain_strategy)
    assert fused_loss == plain_loss and fused_loss[-1] < fused_loss[0]
    assert report(fused_strategy, "dense/kernel").fused
    for a, b in zip(weights_of(fused_strategy, fused_model),
                    weights_of(plain_strategy, plain_model)):
        np.testing.assert_array_equal(a, b)


def test_async_fused_training_equals_the_per_table_path(make_strategy):
    fused_strategy = make_strategy(sync=False)
    _, fused_loss = train_fit(fused_strategy)
    plain_strategy = make_strategy(sync=False, fuse=False)
    _, plain_loss = train_fit(plain_strategy)
    assert fused_loss == plain_loss


def test_evaluation_steps_pull_fused_and_push_nothing(make_strategy):
    strategy = make_strategy()
    model, _ = train_fit(strategy, epochs=1)
    before = server_requests(strategy)
    x, y = data(n=BATCH * 3, seed=2)
    model.evaluate(x, y, batch_size=BATCH, verbose=0)
    after = server_requests(strategy)
    assert after.get("PushMany", 0) == before.get("PushMany", 0)
    assert after["PullMany"] - before["PullMany"] == 3 * 2



class HashedIds(keras.Model):
    """Three tables; the third's ids pass through a stateful op (a numpy_function, as numpy
    hashing of raw features would). `dependent=True` first looks the second table up with ids
    taken from the first table's rows (its own pull, a stateful op using grouped rows):
    TensorFlow then runs the third table's id op after that pull, so the third lookup cannot
    join the fused pull (a cycle: TensorFlow refused the graph)."""

    def __init__(self, dependent):
        super().__init__()
        keras.utils.set_random_seed(3)
        self.tables = [keras.layers.Embedding(VOCAB, DIM, name=f"table{i}") for i in range(3)]
        self.dense = keras.layers.Dense(1, name="dense")
        self.dependent = dependent

    def call(self, ids):
        first = self.tables[0](ids[:, 0])
        if self.dependent:
            first = first + self.tables[1](tf.cast(tf.argmax(first, axis=-1), tf.int64))
        hashed = tf.numpy_function(lambda x: x, [ids[:, 2]], tf.int64, stateful=True)
        hashed.set_shape(ids[:, 2].shape)
        third = self.tables[2](hashed)
        rows = [tf.reshape(r, [tf.shape(ids)[0], 2 * DIM]) for r in (first, third)]
        return self.dense(tf.concat(rows, axis=1))


@pytest.mark.parametrize("dependent", [True, False], ids=["after-rows", "alone"])
def test_ids_from_a_stateful_op_after_a_use_of_grouped_rows_keep_their_own_pull(
        make_strategy, dependent):
    x, y = data(n=BATCH * 3)
    losses = []
    for fuse in (True, False):
        strategy = make_strategy(fuse=fuse)
        with strategy.scope():
            model = HashedIds(dependent)
            model.compile(keras.optimizers.SGD(0.2), loss="mse")
        losses.append(model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False,
                                verbose=0).history["loss"])
        if fuse:
            third = report(strategy, "table2/embeddings")
            if dependent:
                assert not third.fused and "stateful op" in third.reason, third
                assert "table0/embeddings" in third.reason
            else:
                assert third.fused, third
    assert losses[0] == losses[1]


def test_a_table_updated_twice_in_one_step_gets_two_server_steps(make_strategy):
    """Two apply_gradients in one step: the per-table path pushes each (two steps on the
    servers, as Keras applies the dense variables twice); fusion must not sum them into one
    push (one Adagrad step of the summed gradient, with the first learning rate)."""
    x, y = data(n=BATCH * 3)
    results = []
    for fuse in (True, False):
        strategy = make_strategy(fuse=fuse)
        with strategy.scope():
            model = Tables()
            optimizer = keras.optimizers.Adagrad(0.5)

        def step(ids, target):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(ids) - target) ** 2)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        run = tf.function(lambda ids, target: strategy.run(step, (ids, target)))
        losses = [float(run(tf.constant(x[s:s + BATCH]), tf.constant(y[s:s + BATCH])))
                  for s in range(0, len(x), BATCH)]
        results.append((losses, weights_of(strategy, model)))
    (fused_losses, fused_weights), (plain_losses, plain_weights) = results
    assert fused_losses == plain_losses
    for a, b in zip(fused_weights, plain_weights):
        np.testing.assert_array_equal(a, b)


def test_a_refused_push_fails_the_next_step_at_once(make_strategy):
    """The fused pull leaves beside the previous step's push (the servers hold it until that
    step is applied): when the push is refused (here a NaN learning rate), the next step
    raises the push's error at once, rather than its pull waiting out the deadline for a
    step that cannot close."""
    strategy = make_strategy(client_options=parallax.ClientOptions(timeout=60))
    x, y = data()
    with strategy.scope():
        model = Tables()
        model.compile(keras.optimizers.SGD(0.1), loss="mse")
    model.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, epochs=1, verbose=0)
    model.optimizer.learning_rate.assign(float("nan"))
    started = time.monotonic()
    with pytest.raises(Exception, match="learning_rate nan must be finite"):
        model.fit(x[:3 * BATCH], y[:3 * BATCH], batch_size=BATCH, epochs=1, verbose=0)
    assert time.monotonic() - started < 20
