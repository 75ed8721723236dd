"""The worker row cache in training (`ParallaxStrategy(cache=parallax.RowCache(...))`), one
worker against the session's two real parameter servers: hits really skip the servers (the
rows the servers were asked for, from their own Stats, fall by exactly the cache's hits);
staleness 0 trains bit for bit as no cache, evaluation included; a reshard, a restore and
an assign invalidate it; async training and table groups run with it; bad values are
refused naming the fix."""
from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import parallax
from test_fusion import Tables, data, make_strategy, weights_of  # noqa: F401 (a fixture)

BATCH = 16


def pulled_rows(strategy) -> int:
    """Rows the job's servers were asked to pull, over their tables (their Stats)."""
    names = {v.table for v in strategy.plan.on_servers}
    total = 0
    for reply in strategy.extended.client.stats(sorted(names)).values():
        for table in reply.tables:
            total += sum(m.rows for m in table.methods if m.method in ("Pull", "PullMany"))
    return total


def train(strategy, epochs=2, evaluate=False, optimizer=None):
    x, y = data()
    with strategy.scope():
        model = Tables()
        model.compile(optimizer or keras.optimizers.Adagrad(0.2), loss="mse")
    losses = []
    for _ in range(epochs):
        losses += model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False,
                            verbose=0).history["loss"]
        if evaluate:
            losses.append(model.evaluate(x, y, batch_size=BATCH, verbose=0))
    return model, losses


def test_staleness_zero_trains_bit_for_bit_as_no_cache(make_strategy):
    off = make_strategy()
    model_off, losses_off = train(off, evaluate=True)
    on = make_strategy(cache=parallax.RowCache(staleness=0))
    model_on, losses_on = train(on, evaluate=True)
    assert losses_on == losses_off
    for a, b in zip(weights_of(off, model_off), weights_of(on, model_on)):
        np.testing.assert_array_equal(a, b)
    stats = on.cache_stats()
    assert stats.hits > 0  # an evaluation's rows serve the next step (same step) ...
    assert stats.misses > stats.hits  # ... and rows of earlier steps were pulled again
    assert off.cache_stats() is None
    assert "worker row cache on" in on.plan.summary() and "cache" not in off.plan.summary()


def test_hits_skip_the_servers_rows_and_bytes(make_strategy):
    off = make_strategy(group_tables=False)
    train(off)
    on = make_strategy(group_tables=False, cache=parallax.RowCache(staleness=8))
    _, losses = train(on)
    stats = on.cache_stats()
    assert stats.hits > 0 and np.isfinite(losses).all()
    assert pulled_rows(off) - pulled_rows(on) == stats.hits  # the same ids asked each step
    assert stats.bytes_saved == stats.hits * 4 * 4  # dim 4, float32
    assert stats.bytes_held <= parallax.RowCache().bytes


def test_a_table_group_and_async_training_run_with_the_cache(make_strategy):
    grouped = make_strategy(cache=parallax.RowCache(staleness=2))
    _, losses = train(grouped, epochs=1)
    assert grouped.plan.grouped and grouped.cache_stats().hits > 0
    async_ = make_strategy(sync=False, cache=parallax.RowCache(staleness=2))
    _, losses = train(async_, epochs=1)
    assert np.isfinite(losses).all() and async_.cache_stats().hits > 0


def test_reshard_assign_and_restore_invalidate_the_cache(make_strategy, tmp_path):
    strategy = make_strategy(group_tables=False, cache=parallax.RowCache(staleness=100))
    model, _ = train(strategy, epochs=1)
    assert strategy.cache_stats().rows_held > 0
    strategy.reshard(2)
    assert strategy.cache_stats().rows_held == 0 and strategy.cache_stats().invalidations == 1
    x, y = data()
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert strategy.cache_stats().rows_held > 0

    table = model.tables[0].embeddings
    cache = strategy.extended.table_client
    name = strategy.tables[table.path].table.name
    assert name in cache._where
    table.assign(np.full(table.shape, 0.5, np.float32))  # every row: the cache forgets them
    assert strategy.cache_stats().invalidations == 2 and name not in cache._where
    before = strategy.cache_stats()
    model.predict(x[:BATCH], batch_size=BATCH, verbose=0)
    after = strategy.cache_stats()
    assert after.misses - before.misses >= len(np.unique(x[:BATCH, 0]))  # table0 pulled

    path = tf.train.Checkpoint(optimizer=model.optimizer, model=model).save(tmp_path / "c")
    saved = np.asarray(table.numpy())  # read from the servers, not through the cache
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)  # rows move on
    assert strategy.cache_stats().rows_held > 0
    tf.train.Checkpoint(optimizer=model.optimizer, model=model).restore(path)
    stats = strategy.cache_stats()  # the restore, and the file's rows assigned to each table
    assert stats.invalidations > 2 and stats.rows_held == 0
    np.testing.assert_array_equal(np.asarray(table.numpy()), saved)
    model.predict(x[:BATCH], batch_size=BATCH, verbose=0)
    assert strategy.cache_stats().hits == stats.hits  # every row pulled again


def test_a_save_empties_the_cache_so_a_resume_trains_as_the_run_that_saved(make_strategy,
                                                                          tmp_path):
    """At staleness > 0 the rows a step reads depend on what the cache holds. A resumed job
    (a restart, a restore) starts with none; so must the job that saved, for the resume to
    train exactly as it: the epoch after a save, then again from that save, end with the same
    weights and losses."""
    strategy = make_strategy(cache=parallax.RowCache(staleness=3))
    model, _ = train(strategy, epochs=1)
    checkpoint = tf.train.Checkpoint(optimizer=model.optimizer, model=model)
    path = checkpoint.save(tmp_path / "c")
    x, y = data()
    on = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    went_on = weights_of(strategy, model)
    checkpoint.restore(path)
    again = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert again.history["loss"] == on.history["loss"]
    for a, b in zip(went_on, weights_of(strategy, model)):
        np.testing.assert_array_equal(a, b)
    assert strategy.cache_stats().hits > 0  # stale rows were served


def test_bad_cache_values_are_refused_naming_the_fix():
    with pytest.raises(parallax.ConfigError, match=r"cache must be a parallax.RowCache.*"
                                                   r"RowCache\(bytes=64 << 20"):
        parallax.ParallaxStrategy(cache=64 << 20, log_plan=False)
    with pytest.raises(parallax.ConfigError, match=r"staleness=-2"):
        parallax.RowCache(staleness=-2)
