"""TensorFlow's own distributed training, the two peers parallax is compared against.

- `mwms`: tf.distribute.MultiWorkerMirroredStrategy with ring collectives. Every variable is
  replicated; dense gradients are all-reduced and sparse (IndexedSlices) gradients are
  all-gathered by TensorFlow, which is the cost parallax's sparse path avoids.
- `tf_ps`: tf.distribute.ParameterServerStrategy driven by a ClusterCoordinator on the chief.
  Variables live on the `ps` tasks; tables bigger than `MIN_SHARD_BYTES` are split across
  them as ShardedVariables. Workers run scheduled steps asynchronously (TF's design).

Both train `models.BenchModel` with Keras' SGD at `spec.lr`, like every other system. The
cluster comes from the TF_CONFIG environment variable, set by the harness for each process.

Why the model's lookups stay on the servers under tf_ps: `tf.nn.embedding_lookup` on a
ShardedVariable is dispatched (tensorflow/python/distribute/sharded_variable.py) to
`embedding_lookup(shard_list, ids, "div")`, which partitions the ids and gathers each part
with `sparse_read` colocated with its shard; a single (unsharded) table is gathered the same
way. Only the looked-up rows travel to the worker, and the gradients are IndexedSlices whose
`scatter_sub` runs on the shard's ps (tests/parallel/test_bench_peers.py checks the placement).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Callable

from parallax.bench import measure, models, workloads
from parallax.errors import ConfigError

TF_CONFIG = "TF_CONFIG"
# TF's own choice in its ParameterServerStrategy tutorial: shard only tables worth
# spreading, so small tables and dense layers stay whole on one ps.
MIN_SHARD_BYTES = 256 << 10


@dataclass
class Built:
    """A trainer with the model and step it drives, so tests can read the variables and
    inspect the traced step (the benchmark itself uses only `trainer`)."""

    trainer: measure.Trainer
    model: models.BenchModel
    strategy: object
    step_fn: Callable


def trainer(system: str, spec: workloads.WorkloadSpec) -> measure.Trainer:
    """The `measure.Trainer` of TF system `system` ("mwms" or "tf_ps", the chief's side)."""
    return build(system, spec).trainer


def build(system: str, spec: workloads.WorkloadSpec) -> Built:
    if system == "mwms":
        return build_mwms(spec)
    if system == "tf_ps":
        return build_tf_ps(spec)
    raise ConfigError(f"unknown TensorFlow system {system!r}: choose mwms or tf_ps")


# --------------------------------------------------------------------------- TF_CONFIG


def tf_config(required_jobs: tuple[str, ...] = ()) -> dict | None:
    """TF_CONFIG parsed and checked, or None when unset and nothing is required.

    TensorFlow reads the variable itself; checking it here first turns its silent
    single-process fallback (MWMS) or opaque resolver errors (PS) into a message that
    names the variable and its expected shape.
    """
    raw = os.environ.get(TF_CONFIG, "").strip()
    shape = ('{"cluster": {"chief": ["host:port"], "worker": [...], "ps": [...]}, '
             '"task": {"type": "worker", "index": 0}}')
    if not raw:
        if required_jobs:
            raise ConfigError(f"{TF_CONFIG} is not set: this process needs a cluster with "
                              f"jobs {', '.join(required_jobs)}, e.g. {shape}")
        return None
    try:
        config = json.loads(raw)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{TF_CONFIG} is not JSON ({err}); expected {shape}") from None
    cluster = config.get("cluster") if isinstance(config, dict) else None
    task = config.get("task") if isinstance(config, dict) else None
    if not isinstance(cluster, dict) or not isinstance(task, dict):
        raise ConfigError(f"{TF_CONFIG} needs a 'cluster' and a 'task' object; expected {shape}")
    missing = [job for job in required_jobs if not cluster.get(job)]
    if missing:
        raise ConfigError(f"{TF_CONFIG}'s cluster has no {', '.join(missing)} job; "
                          f"it must list every one of {', '.join(required_jobs)}")
    kind, index = task.get("type"), task.get("index")
    if kind not in cluster or not isinstance(index, int) or not 0 <= index < len(cluster[kind]):
        raise ConfigError(f"{TF_CONFIG}'s task {task!r} is not in its cluster "
                          f"(jobs: {', '.join(sorted(cluster))})")
    return config


# --------------------------------------------------------------------------- mwms


def build_mwms(spec: workloads.WorkloadSpec) -> Built:
    """One MWMS worker: its own local batches, gradients summed over workers by collectives."""
    config = tf_config()
    workers = len(config["cluster"].get("worker", [])) if config else 1
    rank = config["task"]["index"] if config else 0
    if config and config["task"]["type"] != "worker":
        raise ConfigError(f"mwms runs only 'worker' tasks; {TF_CONFIG} names "
                          f"{config['task']['type']!r}")

    import keras
    import tensorflow as tf


    # First: MWMS must configure the collective runtime before any other op runs.
    options = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    if strategy.num_replicas_in_sync != workers:
        raise ConfigError(f"mwms expected {workers} replicas from {TF_CONFIG} but the strategy "
                          f"has {strategy.num_replicas_in_sync} (one CPU replica per worker)")
    with strategy.scope():
        model = models.BenchModel(spec)
        optimizer = keras.optimizers.SGD(learning_rate=spec.lr)
        optimizer.build(model.trainable_variables)  # slots made now, not inside a trace
    step_fn = models.train_fn(model, optimizer, 1.0 / strategy.num_replicas_in_sync)
    batches = iter(models.dataset(spec, rank))
    last = {"loss": float("nan")}

    @tf.function
    def train(batch):
        return strategy.run(step_fn, args=(batch,))

    def step():
        losses = strategy.experimental_local_results(train(next(batches)))
        last["loss"] = float(losses[0])

    return Built(measure.Trainer(step=step, rank=rank, workers=workers,
                                 global_batch=spec.batch_per_worker * workers,
                                 agree_max=_mwms_max(strategy), loss=lambda: last["loss"]),
                 model, strategy, step_fn)


def _mwms_max(strategy):
    """A collective maximum over the MWMS workers (tf.distribute.ReduceOp has no MAX, so
    every worker all-gathers the values and takes the largest)."""
    import tensorflow as tf

    @tf.function
    def gather(value):
        def replica_fn():
            context = tf.distribute.get_replica_context()
            return context.all_gather(tf.reshape(value, [1]), axis=0)
        return strategy.run(replica_fn)

    def agree_max(value: float) -> float:
        gathered = strategy.experimental_local_results(gather(tf.constant(value, tf.float64)))
        return float(tf.reduce_max(gathered[0]))
    return agree_max


# --------------------------------------------------------------------------- tf_ps


def serve(role: str) -> int:
    """A TF worker or ps server: serves the coordinator's functions/variables until killed."""
    config = tf_config(("chief", "worker", "ps"))
    if config["task"]["type"] != role:
        raise ConfigError(f"--role {role} but {TF_CONFIG} makes this task "
                          f"{config['task']['type']!r}; they must agree")
    # TF's PS tutorial: lets the coordinator, not gRPC, handle a server that goes away.
    os.environ["GRPC_FAIL_FAST"] = "use_caller"
    import tensorflow as tf

    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    server = tf.distribute.Server(resolver.cluster_spec(), job_name=resolver.task_type,
                                  task_index=resolver.task_id,
                                  protocol=resolver.rpc_layer or "grpc", start=True)
    server.join()  # never returns; the harness kills the process when the run is over
    return 0


def build_tf_ps(spec: workloads.WorkloadSpec) -> Built:
    """The coordinator: one `step()` schedules one local batch on each of the W workers."""
    config = tf_config(("chief", "worker", "ps"))
    if config["task"]["type"] != "chief":
        raise ConfigError(f"tf_ps trains from the 'chief' task; {TF_CONFIG} names "
                          f"{config['task']['type']!r}")
    workers = len(config["cluster"]["worker"])
    strategy, coordinator = _ps_strategy(len(config["cluster"]["ps"]))
    model, optimizer = _ps_model(strategy, spec)
    import tensorflow as tf


    step_fn = models.train_fn(model, optimizer, 1.0 / strategy.num_replicas_in_sync)
    iterator = iter(coordinator.create_per_worker_dataset(_union_dataset_fn(spec, workers)))

    @tf.function
    def train(per_worker_iterator):
        return strategy.run(step_fn, args=(next(per_worker_iterator),))

    pending = {"value": None}
    last = {"loss": float("nan")}

    def step():
        for _ in range(workers):
            pending["value"] = coordinator.schedule(train, args=(iterator,))

    def sync():
        coordinator.join()
        if pending["value"] is not None:
            last["loss"] = float(pending["value"].fetch())

    return Built(measure.Trainer(step=step, rank=0, workers=workers,
                                 global_batch=spec.batch_per_worker * workers, sync=sync,
                                 loss=lambda: last["loss"]),
                 model, strategy, step_fn)


def _ps_strategy(num_ps: int):
    os.environ["GRPC_FAIL_FAST"] = "use_caller"
    import tensorflow as tf

    partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(
        min_shard_bytes=MIN_SHARD_BYTES, max_shards=num_ps)
    strategy = tf.distribute.ParameterServerStrategy(
        tf.distribute.cluster_resolver.TFConfigClusterResolver(),
        variable_partitioner=partitioner)
    return strategy, tf.distribute.coordinator.ClusterCoordinator(strategy)


def _ps_model(strategy, spec: workloads.WorkloadSpec):
    """Model and optimizer on the ps tasks. Keras' SGD works there as is: its update for an
    IndexedSlices gradient is `variable.scatter_sub`, which each shard runs on its own ps."""
    import keras

    with strategy.scope():
        model = models.BenchModel(spec)
        optimizer = keras.optimizers.SGD(learning_rate=spec.lr)
        optimizer.build(model.trainable_variables)
    return model, optimizer


def _union_dataset_fn(spec: workloads.WorkloadSpec, workers: int):
    """Every worker's dataset: the W per-rank pools interleaved, each worker cycling it all.

    A per-worker dataset function is traced once and sent to every worker, so it cannot
    know its worker's index (the InputContext PSS passes is the same for all), and the
    coordinator sends each scheduled step to whichever worker is free, so "rank w's batches
    on worker w" would mean nothing anyway. The union keeps the same batches (and batch
    size) as the synchronous systems use over W ranks.
    """
    import tensorflow as tf

    def dataset_fn():
        datasets = [models.dataset(spec, rank) for rank in range(workers)]
        choice = tf.data.Dataset.range(workers).repeat()
        return tf.data.Dataset.choose_from_datasets(datasets, choice).prefetch(2)
    return dataset_fn
