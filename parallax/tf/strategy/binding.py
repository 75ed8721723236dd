"""Put a plan into effect: check that every worker made the same plan, create the tables on
the servers (the chief streams the initial values once), bind each variable to its table and
release the worker's copy, and broadcast rank 0's replicated variables.

Failures on the chief are broadcast to the other workers before it raises, so no worker is
left waiting in a collective for a peer that gave up.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
import zlib
from typing import Callable, Sequence

import numpy as np
import tensorflow as tf

from parallax import native
from parallax.client import ClientOptions, PSClient
from parallax.client.cluster import ClusterSpec
from parallax.client.connection import client_options_from_env
from parallax.env import TABLES_KEPT_ENV
from parallax.errors import ConfigError
from parallax.placement.capacity import check_fits
from parallax.placement.plan import Plan, VariablePlan
from parallax.protocol.specs import (Initializer, TableSpec, counts_steps, keep_on_workers,
                                     optimizer_from_keras)
from parallax.runtime.malloc_tuning import return_freed_memory
from parallax.tf.collectives.workers import Workers, on_chief, on_every_worker
from parallax.tf.keras_support import constraint_of, refuse_horovod_optimizer, slots_of
from parallax.tf.graph.remote import RemoteTable, TablePushes
from parallax.tf.graph.variables import ParallaxVariable, is_released, remote_of

log = logging.getLogger("parallax")


def check_agreement(plan: Plan, workers: Workers) -> None:
    """Every worker must plan the same variables with the same shapes: the alternative is a
    collective that hangs or tables that silently mix two models."""
    signatures = workers.allgather_object(plan.signature())
    chief = signatures[0]
    for rank, other in enumerate(signatures[1:], start=1):
        if other == chief:
            continue
        if len(other) != len(chief):
            raise ConfigError(f"workers disagree on the model: worker 0 has {len(chief)} "
                              f"trainable variables, worker {rank} has {len(other)}; every "
                              f"worker must build the same model")
        for mine, theirs in zip(chief, other):
            if mine != theirs:
                raise ConfigError(
                    f"workers disagree on the model: variable #{mine[0]} is {mine[1]!r} "
                    f"shape {mine[2]} {mine[3]} ({mine[4]}) on worker 0 but {theirs[1]!r} "
                    f"shape {theirs[2]} {theirs[3]} ({theirs[4]}) on worker {rank}; every "
                    f"worker must build the same model")


_SERVER_INITIALIZERS = {  # Keras initializer -> the servers' (config keys kept)
    "RandomUniform": ("uniform", ("minval", "maxval")),
    "RandomNormal": ("normal", ("mean", "stddev")),
    "TruncatedNormal": ("truncated_normal", ("mean", "stddev")),
    "Zeros": ("zeros", ()),
    "Constant": ("constant", ("value",)),
}


def server_initializer(var: ParallaxVariable, key: str, stream_limit: int) -> Initializer | None:
    """For a table too big to stream cheaply (over `stream_limit` bytes) whose Keras
    initializer the servers implement: that initializer, drawn on the servers row by row when
    first touched, so no worker computes or sends the table (the values follow the same
    distribution, not the same draws; an unseeded initializer gets a seed from `key`, the
    same on every worker and in every run of the model). None: stream the initial values."""
    initializer = var.keras_initializer
    if initializer is None or var.shape.num_elements() * var.dtype.size <= stream_limit:
        return None
    return drawn_initializer(initializer, key)


def drawn_initializer(initializer, key: str) -> Initializer | None:
    """The servers' form of a Keras initializer (seeded from `key` when unseeded), or None
    when they do not implement it."""
    name = "Constant" if type(initializer).__name__ == "Ones" else type(initializer).__name__
    if name not in _SERVER_INITIALIZERS:
        return None
    kind, keys = _SERVER_INITIALIZERS[name]
    config = initializer.get_config()
    values = {key: float(config.get(key, 1.0)) for key in keys}
    seed = config.get("seed")
    seed = seed if isinstance(seed, int) and seed >= 0 else zlib.crc32(key.encode())
    return Initializer(kind, seed=seed, **values)


INIT_CHUNK_BYTES = 8 << 20  # initial values are streamed to the servers in chunks of this


def group_keys(variables: dict[int, ParallaxVariable], optimizer,
               stream_limit: int = INIT_CHUNK_BYTES) -> dict[int, tuple]:
    """{variable index: key} for `make_plan`'s table groups: variables whose initial values
    are made the same way (streamed, or drawn by the servers with the same initializer) may
    share a table. None when the optimizer's update counts steps
    (`parallax.protocol.specs.counts_steps`: Adam's bias correction, say): a step pushed to a
    table group in several parts (an update traced in a tf.cond branch, a variable updated
    twice in one step, an eager step) advances the group's step once per part."""
    if counts_steps(optimizer):
        return {}  # (also None: no optimizer, which `bind` refuses)
    keys = {}
    for index, var in variables.items():
        if var.dynamic_rows is not None:
            continue  # keyed rows: a table of its own
        drawn = server_initializer(var, "", stream_limit)
        keys[index] = ("stream",) if drawn is None else \
            dataclasses.astuple(dataclasses.replace(drawn, seed=0))
    return keys


def _table_spec(vp: VariablePlan, optimizer_spec, *, sync: bool, pushers: int,
                initializer: Initializer | None) -> TableSpec:
    """The spec of `vp`'s server table (a table group's: every member's rows)."""
    dim = int(np.prod(vp.shape[1:])) if len(vp.shape) > 1 else 1
    rows = vp.table_rows or (vp.shape[0] if vp.shape else 1)
    keyed = vp.dynamic.spec_fields() if vp.dynamic is not None else \
        dict(vocabulary_size=rows)
    return TableSpec(name=vp.table, dim=dim, dtype=vp.dtype,
                     initializer=initializer or Initializer("zeros"), optimizer=optimizer_spec,
                     shard_count=vp.shards, num_workers=pushers,
                     sync_mode="sync" if sync else "async", aggregation="sum",
                     wire_dtype=vp.wire_dtype, **keyed)


def dynamic_initializer(var: ParallaxVariable, key: str) -> Initializer:
    """A dynamic table's initializer, which the servers draw each new row from (no worker
    can stream rows for keys nobody has seen yet)."""
    initializer = var.keras_initializer or var.dynamic_initializer
    drawn = drawn_initializer(initializer, key) if initializer is not None else None
    if drawn is None:
        raise ConfigError(
            f"{var.name!r} is a DynamicEmbedding table, whose new rows the servers draw, but "
            f"its initializer {type(initializer).__name__ if initializer else 'value'} is not "
            f"one they implement; use one of {', '.join(sorted(_SERVER_INITIALIZERS))} (or "
            f"'ones')")
    return drawn


def check_unconstrained(on_servers: Sequence[VariablePlan],
                        variables: dict[int, ParallaxVariable], optimizer) -> None:
    """Refuse a variable bound for the servers that has a Keras constraint: Keras applies it
    after each update by assigning the whole variable inside the step, which a variable on
    the servers cannot take."""
    found = {vp.name: constraint_of(variables[vp.index], optimizer) for vp in on_servers}
    constrained = {name: type(c).__name__ for name, c in found.items() if c is not None}
    if constrained:
        raise ConfigError(
            f"variables {constrained} (name: constraint) have a Keras constraint "
            f"(embeddings_constraint=, kernel_constraint=, ...), which Keras applies after "
            f"each update by assigning the whole variable on the worker: parallax cannot do "
            f"that for variables on the parameter servers. Remove the constraint, or keep "
            f"them on the workers, all-reduced: {keep_on_workers(list(constrained))}")


class TableBinder:
    """Creates and binds the tables of one plan; owns the PS client."""

    def __init__(self, plan: Plan, cluster: ClusterSpec, workers: Workers,
                 options: ClientOptions | None, connect_timeout: float,
                 local_aggregation: bool, init_chunk_bytes: int = INIT_CHUNK_BYTES) -> None:
        self.plan = plan
        self.cluster = cluster
        self.workers = workers
        if not cluster.embedded:  # a launched job's credentials (parallax run --secure)
            options = client_options_from_env(options)
        self.client = PSClient(cluster.ps_addresses, options)
        self.connect_timeout = connect_timeout
        self.init_chunk_bytes = init_chunk_bytes
        info = workers.info
        self.pushers = info.size // info.local_size if local_aggregation else info.size
        self.sends_pushes = info.local_rank == 0 if local_aggregation else True
        self.pusher_index = info.rank // info.local_size if local_aggregation else info.rank
        self.remotes: dict[int, RemoteTable] = {}

    def _slot_source(self, remote: RemoteTable, slot: tf.Variable, spec: TableSpec):
        """Where the chief's eager reads of a released slot come from: (remote, the
        servers' slot name); None on other workers (the chief's file is the one restored)
        and for keyed tables (their slots are keyed; the servers' checkpoint holds them)."""
        name = _server_slot_name(slot, spec)
        if name is None or remote.keyed or not self.workers.info.is_chief:
            return None
        return remote, name

    def bind(self, variables: dict[int, ParallaxVariable], optimizer,
             restore: Callable[[PSClient], bool] | None = None) -> dict[int, RemoteTable]:
        """Create and bind the plan's tables. `restore` (a resumed job): the chief calls it
        on the created tables instead of filling them with initial values; when it returns
        False (no checkpoint to load), they are filled from the variables as usual."""
        on_servers = self.plan.on_servers
        if optimizer is None:
            raise ConfigError(
                f"{len(on_servers)} variable(s) go to the parameter servers, which apply the "
                f"optimizer themselves, but no Keras optimizer updated them in the traced "
                f"step; update variables with a keras.optimizers optimizer "
                f"(apply_gradients / fit), or use mode='allreduce'")
        refuse_horovod_optimizer(optimizer)
        optimizer_spec = optimizer_from_keras(optimizer, [vp.name for vp in on_servers])
        check_unconstrained(on_servers, variables, optimizer)
        on_server_init = {vp.index: (dynamic_initializer if vp.dynamic else
                                     functools.partial(server_initializer,
                                                       stream_limit=self.init_chunk_bytes))(
                              variables[vp.index], f"{vp.index}:{vp.name}")
                          for vp in on_servers}
        # one spec per server table: a table group's, from its first member
        heads = {vp.table: vp for vp in on_servers if vp.offset == 0}
        grouped = {vp.table for vp in on_servers if vp.offset}
        specs = [_table_spec(heads[vp.table], optimizer_spec, sync=self.plan.sync,
                             pushers=self.pushers,
                             initializer=on_server_init[heads[vp.table].index])
                 for vp in on_servers]
        on_every_worker(self.workers, lambda: self.client.wait_ready(self.connect_timeout),
                        "could not reach the parameter servers")

        def create_and_fill() -> None:
            stats = self.client.stats()  # (a server lost already: not reported, 0)
            memory = [stats[a].memory_bytes if a in stats else 0 for a in self.client.addresses]
            check_fits(self.plan, {vp.index: spec for vp, spec in zip(on_servers, specs)},
                       memory, self.client.options.replicas)
            drop_kept_tables(self.client, self.cluster.run_id, restore)
            tables: dict = {}
            for vp, spec in zip(on_servers, specs):
                if spec.name not in tables:  # a table group's spec comes once per member
                    tables[spec.name] = self.client.create_table(spec, vp.servers or None)
            if restore is not None and restore(self.client):
                return  # the checkpoint replaced whatever the tables held
            for table in tables.values():
                unused(table)
            for vp, spec in zip(on_servers, specs):
                fill(vp, spec, tables[spec.name])
            if restore is not None and hasattr(restore, "import_rows"):
                restore.import_rows(tables)  # the rows, slots and steps a file carries

        def unused(table) -> None:
            applied = table.wait_step(0)
            if applied:
                raise ConfigError(
                    f"table {table.name!r} already exists on the servers and has applied "
                    f"{applied} steps: another job, or an earlier run, used run id "
                    f"{self.cluster.run_id!r}; pass a new run_id (or none: one is made up)"
                    f" or restart the servers. Nothing was changed")

        def fill(vp: VariablePlan, spec: TableSpec, table) -> None:
            if on_server_init[vp.index] is not None:
                return  # drawn by the servers
            for first, rows in variables[vp.index].initial_chunks(self.init_chunk_bytes):
                ids = np.arange(vp.offset + first, vp.offset + first + len(rows),
                                dtype=np.int64)
                table.assign(ids, rows.reshape(len(rows), spec.dim))

        on_chief(self.workers, create_and_fill,
                  "failed to set up the parameter-server tables")
        return_freed_memory()
        tables, pushes = {}, {}
        for vp, spec in zip(on_servers, specs):
            if spec.name not in tables:  # idempotent; a differing spec is refused
                tables[spec.name] = self.client.create_table(spec, vp.servers or None)
                pushes[spec.name] = TablePushes()
            var = variables[vp.index]
            shared = pushes[spec.name] if spec.name in grouped else None
            remote = RemoteTable(vp.name, var.shape, var.dtype, tables[spec.name],
                                 sync=self.plan.sync, worker=self.pusher_index,
                                 sends_pushes=self.sends_pushes, offset=vp.offset,
                                 pushes=shared, keyed=vp.dynamic is not None)
            var.bind_remote(remote)
            for slot in slots_of(optimizer, var):
                if isinstance(slot, ParallaxVariable):
                    slot.release_as_constant(self._slot_source(remote, slot, spec))
            self.remotes[vp.index] = remote
        return self.remotes


def _server_slot_name(slot: tf.Variable, spec: TableSpec) -> str | None:
    """The servers' name of Keras' slot variable `slot` (Keras names it after the
    variable's path and the slot: `..._embeddings_velocity`; the servers use Keras' names)."""
    base = slot.name.split(":")[0]
    return next((n for n in spec.optimizer.slot_names() if base.endswith(f"_{n}")), None)


def drop_kept_tables(client: PSClient, run_id: str, restore) -> None:
    """Chief, where the launcher kept the run's tables for a resume from a held backup
    (TABLES_KEPT_ENV, `parallax.tf.state.held_backups`: a restarted attempt's, or every
    attempt of a Kubernetes gang, a recreated one's first too): any other start (a backup on
    disk, none at all) drops them first, as the launcher does without held backups, so the
    tables start as on fresh servers."""
    if os.environ.get(TABLES_KEPT_ENV) != "1":
        return
    reference = getattr(restore, "reference", None) or {}
    if not reference.get("held"):
        dropped = client.delete_tables(f"{run_id}.")
        if dropped:
            log.info("dropped %d table(s) the attempt before left on the servers: this "
                     "attempt does not resume from a held backup", len(dropped))


def broadcast_replicated(variables: Sequence[tf.Variable], workers: Workers) -> None:
    """Rank 0's values for every variable the workers keep (dense weights, their slots)."""
    local = [v for v in variables if remote_of(v) is None
             and not is_released(v)  # released slots stay empty
             and v.synchronization != tf.VariableSynchronization.ON_READ]  # per worker
    workers.broadcast_variables(local)


def log_plan(plan: Plan, workers: Workers) -> None:
    """The plan, and which data path moves its tables' rows (parallax.native)."""
    if workers.info.is_chief:
        log.info("%s\nworker data path: %s", plan.format(), native.describe())


def log_lookups(plan: Plan, workers: Workers) -> None:
    if workers.info.is_chief:
        log.info("%s", plan.format_lookups().lstrip("\n"))
