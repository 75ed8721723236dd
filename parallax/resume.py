"""Exact resume through TensorFlow's and Keras' own checkpoints: the tables' rows, optimizer
slots and step travel with `tf.train.Checkpoint` / `CheckpointManager`, Keras
`BackupAndRestore`, `ModelCheckpoint`, `save_weights` and `model.save`, by reference.

Every Keras optimizer built in a `ParallaxStrategy`'s scope gets one more attribute,
`parallax_server_tables`: the strategy's `ServerTables`, both a TF trackable and a Keras
saveable, so both formats find it next to the optimizer's own state.
- Saving it makes the chief wait until the servers applied every step it pushed, then has
  the servers write a checkpoint of every table (`PSClient.save`: a new directory, sealed by
  a checksummed manifest, the newest `checkpoints_kept` kept) under `resume/<run id>` in
  their data directory. The file gets a small JSON reference to it: path, checkpoint name,
  and per variable (by creation order in the strategy, as the plan numbers them) its name,
  its table's name and its step. Other workers write no server checkpoint
  (a file of theirs says so, and restoring it is refused).
- Restoring it loads that checkpoint into the servers; every worker restores (each may read
  its own file, as Keras' per-worker backups do: all follow the chief's reference). Before
  the first training step (the usual resume: a new process restores, then trains) the
  reference waits: the plan then names the tables as saved, and the chief fills them from
  the checkpoint instead of initial values. After it, every worker lands its pushes, the
  chief restores, and every worker continues from the saved step.
Servers without `--data-dir` cannot write checkpoints: the file then holds the rows only (as
the variables' values) and the slots restart from their initial values, with a warning.
"""
from __future__ import annotations

import dataclasses
import json
import logging

import grpc
import numpy as np
import tensorflow as tf
from keras.src.saving.keras_saveable import KerasSaveable

from parallax.binding import on_chief, on_every_worker
from parallax.errors import ConfigError, ServerError
from parallax.plan import Plan

ATTRIBUTE = "parallax_server_tables"
FORMAT = 1
_KEY = "reference"
_MARK = "_parallax_tables_attached"
log = logging.getLogger("parallax")


class ServerTables(tf.__internal__.tracking.Trackable, KerasSaveable):
    """The servers' part of a job's state, as seen by TF checkpoints and Keras files."""

    def __init__(self, extended) -> None:
        self._strategy_extended = extended
        self.pending: dict | None = None  # restored before the plan: applied when binding
        self._warned = False

    def _obj_type(self) -> str:
        return "Loss"  # Keras walks only known kinds; this one adds nothing to skip

    # ---- TensorFlow checkpoints ----

    def _serialize_to_tensors(self):
        text = self.save() if tf.executing_eagerly() else "{}"  # SavedModel tracing: none
        return {_KEY: tf.constant(text)}

    def _restore_from_tensors(self, restored_tensors):
        self.restore(restored_tensors[_KEY].numpy().decode())

    # ---- Keras files ----

    def save_own_variables(self, store) -> None:
        store[_KEY] = np.frombuffer(self.save().encode(), dtype=np.uint8)

    def load_own_variables(self, store) -> None:
        self.restore(bytes(np.asarray(store[_KEY], dtype=np.uint8)).decode())

    # ---- both ----

    def save(self) -> str:
        """Checkpoint the tables on the servers (chief); the JSON reference to it."""
        return json.dumps(self._reference(), sort_keys=True)

    def _reference(self) -> dict:
        extended = self._strategy_extended
        if not extended.remotes:
            return {}  # nothing on the servers (yet)
        info = extended.workers.info
        if not info.is_chief:
            return {"format": FORMAT, "worker": info.rank}
        tables = tables_by_variable(extended.plan, extended.remotes)
        for remote in tables.values():
            remote.land_pushes()
        path = f"resume/{extended.cluster.run_id}"
        try:
            shards = extended.client.save(path, [r.table.name for r in tables.values()],
                                          keep=extended.config.checkpoints_kept)
        except ServerError as err:
            if err.code != grpc.StatusCode.FAILED_PRECONDITION:
                raise
            self._warn_once(f"the parameter servers cannot write checkpoints ({err}); this "
                            f"checkpoint holds the tables' rows but not their optimizer "
                            f"slots or step, so a resume from it is not exact. Start the "
                            f"servers with a data directory (parallax run --data-dir DIR)")
            return {"format": FORMAT, "unsaved": str(err)}
        steps = {s.table: s.step for s in shards}
        return {"format": FORMAT, "path": path, "checkpoint": shards[0].checkpoint,
                "tables": {str(i): {"variable": r.label, "table": r.table.name,
                                    "step": steps[r.table.name]}
                           for i, r in tables.items()}}

    def restore(self, text: str) -> None:
        """Load the referenced checkpoint into the servers now, or at the first step."""
        reference = _parse(text)
        if not reference:
            return
        extended = self._strategy_extended
        if extended.plan is None:
            self.pending = reference
            return
        reference = self.chiefs(reference)
        if reference is not None:
            restore_now(extended, reference)

    def take_pending(self) -> dict | None:
        """The chief's reference restored before the plan, on every worker (collective)."""
        pending, self.pending = self.pending, None
        return self.chiefs(pending)

    def chiefs(self, reference: dict | None) -> dict | None:
        """The chief's reference on every worker (collective: other workers' files hold no
        tables checkpoint, they follow the chief's); None when it holds none."""
        workers = self._strategy_extended.workers
        reference = workers.broadcast_object(reference if workers.info.is_chief else None)
        if not reference:
            return None
        if "worker" in reference:
            raise ConfigError(
                f"worker 0 restored a checkpoint written by worker {reference['worker']}, "
                f"which does not save the tables on the parameter servers (the chief does); "
                f"restore the chief's checkpoint on worker 0")
        if "unsaved" in reference:
            self._warn_once(f"this checkpoint holds no checkpoint of the tables' optimizer "
                            f"slots and step ({reference['unsaved']}); they restart from "
                            f"their initial values")
            return None
        return reference

    def _warn_once(self, message: str) -> None:
        if not self._warned:
            log.warning("%s", message)
            self._warned = True


