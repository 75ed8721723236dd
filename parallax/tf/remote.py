"""A variable's rows on the parameter servers, as TensorFlow ops with gradients.

Lookup: ids -> tf.unique -> pull the unique rows (one numpy_function op calling the gRPC
client) -> gather with the inverse indices. The pull is recorded on the gradient tape against
the variable's handle, with a backward function that returns an `IndexedSlices` over the
*global* ids, so the optimizer hands the strategy exactly what must be pushed: unique ids and
their summed gradients. Sync steps: a pull waits until the servers applied every step this
worker pushed (`min_step`), so all workers read the same rows.

Sync pushes complete in the background: the push op hands the gradient (copied) to an RPC
thread and returns, so a step's pushes to many tables overlap one another and the rest of
the step instead of costing one round trip each, in turn. Nothing can read a table before
its pushes are in: the next pull of the table first waits for them (and raises their error,
if any), the servers make that pull wait for the step anyway, and exit waits for what is
still in flight.
"""
from __future__ import annotations

import atexit
import logging
import math
import os
import threading
import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import tensorflow as tf
from tensorflow.python.eager import record
from tensorflow.python.ops.resource_variable_ops import variable_accessed

from parallax.client import ShardedTable
from parallax.client.connection import run_in_background
from parallax.tf.step_traffic import land_pushes_of
from parallax.errors import ConfigError
from parallax.protocol.routing import out_of_range

log = logging.getLogger("parallax")


class _StepSlot(threading.local):
    """What the strategy knows of the step being traced on this thread."""

    fusion = None  # its parallax.tf.fusion.StepFusion
    owners: dict | None = None  # {lookup's dense_shape tensor .ref(): its RemoteTable}


_STEP = _StepSlot()


def fusion_of_step():
    """The StepFusion of the training step being traced on this thread, or None."""
    return _STEP.fusion


def set_fusion_of_step(fusion) -> None:
    _STEP.fusion = fusion


@dataclass
class TableTraffic:
    """Bytes and calls of one table on this worker, for logs and benchmarks."""

    pulls: int = 0
    pulled_rows: int = 0
    pushes: int = 0
    pushed_rows: int = 0
    pull_seconds: float = 0.0  # wall time of pulls (waits included), for the partitioner
    push_seconds: float = 0.0  # wall time of push RPCs, in the background or not
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


class TablePushes:
    """This worker's pushes to one server table: the step it pushes next, the pushes in
    flight, whether a pull came since the last push. The variables of a table group share
    one (their table gets one push per step, carrying all of them)."""

    def __init__(self) -> None:
        self.steps = 0
        self.in_flight: list[Future] = []
        self.lock = threading.Lock()
        self.pulled_since_push = True


