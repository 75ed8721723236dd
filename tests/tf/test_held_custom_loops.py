"""Held checkpoints of a custom training loop (`parallax.tf.state.held_checkpoints`), in this
process against 2 real servers with a data directory: a `tf.train.CheckpointManager` saving
every step under PARALLAX_HELD_BACKUPS=3 holds two saves in three; a new job on the kept
servers resumes from the newest held one (after an unsaved step the servers roll back), one
on restarted servers from the newest on disk, which `max_to_keep=2` did not delete. Both
end with the weights of an uninterrupted run (1e-6).
"""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

import parallax
from parallax.client.local_cluster import LocalCluster
from parallax.env import HELD_BACKUPS_ENV, TABLES_KEPT_ENV
from parallax.tf.state import held_backups, held_checkpoints

STEPS, STOP = 9, 6


def _model():
    keras.utils.set_random_seed(3)
    inputs = keras.Input((3,), dtype="int64")
    rows = keras.layers.Embedding(300, 4, name="embedding")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(1, name="dense")(
        keras.layers.Flatten()(rows)))
    model.compile(keras.optimizers.Adagrad(0.3), loss="mse")
    return model


def _batch(step: int):
    rng = np.random.default_rng(100 + step)
    return (tf.constant(rng.integers(0, 300, size=(32, 3))),
            tf.constant(rng.normal(size=(32, 1)).astype("float32")))


def _train(strategy, directory: Path | None, stop: int, extra: int = 0):
    """A custom loop in the MWMS tutorial's shape: resume from the manager's latest
    checkpoint, train and save every step up to `stop`, then `extra` steps unsaved (what a
    failed attempt pushed after its last save). (model, manager, the step it resumed at)."""
    with strategy.scope():
        model = _model()
    optimizer = model.optimizer
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
    manager = tf.train.CheckpointManager(checkpoint, directory, max_to_keep=2) \
        if directory is not None else None
    if manager is not None:
        manager.restore_or_initialize()

    step = _step(strategy, model)
    start = int(optimizer.iterations.numpy())
    for k in range(start, stop + extra):
        step(*_batch(k))
        if manager is not None and k < stop:
            manager.save()
    return model, manager, start


