"""Exact resume through TensorFlow's and Keras' own checkpoints: the tables' rows, optimizer
slots and step travel with `tf.train.Checkpoint` / `CheckpointManager`, Keras
`BackupAndRestore`, `ModelCheckpoint`, `save_weights` and `model.save`, by reference.

Every Keras optimizer built in a `ParallaxStrategy`'s scope gets one more attribute,
`parallax_server_tables` (`parallax.tf.keras_patches.attach_to_keras_optimizers`): the
strategy's `ServerTables`, both a TF trackable and a Keras saveable, so both formats find it
next to the optimizer's own state.
- Saving it makes the chief wait until the servers applied every step it pushed, then has
  the servers write a checkpoint of every table (`PSClient.save`: a new directory, sealed by
  a checksummed manifest, the newest `checkpoints_kept` kept) under `resume/<run id>` in
  their data directory. The file gets a small JSON reference to it: path, checkpoint name,
  and per variable (by creation order in the strategy, as the plan numbers them) its name,
  its table's name and its step. Other workers write no server checkpoint
  (a file of theirs says so, and restoring it is refused). Every worker's save also
  empties its row cache (`ParallaxStrategy(cache=...)`): a job resumed from the save starts
  with none, and rows served stale from an older cache would make it train otherwise.
- Restoring it loads that checkpoint into the servers; every worker restores (each may read
  its own file, as Keras' per-worker backups do: all follow the chief's reference). Before
  the first training step (the usual resume: a new process restores, then trains) the
  reference waits: the plan then names the tables as saved, and the chief fills them from
  the checkpoint instead of initial values. After it, every worker lands its pushes, the
  chief restores, and every worker continues from the saved step.
The file also holds the tables' rows (as the variables' values). When the servers do not have
the referenced checkpoint (the file was moved to another job or data directory, the servers
have no `--data-dir`, or it is older than the newest `checkpoints_kept` saves), restoring
falls back to those rows, with a warning naming the file and the checkpoint: the optimizer
slots and step of the tables are then not restored. Servers without `--data-dir` (the
embedded default of `ParallaxStrategy()` outside `parallax run`) cannot write checkpoints:
saving then reads every table's touched rows, slots and step into the file itself
(`inline_tables`, after the reference), and restoring writes them back into the tables once
they hold the file's rows, so that resume is exact too, with no data directory; any other
failed save of the tables (a read-only or full disk, ...) fails the save.
"""
from __future__ import annotations

import contextvars
import dataclasses
import json
import logging
from typing import Collection

import grpc
import numpy as np
import tensorflow as tf
from keras.src.saving.keras_saveable import KerasSaveable

from parallax.client import replay
from parallax.errors import ConfigError, ServerError
from parallax.placement.plan import Plan
from parallax.protocol.checkpoint_names import NO_DATA_DIR
from parallax.tf.state import inline_tables
from parallax.tf.collectives.workers import on_chief, on_every_worker

ATTRIBUTE = "parallax_server_tables"
FORMAT = 1
_KEY = "reference"
INLINE = "inline"  # in the reference: the tables' rows, slots and steps are in the file,
#                    after it and a NUL byte (the servers could not save them themselves)
ROWS_KEY = "_rows"  # (in the chief's reference, once restored: those bytes)
log = logging.getLogger("parallax")
# The file being loaded ("Keras file PATH"), while Keras or TF loads one: warnings name it.
LOADING: contextvars.ContextVar[str] = contextvars.ContextVar("parallax_loading", default="")
# Set while a save is a held backup's (`held_backups`): the servers keep the tables' part in
# memory (`PSClient.save(held=True)`), the newest HELD_KEPT of them.
HELD: contextvars.ContextVar[bool] = contextvars.ContextVar("parallax_held", default=False)
HELD_KEPT = 2  # the newest, and the one before it while a save is under way


def resume_path(run_id: str) -> str:
    """Where the servers keep a run's checkpoints for resuming (held ones too)."""
    return f"resume/{run_id}"


