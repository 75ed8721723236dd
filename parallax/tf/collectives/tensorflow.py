"""Dense collectives over TensorFlow's own collective ops, the engine MultiWorkerMirroredStrategy
uses (CollectiveReduceV2 / CollectiveGatherV2 in a ring over each worker's TensorFlow server),
for workers started without Horovod: on TensorFlow releases Horovod does not build for.

Every worker learns the job's workers from the launcher (`parallax.env.WORKERS_ENV` and
`WORKER_RANK_ENV`, which `parallax run` sets) or from TF_CONFIG's "chief" and "worker" tasks
(a TFJob's), and serves TensorFlow's collective service on its own address among them.

A collective is matched across workers by its instance key, which every worker assigns in
the order it makes (or traces) its collectives: workers run the same program, as under
MultiWorkerMirroredStrategy. One instance key keeps one shape: a dense all-reduce packs every
gradient of one dtype into one buffer (one collective per dtype and step); a sparse gradient
is summed as the dense tensor it stands for; an object is gathered with its length first,
each eager gather under a key of its own.
"""
from __future__ import annotations

import copy
import itertools
import json
import pickle
import socket
import threading
from typing import Any, Mapping, Sequence

import numpy as np
import tensorflow as tf

from parallax.client.cluster import parse_addresses
from parallax.env import TF_CONFIG_ENV, WORKER_RANK_ENV, WORKERS_ENV, tf_heartbeat_seconds
from parallax.errors import ConfigError
from parallax.tf.collectives.workers import WorkerInfo

# No timeout: a collective waits for its slowest peer, as Horovod's do (a chief's long
# evaluation or checkpoint must not fail the job); a dead peer ends the job through the
# launcher, which watches every worker.
COLLECTIVE_TIMEOUT_S = 0.0
# What CollectiveReduceV2 sums; other integer and bool tensors travel as int64 (exact).
_REDUCIBLE = (tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int32, tf.int64)
_GROUP_KEY = 1                # every worker is in the one group
_JOB = "worker"
LOCAL_AGGREGATION_NEEDS_HOROVOD = (
    "local aggregation gathers each step's sparse gradients, whose row counts change from "
    "step to step, and TensorFlow's collectives gather one shape per collective: run it "
    "with Horovod (parallax run --collectives horovod), or drop local_aggregation")
# One collective service per process, started by the first strategy; later strategies of the
# process (several jobs in turn) share it, and its instance keys, which must never repeat.
_SERVING: tuple[tuple[str, ...], int] | None = None
_KEYS = itertools.count(1)
_KEYS_LOCK = threading.Lock()


def collective_workers(environ: Mapping[str, str]) -> tuple[list[str], int] | None:
    """(every worker's collective address, in rank order; this worker's rank) from the
    launcher's variables or TF_CONFIG's chief and worker tasks; None when neither names
    several workers."""
    if environ.get(WORKERS_ENV):
        addresses = list(parse_addresses(environ[WORKERS_ENV], WORKERS_ENV))
        rank = environ.get(WORKER_RANK_ENV, "")
        if not rank.isdigit() or int(rank) >= len(addresses):
            raise ConfigError(f"{WORKER_RANK_ENV}={rank!r} must be this worker's index in "
                              f"{WORKERS_ENV} (0..{len(addresses) - 1})")
        return (addresses, int(rank)) if len(addresses) > 1 else None
    if environ.get(TF_CONFIG_ENV):
        return _tf_config_workers(environ[TF_CONFIG_ENV])
    return None


def _tf_config_workers(text: str) -> tuple[list[str], int] | None:
    try:
        config = json.loads(text)
        cluster, task = config["cluster"], config.get("task")
        chiefs, workers = cluster.get("chief", []), cluster.get("worker", [])
        if not all(isinstance(x, list) for x in (chiefs, workers)):
            raise TypeError("cluster.chief and cluster.worker must be lists of \"host:port\"")
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise ConfigError(f"{TF_CONFIG_ENV} is not a TensorFlow cluster description ({exc})"
                          ) from None
    if len(chiefs) + len(workers) < 2:
        return None
    addresses = list(parse_addresses(",".join(map(str, chiefs + workers)),
                                     f"{TF_CONFIG_ENV} cluster.chief/worker"))
    if not isinstance(task, dict):
        raise ConfigError(f"{TF_CONFIG_ENV} names {len(addresses)} workers but no \"task\" "
                          f"(which one this process is): give {{\"task\": {{\"type\": "
                          f"\"worker\", \"index\": N}}}}")
    kind, index = task.get("type"), task.get("index")
    if kind not in ("chief", "worker"):
        return None  # a ps or evaluator task takes no part in the collectives
    tasks = chiefs if kind == "chief" else workers
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(tasks):
        raise ConfigError(f"{TF_CONFIG_ENV} task index {index!r} is not one of the "
                          f"{len(tasks)} {kind} tasks (0..{len(tasks) - 1})")
    return addresses, index if kind == "chief" else len(chiefs) + index