def _step(strategy, model):
    """One training step of `model` on a batch, every replica's loss averaged."""
    @tf.function
    def step(x, y):
        def replica(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
            grads = tape.gradient(loss, model.trainable_variables)
            model.optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss
        return strategy.reduce("MEAN", strategy.run(replica, (x, y)), axis=None)
    return step


def _weights(model) -> np.ndarray:
    """The predictions on a probe batch (they read the table's rows) and the dense kernel."""
    return np.concatenate([model(_batch(99)[0]).numpy().ravel(),
                           model.get_layer("dense").kernel.numpy().ravel()])


def _strategy(cluster, run_id: str):
    return parallax.ParallaxStrategy(ps_addresses=cluster.addresses, log_plan=False,
                                     run_id=run_id)


def _names(manager) -> list[str]:
    return [os.path.basename(p) for p in manager.checkpoints]


def test_a_custom_loop_resumes_from_its_held_checkpoint_or_the_newest_on_disk(
        tmp_path, monkeypatch):
    monkeypatch.setenv(HELD_BACKUPS_ENV, "3")
    monkeypatch.setattr(held_backups, "_refused", [])  # (no earlier refusal in the process)
    with LocalCluster(2) as cluster:
        full, _, _ = _train(_strategy(cluster, f"full-{int(time.time())}"), None, STEPS)
        want = _weights(full)

    run_id = f"loop-{int(time.time())}"
    data = tmp_path / "data"
    first, second = tmp_path / "first", tmp_path / "second"
    cluster = LocalCluster(2, data_dir=data).start()
    try:
        # saves 1, 4 on disk, the others held; max_to_keep=2 keeps 5 and 6, and 4 as their
        # fallback; a 7th step is pushed unsaved, as by an attempt that then died
        _, manager, _ = _train(_strategy(cluster, run_id), first, STOP, extra=1)
        assert _names(manager) == ["ckpt-4", "ckpt-5", "ckpt-6"]
        assert sorted(p.name for p in first.glob("*.index")) == \
            ["ckpt-4.index", "ckpt-5.index", "ckpt-6.index"]
        assert held_checkpoints.reference_of(str(first / "ckpt-6")).get("held")
        assert not held_checkpoints.reference_of(str(first / "ckpt-4")).get("held")
        sizes = {n: (first / f"ckpt-{n}.data-00000-of-00001").stat().st_size for n in (4, 6)}
        assert sizes[6] < sizes[4] / 2, sizes  # the held one holds no rows of the table
        shutil.copytree(first, second)

        # (a) a worker restarted, the servers and the run's tables kept: the held ckpt-6
        monkeypatch.setenv(TABLES_KEPT_ENV, "1")
        model, manager, start = _train(_strategy(cluster, run_id), first, STEPS)
        assert start == STOP
        np.testing.assert_allclose(_weights(model), want, atol=1e-6)
    finally:
        cluster.stop()

    # (b) the servers restarted (their marks gone): the newest on disk, ckpt-4
    monkeypatch.delenv(TABLES_KEPT_ENV)
    with LocalCluster(2, data_dir=data) as cluster:
        strategy = _strategy(cluster, run_id)
        assert tf.train.latest_checkpoint(str(second)) == str(second / "ckpt-4")
        model, manager, start = _train(strategy, second, STEPS)
        assert start == 4
        np.testing.assert_allclose(_weights(model), want, atol=1e-6)


def test_tables_the_servers_cannot_hold_are_saved_on_disk(tmp_path, monkeypatch, caplog):
    """Async tables (the servers refuse to hold them): every save is on disk, numbered as
    usual, said once."""
    monkeypatch.setenv(HELD_BACKUPS_ENV, "3")
    monkeypatch.setattr(held_backups, "_refused", [])  # (said once a process: this one's)
    with LocalCluster(1, data_dir=tmp_path / "data") as cluster:
        strategy = parallax.ParallaxStrategy(ps_addresses=cluster.addresses, log_plan=False,
                                             run_id=f"async-{int(time.time())}", sync=False)
        _, manager, _ = _train(strategy, tmp_path / "ckpt", 4)
    assert _names(manager) == ["ckpt-3", "ckpt-4"]
    assert not any(held_checkpoints.reference_of(p).get("held") for p in manager.checkpoints)
    said = [r.getMessage() for r in caplog.records if "cannot hold" in r.getMessage()]
    assert len(said) == 1, said


def test_other_managers_neither_fail_nor_drop_the_held_checkpoints(tmp_path, monkeypatch):
    """Two more managers beside the model's: one of a step counter (no tables: its
    `latest_checkpoint` raised KeyError 'tables' at its second save, held like any), one of
    the model (a "best model" manager: its first save, on disk, dropped every held mark of
    the process, the model manager's newest held checkpoint then no longer restorable)."""
    monkeypatch.setenv(HELD_BACKUPS_ENV, "3")
    monkeypatch.setattr(held_backups, "_refused", [])
    with LocalCluster(2, data_dir=tmp_path / "data") as cluster:
        strategy = _strategy(cluster, f"managers-{int(time.time())}")
        with strategy.scope():
            model = _model()
        step = tf.Variable(0, dtype=tf.int64)
        counter = tf.train.CheckpointManager(tf.train.Checkpoint(step=step), tmp_path / "step",
                                             max_to_keep=2)
        checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
        main = tf.train.CheckpointManager(checkpoint, tmp_path / "main", max_to_keep=5)
        train = _step(strategy, model)
        for k in range(3):
            train(*_batch(k))
            main.save()
            step.assign_add(1)
            counter.save()
            assert counter.latest_checkpoint.endswith(f"ckpt-{k + 1}")
        tf.train.CheckpointManager(checkpoint, tmp_path / "best", max_to_keep=1).save()
        again = tf.train.CheckpointManager(checkpoint, tmp_path / "main", max_to_keep=5)
        assert again.latest_checkpoint.endswith("ckpt-3")  # held, still restorable
