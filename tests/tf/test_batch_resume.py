"""Mid-epoch resume with `BackupAndRestore(save_freq=N)` (parallax.tf.state.batch_resume), in
one worker process against the session's real servers: a fit that fails inside an epoch
resumes after the batches its last backup had trained, so it redoes at most N steps and ends
with the weights of a fit that never failed (plain Keras 3 restarts the epoch from its first
batch and trains those batches twice). A second failure inside the resumed epoch resumes
there too (Keras recorded epoch 0 for a backup taken there)."""
from __future__ import annotations

import itertools
import json
import time

import keras
import numpy as np
import pytest

import parallax

_ids = itertools.count()
STEPS, EPOCHS, BATCH, SAVE_FREQ = 5, 3, 8, 2


class Failure(Exception):
    pass


class Trace(keras.callbacks.Callback):
    """Records (epoch, batch) of every step trained; raises Failure after `fail_at` ones."""

    def __init__(self, fail_at: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.fail_at, self.epoch, self.steps = fail_at, 0, []

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self.steps.append((self.epoch, batch))
        if (self.epoch, batch) == self.fail_at:
            raise Failure(self.fail_at)


def _data():
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 60, size=(STEPS * BATCH, 2)).astype("int64")
    return ids, rng.normal(size=(STEPS * BATCH, 1)).astype("float32")


def _fit(cluster, run_id: str, backup, fail_at=None, initial_epoch: int = 0,
         save_freq: int = SAVE_FREQ) -> tuple[dict, list]:
    """(the weights, the steps trained) of one fit process-worth, failing at `fail_at`."""
    strategy = parallax.ParallaxStrategy(ps_addresses=cluster.addresses, log_plan=False,
                                         run_id=run_id)
    with strategy.scope():
        keras.utils.set_random_seed(7)
        inputs = keras.Input((2,), dtype="int64")
        rows = keras.layers.Embedding(60, 4, name="embedding")(inputs)
        model = keras.Model(inputs, keras.layers.Dense(1, name="dense")(
            keras.layers.Flatten()(rows)))
        model.compile(keras.optimizers.Adagrad(0.2), loss="mse")
    trace = Trace(fail_at)
    callbacks = [keras.callbacks.BackupAndRestore(str(backup), save_freq=save_freq), trace]
    try:
        model.fit(*_data(), batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                  callbacks=callbacks, initial_epoch=initial_epoch)
    except Failure:
        return {}, trace.steps
    return {w.path: w.numpy() for w in model.weights}, trace.steps


@pytest.mark.parametrize("failures", [[(1, 3)], [(1, 3), (1, 4)]], ids=["once", "twice"])
def test_a_fit_failing_mid_epoch_resumes_after_its_last_backup(cluster, tmp_path, failures):
    stamp = f"{next(_ids)}-{int(time.time())}"
    want, _ = _fit(cluster, f"bf{stamp}", tmp_path / "full")
    run_id, runs = f"bi{stamp}", []
    for fail_at in failures:
        got, steps = _fit(cluster, run_id, tmp_path / "backup", fail_at)
        runs.append(steps)
        assert not got and steps[-1] == fail_at
    got, steps = _fit(cluster, run_id, tmp_path / "backup")
    runs.append(steps)
    # the backups count 2 batches across epochs: after (0, 1), (0, 3), (1, 0), (1, 2), ...
    # so a failure at (1, 3) resumes after (1, 2). The resumed run's first backup comes 2
    # batches later, after (1, 4), the epoch's last: a failure there resumes at epoch 2
    # (Keras' own record of that backup said epoch 0, which would resume at epoch 1)
    assert [r[0] for r in runs[1:]] == [(1, 3), (2, 0)][:len(failures)], runs
    assert runs[-1][-1] == (EPOCHS - 1, STEPS - 1)
    redone = sum(map(len, runs)) - STEPS * EPOCHS
    assert redone == 1, runs  # (1, 3) once: the second failure came right after a backup
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=0, atol=1e-6, err_msg=name)


def test_a_fit_from_initial_epoch_resumes_at_the_epoch_it_backed_up(cluster, tmp_path):
    """fit(initial_epoch=1): its backups record the epoch it runs (Keras recorded 0 until
    that epoch's end), so a failure right after the backup at epoch 1's last batch resumes
    at epoch 2 (Keras' epoch 0, all its batches done, resumed at epoch 1: trained twice; from
    initial_epoch=2, at epoch 1, before the one fit was asked to start at)."""
    stamp = f"{next(_ids)}-{int(time.time())}"
    want, _ = _fit(cluster, f"if{stamp}", tmp_path / "full", initial_epoch=1, save_freq=STEPS)
    run_id, backup = f"ii{stamp}", tmp_path / "backup"
    got, steps = _fit(cluster, run_id, backup, (1, STEPS - 1), 1, STEPS)
    assert not got and steps[-1] == (1, STEPS - 1)
    got, steps = _fit(cluster, run_id, backup, initial_epoch=1, save_freq=STEPS)
    assert steps == [(EPOCHS - 1, b) for b in range(STEPS)], steps
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=0, atol=1e-6, err_msg=name)


def test_a_backup_record_cut_short_leaves_the_one_before(cluster, tmp_path, monkeypatch):
    """The record of where a backup was taken is written whole or not at all: a save that
    fails while writing it (a kill, a full disk) leaves the previous record, which a resume
    reads (Keras truncates the file first: a resume then failed with JSONDecodeError)."""
    dumps, records = json.dumps, []

    def failing(value, *args, **kwargs):
        if isinstance(value, dict) and set(value) == {"epoch", "batch"}:
            records.append(value)
            if len(records) == 3:
                raise OSError("no space left on device")
        return dumps(value, *args, **kwargs)
    monkeypatch.setattr(json, "dumps", failing)
    backup = tmp_path / "backup"
    with pytest.raises(OSError, match="no space"):
        _fit(cluster, f"ba{next(_ids)}-{int(time.time())}", backup)
    monkeypatch.setattr(json, "dumps", dumps)
    assert json.loads((backup / "training_metadata.json").read_text()) == records[1]
    assert sorted(p.name for p in backup.iterdir()) == ["latest.weights.h5",
                                                        "training_metadata.json"]
