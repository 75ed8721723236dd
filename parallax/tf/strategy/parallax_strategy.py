"""`ParallaxStrategy`: a `tf.distribute.Strategy` for hybrid parameter-server / all-reduce
data parallelism. One replica per worker process; workers are Horovod ranks.

The hooks TF and Keras call, and what parallax does in each:
- `_create_variable`: every variable made in `scope()` is a `ParallaxVariable`, so the plan
  can later move its rows to the servers.
- `_call_for_each_replica` (`strategy.run`): before the first training step, trace the step
  once for analysis (updates are observed, not applied), classify variables, make and apply
  the plan. Afterwards: run the step; tables untouched by a training step get an empty push;
  Keras' logs are averaged and its predictions gathered over the workers (`keras_patches`).
- `_experimental_distribute_dataset`: each worker's part of every global batch, dropping a
  partial last one in training, splitting it among the workers for evaluate and predict.
- `_batch_reduce_to` (the optimizer's gradient all-reduce): table gradients pass through
  (the servers sum them); everything else goes through one grouped all-reduce of the
  collectives backend (Horovod, or TensorFlow's collective ops: `collectives=`).
- `_update` (the optimizer's per-variable update): variables on the servers push their
  gradient there; replicated variables are updated locally, identically on every worker.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import weakref
from typing import Mapping, Sequence

import tensorflow as tf
from tensorflow.python.distribute import distribute_lib, input_util, one_device_strategy
from tensorflow.python.distribute.cluster_resolver import SimpleClusterResolver

from parallax.client import ClientOptions, worker_metrics
from parallax.client.cluster import ClusterSpec, mode_from_env, parse_addresses, resolve_cluster
from parallax.client.row_cache import CacheStats, CachingClient, RowCache
from parallax.client.table_client import DirectClient, table_client
from parallax.client.worker_metrics import WORKER_METRICS
from parallax.env import ADDRESSES_ENV, worker_metrics_port
from parallax.env import connect_timeout as env_connect_timeout
from parallax.errors import ConfigError, ParallaxError
from parallax.placement import tuning
from parallax.placement.plan import (Plan, PlacementOptions, VariableInfo, make_plan,
                                     place_shards)
from parallax.placement.tuning import PartitionSearch
from parallax.runtime.cpu_quota import size_tf_pools
from parallax.runtime.malloc_tuning import reuse_freed_memory
from parallax.tf import keras_patches, keras_support
from parallax.tf.collectives import make_collectives
from parallax.tf.collectives.tensorflow import LOCAL_AGGREGATION_NEEDS_HOROVOD, TensorFlowWorkers
from parallax.tf.collectives.workers import WorkerInfo
from parallax.tf.graph.analysis import NOT_READ, inspect_reads
from parallax.tf.graph.fusion import StepFusion
from parallax.tf.graph.remote import RemoteTable, StepTrace, in_xla_function
from parallax.tf.graph.variables import (ParallaxVariable, analysis_trace, is_liftable,
                                         remote_of, restore_storage)
from parallax.tf.state import held_checkpoints, rescale, resume
from parallax.tf.state.resharding import Layout, ReshardReport, Resharder, check_layouts
from parallax.tf.state.tuner import PartitionTuner
from parallax.tf.strategy import binding
from parallax.tf.strategy.config import StrategyConfig
from parallax.tf.strategy.datasets import cover_for_worker, global_batch_size, shard_for_worker

_OPTIMIZER_UPDATE = "apply_grad_to_update_var"  # Keras 3's per-variable update function

log = logging.getLogger("parallax")


class _Observations:
    """What the analysis trace saw: gradient kinds per variable, and the optimizer."""

    def __init__(self) -> None:
        self.gradients: dict[int, str] = {}
        self.updated: list[tf.Variable] = []
        self.optimizer = None
        self.graph = None  # the step's own graph
        self.nested: set[int] = set()  # id() of variables updated in a branch or loop body

    def record(self, var, fn, args) -> None:
        if tf.compat.v1.get_default_graph() is not self.graph:
            self.nested.add(id(var))  # e.g. LossScaleOptimizer's tf.cond
        grad = args[0] if args else None
        kind = "IndexedSlices" if isinstance(grad, tf.IndexedSlices) else \
            "Tensor" if grad is not None else "none"
        self.gradients[id(var)] = kind
        self.updated.append(var)
        self.optimizer = self.optimizer or keras_support.keras_optimizer_of(fn)


def _spec_of(value):
    if isinstance(value, (tf.Tensor, tf.__internal__.CompositeTensor)):
        return tf.type_spec_from_value(value)
    return value


class WorkerClusterResolver(SimpleClusterResolver):
    """`strategy.cluster_resolver`: task type "worker", task id = rank (worker 0 is the
    chief, as the MWMS tutorials' `_is_chief` expects); the cluster spec lists the host of
    each worker (Horovod ranks run no TF server, so there is no port) and, as "ps", the
    parameter servers' addresses once known."""

    def __init__(self, extended: "ParallaxExtended") -> None:
        info = extended.workers.info
        self._hosts = list(extended.workers.allgather_object(info.host))
        self._extended = weakref.ref(extended)
        super().__init__(tf.train.ClusterSpec({"worker": self._hosts}), task_type="worker",
                         task_id=info.rank)

    def cluster_spec(self) -> tf.train.ClusterSpec:
        extended = self._extended()
        servers = list(extended.ps_addresses()) if extended is not None else []
        return tf.train.ClusterSpec({"worker": self._hosts, **({"ps": servers} if servers
                                                               else {})})


def _warn_unread_tables(infos, chief: bool) -> None:
    """Trainable matrices the planned step never read (a second model built in the same
    scope, most often): they stay local and all-reduced, which for an embedding table is
    the costly placement this strategy exists to avoid. Said once, by the chief."""
    unread = [i.name for i in infos if i.read_reason == NOT_READ and len(i.shape) == 2]
    if unread and chief:
        log.warning("trainable matrices %s were not read by the step the plan was made from "
                    "(the first fit or strategy.run), so they stay on the workers and are "
                    "all-reduced as dense: if they belong to another model built in the same "
                    "strategy.scope(), its embedding tables never reach the servers; build "
                    "each model in its own ParallaxStrategy", unread)


def _moves(layouts, restored) -> bool:
    """Whether a saved search decision's layouts move a table a restored checkpoint placed
    ({variable name: servers} both)."""
    return any(name in layouts and tuple(layouts[name]) != tuple(servers)
               for name, servers in restored.items())


def _wants_servers(config: StrategyConfig) -> bool:
    """Whether the plan may put a variable on the servers (every worker must then reach the
    same ones: embedded servers are per worker)."""
    return config.mode != "allreduce" or "ps" in config.placement.values()


def _why_servers(config: StrategyConfig) -> str:
    if config.mode != "allreduce":
        return ""
    named = sorted(k for k, v in config.placement.items() if v == "ps")
    return f" (placement puts {named} on them)"


def _size_tf_pools() -> None:
    """TensorFlow's thread pools sized to this container's CPU quota (`cpu_quota`)."""
    sized = size_tf_pools(tf)
    if sized is not None:
        applied, said = sized
        (log.info if applied else log.warning)(said)


class _NotingInputContext(distribute_lib.InputContext):
    """`distribute_datasets_from_function`'s context: the global batch a dataset function
    asks its part of (`get_per_replica_batch_size`) is noted for an elastic job's launcher,
    as `experimental_distribute_dataset`'s is (`rescale.publish_global_batch`), so it starts
    only counts that split it: TensorFlow's ValueError for a count that does not failed
    every worker, in every attempt with that count."""

    def __init__(self, workers, **kwargs) -> None:
        super().__init__(**kwargs)
        self._parallax_workers = workers

    def get_per_replica_batch_size(self, global_batch_size):
        rescale.publish_global_batch(self._parallax_workers, lambda: int(global_batch_size))
        return super().get_per_replica_batch_size(global_batch_size)


class ParallaxExtended(one_device_strategy.OneDeviceExtended):
    def __init__(self, container, config: StrategyConfig, client_options: ClientOptions | None,
                 connect_timeout: float, search_partitions="auto",
                 metrics_port: int | None = None) -> None:
        _size_tf_pools()  # before any op starts TensorFlow's runtime
        self.config = config
        self._search_setting = search_partitions
        self.tuner: PartitionTuner | None = None
        self._eager_steps = False  # whether the first training step ran eagerly
        self.workers = make_collectives(config.collectives)
        if config.local_aggregation and isinstance(self.workers, TensorFlowWorkers):
            raise ConfigError(LOCAL_AGGREGATION_NEEDS_HOROVOD)
        info = self.workers.info
        gpus = tf.config.list_physical_devices("GPU")
        device = f"/gpu:{info.local_rank % len(gpus)}" if gpus else "/cpu:0"
        super().__init__(container, device)
        self._client_options = client_options
        self._connect_timeout = connect_timeout
        self._created: list[weakref.ref] = []
        self._observations: _Observations | None = None
        self._pushed: set[int] | None = None
        # the step traced last (its fusion while its lookups are traced; whose gradients)
        self._trace = StepTrace()
        self.plan: Plan | None = None
        self.remotes: dict[int, RemoteTable] = {}
        self.table_client = table_client(CachingClient.name, config.cache) if config.cache \
            else table_client(DirectClient.name)  # what fused steps pull and push through
        self.cluster: ClusterSpec | None = None
        self._binder = None
        self._resharder: Resharder | None = None
        self._optimizer = None  # the Keras optimizer the servers replicate
        self.server_tables = resume.ServerTables(self)  # in TF checkpoints and Keras files
        keras_patches.attach_to_keras_optimizers()
        keras_patches.make_weight_saves_atomic()
        keras_patches.make_backup_records_atomic()
        keras_patches.install(self)  # fit/evaluate/predict: scope checks, rows, logs
        held_checkpoints.install(self)  # CheckpointManager: held saves, restorable latest
        self._cluster_resolver = WorkerClusterResolver(self)  # strategy.cluster_resolver
        if info.size > 1 and _wants_servers(config) and resolve_cluster(
                config.ps_addresses, config.run_id, start=False).embedded:
            raise ConfigError(
                f"{info.size} workers were launched but no parameter servers were given"
                f"{_why_servers(config)}: start the job with `parallax run` (it sets "
                f"{ADDRESSES_ENV}), pass ps_addresses=... to ParallaxStrategy, or describe "
                f"them as TF_CONFIG's \"ps\" tasks")
        reuse_freed_memory()
        if metrics_port is not None:
            self._serve_metrics(metrics_port)

    def _serve_metrics(self, port: int) -> None:
        """This worker's /metrics (`parallax.client.worker_metrics`), its row cache's counters
        included."""
        info = self.workers.info
        client = self.table_client
        WORKER_METRICS.cache_stats = client.stats if isinstance(client, CachingClient) \
            else None
        worker_metrics.serve(port, info.rank, info.local_rank, info.size)

    # ---- variables ----

    def _create_variable(self, next_creator, **kwargs):
        kwargs.pop("colocate_with", None)
        if kwargs.get("variable_def") is not None or not is_liftable(kwargs.get("initial_value")):
            return next_creator(**kwargs)
        with tf.init_scope(), tf.device(self._device):
            var = ParallaxVariable.create(len(self._created), **kwargs)
            var.parallax_planned = self.plan is not None  # made after the plan: stays local
            if self.workers.info.size > 1 and \
                    var.synchronization == tf.VariableSynchronization.ON_READ:
                var.aggregate_reads_with(self._aggregate_across_workers)
        self._created.append(weakref.ref(var))
        return var

    def variables(self) -> list[ParallaxVariable]:
        return [v for v in (ref() for ref in self._created) if v is not None]

    # ---- steps ----

    def _call_for_each_replica(self, fn, args, kwargs):
        if self.plan is None and self._observations is None:
            self._plan_from(fn, args, kwargs)
        if self._observations is None and in_xla_function():
            self._check_xla_can_compile()
        if self._observations is not None or self._pushed is not None:
            # The analysis trace, or a nested call inside a step (LossScaleOptimizer's
            # merge_call runs its own replica functions): part of the step in progress.
            if self._observations is not None and self._observations.graph is None:
                self._observations.graph = tf.compat.v1.get_default_graph()
            return super()._call_for_each_replica(fn, args, kwargs)
        self._pushed = set()
        step = StepFusion(tf.compat.v1.get_default_graph(), self.table_client) \
            if self.remotes and self.config.fuse and not tf.executing_eagerly() else None
        trace = self._trace = StepTrace(step).begin_here()  # what this thread's lookups join
        try:
            result = super()._call_for_each_replica(fn, args, kwargs)
            if self.workers.info.size > 1:
                result = self._across_workers(fn, result)
            trace.end_lookups()  # what follows is the step's own tail, not its lookups
            if step is not None:
                self._finish_fused(step)
            elif self._pushed:  # a training step: every table must hear from this worker
                for index, remote in self.remotes.items():
                    if index not in self._pushed:
                        remote.push_nothing()
            if self._pushed and self.tuner is not None and not self.tuner.done:
                # after the step's pushes (stateful ops run in program order)
                tf.numpy_function(self.tuner.after_step, [], tf.int64, stateful=True,
                                  name="parallax_partition_search")
        finally:
            trace.end_lookups()
            trace.end_updates()
            self._pushed = None
        return result

    def _across_workers(self, fn, result):
        """Keras' predictions: every worker's rows, gathered in rank order (the global
        batch, in order). Keras' logs: averaged, in the step, or after each execution of
        Keras' multi-step loop, where a collective in the step could overlap the last."""
        if keras_support.is_keras_predict_step(fn) and not keras_patches.predicting_on_batch():
            flat = tf.nest.flatten(result)
            rows = [i for i, v in enumerate(flat) if isinstance(v, tf.Tensor) and v.shape.rank]
            for i, gathered in zip(rows, self.workers.allgather_rows([flat[i] for i in rows])):
                flat[i] = gathered
            return tf.nest.pack_sequence_as(result, flat)
        if not keras_support.is_keras_logging_step(fn):
            return result
        if keras_patches.in_loop():
            keras_patches.average_outside(keras_support.keras_model_of(fn), self)
            return result
        return self.average_logs(result)

    def _finish_fused(self, step: StepFusion) -> None:
        """One pull op for the step's grouped lookups, one push op for its tables (those
        updated through the fused path, and empty pushes for those not updated at all)."""
        silent = [r for i, r in self.remotes.items() if i not in self._pushed]
        step.finish(silent, training=bool(self._pushed))
        if step.reports and self.plan is not None and not self.plan.lookups:
            self.plan = dataclasses.replace(self.plan, lookups=tuple(step.reports))
            if self.config.log_plan:
                binding.log_lookups(self.plan, self.workers)

    def _check_xla_can_compile(self) -> None:
        """A step traced in `tf.function(jit_compile=True)`: XLA cannot compile the ops that
        pull and push a table's rows, nor the deferred reads of variables before the plan."""
        if self.plan is not None and not self.remotes:
            return  # only replicated variables, already local: plain TensorFlow ops
        reason = "its tables' rows are pulled from and pushed to the parameter servers" \
            if self.plan is not None else "no training step has made the plan yet"
        raise ConfigError(
            f"a step under ParallaxStrategy is traced in a tf.function(jit_compile=True), "
            f"but XLA cannot compile it: {reason}, by ops XLA has no kernel for. Drop "
            f"jit_compile=True from that tf.function (XLA may still compile functions the "
            f"step calls that read no table on the servers)")

    def _plan_from(self, fn, args, kwargs) -> None:
        observations = _Observations()
        self._eager_steps = tf.executing_eagerly()  # steps run eagerly are never fused
        self._observations = observations
        try:
            spec_args, spec_kwargs = tf.nest.map_structure(_spec_of, (tuple(args), kwargs or {}))
            strategy = self._container_strategy()
            traced = tf.function(lambda *a, **k: strategy.run(fn, a, k))
            with analysis_trace():
                graph = traced.get_concrete_function(*spec_args, **spec_kwargs).graph
        finally:
            self._observations = None
        with tf.init_scope():
            if observations.gradients:
                self._make_plan(graph, observations)
            # Not a training step (evaluate, predict): no plan yet, variables stay local.
            self._materialize_local()

    def _group_keys(self, variables: dict[int, ParallaxVariable],
                    observations: _Observations, wanted: bool | None = None) -> dict:
        """Which variables may share a server table (`make_plan`): those whose update joins
        the step's one fused push (traced steps, an update in the step's own graph), under
        an optimizer that allows it (`binding.group_keys`). `wanted`: group at all (default:
        `group_tables`)."""
        wanted = self.config.group_tables if wanted is None else wanted
        if not (wanted and self.config.fuse) or self._eager_steps:
            return {}  # each table's update would be a push (and a step) of its own
        keys = binding.group_keys(variables, observations.optimizer)
        return {i: key for i, key in keys.items() if id(variables[i]) not in observations.nested}

    def _saved_groups(self, pending: dict, by_index, observations, planned_with) -> Plan:
        """The plan with the table groups of a checkpoint restored before it (restoring
        changes what made the groups: the variables' deferred initial values), where this
        job can push each group together; else ConfigError (with_saved_tables refuses a
        checkpoint whose groups the plan still lacks)."""
        members = resume.saved_group_members(pending)
        allowed = self._group_keys(by_index, observations, wanted=True)
        refused = sorted(pending["tables"][str(i)]["variable"] for i in members
                         if i not in allowed)
        if refused:
            raise ConfigError(
                f"the checkpoint keeps {refused} in table groups (one server table each "
                f"group), which this job cannot push one group at a time: it does not fuse "
                f"its steps (fuse=False or eager steps), updates them in a tf.cond branch "
                f"(LossScaleOptimizer) or uses an optimizer that counts steps (Adam, "
                f"Adamax, Nadam); restore it with the settings that saved it")
        if members and not self.config.group_tables:
            log.warning("parallax: group_tables=False, but the checkpoint restored keeps %d "
                        "variables in table groups: the plan keeps its groups", len(members))
        options = dataclasses.replace(self.config.placement_options, group_tables=True)
        return planned_with(options, resume.saved_group_keys(pending), saved=True)

    def _materialize_local(self) -> None:
        """Compute the deferred initial value of every variable that stays on this worker;
        once planned, a variable stays where it is (local reads need no run-time check)."""
        for var in self.variables():
            if var.remote is None:
                var.materialize()
            var.parallax_planned = self.plan is not None

    def _variable_infos(self, graph, observations: _Observations) -> dict[int, VariableInfo]:
        variables = [v for v in self.variables() if v.trainable]
        reports = inspect_reads(graph, variables)
        names: dict[str, int] = {}
        infos = {}
        for var in variables:
            name = keras_support.keras_path_of(var, observations.optimizer) or \
                var.name.split(":")[0]
            names[name] = names.get(name, 0) + 1
            if names[name] > 1:
                name = f"{name}#{var.parallax_index}"
            report = reports[id(var)]
            infos[var.parallax_index] = VariableInfo(
                index=var.parallax_index, name=name, shape=tuple(var.shape.as_list()),
                dtype=var.dtype.name, gather_only=report.gather_only, read_reason=report.reason,
                gradient=observations.gradients.get(id(var), "none"), dynamic=var.dynamic_rows)
        return infos

    def _make_plan(self, graph, observations: _Observations) -> None:
        foreign = [v.name for v in observations.updated if not isinstance(v, ParallaxVariable)]
        if foreign:
            raise ConfigError(
                f"variables {foreign} were created outside strategy.scope(), so parallax "
                f"cannot place them; build the model and the optimizer inside "
                f"`with strategy.scope():`")
        infos = self._variable_infos(graph, observations)
        info = self.workers.info
        # Where the servers would be (started only if the plan puts something on them).
        planned = resolve_cluster(self.config.ps_addresses, self.config.run_id,
                                  embedded_servers=self.config.embedded_servers, start=False)
        # Without a configured run id each worker made one up: use the chief's.
        planned = dataclasses.replace(planned,
                                      run_id=self.workers.broadcast_object(planned.run_id))
        by_index = {v.parallax_index: v for v in self.variables()}
        options = self.config.placement_options

        def planned_with(chosen: PlacementOptions, keys, saved: bool = False) -> Plan:
            return make_plan(chosen, list(infos.values()), run_id=planned.run_id,
                             num_servers=len(planned.ps_addresses), num_workers=info.size,
                             group_keys=keys, saved_groups=saved)
        plan = planned_with(options, self._group_keys(by_index, observations))
        if plan.on_servers:
            self.cluster = planned if not planned.embedded else resolve_cluster(
                None, planned.run_id, embedded_servers=self.config.embedded_servers)
        pending = self.server_tables.take_pending()  # a checkpoint restored before the plan
        if pending is not None and not resume.same_grouping(plan, pending):
            plan = self._saved_groups(pending, by_index, observations, planned_with)
        restored = resume.saved_layouts(pending, len(planned.ps_addresses), options)
        plan = tuning.with_layouts(plan, restored)  # where the checkpoint's shards are
        search = tuning.resolve(self._search_setting, plan, options)
        if search is not None and plan.grouped:
            if pending is not None:
                log.warning("parallax: no partition search: the checkpoint restored keeps "
                            "its table groups (group_tables), which the search does not tune")
                search = None
            else:  # the search tunes each table's shards on its own
                plan = planned_with(options, None)
        cached = None
        if search is not None:  # the chief's saved decision, the same on every worker
            cached = self.workers.broadcast_object(
                tuning.load_decision(search, plan) if info.is_chief else None)
            if cached is not None and _moves(cached["layouts"], restored):
                cached = None  # the checkpoint's layout stands; the search runs again
            if cached is not None:
                plan = tuning.with_layouts(plan, cached["layouts"])
        if pending is not None:
            plan = resume.with_saved_tables(plan, pending)
        binding.check_agreement(plan, self.workers)
        if plan.on_servers:
            self._binder = binding.TableBinder(plan, self.cluster, self.workers,
                                               self._client_options, self._connect_timeout,
                                               self.config.local_aggregation)
            resumption = None if pending is None else resume.Resumption(pending)
            self.remotes = self._binder.bind(by_index, observations.optimizer, resumption)
            for remote in self.remotes.values():  # an assign makes cached rows wrong
                remote.on_assign = self.table_client.invalidate
            if resumption is not None:
                resumption.continue_steps(resume.tables_by_variable(plan, self.remotes),
                                          self.workers)
            self._optimizer = observations.optimizer
            self._resharder = Resharder(self._binder.client, self.workers, self.remotes)
            if search is not None:
                self.tuner = PartitionTuner(search, self, cached)
            keras_patches.route_keras_take()
            keras_patches.check_sparse_values_only()
        binding.broadcast_replicated(self.variables(), self.workers)
        self.plan = plan
        keras_patches.forget_functions(self)  # evaluate/predict traced before: trace again
        if self.config.log_plan:
            binding.log_plan(plan, self.workers)
        _warn_unread_tables(infos.values(), self.workers.info.is_chief)

    @property
    def client(self):
        """The client of the job's parameter servers (None before tables are placed)."""
        return self._binder.client if self._binder is not None else None

    def ps_addresses(self) -> tuple[str, ...]:
        """The servers' addresses, as far as known (embedded ones start with the plan)."""
        if self.cluster is not None:
            return self.cluster.ps_addresses
        if self.config.ps_addresses:
            return self.config.ps_addresses
        text = os.environ.get(ADDRESSES_ENV)
        return parse_addresses(text, ADDRESSES_ENV) if text else ()

    def reshard(self, layouts: Mapping[str, Layout], log: bool = True,
                keep_previous: bool = False) -> ReshardReport:
        """New layouts for tables, applied now on every worker (all must call it at the same
        step boundary, outside any tf.function); see `Resharder` for `keep_previous`."""
        if self.plan is None or self._resharder is None:
            raise ConfigError("no table is on the parameter servers yet: reshard after the "
                              "first training step (which makes the plan)")
        try:
            self.plan, report = self._resharder.apply(self.plan, layouts, log=log,
                                                      keep_previous=keep_previous)
        finally:  # the tables' layouts (and names) changed, or may have
            self.table_client.invalidate()
        return report

    def release_previous(self) -> None:
        if self._resharder is not None:
            self._resharder.release_previous()

    def layouts_for(self, shards: int | Mapping[str, int],
                    servers: Mapping[str, Sequence[int]] | None = None) -> dict[str, Layout]:
        """Layouts giving tables these shard counts: the servers given, else placed by
        bytes next to the tables that keep theirs."""
        plan = self.plan
        if plan is None:
            raise ConfigError("reshard after the first training step, which makes the plan")
        counts = {v.name: shards for v in plan.on_servers} if isinstance(shards, int) \
            else dict(shards)
        servers = dict(servers or {})
        for vp in [v for v in plan.on_servers if v.name in counts or v.name in servers]:
            for member in plan.members(vp.table):  # a table group moves as one table
                if vp.name in counts:
                    counts.setdefault(member.name, counts[vp.name])
                if vp.name in servers:
                    servers.setdefault(member.name, servers[vp.name])
        for name, given in servers.items():
            if name in counts and len(given) != counts[name]:
                raise ConfigError(f"{name!r}: {counts[name]} shards but {len(given)} servers "
                                  f"given ({list(given)}); give one server per shard")
        check_layouts(plan, {n: Layout(tuple(servers.get(n, [0] * c))) for n, c in
                             counts.items()})
        moving = {v.name for v in plan.on_servers if v.name in counts and v.name not in servers}
        keep = {v.index: tuple(servers.get(v.name, v.servers)) for v in plan.on_servers
                if v.name not in moving}  # given servers count as load where they will be
        wanted = tuple(dataclasses.replace(v, shards=counts.get(v.name, v.shards))
                       for v in plan.on_servers)
        placed = place_shards(wanted, plan.num_servers, keep)
        by_name = {v.name: v for v in plan.on_servers}
        return {name: Layout(placed[by_name[name].index]) for name in counts}

    def _aggregate_across_workers(self, value: tf.Tensor, aggregation) -> tf.Tensor:
        total = self.workers.allreduce_sum([value])[0]
        if aggregation == tf.VariableAggregation.MEAN:
            return total / self.workers.info.size
        if aggregation == tf.VariableAggregation.ONLY_FIRST_REPLICA:
            return value
        return total

    def average_logs(self, logs):
        """Keras' per-worker metric values -> their mean over workers (one grouped
        all-reduce of a few scalars per step), identical on every worker."""
        flat = tf.nest.flatten(logs)
        positions = [i for i, v in enumerate(flat) if isinstance(v, tf.Tensor)
                     and v.dtype.is_floating and v.shape.rank == 0]
        summed = self.workers.allreduce_sum([flat[i] for i in positions])
        for i, total in zip(positions, summed):
            flat[i] = total / self.workers.info.size
        return tf.nest.pack_sequence_as(logs, flat)

    # ---- reductions and updates ----

    def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
        values = [value for value, _ in value_destination_pairs]
        if self._observations is not None:
            return values
        size = self.workers.info.size
        mean = reduce_op == tf.distribute.ReduceOp.MEAN
        results: list = [None] * len(values)
        dense_positions = []
        for i, value in enumerate(values):
            if self._trace.owner_of(value) is None:
                dense_positions.append(i)
                continue
            if mean and size > 1:
                value = tf.IndexedSlices(value.values / size, value.indices, value.dense_shape)
            if self.config.local_aggregation and size > 1:
                value = tf.IndexedSlices(self.workers.local_allgather(value.values),
                                         self.workers.local_allgather(value.indices),
                                         value.dense_shape)
            results[i] = value
        reduced = self.workers.allreduce_sum([values[i] for i in dense_positions])
        for i, value in zip(dense_positions, reduced):
            results[i] = value / size if mean and size > 1 else value
        return results

    def _refuse_unplanned_table(self, var, fn, args) -> None:
        """A sparse (IndexedSlices) gradient for a variable the plan's step never read (a
        second model's table, built in the same scope before or after the plan): it would
        train as a dense copy on every worker, all-reduced, without a word."""
        if self.plan is None or not args or not isinstance(args[0], tf.IndexedSlices) or \
                self.config.mode == "allreduce" or not var.trainable:
            return  # (an optimizer's own variable, a gradient accumulator, is no table)
        index = getattr(var, "parallax_index", -1)
        planned = next((v for v in self.plan.variables if v.index == index), None)
        if planned is not None and (planned.reason != NOT_READ or
                                    self.config.placement.get(planned.name) == "allreduce"):
            return
        name = planned.name if planned is not None else keras_support.keras_path_of(
            var, keras_support.keras_optimizer_of(fn)) or var.name.split(":")[0]
        raise ConfigError(
            f"{name!r} gets a sparse gradient (a table), but the plan was made from the first "
            f"training step (the first fit or strategy.run), which did not read it"
            f"{' (it was created after that step)' if planned is None else ''}: it would "
            f"stay on every worker, all-reduced as dense, instead of on the servers. A "
            f"ParallaxStrategy plans one model: build each model in its own ParallaxStrategy "
            f"(its own `with strategy.scope():`), or train them in one step (one model "
            f"holding both)")

    def _reduce_to(self, reduce_op, value, destinations, options):
        return self._batch_reduce_to(reduce_op, [(value, destinations)], options)[0]

    def _update(self, var, fn, args, kwargs, group):
        if self._observations is not None:
            self._observations.record(var, fn, args)
            return tf.no_op() if group else (tf.no_op(),)
        remote = remote_of(var)
        if remote is None:
            self._refuse_unplanned_table(var, fn, args)
            return super()._update(var, fn, args, kwargs, group)
        if getattr(fn, "__name__", "") != _OPTIMIZER_UPDATE or not args:
            raise ParallaxError(
                f"{getattr(fn, '__name__', fn)!r} tried to update {remote.label!r}, which lives"
                f" on the parameter servers; only Keras optimizer updates are forwarded there")
        if keras_support.keras_optimizer_of(fn) is not self._optimizer:
            raise ParallaxError(
                f"{remote.label!r} lives on the parameter servers, which apply the optimizer "
                f"the first training step used ({type(self._optimizer).__name__}); a "
                f"different optimizer (a second model.compile(...) makes one, as fine-tuning "
                f"after changing `trainable` does) cannot update it. Compile with that "
                f"first one (kept before compiling again: `first = model.optimizer`, then "
                f"`model.compile(optimizer=first, ...)`; set its rate with "
                f"`first.learning_rate = ...`); or, for a new optimizer, copy the "
                f"weights into the model built again in a new ParallaxStrategy: `weights = "
                f"model.get_weights()`, then in the new strategy's scope build the model, "
                f"`set_weights(weights)` and compile it")
        learning_rate = args[1] if len(args) > 1 else None
        step = self._trace.fusion
        if step is not None and step.can_push(args[0], learning_rate):
            step.push(remote, args[0], learning_rate)  # sent by the step's fused push op
            op = tf.no_op()
        else:
            op = remote.push(args[0], learning_rate=learning_rate)
        if self._pushed is not None:
            self._pushed.add(var.parallax_index)
        self._trace.record_update(remote)
        return op if group else (op,)

    # ---- datasets and topology ----

    def _experimental_distribute_dataset(self, dataset, options):
        info = self.workers.info
        split = cover_for_worker if keras_patches.covering_rows() else shard_for_worker
        if split is shard_for_worker:  # training: an elastic job's counts must split it
            rescale.publish_global_batch(self.workers, lambda: global_batch_size(dataset))
        return super()._experimental_distribute_dataset(
            split(dataset, info.rank, info.size), options)

    def _distribute_datasets_from_function(self, dataset_fn, options):
        info = self.workers.info
        context = _NotingInputContext(self.workers, num_input_pipelines=info.size,
                                      input_pipeline_id=info.rank,
                                      num_replicas_in_sync=info.size)
        return input_util.get_distributed_datasets_from_function(
            dataset_fn, self._input_workers_with_options(options), [context],
            self._container_strategy(), options=options)

    def _in_multi_worker_mode(self):
        # To TensorFlow each worker is a single client (one device, no TF collectives): the
        # workers coordinate through Horovod. So datasets yield plain tensors, not PerReplica.
        return False

    @property
    def _num_replicas_in_sync(self):
        return self.workers.info.size

    @property
    def should_checkpoint(self):
        return self.workers.info.is_chief

    @property
    def should_save_summary(self):
        return self.workers.info.is_chief


def _checked_cache(cache) -> RowCache | None:
    if cache is not None and not isinstance(cache, RowCache):
        raise ConfigError(f"cache must be a parallax.RowCache or None, got {cache!r}; e.g. "
                          f"cache=parallax.RowCache(bytes=64 << 20, staleness=4)")
    return cache


class ParallaxStrategy(distribute_lib.Strategy):
    """Drop-in for `MultiWorkerMirroredStrategy`: sparse tables on parameter servers, dense
    variables all-reduced by Horovod or TensorFlow's collectives (`collectives=`).

    Example (one worker with embedded servers, or N workers under `parallax run -np N`):

        strategy = parallax.ParallaxStrategy()
        with strategy.scope():
            model = keras.Sequential([keras.layers.Embedding(100_000, 64), ...])
            model.compile(keras.optimizers.Adagrad(0.1), loss="mse")
        model.fit(strategy.distribute_datasets_from_function(make_dataset), epochs=3)

    Every argument is described in `__init__`'s docstring (where the servers, run id and mode
    come from when not given: the arguments, then `parallax run`'s environment, then
    TF_CONFIG's "ps" tasks, else embedded servers). `cluster_resolver`: task type "worker",
    task id = this worker's rank, as MWMS gives it.
    """

    def __init__(self, mode: str | None = None, *, sync: bool | None = None,
                 ps_addresses=None, run_id: str | None = None, embedded_servers: int = 2,
                 local_aggregation: bool | None = None, placement: dict | None = None,
                 shards=None, log_plan: bool = True, connect_timeout: float | None = None,
                 fuse: bool = True, group_tables: bool = True, checkpoints_kept: int = 5,
                 client_options: ClientOptions | None = None,
                 search_partitions: bool | str | PartitionSearch | None = None,
                 collectives: str = "auto", wire_dtype=None,
                 cache: RowCache | None = None, metrics_port: int | None = None) -> None:
        """Configure the strategy. Nothing is placed and no server is contacted here: the
        first training step (`fit`, or the first `strategy.run` whose step updates
        variables) makes the plan and checks what needs the model or the servers. Every
        worker must construct it (under Horovod the workers exchange their host names here).

        In a `parallax k8s` worker pod (`PARALLAX_JOB_CONFIG` names the job's `job.json`),
        `placement`, `shards`, `local_aggregation` and `search_partitions` left None take
        the job's `--plan` values, and one INFO line names what was applied; an argument
        given wins. Elsewhere they take the defaults below.

        Args:
            mode: str or None (default). "hybrid": the variables the plan finds sparse (every
                read a row gather on axis 0, gradient `IndexedSlices`) live on the parameter
                servers; every other trainable variable is kept on every worker and its
                gradients are summed by one grouped all-reduce per step (`collectives`). "ps":
                every trainable variable on the servers (dense ones pulled whole at every
                step). "allreduce": every variable on every worker, sparse gradients
                all-gathered by the collectives, no servers. None: `PARALLAX_MODE` (`parallax
                run --mode`) when set and not empty, else "hybrid". The only argument that
                may be positional.
            sync: bool or None (default). True: a table shard applies one update per step,
                from the sum of every worker's push, and a worker's pull waits until the
                servers applied every step it pushed, so all workers read the same rows.
                False: each push is applied on arrival and pulls do not wait; the dense
                all-reduce (hybrid mode) stays synchronous. None: `PARALLAX_SYNC`, "sync" or
                "async" (`parallax run --async` sets "async"), else True. Only tables on the
                servers are affected.
            ps_addresses: str, sequence of str, or None (default): "host:port" of each
                parameter server, as one comma-separated string or a sequence. The servers
                are the first of: this argument; `PARALLAX_PS_ADDRESSES` (set by `parallax
                run`); the "ps" tasks of `TF_CONFIG` when it has any (each running `parallax
                server`); else `embedded_servers` servers that this process starts. They are
                contacted at the first training step, and only if the plan puts a variable
                on them.
            run_id: str or None (default): the job's id, 1-48 letters, digits, '_' or '-',
                which prefixes its tables' names on the servers (`<run_id>.v<index>.<name>`).
                None: `PARALLAX_RUN_ID` (set by `parallax run`), else with servers from
                `TF_CONFIG` "tf-" and 12 hex digits of a hash of its cluster (the same for
                every worker and every run of that cluster), else one the chief makes up
                (date, time, 6 random hex digits). A table of that name that already exists
                and has applied steps stops the first training step with a ConfigError,
                changing nothing: another job, or an earlier run, used this id.
            embedded_servers: int >= 1, default 2: how many servers to start when nothing
                names any (see `ps_addresses`): child processes of this one on loopback,
                started at the first training step if the plan puts a variable on them,
                stopped when this process exits or dies. They have no data directory, so
                checkpoints then carry the tables' rows, optimizer slots and step themselves
                (a resume is exact). Only for one worker: several workers need servers
                named (see Raises).
            local_aggregation: bool or None (default: False). True: the workers of a host
                all-gather their table gradients and its local rank 0 alone pushes them, so
                a table gets one push per host per step instead of one per worker. One host
                only: with workers on several hosts the first training step raises a
                ConfigError. No effect with one worker.
            placement: dict or None (default: no overrides): {variable name: "ps" |
                "allreduce"}, names as `strategy.plan` lists them (e.g.
                "embedding/embeddings"). Puts that variable on the servers ("ps") or on every
                worker ("allreduce") whatever the mode and its kind.
            shards: int, dict or None (default). An int >= 1: every table's shard count; a
                dict {variable name: int >= 1}: those tables' counts, the others keep the
                default; names that match no table are ignored. None: one shard per whole
                16 MiB of the table, at most one per server, at least one. A count is capped
                at the table's rows, and one above the number of servers puts several shards
                on a server. Shards go to servers balancing bytes, biggest tables first. Any
                value but None turns the "auto" partition search off.
            log_plan: bool, default True: the chief logs the plan (`strategy.plan.format()`)
                at INFO on the "parallax" logger when it is made, and how the step's lookups
                travel once a fused step is traced. False: neither (`strategy.plan` still
                has the plan; warnings are not affected).
            connect_timeout: float, seconds, default $PARALLAX_CONNECT_TIMEOUT, else 60.0
                (`parallax k8s` sets 600 in worker pods: `--server-wait`): how long each
                server has, at the first training step, to answer a health check with
                SERVING; the servers are waited for one after another. A worker that
                cannot reach one raises ServerError (UNAVAILABLE) naming it, the other
                workers a ParallaxError naming that worker. Not the timeout of each request
                (`ClientOptions.timeout`).
            fuse: bool, default True: in a traced step (`strategy.run` inside a
                `tf.function`, as `fit` does) the lookups of tables whose ids do not depend
                on another lookup's rows share one pull op, and the step's table gradients
                one push op: one PullMany and one PushMany request per server per step
                (`parallax.tf.graph.fusion`). False: each table its own pull and push requests. Both
                train alike; eager steps are never fused.
            group_tables: bool, default True: variables on the servers with the same row
                shape and dtype, whose initial values are made the same way, and which the
                plan gave the same shards on the same servers, share one server table (a
                table group: each at its own row offset), so a step's request to a server
                carries one part for all of them instead of one per table, which is what
                many small tables cost. Only with
                `fuse=True`, traced steps, variables updated in the step's own graph (not in
                a `tf.cond` branch, as LossScaleOptimizer's are), an optimizer whose
                update does not count steps (SGD, Adagrad, Ftrl, RMSprop, Lion; not Adam,
                Adamax, Nadam), without a shard count named for the variable, and not with
                `search_partitions` set (which tunes tables one by one). `strategy.plan`
                shows a group as "in g<N>"; a reshard moves a group as one table, and a
                checkpoint restored before the first step keeps its groups (refused where
                this job could not push them together). Trains exactly as separate tables
                (rows the servers draw follow the same distribution, not the same draws).
            checkpoints_kept: int >= 1, default 5: how many checkpoints of this job's tables
                the servers keep. One is written (under `resume/<run id>` in the servers'
                `--data-dir`) whenever a TF checkpoint or Keras file holding the optimizer
                is saved, and older ones beyond this count are removed. A file whose tables'
                checkpoint was removed restores the rows it holds, without the optimizer
                slots and step, with a warning: keep at least as many as the files you keep
                (`ModelCheckpoint`, `CheckpointManager(max_to_keep=...)`).
            client_options: `parallax.ClientOptions` or None (default: `ClientOptions()`):
                the client of the servers (request timeout, retries, message and chunk
                sizes, TLS, token, data plane). With servers this process did not start,
                the fields `tls_ca`, `tls_cert`, `tls_key` and `token` left None are filled
                from `PARALLAX_TLS_CA`, `PARALLAX_TLS_CERT`, `PARALLAX_TLS_KEY` and
                `PARALLAX_TOKEN_FILE` (set by `parallax run --secure`).
            search_partitions: "auto", True, False, a `parallax.PartitionSearch`, or None
                (default: "auto"). The search times the training steps under one shard
                layout after another while the job trains, and every worker moves the tables
                to the fastest layout measured, at the same step; the decision is saved
                (`PartitionSearch.cache_dir`) and the next run of the same job starts from
                it without searching. "auto": search when the plan puts tables on the
                servers, with 2 or more workers, `shards` None and no table groups (see
                `group_tables`). True: whenever the plan puts tables on the servers, with
                `PartitionSearch()`'s settings, and then without table groups; a
                `PartitionSearch`: likewise, with its settings. False: never.
            collectives: "auto" (default), "horovod" or "tensorflow": what sums the dense
                gradients of several workers. "horovod": Horovod's ring all-reduce (the
                workers started by `horovodrun`, `mpirun` or `parallax run` with Horovod).
                "tensorflow": TensorFlow's own collective ops, as MultiWorkerMirroredStrategy
                uses them, among the workers `parallax run` names (`PARALLAX_WORKERS`) or
                TF_CONFIG's "chief" and "worker" tasks; no Horovod needed, so any TensorFlow
                release. "auto": Horovod when this process was launched by it, else
                TensorFlow's when several workers are named, else one worker. With
                TensorFlow's, create the strategy before any other TensorFlow work.
            wire_dtype: None (default), "float32", "float16" or "bfloat16", or a dict of
                variable name -> one of those: the dtype the rows of the tables on the
                servers travel in, pulls and pushes alike (a string: every float32 table;
                a dict: the variables it names). The servers keep float32 rows and
                optimizer slots and apply float32 gradients; only the wire narrows (half
                the row bytes). "bfloat16" keeps float32's range with 8 bits of
                precision; "float16" has 11 bits but overflows past 65504 (a gradient or
                row beyond it is refused, naming the table). Exports, `model.save` and
                checkpoints stay float32. `strategy.plan` shows it in a "wire" column.
            cache: a `parallax.RowCache` or None (default: no cache). Each worker keeps the
                rows its fused steps pull most often, within `RowCache.bytes`, and answers a
                pull from them while they are at most `RowCache.staleness` steps old; the
                misses and older rows are pulled, every gradient is pushed as before
                (`parallax.client.row_cache`; `strategy.cache_stats()` counts it). With
                staleness 0 training is exactly that without a cache.
            metrics_port: int or None (default). The worker serves its own Prometheus
                metrics (`parallax_worker_*`: steps, step, pull and push seconds, rows and
                bytes per table, row cache hits and misses, its rank) at
                http://127.0.0.1:PORT/metrics: 0 a free port, P the worker of local rank i
                at P+i; None: `PARALLAX_WORKER_METRICS_PORT` (`parallax run
                --metrics-port` sets it), else no endpoint. The address is printed on stderr
                (`PARALLAX_WORKER_METRICS rank=R address=H:P`); with PARALLAX_TOKEN_FILE a
                scrape must carry the token (docs/observability.md).

        Raises:
            ConfigError: `mode` (or `PARALLAX_MODE`) is not "hybrid", "ps" or "allreduce";
                `PARALLAX_SYNC` is not "sync" or "async"; `ps_addresses` is empty or names
                something that is not host:port with a port in 1-65535; a `placement` value
                is not "ps" or "allreduce"; `embedded_servers`, `checkpoints_kept` or a
                shard count is not an int >= 1 (bools refused); `search_partitions`
                is none of the values above; `PARALLAX_JOB_CONFIG` names a file that is not
                a JSON object; `collectives` is none of the values above, or "tensorflow"
                with the strategy created after other TensorFlow work; the process was
                started by horovodrun or mpirun
                (`HOROVOD_RANK`, `OMPI_COMM_WORLD_RANK` or `PMI_RANK` set) and Horovod cannot
                be imported; or there are several workers, the plan may put variables on
                the servers (`mode` is not "allreduce", or `placement` sends some to "ps")
                and neither `ps_addresses`, `PARALLAX_PS_ADDRESSES` nor TF_CONFIG's "ps"
                tasks name them.

            The first training step raises instead, before any table changes, for what needs
            the model or the cluster: a `run_id` or `PARALLAX_RUN_ID` of other characters, a
            malformed `PARALLAX_PS_ADDRESSES` or `TF_CONFIG`, a `placement` or `shards` name
            that matches no trainable variable, an optimizer the servers cannot apply, workers
            that built different models (ConfigError); servers that do not answer within
            `connect_timeout` (ServerError).
        """
        from parallax.env import plan_overrides
        given = dict(placement=placement, shards=shards, local_aggregation=local_aggregation,
                     search_partitions=search_partitions)
        given.update(plan_overrides(given))  # arguments given win
        placement, shards = given["placement"], given["shards"]
        local_aggregation = given["local_aggregation"] or False
        search_partitions = given["search_partitions"] if given["search_partitions"] \
            is not None else "auto"
        if ps_addresses is not None:
            ps_addresses = parse_addresses(ps_addresses if isinstance(ps_addresses, str)
                                           else ",".join(ps_addresses), "ps_addresses")
        mode, sync = mode_from_env(mode, sync)
        config = StrategyConfig(mode=mode, sync=sync,
                                ps_addresses=tuple(ps_addresses) if ps_addresses else None,
                                run_id=run_id, embedded_servers=embedded_servers,
                                local_aggregation=local_aggregation,
                                placement=dict(placement or {}), shards=shards,
                                log_plan=log_plan, fuse=fuse, group_tables=group_tables,
                                checkpoints_kept=checkpoints_kept, collectives=collectives,
                                wire_dtype=wire_dtype, cache=_checked_cache(cache))
        tuning.check_setting(search_partitions)
        if connect_timeout is None:
            connect_timeout = env_connect_timeout()
        if metrics_port is None:
            metrics_port = worker_metrics_port()
        elif isinstance(metrics_port, bool) or not isinstance(metrics_port, int) or \
                not 0 <= metrics_port <= 65535:
            raise ConfigError(f"metrics_port={metrics_port!r} must be None, 0 (a free port) "
                              f"or a port in 1-65535")
        super().__init__(ParallaxExtended(self, config, client_options, connect_timeout,
                                          search_partitions, metrics_port))

    @property
    def plan(self) -> Plan | None:
        """The placement plan, once the first training step has run (None before)."""
        return self.extended.plan

    @property
    def worker(self) -> WorkerInfo:
        return self.extended.workers.info

    def reshard(self, shards: int | Mapping[str, int],
                servers: Mapping[str, Sequence[int]] | None = None) -> ReshardReport:
        """Give tables new shard counts (an int: every table) and, optionally, the server of
        each shard; rows, optimizer slots and the step move to the new shards, so training
        continues exactly where it was. Call it on every worker at the same point between
        steps (outside tf.function), after the first training step."""
        if tf.inside_function():
            raise ConfigError("strategy.reshard moves tables between steps: call it eagerly "
                              "(outside tf.function), on every worker")
        extended = self.extended
        return extended.reshard(extended.layouts_for(shards, servers))

    def rescale_point(self, step: int) -> None:
        """Call on every worker right after a checkpoint (the custom loop's; Keras `fit`
        does it itself at the end of every epoch that saved one). Under `parallax run
        --host-discovery-script`, when the launcher asked for another worker count, every
        worker ends here (SystemExit, code 75) and the job starts again with that count,
        resuming from this checkpoint (`step`: where it is, for the log). Elsewhere it does
        nothing."""
        if tf.inside_function():
            raise ConfigError("strategy.rescale_point() may end the process: call it eagerly "
                              "(outside tf.function), on every worker, after a checkpoint")
        rescale.stop_if_asked(self.extended, saved=True, at=f"step {step}")

    def cache_stats(self) -> CacheStats | None:
        """What this worker's row cache did (hits, misses, stale refreshes, rows and bytes
        saved, memory held), or None without a cache (`cache=`)."""
        client = self.extended.table_client
        return client.stats() if isinstance(client, CachingClient) else None

    @property
    def partition_search(self) -> PartitionTuner | None:
        """The measured tuning of shard counts (None when off): `.done`, `.report()`."""
        return self.extended.tuner

    @property
    def tables(self) -> dict[str, RemoteTable]:
        """Variables on the parameter servers, by name in the plan."""
        plan = self.extended.plan
        if plan is None:
            return {}
        return {v.name: self.extended.remotes[v.index] for v in plan.on_servers}

    @contextlib.contextmanager
    def local_tables(self):
        """Pull every table into the worker's memory for the duration of the block, e.g. to
        export a SavedModel that serves without parallax. Changes made inside are dropped.
        A DynamicEmbedding's table stays on the servers: serve its rows with
        `parallax.layers.serving_model` instead."""
        remotes = {v.parallax_index: v for v in self.extended.variables()
                   if v.remote is not None and not v.remote.keyed}
        with tf.init_scope():
            values = {i: var.numpy() for i, var in remotes.items()}
            for i, var in remotes.items():
                var.unbind_remote()
                restore_storage(var, values[i])
        try:
            yield
        finally:
            with tf.init_scope():
                for i, var in remotes.items():
                    var.bind_remote(self.extended.remotes[i])