class RemoteTable:
    """The servers' copy of one variable, seen as a [rows, dim] table: rows `offset` to
    `offset + rows` of the server table `table` (offset 0 unless the variable is in a table
    group, whose members share `pushes`). `keyed`: a dynamic table (DynamicEmbedding), whose
    ids are any int64 keys, held or not (the servers admit and evict rows); `shape` is then
    only the layer's local stand-in, and the table has no whole value to read or assign."""

    def __init__(self, label: str, shape: tf.TensorShape, dtype: tf.DType,
                 table: ShardedTable, *, sync: bool, worker: int = 0,
                 sends_pushes: bool = True, offset: int = 0,
                 pushes: TablePushes | None = None, keyed: bool = False) -> None:
        self.label = label  # the user's name for the variable, used in every message
        self.shape = tf.TensorShape(shape)
        self.dtype = dtype
        self.rows = int(self.shape[0]) if self.shape.rank else 1
        self.row_shape = self.shape.as_list()[1:]
        self.dim = int(math.prod(self.row_shape)) if self.row_shape else 1
        self.table = table
        self.offset = offset
        self.keyed = keyed
        self.table_rows = None if keyed else offset + self.rows if pushes is None else \
            table.router.vocabulary_size  # the server table's (a group's: all members')
        self.sync = sync
        self.worker = worker  # this worker's index among those that push
        self.sends_pushes = sends_pushes  # False on non-root workers under local aggregation
        self.pushes = pushes or TablePushes()
        self.traffic = TableTraffic()
        self._np_dtype = dtype.as_numpy_dtype
        self.id_sample: list[np.ndarray] | None = None  # pulled ids, while the tuner samples
        self.on_assign = None  # called with [table] after `assign_all` (a row cache forgets)
        _TABLES.add(self)

    # ---- numpy side: runs inside numpy_function ops ----

    def _check_ids(self, ids: np.ndarray) -> None:
        if self.keyed:
            return  # any int64 key
        bad = out_of_range(ids, self.rows)
        if bad is not None:
            raise ConfigError(f"table {self.label!r} has {self.rows} rows: id "
                              f"{int(ids[bad[0]])} is out of range [0, {self.rows}) "
                              f"({len(bad)} bad ids in this batch); check the "
                              f"vocabulary size of the layer and the input ids")

    @property
    def steps_pushed(self) -> int:
        """The step this worker pushes next to the table (a table group's, shared)."""
        return self.pushes.steps

    @steps_pushed.setter
    def steps_pushed(self, step: int) -> None:
        self.pushes.steps = step

    def table_ids(self, ids: np.ndarray) -> np.ndarray:
        """The server table's ids of this variable's (checked) ids."""
        return ids + self.offset if self.offset else ids

    def _min_step(self) -> int:
        return self.steps_pushed if self.sync else 0

    def wait_for_pushes(self, timeout: float | None = None) -> None:
        """Block until this worker's pushes to the table have landed (all of them, even
        after a failure); raise the first error."""
        land_pushes_of([self], timeout)

    def take_in_flight(self) -> list[Future]:
        """This table's pushes in flight, forgotten here: the caller waits for them."""
        pushes = self.pushes
        with pushes.lock:
            in_flight, pushes.in_flight = pushes.in_flight, []
        return in_flight

    def land_pushes(self) -> None:
        """Between steps: this worker's pushes have landed and, in sync mode, the servers
        applied every step it pushed (before a checkpoint, a reshard or an assign)."""
        self.wait_for_pushes()
        if self.sync:
            self.table.wait_step(self.steps_pushed)

    def pull_rows(self, unique: np.ndarray, full_precision: bool = False) -> np.ndarray:
        start = time.perf_counter()
        self.before_pull(unique)
        rows = self.table.pull_unique(self.table_ids(unique), min_step=self._min_step(),
                                      full_precision=full_precision)
        self.after_pull(unique, time.perf_counter() - start)
        return rows.astype(self._np_dtype, copy=False)

    def before_pull(self, unique: np.ndarray) -> int:
        """Checks before this table's rows are pulled: its pushes have landed, ids are in
        range. Returns the step the pull must wait for."""
        self.wait_for_pushes()
        self._check_ids(unique)
        return self._min_step()

    def min_step(self) -> int:
        """The step a pull must wait for (once this worker's pushes have landed)."""
        return self._min_step()

    def after_pull(self, unique: np.ndarray, seconds: float) -> None:
        self.pushes.pulled_since_push = True
        if self.id_sample is not None:
            self.id_sample.append(unique.copy())
        with self.traffic.lock:
            self.traffic.pulls += 1
            self.traffic.pulled_rows += len(unique)
            self.traffic.pull_seconds += seconds

    def pull_all_rows(self) -> np.ndarray:
        self._refuse_whole("read as a whole")
        return self.pull_rows(np.arange(self.rows, dtype=np.int64), full_precision=True)

    def pull_exact(self, unique: np.ndarray) -> np.ndarray:
        """Rows in the table's dtype whatever its wire dtype (eager reads: saving, export)."""
        return self.pull_rows(unique, full_precision=True)

    def push_rows(self, ids: np.ndarray, grads: np.ndarray, learning_rate) -> np.int64:
        step = self.steps_pushed
        job = self.prepare_push(ids, grads)
        if job is not None:
            if self.sync:
                # numpy_function's inputs may share TensorFlow's buffers, reused once the op
                # returns: the background push gets its own copies.
                future = run_in_background(self._timed_push, job[0].copy(), job[1].copy(),
                                           step, float(learning_rate))
                self.track_push(future)
            else:
                self._timed_push(*job, step, float(learning_rate))
        return np.int64(step)

    def prepare_push(self, ids: np.ndarray, grads: np.ndarray, checked: bool = False
                     ) -> tuple[np.ndarray, np.ndarray] | None:
        """This worker's push of the open step to the server table, checked and counted:
        (table ids, grads) to send, or None when this worker does not push (local
        aggregation). `ids`: this variable's, or, when the caller `checked` them, the
        server table's ids already (a fused push, which counts the rows itself)."""
        step = self.steps_pushed
        if not self.sends_pushes:
            self.steps_pushed = step + 1
            return None
        ids = ids.astype(np.int64, copy=False).reshape(-1)
        if not checked:
            self._check_ids(ids)
            self.count_push(len(ids))
            ids = self.table_ids(ids)
        grads = grads.reshape(len(ids), self.dim)
        if self.sync:
            if not self.pushes.pulled_since_push:
                # No pull since this table's last push (a table pushed but not read this
                # step): that pull would have waited for the push and for the step to
                # close; a push for the next step before that is refused as "ahead".
                self.wait_for_pushes()
                self.table.wait_step(step)
            self.pushes.pulled_since_push = False
            _drain_at_exit()
        self.steps_pushed = step + 1
        return ids, grads

    def count_push(self, rows: int) -> None:
        with self.traffic.lock:
            self.traffic.pushes += 1
            self.traffic.pushed_rows += rows

    def track_push(self, future: Future) -> None:
        """A push of this table in flight: the next pull, assign and exit wait for it."""
        with self.pushes.lock:
            self.pushes.in_flight.append(future)

    def _timed_push(self, ids: np.ndarray, grads: np.ndarray, step: int,
                    learning_rate: float) -> bool:
        start = time.perf_counter()
        try:
            return self.table.push(ids, grads, step=step, worker=self.worker,
                                   learning_rate=learning_rate)
        finally:
            self.add_push_seconds(time.perf_counter() - start)

    def add_push_seconds(self, seconds: float) -> None:
        with self.traffic.lock:
            self.traffic.push_seconds += seconds

    def assign_all(self, value) -> None:
        """Replace every row (eager), e.g. when weights are loaded into a trained model."""
        self._refuse_whole("assigned a whole value")
        values = np.asarray(value, dtype=self._np_dtype)
        if values.shape != tuple(self.shape.as_list()):
            raise ConfigError(f"cannot assign a value of shape {values.shape} to "
                              f"{self.label!r} of shape {tuple(self.shape.as_list())}")
        self.land_pushes()
        try:
            self.table.assign(self.table_ids(np.arange(self.rows, dtype=np.int64)),
                              values.reshape(self.rows, self.dim))
        finally:
            if self.on_assign is not None:
                self.on_assign([self.table])

    def _refuse_whole(self, what: str) -> None:
        if self.keyed:
            raise ConfigError(
                f"{self.label!r} is a DynamicEmbedding table: its rows live on the servers "
                f"keyed by any int64, so it cannot be {what}; read rows by key (call the "
                f"layer), export them with layer.export_rows() or layer.serving_layer(), and "
                f"save them with a tf.train.Checkpoint / Keras checkpoint in the strategy")

    # ---- graph side ----

    def gather(self, var: tf.Variable, ids) -> tf.Tensor:
        """Rows of `ids` (any shape); differentiable with respect to `var`."""
        ids = tf.convert_to_tensor(ids)
        if not ids.dtype.is_integer:
            raise ConfigError(f"lookup in {self.label!r}: ids must be integers, got {ids.dtype}")
        unique, inverse = tf.unique(tf.reshape(tf.cast(ids, tf.int64), [-1]), out_idx=tf.int32)
        rows = self._pull_op(unique, self.pull_rows, "parallax_pull")
        rows = tf.reshape(rows, [-1] + self.row_shape)
        self._record(var, rows, unique)
        out = tf.gather(rows, inverse)
        out = tf.reshape(out, tf.concat([tf.shape(ids), tf.constant(self.row_shape, tf.int32)],
                                        axis=0))
        out.set_shape(ids.shape.concatenate(self.row_shape))
        return out

    def read_all(self, var: tf.Variable) -> tf.Tensor:
        """The whole variable pulled from the servers. Its gradient is still delivered as an
        `IndexedSlices` (over every row) so the strategy knows it belongs to the servers and
        does not all-reduce it as well. Read eagerly (saving, `get_weights`, a checkpoint),
        the rows come in the table's own dtype, never a narrower wire dtype. A keyed table's
        whole value is its stand-in's zeros (what saving the variable writes; the servers'
        checkpoint holds the rows)."""
        if self.keyed:
            return tf.zeros(self.shape, self.dtype)
        every = tf.range(self.rows, dtype=tf.int64)
        pull = self.pull_exact if tf.executing_eagerly() else self.pull_rows
        rows = self._pull_op(every, pull, "parallax_pull_all")
        self._record(var, rows, every)
        return tf.reshape(rows, self.shape)

    def _pull_op(self, unique: tf.Tensor, pull, name: str) -> tf.Tensor:
        """The rows of `unique`: from the step's fused pull when the step being traced can
        group this lookup (parallax.tf.fusion), else from an op of its own."""
        step = fusion_of_step()
        rows = step.lookup(self, unique) if step is not None else None
        if rows is None:
            rows = tf.numpy_function(pull, [unique], self.dtype, stateful=True, name=name)
        return rows

    def _record(self, var: tf.Variable, rows: tf.Tensor, ids: tf.Tensor) -> None:
        """Put `rows` (pulled for `ids`) on the gradient tape as a read of `var`."""
        dense_shape = tf.constant(self.shape.as_list() or [1], tf.int64)
        if _STEP.owners is None:
            _STEP.owners = {}
        _STEP.owners[dense_shape.ref()] = self  # whose gradient this IndexedSlices will be

        def backward(grad_rows):
            if isinstance(grad_rows, tf.IndexedSlices):
                grad_rows = tf.math.unsorted_segment_sum(grad_rows.values, grad_rows.indices,
                                                         tf.shape(ids)[0])
            return [tf.IndexedSlices(tf.reshape(grad_rows, [-1] + self.row_shape), ids,
                                     dense_shape)]

        variable_accessed(var)
        record.record_operation("ParallaxPull", [rows], [var.handle], backward_function=backward)

    def push_inputs(self, grad, learning_rate=None) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
        """(ids, rows [n, dim], learning rate) of a gradient (IndexedSlices or dense)."""
        if isinstance(grad, tf.IndexedSlices):
            ids = tf.cast(grad.indices, tf.int64)
            values = tf.reshape(grad.values, [-1, self.dim])
        else:
            ids = tf.range(self.rows, dtype=tf.int64)
            values = tf.reshape(grad, [self.rows, self.dim])
        lr = tf.constant(0.0, tf.float64) if learning_rate is None else \
            tf.cast(learning_rate, tf.float64)
        return ids, tf.cast(values, self.dtype), lr

    def push(self, grad, learning_rate=None) -> tf.Tensor:
        """An op sending this step's gradient (IndexedSlices or dense) to the servers."""
        return self.push_op(*self.push_inputs(grad, learning_rate))

    def push_op(self, ids: tf.Tensor, rows: tf.Tensor, learning_rate: tf.Tensor) -> tf.Tensor:
        """The op sending converted push inputs (see `push_inputs`) on their own."""
        return tf.numpy_function(self.push_rows, [ids, rows, learning_rate], tf.int64,
                                 stateful=True, name="parallax_push")

    def empty_gradient(self) -> tf.IndexedSlices:
        """No rows: a sync step must hear from every worker, used or not."""
        return tf.IndexedSlices(tf.zeros([0, self.dim], self.dtype), tf.zeros([0], tf.int64))

    def push_nothing(self) -> tf.Tensor:
        """An empty push (see `empty_gradient`)."""
        return self.push(self.empty_gradient())