def _parse(text: str) -> dict:
    try:
        reference = json.loads(text or "{}")
    except ValueError:
        reference = None
    if not isinstance(reference, dict) or reference.get("format", FORMAT) != FORMAT:
        raise ConfigError(f"the parallax tables reference in this checkpoint ({text[:200]!r}) "
                          f"is not format {FORMAT}; it was written by another parallax "
                          f"version: restore it with that version")
    return reference


def tables_by_variable(plan: Plan, remotes: dict) -> dict:
    """{variable index in the plan: its RemoteTable}."""
    return {vp.index: remotes[vp.index] for vp in plan.on_servers}


def _check_variables(reference: dict, plan: Plan) -> None:
    saved = {int(i): t["variable"] for i, t in reference["tables"].items()}
    ours = {vp.index: vp.name for vp in plan.on_servers}
    if sorted(saved) != sorted(ours):
        raise ConfigError(f"the checkpoint holds tables of variables {sorted(saved.values())} "
                          f"but this model puts {sorted(ours.values())} on the parameter "
                          f"servers; restore it into the model that saved it, built the same "
                          f"way")


def with_saved_tables(plan: Plan, reference: dict) -> Plan:
    """The plan with its tables named as in the checkpoint (run id, resharding generation),
    so the servers can restore them by name."""
    _check_variables(reference, plan)
    saved = reference["tables"]
    return dataclasses.replace(plan, variables=tuple(
        dataclasses.replace(vp, table=saved[str(vp.index)]["table"])
        if vp.placement == "ps" else vp for vp in plan.variables))


def restore_into_servers(client, reference: dict) -> None:
    """Chief: load the referenced checkpoint into its tables (created, same names)."""
    tables = {t["table"]: t["step"] for t in reference["tables"].values()}
    shards = client.restore(reference["path"], sorted(tables), reference["checkpoint"])
    wrong = sorted({(s.table, s.step) for s in shards if s.step != tables[s.table]})
    if wrong:
        raise ConfigError(f"checkpoint {reference['checkpoint']} under {reference['path']!r} "
                          f"restored (table, step) {wrong}, not the steps it was saved at "
                          f"({tables}); it was changed since: restore another checkpoint")


def set_steps(remotes: dict, reference: dict) -> None:
    """Every worker: the next push of each table ({variable index: RemoteTable}) is the
    saved step's."""
    for index, remote in remotes.items():
        remote.steps_pushed = reference["tables"][str(index)]["step"]


def restore_now(extended, reference: dict) -> None:
    """After the plan: every worker lands its pushes, the chief restores, all continue from
    the saved step. Call on every worker (as TF and Keras restore on every worker)."""
    tables = tables_by_variable(extended.plan, extended.remotes)
    _check_variables(reference, extended.plan)
    moved = sorted(r.label for i, r in tables.items()
                   if r.table.name != reference["tables"][str(i)]["table"])
    if moved:
        raise ConfigError(f"tables of {moved} were renamed since this checkpoint was saved "
                          f"(resharded, or another run id), so the servers cannot restore "
                          f"them in place; restore it in a new process, before the first "
                          f"training step")
    workers = extended.workers
    on_every_worker(workers, lambda: [r.land_pushes() for r in tables.values()],
                    "could not land its pushes before a restore")
    on_chief(workers, lambda: restore_into_servers(extended.client, reference),
             "failed to restore the tables on the parameter servers")
    set_steps(tables, reference)


def attach_to_keras_optimizers() -> None:
    """Idempotent: Keras optimizers made in a ParallaxStrategy's scope get `ServerTables`
    as the attribute `parallax_server_tables` (see the module docstring)."""
    from keras.src.backend.tensorflow.optimizer import TFOptimizer
    from keras.src.optimizers.optimizer import Optimizer

    original = TFOptimizer.__init__
    if getattr(original, _MARK, False):
        return

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        tables = getattr(self._distribution_strategy.extended, "server_tables", None)
        # Keras lists a bare Optimizer's attributes as those never to save: not this one.
        if isinstance(tables, ServerTables) and type(self) is not Optimizer:
            setattr(self, ATTRIBUTE, tables)

    setattr(__init__, _MARK, True)
    __init__.__wrapped__ = original
    TFOptimizer.__init__ = __init__