class TensorFlowWorkers:
    """Peers over TensorFlow's collective ops (`BACKENDS["tensorflow"]`)."""

    def __init__(self, addresses: Sequence[str], rank: int) -> None:
        global _SERVING
        self.addresses, self.size = list(addresses), len(addresses)
        if _SERVING is None:
            _start_collective_service(self.addresses, rank)
            _SERVING = (tuple(self.addresses), rank)
        elif _SERVING != (tuple(self.addresses), rank):
            raise ConfigError(f"this process already serves TensorFlow's collectives as worker "
                              f"{_SERVING[1]} of {list(_SERVING[0])}; it cannot become worker "
                              f"{rank} of {self.addresses} (one job's workers per process)")
        host = self.addresses[rank].rsplit(":", 1)[0]
        local = [i for i, a in enumerate(self.addresses) if a.rsplit(":", 1)[0] == host]
        self.info = WorkerInfo(rank, self.size, local.index(rank), len(local),
                               socket.gethostname())
        self.device = f"/job:{_JOB}/replica:0/task:{rank}/device:CPU:0"

    # ---- the interface --------------------------------------------------------------------
    def allreduce_sum(self, tensors: Sequence[Any]) -> list[Any]:
        """Sum every tensor over the workers, packed per dtype into one all-reduce. An
        IndexedSlices is summed as the dense tensor it stands for (the sum Horovod's
        all-gather gives; TensorFlow's gathers need one shape per collective, and a
        gradient's row count changes from step to step)."""
        dense = [tf.convert_to_tensor(t) for t in tensors]
        out: list[Any] = list(dense)
        by_dtype: dict[tf.DType, list[int]] = {}
        for i, t in enumerate(dense):
            by_dtype.setdefault(_carrier(t.dtype), []).append(i)
        for carrier, positions in by_dtype.items():
            summed = self._sum_packed([tf.cast(dense[i], carrier) for i in positions])
            for i, total in zip(positions, summed):
                out[i] = tf.cast(total, dense[i].dtype)  # (no op where it is that dtype)
        return out

    def local_allgather(self, tensor: tf.Tensor) -> tf.Tensor:
        raise ConfigError(LOCAL_AGGREGATION_NEEDS_HOROVOD)

    def allgather_rows(self, tensors: Sequence[Any]) -> list[Any]:
        """Concatenate each tensor along axis 0 over every worker, in rank order. Row counts
        may differ (zero included): each is padded to the largest, gathered, and unpadded."""
        return [self._gather_rows(tf.convert_to_tensor(t)) for t in tensors]

    def broadcast_variables(self, variables: Sequence[tf.Variable]) -> None:
        """Every variable takes rank 0's value (others add zeros to it: exact)."""
        if not variables:
            return
        mine = [tf.convert_to_tensor(v) if self.info.is_chief else tf.zeros(v.shape, v.dtype)
                for v in variables]
        for variable, value in zip(variables, self.allreduce_sum(mine)):
            variable.assign(value)

    def allgather_object(self, obj: Any) -> list[Any]:
        data = pickle.dumps(obj)
        lengths = self._gather(tf.constant([len(data)], tf.int64)).numpy()
        padded = bytearray(-(-int(lengths.max()) // 8) * 8)  # as int64s: the gather's dtypes
        padded[:len(data)] = data
        every = self._gather(tf.constant(np.frombuffer(padded, np.int64)[None, :])).numpy()
        return [pickle.loads(every[r].tobytes()[:int(n)]) for r, n in enumerate(lengths)]

    def broadcast_object(self, obj: Any) -> Any:
        return self.allgather_object(obj if self.info.is_chief else None)[0]

    # ---- the collectives ------------------------------------------------------------------
    def _key(self) -> int:
        """The next instance key: the same on every worker for the same collective."""
        with _KEYS_LOCK:
            return next(_KEYS)

    def _sum_packed(self, tensors: Sequence[Any]) -> list[tf.Tensor]:
        flat = tf.concat([tf.reshape(t, [-1]) for t in tensors], axis=0)
        with tf.device(self.device):
            summed = tf.raw_ops.CollectiveReduceV2(
                input=flat, group_size=self.size, group_key=_GROUP_KEY,
                instance_key=self._key(), ordering_token=[], merge_op="Add", final_op="Id",
                communication_hint="ring", timeout_seconds=COLLECTIVE_TIMEOUT_S)
        sizes = [tf.size(t) for t in tensors]
        return [tf.reshape(part, tf.shape(t))
                for part, t in zip(tf.split(summed, sizes), tensors)]

    def _call_key(self):
        """An instance key taken when the function runs, not when it is traced (as
        MultiWorkerMirroredStrategy's): for collectives whose shapes change from call to
        call, in functions a worker may trace again when another does not (Keras' predict
        function is traced per input shape, and the workers' parts of a batch differ)."""
        graph = tf.compat.v1.get_default_graph()
        while getattr(graph, "is_control_flow_graph", False):
            graph = graph.outer_graph
        if tf.executing_eagerly() or not graph.building_function:
            with tf.device("CPU:0"):
                return tf.constant(self._key(), tf.int32)
        with graph.as_default():
            return graph.capture_call_time_value(self._call_key, tf.TensorSpec([], tf.int32))

    def _gather_rows(self, tensor: tf.Tensor) -> tf.Tensor:
        rows = tf.shape(tensor, out_type=tf.int64)[:1]
        counts = self._gather(rows, self._call_key())
        most = tf.reduce_max(counts)
        padding = [[0, most - rows[0]]] + [[0, 0]] * (tensor.shape.rank - 1)
        every = self._gather(tf.pad(tensor, padding), self._call_key())
        return tf.boolean_mask(every, tf.reshape(tf.sequence_mask(counts, most), [-1]))

    def _gather(self, tensor: tf.Tensor, key=None) -> tf.Tensor:
        """Concatenate equal-shaped `tensor`s of every worker along axis 0, in rank order."""
        with tf.device(self.device):
            return tf.raw_ops.CollectiveGatherV2(
                input=tensor, group_size=self.size, group_key=_GROUP_KEY,
                instance_key=self._key() if key is None else key, ordering_token=[],
                communication_hint="ring", timeout_seconds=COLLECTIVE_TIMEOUT_S)


def _start_collective_service(addresses: Sequence[str], rank: int) -> None:
    """Serve TensorFlow's collectives at addresses[rank], with worker 0 leading, as
    MultiWorkerMirroredStrategy sets its context up; before any other TensorFlow work."""
    from tensorflow.core.protobuf import tensorflow_server_pb2
    from tensorflow.python.eager import context

    leader = f"/job:{_JOB}/replica:0/task:0"
    ctx = context.context()
    try:
        ctx.configure_collective_ops(collective_leader=leader,
                                     scoped_allocator_enabled_ops=("CollectiveReduce",),
                                     device_filters=(f"/job:{_JOB}/task:{rank}",))
    except RuntimeError:
        raise ConfigError("create ParallaxStrategy before any other TensorFlow work (tensors, "
                          "datasets, models) in a job of several workers without Horovod: "
                          "TensorFlow's collectives must be set up before its runtime starts, "
                          "as for MultiWorkerMirroredStrategy") from None
    ctx.configure_coordination_service(
        service_type="standalone", service_leader=leader,
        heartbeat_timeout_in_ms=int(tf_heartbeat_seconds() * 1000),
        coordinated_jobs=[_coordination_protos(context).CoordinatedJob(
            name=_JOB, num_tasks=len(addresses))])
    config = copy.deepcopy(ctx.config)
    config.experimental.collective_group_leader = leader
    del config.device_filters[:]
    config.device_filters.append(f"/job:{_JOB}/task:{rank}")
    port = int(addresses[rank].rsplit(":", 1)[1])
    server_def = tensorflow_server_pb2.ServerDef(
        cluster=tf.train.ClusterSpec({_JOB: list(addresses)}).as_cluster_def(),
        default_session_config=config, job_name=_JOB, task_index=rank, protocol="grpc",
        port=port)
    ctx.enable_collective_ops(server_def)
    ctx.ensure_initialized()


def _coordination_protos(context):
    """TensorFlow's coordination_config_pb2, wherever this release keeps it (tensorflow.tsl
    up to 2.17, tensorflow.compiler.xla.tsl since): as its eager context imported it."""
    return context.coordination_config_pb2


def _carrier(dtype: tf.DType) -> tf.DType:
    """The dtype a tensor is summed in: its own where CollectiveReduceV2 takes it, int64 for
    other integers and bools (exact)."""
    if dtype in _REDUCIBLE:
        return dtype
    if dtype.is_integer or dtype == tf.bool:
        return tf.int64
    raise ConfigError(f"TensorFlow's collectives cannot sum {dtype.name} tensors; use Horovod "
                      f"(parallax run --collectives horovod) for this model")