class ServerTables(tf.__internal__.tracking.Trackable, KerasSaveable):
    """The servers' part of a job's state, as seen by TF checkpoints and Keras files."""

    def __init__(self, extended) -> None:
        self._strategy_extended = extended
        self.pending: dict | None = None  # restored before the plan: applied when binding
        self._warned = False
        self._rows = b""  # the tables' rows of the file restored last, when it carries them
        self.saves = 0  # checkpoints this worker saved (the tables' part of each) on disk
        self.held_saves = 0  # and held in the servers' memory (`HELD`)
        self._held: list[tuple[list[str], str]] = []  # (tables, name) the chief had held

    def _obj_type(self) -> str:
        return "Loss"  # Keras walks only known kinds; this one adds nothing to skip

    # ---- TensorFlow checkpoints ----

    def _serialize_to_tensors(self):
        saved = self.saved() if tf.executing_eagerly() else ("{}", b"")  # SavedModel
        return {_KEY: tf.constant(_pack(*saved))}                       # tracing: none

    def _restore_from_tensors(self, restored_tensors):
        if not tf.executing_eagerly():  # tf.saved_model.save tracing the restore function:
            return tf.no_op()           # a SavedModel holds no server tables to restore
        self.restore(*_unpack(restored_tensors[_KEY].numpy()),
                     LOADING.get() or "this TensorFlow checkpoint")
        return None

    # ---- Keras files ----

    def save_own_variables(self, store) -> None:
        store[_KEY] = np.frombuffer(_pack(*self.saved()), dtype=np.uint8)

    def load_own_variables(self, store) -> None:
        self.restore(*_unpack(bytes(np.asarray(store[_KEY], dtype=np.uint8))),
                     LOADING.get() or "this Keras file")

    # ---- both ----

    def save(self) -> str:
        """Checkpoint the tables on the servers (chief); the JSON reference to it."""
        return self.saved()[0]

    def saved(self) -> tuple[str, bytes]:
        """Checkpoint the tables (chief): (the JSON reference, the tables' rows, slots and
        steps when the servers cannot checkpoint them: `inline_tables`; else empty)."""
        reference, rows = self._reference()
        if HELD.get():
            self.held_saves += 1
        else:
            self.saves += 1
        if self._strategy_extended.remotes:
            self._strategy_extended.table_client.invalidate()  # as a resume from it starts
        return json.dumps(reference, sort_keys=True), rows

    def _reference(self) -> tuple[dict, bytes]:
        extended = self._strategy_extended
        if not extended.remotes:
            return {}, b""  # nothing on the servers (yet)
        info = extended.workers.info
        if not info.is_chief:
            return {"format": FORMAT, "worker": info.rank}, b""
        tables = tables_by_variable(extended.plan, extended.remotes)
        for remote in tables.values():
            remote.land_pushes()
        path = resume_path(extended.cluster.run_id)
        held = HELD.get()
        try:
            names = list(dict.fromkeys(r.table.name for r in tables.values()))  # groups once
            shards = extended.client.save(
                path, names, keep=HELD_KEPT if held else extended.config.checkpoints_kept,
                held=held)
        except ServerError as err:
            if held:
                raise  # (`held_backups` saves this backup on disk instead)
            if not without_data_dir(err):
                raise  # a failing disk, ...: the user's save must fail, not lose the slots
            return self._inline(tables)  # no data directory: the rows travel in the file
        reference = reference_to(path, shards, {i: (r.label, r.table.name, r.offset)
                                                for i, r in tables.items()},
                                 {r.table.name: r.table.spec for r in tables.values()},
                                 extended.plan)
        if not held:
            return reference, b""
        self._held = [*self._held[-HELD_KEPT + 1:], (names, reference["checkpoint"])]
        return {**reference, "held": True}, b""

    def _inline(self, tables: dict) -> tuple[dict, bytes]:
        """The reference and the tables' rows, slots and steps, for servers that cannot
        write checkpoints (`inline_tables`)."""
        rows, steps = inline_tables.export_state({r.table.name: r.table
                                                  for r in tables.values()})
        saved = [_Saved(name, step) for name, step in steps.items()]
        reference = reference_to("", saved, {i: (r.label, r.table.name, r.offset)
                                             for i, r in tables.items()},
                                 {r.table.name: r.table.spec for r in tables.values()})
        return {**reference, INLINE: True}, rows

    def newest_held(self) -> str | None:
        """Chief: the name of the newest held checkpoint it made and has not dropped."""
        return self._held[-1][1] if self._held else None

    def release_held(self, only: Collection[str] | None = None) -> None:
        """Chief: have the servers drop the held checkpoints it made (a newer backup is on
        disk, or the backups are deleted), so that they stop copying rows for them; `only`:
        those of these names (a custom loop's manager drops its own)."""
        held = [h for h in self._held if only is None or h[1] in only]
        self._held = [h for h in self._held if h not in held]
        for names, name in held:
            try:
                self._strategy_extended.client.drop_held(names, name)
            except ServerError as err:  # (a server gone: its copies went with it)
                log.warning("could not drop held checkpoint %s from the servers: %s", name, err)

    def restore(self, text: str, rows: bytes = b"", source: str = "this checkpoint") -> None:
        """Load the referenced checkpoint (or the tables' `rows` the file carries) into the
        servers now, or at the first step; `source` names the file in a warning if the
        servers do not have it."""
        reference = _parse(text)
        if not reference:
            return
        if reference.get(INLINE):
            if not rows:
                raise ConfigError(f"{source} refers to the tables' rows it carries, but "
                                  f"holds none (it was cut short or rewritten); restore "
                                  f"another checkpoint")
            self._rows = rows  # the chief's are restored; they never travel to workers
        reference = {**reference, "source": source}  # (the chief's travels to every worker)
        extended = self._strategy_extended
        if extended.plan is None:
            self.pending = reference
            return
        reference = self._with_rows(self.chiefs(reference))
        if reference is not None:
            restore_now(extended, reference)

    def take_pending(self) -> dict | None:
        """The chief's reference restored before the plan, on every worker (collective)."""
        pending, self.pending = self.pending, None
        return self._with_rows(self.chiefs(pending))

    def _with_rows(self, reference: dict | None) -> dict | None:
        """The chief's reference with the rows its file carries (`ROWS_KEY`, never sent)."""
        if reference and reference.get(INLINE) and \
                self._strategy_extended.workers.info.is_chief:
            reference = {**reference, ROWS_KEY: self._rows}
        return reference

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