_TABLES: weakref.WeakSet[RemoteTable] = weakref.WeakSet()
_EXIT_DRAIN = threading.Lock()
_EXIT_DRAIN_REGISTERED = False
EXIT_PUSH_TIMEOUT = 60.0


def _forget_in_flight() -> None:
    """In a forked child: the parent's pushes in flight are the parent's to land."""
    for table in list(_TABLES):  # a lock another thread held at the fork stays held here
        table.pushes.in_flight, table.pushes.lock = [], threading.Lock()


os.register_at_fork(after_in_child=_forget_in_flight)


def _drain_at_exit() -> None:
    """Register `_land_pushes_in_flight` at the first background push, i.e. after embedded
    servers registered their own stop: exit handlers run last-registered first, so the last
    pushes land before those servers go away."""
    global _EXIT_DRAIN_REGISTERED
    with _EXIT_DRAIN:
        if not _EXIT_DRAIN_REGISTERED:
            atexit.register(_land_pushes_in_flight)
            _EXIT_DRAIN_REGISTERED = True


def _land_pushes_in_flight() -> None:
    """A program that ends right after its last step still delivers that step's pushes."""
    for table in list(_TABLES):
        try:
            table.wait_for_pushes(timeout=EXIT_PUSH_TIMEOUT)
        except Exception as err:  # noqa: BLE001 - exiting: report, do not mask the exit
            log.error("the last push to %r did not land, so the servers miss this worker's "
                      "last step: %s", table.label, err)


def owner_of_gradient(grad) -> RemoteTable | None:
    """The table whose lookup, traced on this thread since the step began, produced this
    IndexedSlices gradient (the tape keeps the `dense_shape` tensor of the first lookup when
    it aggregates several): the tensor itself identifies it."""
    if not isinstance(grad, tf.IndexedSlices) or grad.dense_shape is None or not _STEP.owners:
        return None
    return _STEP.owners.get(grad.dense_shape.ref())


def forget_gradient_owners() -> None:
    """A step begins on this thread: its lookups' gradients are the ones to recognise."""
    _STEP.owners = {}
