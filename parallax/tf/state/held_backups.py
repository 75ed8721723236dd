"""Held backups: Keras' `BackupAndRestore` with most backups' tables held in the servers'
memory, so that a backup every step costs about what the step's rows do, not the tables.

A backup of a `ParallaxStrategy` model on disk holds everything (`resume`): the servers write
every table to their data directory, and the Keras file gets the tables' rows too. With
PARALLAX_HELD_BACKUPS=N (`parallax run --held-backups N`) one backup in N (each attempt's
first, then every N-th, and any taken while the launcher asks the workers to stop) is made
that way; the others are held: the servers mark the tables in memory
(`PSClient.save(held=True)`, copy on write: servers/parallax_ps/held.py) and the worker
writes HELD_FILE beside Keras' files: its dense variables and dense optimizer state, where
the backup was taken ({"epoch", "batch"}, as Keras records it) and the reference to the
mark.

A resumed `fit` loads the newer of the two backups: the held one only where the chief finds
every server still holding its mark (a worker died, the servers and the run's tables were
kept: `parallax run` keeps them with --held-backups); after a server's restart, or with the
run's tables dropped for a new worker count, the one on disk, older by at most N - 1
backups. A job stops for the launcher (`rescale`) only after a backup on disk. Tables the
servers cannot hold (keyed, async) make every backup one on disk, said once.
"""
from __future__ import annotations

import json
import logging
import os

import grpc
import numpy as np
import tensorflow as tf

from parallax.env import RESCALE_FILE_ENV, held_backups, rescale_request
from parallax.errors import ParallaxError, ServerError
from parallax.tf.graph.variables import is_released, remote_of
from parallax.tf.state import resume

HELD_FILE = "held.npz"  # in BackupAndRestore's directory, beside Keras' own files
log = logging.getLogger("parallax")
_refused: list[str] = []  # why the servers cannot hold this job's tables (said once)
REFUSED = "held checkpoints keep fixed-vocabulary sync tables only"  # (servers' shard.hold)


def save(backup, extended) -> bool:
    """Take this backup held, when it is one to hold; False: the caller writes it on disk."""
    count = getattr(backup, "_parallax_backups", 0)
    backup._parallax_backups = count + 1  # noqa: SLF001 - our own field
    every = held_backups()
    if not every or _refused or count % every == 0 or _asked_to_stop():
        return False
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
              "variables": _layout(backup.model, {k: a.shape for k, a in arrays.items()})}
    _write(os.path.join(backup.backup_dir, HELD_FILE), record, arrays)
    return True


def saved_on_disk(backup, extended) -> None:
    """After a backup on disk: the held one is older now, and the servers' marks useless."""
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
    """Resume from the held backup when it is the newer one and still held; False: the
    caller loads the one on disk."""
    path = os.path.join(backup.backup_dir, HELD_FILE)
    if not os.path.exists(path):
        return False
    with np.load(path) as stored:
        record = json.loads(bytes(stored["record"]).decode())
        arrays = {key: stored[key] for key in stored.files if key != "record"}
    if not _newer(record, backup._training_metadata_path):  # noqa: SLF001 - Keras' path
        return False
    reference = json.loads(record["reference"] or "{}")
    if extended.workers.info.is_chief and reference.get("held") and \
            not _servers_hold(extended, reference, path):
        return False
    model = backup.model
    if model.optimizer is not None and not model.optimizer.built:
        model.optimizer.build(model.trainable_variables)  # (as Keras' own load does)
    if not _checked(model, record, path):
        return False
    _assign(model, arrays)
    extended.server_tables.restore(record["reference"], b"", f"held backup {path}")
    model._initial_epoch = record["epoch"]  # noqa: SLF001 - as Keras' `_load_model`
    backup._parallax_held = record  # noqa: SLF001 - read by `batch_resume.position`
    log.info("resuming from the held backup of epoch %d, batch %d (%s)", record["epoch"] + 1,
             record["batch"] + 1, path)
    return True


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


def _newer(record: dict, metadata_path: str) -> bool:
    """Whether the held backup was taken after the one on disk (Keras' record)."""
    try:
        with open(metadata_path) as f:
            disk = json.load(f)
    except (OSError, ValueError):
        return True
    return (record["epoch"], record["batch"]) > (disk.get("epoch", -1), disk.get("batch", -1))


def _servers_hold(extended, reference: dict, path: str) -> bool:
    """Chief: whether every server still holds the held backup's mark of the tables."""
    from parallax.client.connection import client_options_from_env
    from parallax.client.ps_client import PSClient
    tables = sorted({t["table"] for t in reference["tables"].values()})
    try:
        with PSClient(extended.ps_addresses(),
                      client_options_from_env(extended._client_options)) as client:  # noqa: SLF001
            client.wait_ready(extended._connect_timeout)  # noqa: SLF001
            held = client.holds(tables, reference["checkpoint"])
    except ParallaxError as err:
        log.warning("could not ask the servers for the held backup %s (%s): resuming from "
                    "the backup on disk", path, err)
        return False
    if not held:
        log.info("the servers no longer hold the held backup %s (they started anew, or "
                 "the run's tables were dropped): resuming from the backup on disk", path)
    return held


def _write(path: str, record: dict, arrays: dict[str, np.ndarray]) -> None:
    """The held backup, written under a temporary name and renamed into place."""
    temporary = f"{path}.parallax-{os.getpid()}"
    try:
        with open(temporary, "wb") as f:
            np.savez(f, record=np.frombuffer(json.dumps(record).encode(), np.uint8), **arrays)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)