def _pack(text: str, rows: bytes) -> bytes:
    """The reference's JSON, then (when the file carries the tables' rows) a NUL byte, which
    JSON never holds, and the rows: one value, the one a file without rows holds too."""
    return text.encode() + (b"\0" + rows if rows else b"")


def _unpack(value: bytes) -> tuple[str, bytes]:
    text, _, rows = bytes(value).partition(b"\0")
    return text.decode(), rows


def without_data_dir(err: ServerError) -> bool:
    """Whether `err` is the servers' refusal to save or restore for having no --data-dir
    (FAILED_PRECONDITION whose message starts with `NO_DATA_DIR`), not any other failure."""
    return (err.code == grpc.StatusCode.FAILED_PRECONDITION
            and f"{err.code.name}: {NO_DATA_DIR}" in str(err))


@dataclasses.dataclass(frozen=True)
class _Saved:
    """A table's step, as `reference_to` reads a saved shard (no server checkpoint)."""

    table: str
    step: int
    checkpoint: str = ""


def reference_to(path: str, shards, tables: dict, specs: dict | None = None,
                 plan: Plan | None = None) -> dict:
    """The reference to the checkpoint under `path` that `shards` (ShardCheckpoint) were
    saved in; `tables`: {variable index: (variable name, table name, first row in the
    table: not 0 in a table group)}. A table's step is its
    shards' highest, the one restoring gives every shard (async shards count their own
    pushes, so one may be ahead of another; sync shards are at one step). `specs` (by table
    name): a bounded keyed table's shard count and bound are kept, so a restore into
    another shard count bounds each shard to fit (`with_saved_tables`). `plan`: the job's,
    whose fixed tables' servers (and the number of servers) are kept, so that a job on as
    many servers restores each shard where it was saved (`saved_layouts`)."""
    steps: dict[str, int] = {}
    for shard in shards:
        steps[shard.table] = max(steps.get(shard.table, 0), shard.step)
    bounds = {name: {"shards": spec.shard_count, "bound": spec.max_rows_per_shard}
              for name, spec in (specs or {}).items() if spec.max_rows_per_shard}
    placed = {vp.index: {"servers": list(vp.servers)} for vp in
              (plan.on_servers if plan is not None else ()) if vp.dynamic is None}
    return {"format": FORMAT, "path": path, "checkpoint": shards[0].checkpoint,
            **({"servers": plan.num_servers} if plan is not None else {}),
            "tables": {str(i): {"variable": variable, "table": table, "step": steps[table],
                                "offset": offset, **bounds.get(table, {}),
                                **placed.get(i, {})}
                       for i, (variable, table, offset) in tables.items()}}


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


