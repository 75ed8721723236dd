"""Exact mid-epoch resume with Keras' `BackupAndRestore(save_freq=N)`: at most N steps redone.

Keras 3 records the epoch and the last batch of a batch-level backup ({"epoch": E,
"batch": b} beside the weights), but restores the epoch only: a resumed `fit` starts epoch E
again from its first batch, on top of weights that had already trained on batches 0..b, so
those batches are trained twice and the run differs from an uninterrupted one. It also
forgets the epoch it resumed (`_current_epoch` stays 0 until that epoch ends, as in a `fit`
from `initial_epoch=E`), so a batch-level save during that epoch records epoch 0, and a
second failure there would resume at the very beginning.

In a `ParallaxStrategy`'s `fit` (`parallax.tf.keras_patches`, at `on_train_begin`):
`position` reads where the backup was taken, every worker takes the chief's, the training
iterator skips the b + 1 batches of epoch E already trained (read, not trained: the data
stays in order, as MultiWorkerMirroredStrategy's does not need since it only resumes
epochs), and `continue_backups` has the callbacks count epoch and batches from there
(`begin_epoch`: each epoch's saves record the epoch `fit` runs). So a
failure costs at most N steps (the steps since the last backup), and the resumed run equals
an uninterrupted one when every epoch reads its data from the start (not with a
`steps_per_epoch` shorter than the data: Keras' iterator then goes on across epochs in an
uninterrupted fit, but starts again in a resumed one). Epoch-level backups
(`save_freq="epoch"`) resume as Keras does.
"""
from __future__ import annotations

import json
import logging

import keras

from parallax.tf.state import held_backups

log = logging.getLogger("parallax")


def _backups(callbacks) -> list:
    return [c for c in callbacks if isinstance(c, keras.callbacks.BackupAndRestore)]


def _batch_backup(backup) -> dict | None:
    """A batch-level backup's {"epoch", "batch"}, once restored; None for an epoch-level one
    or none at all."""
    if backup.save_freq == "epoch":
        return None
    held = held_backups.position(backup)
    if held is not None:
        return held
    try:
        with open(backup._training_metadata_path) as f:  # noqa: SLF001 - Keras' path
            saved = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(saved, dict) or not all(isinstance(saved.get(k), int)
                                              for k in ("epoch", "batch")):
        return None
    return saved


def position(callbacks, initial_epoch: int | None) -> tuple[int | None, int]:
    """(the epoch `fit` resumes at, the batches of it its backup already trained): from
    this worker's batch-level `BackupAndRestore`, else (initial_epoch, 0)."""
    for backup in _backups(callbacks):
        saved = _batch_backup(backup)
        if saved is not None:
            return saved["epoch"], saved["batch"] + 1
    return initial_epoch, 0


def batch_level_epoch(callbacks) -> int | None:
    """The epoch a batch-level `BackupAndRestore` among `callbacks` counts now (Keras'
    0-based, as `continue_backups` set it); None without one."""
    for backup in _backups(callbacks):
        if backup.save_freq != "epoch":
            return backup._current_epoch  # noqa: SLF001 - Keras' field
    return None


def backed_up_now(callbacks) -> bool:
    """Whether a batch-level `BackupAndRestore` among `callbacks` saved at the batch that
    just ended (its count of batches since the last save went back to 0: the same on every
    worker, which all count the same batches)."""
    return any(backup.save_freq != "epoch"
               and backup._batches_seen_since_last_saving == 0  # noqa: SLF001 - Keras' field
               for backup in _backups(callbacks))


def begin_epoch(callbacks, epoch: int) -> None:
    """Have every `BackupAndRestore` record `epoch`, the one `fit` begins now, in its next
    saves (Keras sets it at epoch ends only: 0 until then, whatever `initial_epoch` was)."""
    for backup in _backups(callbacks):
        backup._current_epoch = epoch  # noqa: SLF001 - Keras' field


def continue_backups(callbacks, epoch: int | None, done: int) -> None:
    """Have every `BackupAndRestore` go on from epoch `epoch`, `done` batches into it: the
    epoch its next saves record, and its count of batches since the last save."""
    for backup in _backups(callbacks):
        backup._current_epoch = epoch or 0  # noqa: SLF001 - Keras' fields
        backup._last_batch_seen = done - 1 if done else 0  # noqa: SLF001
        backup._batches_seen_since_last_saving = 0  # noqa: SLF001
