"""Held checkpoints for custom training loops: `tf.train.CheckpointManager.save` with most
saves' tables held in the servers' memory, as Keras' `BackupAndRestore` gets them
(`held_backups`), so that a checkpoint every step costs about the step's rows.

With PARALLAX_HELD_BACKUPS=N (`parallax run --held-backups N`) and a `ParallaxStrategy` in the
process, a manager's save is on disk as before for one save in N (each process's first,
then every N-th, and any taken while the launcher asks the workers to stop); the others are
held: TensorFlow writes the checkpoint's files as usual (dense variables, optimizer, the
user's step and iterator), but the tables' part is a mark the servers keep in memory
(`resume.HELD`: `PSClient.save(held=True)`, copy on write), whose reference the files hold,
and the tables' variables and slots save an empty value (`variables.WITHOUT_ROWS`: not
every row read from the servers; restoring one leaves the table to the mark).
Why here: custom loops (the MWMS and Horovod tutorials, the benchmark's workers) save
through a manager, and the user changes nothing but the launcher's flag.

A held checkpoint is restorable only while every server holds its mark (a worker died, the
servers and the run's tables were kept). So under parallax `manager.latest_checkpoint`, and
`restore_or_initialize`, give the newest checkpoint that is on disk or still held: each
candidate's reference is read from its files, newest first, and the servers are asked
(`PSClient.holds`) about held ones. Every worker asks the same servers and gets the same
answer; the tables follow the chief's choice whatever the others restore (`resume`).
`max_to_keep` counts every save, held or not, but never deletes the newest checkpoint on
disk while held ones are newer: it is their fallback. After a save on disk the chief drops
the held marks that manager's saves made (`ServerTables.release_held`): a resume then picks
the newer disk one. The servers keep the newest HELD_KEPT marks of the tables whichever
manager made them, so a second manager that saves the tables held (a "best model" one)
pushes the first's out: its resume then falls back to its newest checkpoint on disk.
`tf.train.latest_checkpoint(directory)` gives the same from the directory's `checkpoint` file.
Not covered: `tf.train.Checkpoint.save` / `write` called without a manager (on disk); the
chief's dense state is not sent to the servers (a chief that lost its disk resumes from
nothing).
"""
from __future__ import annotations

import contextlib
import functools
import json
import logging
import threading
import types
import weakref

import grpc
import tensorflow as tf

from parallax.env import held_backups as held_every
from parallax.errors import ServerError
from parallax.tf.graph.variables import WITHOUT_ROWS
from parallax.tf.state import held_backups, resume

log = logging.getLogger("parallax")
_MARK = "_parallax_held_checkpoints"
_SUFFIX = f"{resume.ATTRIBUTE}/.ATTRIBUTES/{resume._KEY}"  # noqa: SLF001 - the tables' key
_job: list = [None]  # weakref to the latest ParallaxExtended made
_state = threading.local()  # .saving: a manager's save is under way (its own reads of
#                             `latest_checkpoint` are of the newest, not `restorable`)


def install(extended) -> None:
    """Remember `extended` as this process's job; patch `tf.train.CheckpointManager` once."""
    _job[0] = weakref.ref(extended)
    manager = tf.train.CheckpointManager
    if getattr(manager.save, _MARK, False):
        return
    _patch(manager, "save", _saving(manager.save))
    _patch(manager, "_sweep", _sweeping(manager._sweep))  # noqa: SLF001 - TF's method
    _patch(manager, "restore_or_initialize",
           _restoring(manager.restore_or_initialize))
    original = manager.latest_checkpoint.fget

    @functools.wraps(original)
    def latest_checkpoint(self):
        latest = original(self)
        return latest if getattr(_state, "saving", False) else restorable(self, latest)
    manager.latest_checkpoint = property(latest_checkpoint)
    tf.train.latest_checkpoint = _latest_in(tf.train.latest_checkpoint)


def _patch(owner, name: str, replacement) -> None:
    setattr(replacement, _MARK, True)
    setattr(owner, name, replacement)


def _extended():
    """The job's ParallaxExtended once its tables are on the servers, else None."""
    extended = _job[0]() if _job[0] is not None else None
    return extended if extended is not None and extended.remotes else None


# ---- saving ----