def same_grouping(plan: Plan, reference: dict) -> bool:
    """Whether the checkpoint's tables hold the plan's variables as the plan's tables will:
    the same variables sharing a table (a table group), at the same offsets."""
    def layout(entries) -> set:
        tables: dict[str, set] = {}
        for index, table, offset in entries:
            tables.setdefault(table, set()).add((index, offset))
        return {frozenset(members) for members in tables.values()}
    saved = layout((int(i), t["table"], t.get("offset", 0))
                   for i, t in reference["tables"].items())
    return saved == layout((vp.index, vp.table, vp.offset) for vp in plan.on_servers)


def saved_group_keys(reference: dict) -> dict[int, str]:
    """`make_plan` group keys that group the variables as the checkpoint's tables do: a
    variable's key is its saved table (one alone in its table groups with no other)."""
    return {int(i): t["table"] for i, t in reference["tables"].items()}


def saved_layouts(reference: dict | None, num_servers: int, options
                  ) -> dict[str, tuple[int, ...]]:
    """{variable name: the servers of its shards} of the checkpoint's fixed tables, for a
    job on as many servers as saved it: it resumes in the layout that saved it (servers
    with a data directory each restore only the shards they saved), not in today's default
    or its search's. A variable is left out where the checkpoint does not record its servers
    (inline tables, keyed tables, checkpoints written before it did) or the user gave its
    shards (`options.shards`)."""
    if reference is None or reference.get(INLINE) or \
            reference.get("servers") != num_servers or isinstance(options.shards, int):
        return {}
    named = set(options.shards or ())
    return {t["variable"]: tuple(t["servers"]) for t in reference["tables"].values()
            if "servers" in t and t["variable"] not in named}


def saved_group_members(reference: dict) -> set[int]:
    """Indices of the variables the checkpoint keeps in a table group (sharing a table)."""
    tables: dict[str, list[int]] = {}
    for i, t in reference["tables"].items():
        tables.setdefault(t["table"], []).append(int(i))
    return {i for members in tables.values() if len(members) > 1 for i in members}


def with_saved_tables(plan: Plan, reference: dict) -> Plan:
    """The plan with its tables named as in the checkpoint (run id, resharding generation),
    so the servers can restore them by name."""
    _check_variables(reference, plan)
    if not same_grouping(plan, reference):
        raise ConfigError(
            "the checkpoint's tables group the variables on the servers differently from "
            "this job's plan (ParallaxStrategy(group_tables=...), the optimizer, or the "
            "variables' initializers changed), so the servers cannot restore them by name; "
            "restore it with the settings and model that saved it")
    saved = reference["tables"]
    return dataclasses.replace(plan, variables=tuple(
        dataclasses.replace(vp, table=saved[str(vp.index)]["table"],
                            dynamic=_saved_bound(vp, saved[str(vp.index)]))
        if vp.placement == "ps" else vp for vp in plan.variables))


def _saved_bound(vp, saved: dict):
    """A bounded dynamic table restored into another shard count: each shard bounded to
    fit its share of what the saved shards could hold (`DynamicRows.resharded`)."""
    if vp.dynamic is None or saved.get("shards", vp.shards) == vp.shards:
        return vp.dynamic
    as_saved = dataclasses.replace(vp.dynamic, max_rows_per_shard=saved["bound"])
    return as_saved.planned(saved["shards"]).resharded(vp.shards)


