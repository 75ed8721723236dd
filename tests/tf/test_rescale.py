"""Where an elastic job's workers stop for a new worker count (parallax.tf.state.rescale), in
one worker process against the session's real servers: Keras `fit` stops right after an
epoch's checkpoint when the launcher's request file (PARALLAX_RESCALE_FILE) asks, leaving the
backup to resume from; never without a checkpoint, never at the last epoch, never without a
request; `strategy.rescale_point()` does the same for custom loops. The whole 2 -> 1 -> 2
round trip under `parallax run` is tests/integration/test_chaos.py's elastic test."""
from __future__ import annotations

import itertools
import json
import logging
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import parallax
from parallax.env import (ELASTIC_ENV, RESCALE_EXIT, RESCALE_FILE_ENV, ask_rescale,
                          global_batch, stopped_for_rescale)

_ids = itertools.count()
STEPS, EPOCHS, BATCH = 3, 4, 8


@pytest.fixture
def request_file(tmp_path, monkeypatch):
    path = tmp_path / "rescale.json"
    monkeypatch.setenv(RESCALE_FILE_ENV, str(path))
    monkeypatch.setenv(ELASTIC_ENV, "1")
    return path


def _fit(cluster, callbacks, epochs: int = EPOCHS, ended: list[int] | None = None) -> list[int]:
    """A small fit; the epochs it ended (`ended`, filled by a callback of its own)."""
    strategy = parallax.ParallaxStrategy(ps_addresses=cluster.addresses, log_plan=False,
                                         run_id=f"rs{next(_ids)}-{int(time.time())}")
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 50, size=(STEPS * BATCH, 2)).astype("int64")
    labels = rng.normal(size=(STEPS * BATCH, 1)).astype("float32")
    with strategy.scope():
        inputs = keras.Input((2,), dtype="int64")
        rows = keras.layers.Embedding(50, 4)(inputs)
        model = keras.Model(inputs, keras.layers.Dense(1)(keras.layers.Flatten()(rows)))
        model.compile(keras.optimizers.Adagrad(0.1), loss="mse")
    ended = [] if ended is None else ended
    seen = keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: ended.append(epoch))
    model.fit(ids, labels, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0,
              callbacks=[*callbacks, seen])
    return ended


def test_fit_stops_right_after_the_checkpoint_of_the_epoch_it_is_asked_in(cluster, tmp_path,
                                                                         request_file):
    ask_rescale(request_file, 2)
    backup = tmp_path / "backup"
    ended: list[int] = []
    with pytest.raises(SystemExit) as stop:
        _fit(cluster, [keras.callbacks.BackupAndRestore(str(backup))], ended=ended)
    assert stop.value.code == RESCALE_EXIT
    assert json.loads((tmp_path / "rescale.json.stopped").read_text()) == {"at": "epoch 1"}
    assert stopped_for_rescale(request_file) and not stopped_for_rescale(request_file)
    assert list(backup.rglob("*.weights.h5")), "the backup to resume from is kept"
    assert global_batch(request_file) == BATCH  # the counts the launcher may start next
    assert ended == [0]  # every callback's end of epoch 1 ran, then the stop


def test_a_job_with_copies_stops_at_its_checkpoint_for_the_reason_given_and_notes_no_batch(
        cluster, tmp_path, request_file, monkeypatch, caplog):
    """`--replicas 2` after a server's death: not elastic (no PARALLAX_ELASTIC), the same
    count asked, for a reason the chief logs; the global batch is not noted (the count is
    fixed)."""
    monkeypatch.delenv(ELASTIC_ENV)
    ask_rescale(request_file, 1, "parameter server 1 started again with copies of its shards")
    with caplog.at_level(logging.INFO, logger="parallax"), pytest.raises(SystemExit) as stop:
        _fit(cluster, [keras.callbacks.BackupAndRestore(str(tmp_path / "b"))])
    assert stop.value.code == RESCALE_EXIT
    assert stopped_for_rescale(request_file) == "epoch 1"
    assert global_batch(request_file) is None
    assert any("the launcher asked for parameter server 1 started again" in r.getMessage()
               for r in caplog.records)


def test_fit_with_batch_level_backups_stops_right_after_one(cluster, tmp_path, request_file,
                                                            caplog):
    """`BackupAndRestore(save_freq=2)` backs up at batch ends only, never at an epoch's end:
    the stop comes right after the first backup once asked, without a warning."""
    ask_rescale(request_file, 2)
    ended: list[int] = []
    with caplog.at_level(logging.WARNING, logger="parallax"), \
            pytest.raises(SystemExit) as stop:
        _fit(cluster, [keras.callbacks.BackupAndRestore(str(tmp_path / "b"), save_freq=2)],
             ended=ended)
    assert stop.value.code == RESCALE_EXIT and ended == []
    assert json.loads((tmp_path / "rescale.json.stopped").read_text()) == \
        {"at": "epoch 1, batch 2"}
    assert not [r for r in caplog.records if "no checkpoint" in r.getMessage()]


def test_fit_without_a_checkpoint_goes_on_and_warns_once(cluster, request_file, caplog):
    ask_rescale(request_file, 2)
    with caplog.at_level(logging.WARNING, logger="parallax"):
        ended = _fit(cluster, [])
    assert ended == list(range(EPOCHS))
    warned = [r for r in caplog.records if "no checkpoint was saved here" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in caplog.records]
    assert not stopped_for_rescale(request_file)


def test_fit_asked_at_its_last_epoch_just_ends(cluster, tmp_path, request_file):
    ask_rescale(request_file, 2)
    ended = _fit(cluster, [keras.callbacks.BackupAndRestore(str(tmp_path / "b"))], epochs=1)
    assert ended == [0]
    assert not stopped_for_rescale(request_file)


def test_without_a_request_nothing_stops(cluster, tmp_path, request_file):
    ended = _fit(cluster, [keras.callbacks.BackupAndRestore(str(tmp_path / "b"))])
    assert ended == list(range(EPOCHS))


def test_a_custom_loops_rescale_point(cluster, request_file, monkeypatch):
    strategy = parallax.ParallaxStrategy(ps_addresses=cluster.addresses, log_plan=False,
                                         run_id=f"rs{next(_ids)}-{int(time.time())}")
    strategy.rescale_point(10)  # no request: nothing
    ask_rescale(request_file, 3)
    with pytest.raises(SystemExit) as stop:
        strategy.rescale_point(20)
    assert stop.value.code == RESCALE_EXIT
    assert stopped_for_rescale(request_file)
    monkeypatch.delenv(RESCALE_FILE_ENV)
    strategy.rescale_point(30)  # not an elastic job: nothing
    with pytest.raises(Exception, match="call it eagerly"):  # (autograph wraps it)
        tf.function(lambda: strategy.rescale_point(40))()
