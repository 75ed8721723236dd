"""Held backups: Keras' `BackupAndRestore` with most backups' tables held in the servers'
memory, so that a backup every step costs about what the step's rows do, not the tables.

A backup of a `ParallaxStrategy` model on disk holds everything (`resume`): the servers write
every table to their data directory, and the Keras file gets the tables' rows too. With
PARALLAX_HELD_BACKUPS=N (`parallax run --held-backups N`) one backup in N (each attempt's
first, then every N-th, and any taken while the launcher asks the workers to stop) is made
that way, and held too (`saved_on_disk`: the newest held mark is then always the newest
backup's, whichever way it was made); the others are held only: the servers mark the
tables in memory (`PSClient.save(held=True)`, copy on write: servers/parallax_ps/held.py)
and the worker writes HELD_FILE beside Keras' files: its dense variables and dense
optimizer state, where the backup was taken ({"epoch", "batch"}, as Keras records it) and
the reference to the mark. The chief sends the same bytes to the servers, split over them
beside the mark (`PSClient.hold_state`: the dense part of the commit, outside the workers).

A resumed `fit` loads the newer of the two backups (the held one when both were taken at
the same batch: it is restored from memory): the held one only where the chief finds
every server still holding its mark (a worker died, the servers and the run's tables were
kept: `parallax run` keeps them with --held-backups); after a server's restart, or with the
run's tables dropped for a new worker count, the one on disk, older by at most N - 1
backups. The chief reads the held backup from the servers when its HELD_FILE is gone or
older, by epoch and batch (a chief rescheduled on a new host, its backup directory
lost); the other workers take the chief's position and dense variables, whichever backup
they had.
A job stops for the launcher (`rescale`) only after a backup on disk. Tables the
servers cannot hold (keyed, async) make every backup one on disk, said once.
"""
from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import zipfile

import grpc
import numpy as np
import tensorflow as tf

from parallax.env import RESCALE_FILE_ENV, RUN_ID_ENV, held_backups, rescale_request
from parallax.errors import ParallaxError, ServerError
from parallax.tf.graph.variables import is_released, remote_of
from parallax.tf.state import resume

HELD_FILE = "held.npz"  # in BackupAndRestore's directory, beside Keras' own files
log = logging.getLogger("parallax")
_refused: list[str] = []  # why the servers cannot hold this job's tables (said once)
_state_refused: list[str] = []  # why they cannot keep the held backups' bytes (said once)
REFUSED = "held checkpoints keep fixed-vocabulary sync tables only"  # (servers' shard.hold)


def save(backup, extended) -> bool:
    """Take this backup held, when it is one to hold; False: the caller writes it on disk."""
    count = getattr(backup, "_parallax_backups", 0)
    backup._parallax_backups = count + 1  # noqa: SLF001 - our own field
    every = held_backups()
    if not every or _refused or not _local(backup) or count % every == 0 or _asked_to_stop():
        return False
    return _held(backup, extended)


def _local(backup) -> bool:
    """Whether the backup directory is a local one: HELD_FILE is written beside Keras'
    files, so a directory given as a URL (`gs://...`) has every backup on disk."""
    return "://" not in os.fspath(backup.backup_dir)


def _held(backup, extended) -> bool:
    """Hold the tables' part of this backup on the servers and write its HELD_FILE (the
    chief: its bytes to the servers too); False when the servers cannot hold them."""
    token = resume.HELD.set(True)
    try:
        text, _ = extended.server_tables.saved()
    except ServerError as err:
        if err.code != grpc.StatusCode.FAILED_PRECONDITION or REFUSED not in str(err):
            raise
        _refused.append(str(err))
        log.warning("the servers cannot hold this job's tables (%s): every backup is "
                    "saved on disk", err)
        return False
    finally:
        resume.HELD.reset(token)
    arrays = _dense(backup.model)
    record = {"epoch": backup._current_epoch, "batch": backup._last_batch_seen,  # noqa: SLF001
              "reference": text,
              "variables": _layout(backup.model, {k: a.shape for k, a in arrays.items()}),
              "workers": extended.workers.info.size}
    data = _packed(record, arrays)
    if extended.workers.info.is_chief:
        _hold_on_servers(extended, json.loads(text), data)
    _write(os.path.join(backup.backup_dir, HELD_FILE), data)
    return True


def _hold_on_servers(extended, reference: dict, data: bytes) -> None:
    """Chief: the held backup's bytes (those of HELD_FILE) to the servers too, beside the
    tables' mark (`PSClient.hold_state`), unless they refused them once (--memory-mb)."""
    if _state_refused:
        return
    try:
        extended.client.hold_state(reference["path"], _tables(reference),
                                   reference["checkpoint"], data, keep=resume.HELD_KEPT)
    except ServerError as err:
        if err.code == grpc.StatusCode.NOT_FOUND:  # (its copies passed --memory-mb)
            log.warning("the servers dropped held checkpoint %s before its dense state "
                        "reached them (%s): a resume goes back to a backup before it",
                        reference["checkpoint"], err)
            return
        if err.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise
        if "--memory-mb" not in str(err):  # (not the servers' room: this backup only)
            log.warning("the servers refused held checkpoint %s's dense state (%s): a resume "
                        "from the servers goes back to a backup before it",
                        reference["checkpoint"], err)
            return
        _state_refused.append(str(err))
        log.warning("the servers have no room for the held backups' dense state (%s): it "
                    "stays on the workers' disks only, and a chief whose backup directory is "
                    "lost resumes from the backup on disk", err)