def restore_into_servers(client, reference: dict, before_plan: bool = True) -> bool:
    """Chief: load the referenced checkpoint into its tables (created, same names). False,
    with a warning, when the servers do not have it: the tables keep the file's rows."""
    tables = {t["table"]: t["step"] for t in reference["tables"].values()}
    if reference.get(INLINE):
        return False  # the file's rows: written after the tables are filled (`import_rows`)
    held = bool(reference.get("held"))
    try:
        shards = client.restore(reference["path"], sorted(tables), reference["checkpoint"],
                                held=held, discard_pending=before_plan)
    except ServerError as err:
        if held and err.code == grpc.StatusCode.NOT_FOUND:
            raise ConfigError(f"{reference.get('source', 'this checkpoint')} refers to held "
                              f"checkpoint {reference['checkpoint']} of the tables, which the "
                              f"servers no longer hold (they started anew, or its tables "
                              f"were dropped), and it carries no rows: restore a backup on "
                              f"disk") from err
        if err.code != grpc.StatusCode.NOT_FOUND and not without_data_dir(err):
            raise
        _warn_rows_only(reference, err, before_plan)
        return False
    wrong = sorted({(s.table, s.step) for s in shards if s.step != tables[s.table]})
    if wrong:
        raise ConfigError(f"checkpoint {reference['checkpoint']} under {reference['path']!r} "
                          f"restored (table, step) {wrong}, not the steps it was saved at "
                          f"({tables}); it was changed since: restore another checkpoint")
    return True


def _warn_rows_only(reference: dict, err: ServerError, before_plan: bool) -> None:
    slots = ("restart from their initial values" if before_plan else
             "keep this job's current values")
    log.warning("%s refers to checkpoint %s of the parameter-server tables under %r, which "
                "the servers cannot load (%s). The tables' rows come from the file instead; "
                "their optimizer slots and step %s (a DynamicEmbedding's rows, only in the "
                "servers' checkpoint, restart empty), so this resume is not exact. To resume "
                "exactly, restore with servers on the --data-dir that saved it, and keep "
                "ParallaxStrategy(checkpoints_kept=N) at least the number of files you keep",
                reference.get("source", "this checkpoint"), reference["checkpoint"],
                reference["path"], err, slots)


class Resumption:
    """Loading a reference into the servers: the chief restores the checkpoint (or leaves
    the file's rows, see `restore_into_servers`); every worker then continues from the saved
    step if it was restored. Pass it to `TableBinder.bind` as `restore` before the plan."""

    def __init__(self, reference: dict, before_plan: bool = True) -> None:
        self.reference = reference
        self.before_plan = before_plan
        self.restored = False

    def __call__(self, client) -> bool:
        """Chief: load the checkpoint; whether the servers had it."""
        self.restored = restore_into_servers(client, self.reference, self.before_plan)
        return self.restored

    def import_rows(self, tables: dict) -> None:
        """Chief, once the tables ({name: ShardedTable}) hold the file's rows: write the rows,
        slots and steps the file carries (`inline_tables`), when it carries them."""
        if not self.reference.get(INLINE):
            return
        steps = inline_tables.import_state(self.reference[ROWS_KEY], tables)
        wrong = sorted((t["table"], t["step"]) for t in self.reference["tables"].values()
                       if steps.get(t["table"]) != t["step"])
        if wrong:
            raise ConfigError(f"the tables' rows in this checkpoint are at steps {steps}, "
                              f"not the saved {wrong}; it was changed since: restore "
                              f"another checkpoint")
        self.restored = True

    def continue_steps(self, remotes: dict, workers) -> None:
        """Every worker (collective): continue from the saved step if the chief restored."""
        if workers.broadcast_object(self.restored if workers.info.is_chief else None):
            set_steps(remotes, self.reference)
            replay.resumed([r.table for r in remotes.values()], self.reference["checkpoint"])


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
    if not same_grouping(extended.plan, reference):
        raise ConfigError(
            "the checkpoint's tables group the variables on the servers differently from "
            "this job's (table groups: ParallaxStrategy(group_tables=...)), so the servers "
            "cannot restore them in place; restore it in a new process, before the first "
            "training step, where the plan takes the checkpoint's groups")
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
    resumption = Resumption(reference, before_plan=False)
    extended.table_client.invalidate()  # the rows (and steps) go back to the checkpoint's

    def load() -> None:
        if not resumption(extended.client):
            resumption.import_rows({r.table.name: r.table for r in tables.values()})
    on_chief(workers, load, "failed to restore the tables on the parameter servers")
    resumption.continue_steps(tables, workers)