def _saving(original):
    @functools.wraps(original)
    def save(self, checkpoint_number=None, check_interval=True, options=None):
        with _saving_now():
            return _save(self, checkpoint_number, check_interval, options)

    def _save(self, checkpoint_number, check_interval, options):
        extended = _extended()
        if extended is None or not _to_hold(self):
            path = original(self, checkpoint_number, check_interval, options)
            if path is not None and extended is not None:
                _saved_on_disk(self, extended, path)
        else:
            path = _held_save(self, extended, original, checkpoint_number, check_interval,
                              options)
        if path is None and extended is not None:  # (`checkpoint_interval` skipped it)
            self._parallax_saves = getattr(self, "_parallax_saves", 1) - 1  # noqa: SLF001
        return path
    return save


@contextlib.contextmanager
def _saving_now():
    before, _state.saving = getattr(_state, "saving", False), True
    try:
        yield
    finally:
        _state.saving = before


def _to_hold(manager) -> bool:
    """Whether this save of `manager` is one to hold (counted per manager and process)."""
    count = getattr(manager, "_parallax_saves", 0)
    manager._parallax_saves = count + 1  # noqa: SLF001 - our own field
    every = held_every()
    return bool(every) and not held_backups._refused and count % every != 0 and \
        not held_backups._asked_to_stop()  # noqa: SLF001 - the Keras path's, shared


def _held_save(manager, extended, original, *args):
    """The save with the tables held; on the servers' refusal to hold them, on disk."""
    token = resume.HELD.set(True)
    rows = WITHOUT_ROWS.set(True)  # (the tables' rows are not read into the files)
    counter = int(manager.checkpoint.save_counter.numpy())
    tables = extended.server_tables
    before = tables.held_saves  # (a checkpoint without the tables holds nothing)
    try:
        path = original(manager, *args)
    except ServerError as err:
        if err.code != grpc.StatusCode.FAILED_PRECONDITION or \
                held_backups.REFUSED not in str(err):
            raise
        held_backups._refused.append(str(err))  # noqa: SLF001 - said once, both paths
        log.warning("the servers cannot hold this job's tables (%s): every checkpoint is "
                    "saved on disk", err)
        manager.checkpoint.save_counter.assign(counter)  # (the failed try counted one)
        resume.HELD.reset(token)
        WITHOUT_ROWS.reset(rows)
        token = None
        path = original(manager, *args)
        if path is not None:
            _saved_on_disk(manager, extended, path)
        return path
    finally:
        if token is not None:
            resume.HELD.reset(token)
            WITHOUT_ROWS.reset(rows)
    held = path is not None and tables.held_saves > before and extended.workers.info.is_chief
    if path is not None:
        _kinds(manager)[path] = held
    if held:
        _marks(manager).add(tables.newest_held())
    return path


def _saved_on_disk(manager, extended, path: str) -> None:
    """After a save on disk: this manager's held marks are older than it, never restored
    again (another manager's, saving the same tables, stay)."""
    _kinds(manager)[path] = False
    marks = _marks(manager)
    if marks and extended.workers.info.is_chief:
        extended.server_tables.release_held(only=set(marks))
    marks.clear()


def _marks(manager) -> set[str]:
    """The names of the held marks `manager`'s saves made (the chief's)."""
    marks = getattr(manager, "_parallax_marks", None)
    if marks is None:
        marks = manager._parallax_marks = set()  # noqa: SLF001 - our own field
    return marks


def _kinds(manager) -> dict[str, bool]:
    """{checkpoint path: whether its tables are held} as this process saved or read them."""
    kinds = getattr(manager, "_parallax_held", None)
    if kinds is None:
        kinds = manager._parallax_held = {}  # noqa: SLF001 - our own field
    return kinds


def _is_held(manager, path: str) -> bool:
    kinds = _kinds(manager)
    if path not in kinds:
        kinds[path] = bool(reference_of(path).get("held"))
    return kinds[path]


def reference_of(path: str) -> dict:
    """The parallax tables reference a TF checkpoint's files hold ({} when none: no tables,
    a worker's, or files that cannot be read)."""
    try:
        reader = tf.train.load_checkpoint(path)
    except (tf.errors.OpError, ValueError):
        return {}
    keys = [k for k in reader.get_variable_to_shape_map() if k.endswith(_SUFFIX)]
    if not keys:
        return {}
    text, _ = resume._unpack(reader.get_tensor(keys[0]))  # noqa: SLF001 - the file's value
    try:
        reference = json.loads(text or "{}")
    except ValueError:
        return {}
    return reference if isinstance(reference, dict) else {}