def saved_on_disk(backup, extended) -> None:
    """After a backup on disk: with held backups, hold it too (the servers' newest mark and
    the dense part then are this step's, so that a node lost with its disk right after it
    still resumes from here, and a worker's death from memory; the held save keeps the
    newest HELD_KEPT marks); else drop an earlier held backup, older now."""
    if held_backups() and not _refused and _local(backup) and _held(backup, extended):
        return
    path = os.path.join(backup.backup_dir, HELD_FILE)
    if os.path.exists(path):
        os.remove(path)
    extended.server_tables.release_held()


def _layout(model, shapes: dict[str, tuple]) -> dict:
    """What a held backup was saved from: every variable's key and name, with its shape
    (`shapes`) where it has one there (the tables and their slots, on the servers, have
    none)."""
    return {key: [getattr(v, "path", v.name), list(shapes[key]) if key in shapes else None]
            for key, v in _variables(model)}


def _checked(model, record: dict, path: str) -> bool:
    """Whether the held backup was saved from this model: the same variables, in the same
    order, by name, and the same shape for each it holds."""
    saved = record.get("variables") or {}
    here = _layout(model, {key: tuple(v.shape) for key, v in _variables(model)})
    differ = [key for key in here.keys() | saved.keys()
              if key not in here or key not in saved or here[key][0] != saved[key][0]
              or (saved[key][1] is not None and here[key][1] != saved[key][1])]
    if not differ:
        return True
    log.warning("the held backup %s was saved from another model (%d of its %d variables "
                "differ, e.g. %s): resuming from the backup on disk", path, len(differ),
                len(saved), sorted(differ)[0])
    return False


def load(backup, extended) -> bool:
    """Resume from the newest held backup when it is newer than the one on disk and still
    held; False: the caller loads the one on disk. The chief's is the newer of its
    HELD_FILE and the servers' copy (`PSClient.held_state`: its HELD_FILE gone with its
    disk); the other workers read theirs, and take the chief's position and dense
    variables."""
    if not _local(backup):
        return False
    path = os.path.join(backup.backup_dir, HELD_FILE)
    local = _unpacked(path) if os.path.exists(path) else None
    if not extended.workers.info.is_chief:
        return local is not None and _newer(local[0], backup) and \
            _resume(backup, extended, local, path)
    if local is None and not held_backups():
        return False
    with _asking(extended, path) as client:
        for record, arrays, source in _newest_first(client, extended, local, path):
            reference = json.loads(record["reference"] or "{}")
            if _newer(record, backup) and (not reference.get("held") or
                                           _servers_hold(client, reference, source)):
                return _resume(backup, extended, (record, arrays), source)
    return False


def _newest_first(client, extended, local: tuple | None, path: str) -> list[tuple]:
    """(record, arrays, source) of the servers' held backup when it was taken after the
    chief's HELD_FILE (`local`), by their positions (epoch, batch), then of that file."""
    mine = [(*local, path)] if local is not None else []
    if client is None:
        return mine
    run_id = _run_id(extended)
    if run_id is None:
        return mine  # (no run id: none of an attempt before to find on the servers)
    name = json.loads(local[0]["reference"] or "{}").get("checkpoint", "") if local else ""
    try:  # (not read when the servers' newest is the file's: names sort after those seen)
        found = client.held_state(resume.resume_path(run_id), after=name)
    except ParallaxError as err:
        log.warning("could not read the servers' copy of the held backup (%s): resuming "
                    "from %s", err, path if local else "the backup on disk")
        return mine
    if found is None:
        return mine
    try:
        record, arrays = _unpacked(found[1])
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as err:
        log.warning("the servers' copy of held checkpoint %s is unreadable (%s): resuming "
                    "from %s", found[0], err, path if local else "the backup on disk")
        return mine
    theirs = (record, arrays, f"the servers' copy of held checkpoint {found[0]}")
    return [theirs, *mine] if local is None or _position(record) > _position(local[0]) \
        else [*mine, theirs]


def _position(record: dict) -> tuple[int, int]:
    return record["epoch"], record["batch"]


def _run_id(extended) -> str | None:
    """The run's id, before the plan too (then as configured: `parallax run` sets one)."""
    if extended.cluster is not None:
        return extended.cluster.run_id
    return extended.config.run_id or os.environ.get(RUN_ID_ENV) or None


def _resume(backup, extended, found: tuple, source: str) -> bool:
    """Load the held backup `found` (record, arrays) into the model; False if it was saved
    from another model or by another worker count."""
    record, arrays = found
    if not _same_workers(record, extended, source):
        return False
    model = backup.model
    if model.optimizer is not None and not model.optimizer.built:
        model.optimizer.build(model.trainable_variables)  # (as Keras' own load does)
    if not _checked(model, record, source):
        return False
    _assign(model, arrays)
    extended.server_tables.restore(record["reference"], b"", f"held backup {source}")
    model._initial_epoch = record["epoch"]  # noqa: SLF001 - as Keras' `_load_model`
    backup._parallax_held = record  # noqa: SLF001 - read by `batch_resume.position`
    log.info("resuming from the held backup of epoch %d, batch %d (%s)", record["epoch"] + 1,
             record["batch"] + 1, source)
    return True


def _same_workers(record: dict, extended, source: str) -> bool:
    """Whether the held backup was taken by as many workers as this job has: its tables on
    the servers wait for that many pushes a step (a Kubernetes worker Job rendered again
    with another -np keeps the servers and their marks)."""
    saved, size = record.get("workers"), extended.workers.info.size
    if saved is None or saved == size:
        return True
    log.warning("the held backup %s was taken by %d workers, this job has %d: resuming from "
                "the backup on disk (the tables are made anew for %d)", source, saved, size,
                size)
    return False


def position(backup) -> dict | None:
    """{"epoch", "batch"} of the held backup this `fit` resumed from, if it did."""
    record = getattr(backup, "_parallax_held", None)
    return None if record is None else {"epoch": record["epoch"], "batch": record["batch"]}


def _asked_to_stop() -> bool:
    path = os.environ.get(RESCALE_FILE_ENV)
    return bool(path) and rescale_request(path) is not None


def _variables(model) -> list[tuple[str, object]]:
    """(key, variable) of every variable a held backup keeps: the model's and its
    optimizer's, by position, but for the tables and their slots (the servers hold them)."""
    pairs = [(f"w{i}", v) for i, v in enumerate(model.weights)]
    if model.optimizer is not None:
        pairs += [(f"o{i}", v) for i, v in enumerate(model.optimizer.variables)]
    return pairs


def _on_servers(variable) -> bool:
    storage = variable if isinstance(variable, tf.Variable) else \
        getattr(variable, "value", None)
    return storage is not None and (remote_of(storage) is not None or is_released(storage))


def _dense(model) -> dict[str, np.ndarray]:
    return {key: np.asarray(v.numpy()) for key, v in _variables(model) if not _on_servers(v)}


def _assign(model, arrays: dict[str, np.ndarray]) -> None:
    variables = dict(_variables(model))
    for key, value in arrays.items():
        variables[key].assign(value)


def _newer(record: dict, backup) -> bool:
    """Whether the held backup was taken after the one on disk (Keras' record), or with it
    (`saved_on_disk`: the same state, restored from memory rather than from disk)."""
    try:
        with open(backup._training_metadata_path) as f:  # noqa: SLF001 - Keras' path
            disk = json.load(f)
    except (OSError, ValueError):
        return True
    return _position(record) >= (disk.get("epoch", -1), disk.get("batch", -1))


def _tables(reference: dict) -> list[str]:
    return sorted({t["table"] for t in reference["tables"].values()})


@contextlib.contextmanager
def _asking(extended, path: str):
    """Chief: a client of the servers, or None (said) when they cannot be reached."""
    from parallax.client.connection import client_options_from_env
    from parallax.client.ps_client import PSClient
    try:
        client = PSClient(extended.ps_addresses(),
                          client_options_from_env(extended._client_options))  # noqa: SLF001
        client.wait_ready(extended._connect_timeout)  # noqa: SLF001
    except ParallaxError as err:
        log.warning("could not ask the servers for the held backup %s (%s): resuming from "
                    "the backup on disk", path, err)
        yield None
        return
    with client:
        yield client


def _servers_hold(client, reference: dict, source: str) -> bool:
    """Chief: whether every server still holds the held backup's mark of the tables."""
    if client is None:
        return False
    try:
        held = client.holds(_tables(reference), reference["checkpoint"])
    except ParallaxError as err:
        log.warning("could not ask the servers for the held backup %s (%s): resuming from "
                    "the backup on disk", source, err)
        return False
    if not held:
        log.info("the servers no longer hold the held backup %s (they started anew, or "
                 "the run's tables were dropped): resuming from the backup on disk", source)
    return held


def _packed(record: dict, arrays: dict[str, np.ndarray]) -> bytes:
    """A held backup's bytes: an npz of its record (JSON) and its arrays."""
    out = io.BytesIO()
    np.savez(out, record=np.frombuffer(json.dumps(record).encode(), np.uint8), **arrays)
    return out.getvalue()


def _unpacked(data: bytes | str) -> tuple[dict, dict[str, np.ndarray]]:
    """(record, arrays) of a held backup's bytes, or of its file."""
    with np.load(io.BytesIO(data) if isinstance(data, bytes) else data) as stored:
        record = json.loads(bytes(stored["record"]).decode())
        return record, {key: stored[key] for key in stored.files if key != "record"}


def _write(path: str, data: bytes) -> None:
    """The held backup, written under a temporary name and renamed into place."""
    temporary = f"{path}.parallax-{os.getpid()}"
    try:
        with open(temporary, "wb") as f:
            f.write(data)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)