# ---- max_to_keep ----

def _sweeping(original):
    @functools.wraps(original)
    def _sweep(self):
        """TF's sweep, keeping the newest checkpoint on disk beyond `max_to_keep` while held
        ones are newer (a server's restart takes those)."""
        _forget(self, self._latest_checkpoint)  # just written (maybe over an older one)
        keep = _fallback(self) if _job[0] is not None and self._max_to_keep else None
        if keep is None:
            return original(self)
        stamp = self._maybe_delete.pop(keep)
        try:
            original(self)
        finally:
            self._maybe_delete[keep] = stamp
            self._maybe_delete.move_to_end(keep, last=False)  # the oldest kept
    return _sweep


def _forget(manager, path: str) -> None:
    """What this process read of `path` (its kind, whether the servers hold it): its files
    were written again."""
    _kinds(manager).pop(path, None)
    getattr(manager, "_parallax_asked", {}).pop(path, None)


def _fallback(manager) -> str | None:
    """The newest checkpoint on disk where it is among those TF's sweep would delete."""
    paths = list(manager._maybe_delete)  # noqa: SLF001 - oldest first
    doomed = paths[:max(0, len(paths) - manager._max_to_keep)]  # noqa: SLF001
    if not doomed:
        return None
    newest = next((p for p in reversed(paths) if not _is_held(manager, p)), None)
    return newest if newest in doomed else None


# ---- resuming ----

def restorable(manager, latest: str | None) -> str | None:
    """The newest of `manager`'s checkpoints that is on disk or whose mark every server
    still holds (`latest` itself in a process without parallax's tables)."""
    if latest is None or _job[0] is None or _job[0]() is None:
        return latest
    paths = list(dict.fromkeys([latest, *reversed(manager.checkpoints)]))
    checked = []
    for path in paths:
        held = _is_held(manager, path)
        if not held or _still_held(manager, path):
            if checked:
                log.info("resuming from checkpoint %s: the servers no longer hold the newer "
                         "held checkpoint(s) %s (they started anew, or the run's tables "
                         "were dropped)", path, checked)
            elif held:
                log.info("resuming from held checkpoint %s (the servers hold its tables)",
                         path)
            return path
        checked.append(path)
    log.warning("no checkpoint of %s is restorable: the servers no longer hold its held "
                "checkpoints %s and none is on disk; training starts anew",
                manager.directory, checked)
    return None


def _latest_in(original):
    @functools.wraps(original)
    def latest_checkpoint(checkpoint_dir, latest_filename=None):
        """TF's, but the newest restorable of the directory's checkpoints (`restorable`), as
        the tutorials call it to resume (the `checkpoint` file lists those a manager kept)."""
        latest = original(checkpoint_dir, latest_filename)
        state = tf.train.get_checkpoint_state(checkpoint_dir, latest_filename) \
            if latest is not None else None
        listed = types.SimpleNamespace(  # (what `restorable` reads of a manager)
            checkpoints=list(state.all_model_checkpoint_paths) if state else [],
            directory=checkpoint_dir)
        return restorable(listed, latest)
    setattr(latest_checkpoint, _MARK, True)
    return latest_checkpoint


def _still_held(manager, path: str) -> bool:
    """Whether every server holds the mark `path`'s files refer to (asked once a process:
    a mark this process took itself is held until a disk save drops it)."""
    known = getattr(manager, "_parallax_asked", None)
    if known is None:
        known = manager._parallax_asked = {}  # noqa: SLF001 - our own field
    if path not in known:
        reference = reference_of(path)
        if not reference.get("tables") or not reference.get("checkpoint"):
            known[path] = False  # (no mark to ask about: a reference without the tables)
            return False
        with held_backups._asking(_job[0](), path) as client:  # noqa: SLF001
            known[path] = held_backups._servers_hold(client, reference, path)  # noqa: SLF001
    return known[path]


def _restoring(original):
    @functools.wraps(original)
    def restore_or_initialize(self):
        """TF's, from the newest restorable checkpoint (`restorable`), not the newest."""
        chosen = self.latest_checkpoint
        if chosen is None and self._latest_checkpoint is not None:  # noqa: SLF001
            if self._init_fn is not None:  # noqa: SLF001 - as TF's with no checkpoint
                self._init_fn()  # noqa: SLF001
            return None
        self._latest_checkpoint = chosen  # noqa: SLF001 - what TF's restores
        return original(self)
    return restore_or_initialize
