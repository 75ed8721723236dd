"""A variable's rows on the parameter servers, as TensorFlow ops with gradients.

`RemoteTable` is a `parallax.client.table_rows.TableRows` (the numpy side: ids, pushes in
flight, counters, the id check) with the graph side added here. Lookup: ids -> tf.unique ->
pull the unique rows (the step's fused pull, `parallax.tf.graph.fusion`, or one numpy_function op
of its own) -> gather with the inverse indices. The pull is recorded on the gradient tape
against the variable's handle, with a backward function that returns an `IndexedSlices` over
the *global* ids, so the optimizer hands the strategy exactly what must be pushed: unique ids
and their summed gradients. Sync steps: a pull waits until the servers applied every step
this worker pushed (`min_step`), so all workers read the same rows.
"""
from __future__ import annotations

import threading

import numpy as np
import tensorflow as tf
from tensorflow.python.eager import record
from tensorflow.python.ops import control_flow_util
from tensorflow.python.ops.resource_variable_ops import variable_accessed

from parallax.client import ShardedTable
from parallax.client.table_rows import TablePushes, TableRows
from parallax.errors import ConfigError
from parallax.protocol import wire
from parallax.protocol.specs import ZERO_RATE

# A push's rate of 0 means "the table's optimizer spec's" on the wire. A Keras rate that is
# 0 (a schedule's warmup start or decayed end, a `LearningRateScheduler` returning 0) travels
# as ZERO_RATE, the smallest normal double, instead (not a subnormal, which TensorFlow may
# flush to 0), which a float32 table reads as 0 and which moves no float64 weight above about
# 1e-292: the update Keras applies at a rate of 0 (Ftrl, which divides by the rate, is
# refused there: Keras' own gives NaN).


def pushed_rate(learning_rate) -> tf.Tensor:
    """The float64 rate a push sends for the optimizer's `learning_rate` (None: the table's
    spec's)."""
    if learning_rate is None:
        return tf.constant(0.0, tf.float64)
    rate = tf.cast(learning_rate, tf.float64)
    return tf.where(tf.equal(rate, 0.0), tf.constant(ZERO_RATE, tf.float64), rate)


def in_xla_function() -> bool:
    """Whether the graph being traced is (or is nested in) a `tf.function(jit_compile=True)`
    (TensorFlow enters an XLA context while tracing one)."""
    return not tf.executing_eagerly() and control_flow_util.GraphOrParentsInXlaContext(
        tf.compat.v1.get_default_graph())


class StepTrace:
    """One training step as the strategy traces it: its fusion (`fusion`, a
    parallax.tf.graph.fusion.StepFusion, or None: every lookup and push makes its own op) and
    the tables whose lookups made its gradients (`owner_of`).

    The strategy makes one for each step it traces and keeps it (its pushes and its gradient
    routing ask it directly). The lookups reach it by one thread-local, `traced_here`: a
    lookup is TensorFlow calling `ParallaxVariable.sparse_read(ids)` (`tf.gather`,
    `tf.nn.embedding_lookup`, Keras' `Embedding`), a call with no room for a handle, and the
    variable is shared by every step and thread while the trace is of one step on one
    thread. `begin_here` makes a trace the one of this thread's step; it stays that until the
    next step begins here, its fusion cleared by `end_lookups` once the step's own lookups
    are traced. A strategy traces one step at a time (its pushes of the step being traced are
    held by the strategy, as they were before traces were objects): two threads tracing
    steps of one strategy at once are not supported.
    """

    def __init__(self, fusion=None) -> None:
        self.fusion = fusion
        self._owners: dict = {}  # {a lookup's dense_shape tensor .ref(): its RemoteTable}
        self._updated: set[int] = set()  # id() of the tables this traced step updated so far

    def begin_here(self) -> StepTrace:
        """Make this the trace that lookups on this thread record in (and return it)."""
        _HERE.trace = self
        return self

    @staticmethod
    def traced_here() -> StepTrace:
        """The trace of the step traced last on this thread (an empty one before any)."""
        trace = getattr(_HERE, "trace", None)
        return trace if trace is not None else StepTrace().begin_here()

    def end_lookups(self) -> None:
        """What follows is the step's own tail, not its lookups: no more fusing."""
        self.fusion = None

    def record_update(self, remote: RemoteTable) -> None:
        """The step being traced pushes an update of `remote` (at its end)."""
        self._updated.add(id(remote))

    def end_updates(self) -> None:
        """The step was traced: later lookups are another step's."""
        self._updated.clear()

    def check_not_updated(self, remote: RemoteTable) -> None:
        """Refuse a traced lookup of a table the same step already updated: the step's rows
        are pulled before its update and the update pushed at its end, so the lookup would
        silently read the rows from before it (TensorFlow reads them after)."""
        if id(remote) in self._updated and not tf.executing_eagerly():
            raise ConfigError(
                f"{remote.label!r} is read after the optimizer updated it in the same step "
                f"(one strategy.run): its rows on the parameter servers change only when the "
                f"step ends, so this read would return the rows from before the update, where "
                f"TensorFlow returns them after. Update and read it in separate steps: end the "
                f"step after apply_gradients and read in the next strategy.run (several "
                f"updates: one strategy.run each; in a Keras train_step, compute the metrics "
                f"from the predictions made before the update)")

    def record_lookup(self, dense_shape: tf.Tensor, remote: RemoteTable) -> None:
        """`remote`'s lookup made a gradient whose `dense_shape` is this tensor."""
        self._owners[dense_shape.ref()] = remote

    def owner_of(self, grad) -> RemoteTable | None:
        """The table whose lookup, traced in this step, produced this IndexedSlices gradient
        (the tape keeps the `dense_shape` tensor of the first lookup when it aggregates
        several): the tensor itself identifies it."""
        if not isinstance(grad, tf.IndexedSlices) or grad.dense_shape is None or \
                not self._owners:
            return None
        return self._owners.get(grad.dense_shape.ref())


_HERE = threading.local()  # .trace: this thread's StepTrace (`StepTrace.traced_here`)


class RemoteTable(TableRows):
    """The servers' copy of one variable (`TableRows`) with the TensorFlow ops that read it
    and push its gradient; `shape` and `dtype` are the variable's, as TensorFlow has them."""

    def __init__(self, label: str, shape: tf.TensorShape, dtype: tf.DType,
                 table: ShardedTable, *, sync: bool, worker: int = 0,
                 sends_pushes: bool = True, offset: int = 0,
                 pushes: TablePushes | None = None, keyed: bool = False) -> None:
        self.shape = tf.TensorShape(shape)
        self.dtype = dtype
        super().__init__(label, self.shape.as_list(), dtype.as_numpy_dtype, table, sync=sync,
                         worker=worker, sends_pushes=sends_pushes, offset=offset,
                         pushes=pushes, keyed=keyed)

    def slot_values(self, name: str, fill: float) -> np.ndarray:
        """This variable's rows of the servers' optimizer slot `name`, read between steps
        (once this worker's pushes landed): each touched row's, `fill` (the slot's initial
        value) for the rest."""
        self.land_pushes()
        out = np.full((self.rows, self.dim), fill, self.np_dtype)
        for shard in range(self.table.spec.shard_count):
            for page in self.table.export_pages(shard):
                if name not in page.slot_names or not (page.ids.shape and page.ids.shape[0]):
                    continue
                ids = wire.decode(page.ids, "ids") - self.offset  # a table group's rows
                slot = wire.decode(page.slots[list(page.slot_names).index(name)], "slot")
                mine = (ids >= 0) & (ids < self.rows)
                out[ids[mine]] = slot.reshape(len(ids), self.dim)[mine]
        return out.reshape(self.shape)

    # ---- graph side ----

    def gather(self, var: tf.Variable, ids) -> tf.Tensor:
        """Rows of `ids` (any shape); differentiable with respect to `var`."""
        ids = tf.convert_to_tensor(ids)
        if not ids.dtype.is_integer:
            raise ConfigError(f"lookup in {self.label!r}: ids must be integers, got {ids.dtype}")
        StepTrace.traced_here().check_not_updated(self)
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
        group this lookup (parallax.tf.graph.fusion), else from an op of its own. Refused
        in a function XLA compiles (`tf.function(jit_compile=True)` around the model, inside
        the step): XLA has no kernel for the pull, and the lookup failed there with an
        unrelated reshape error."""
        if in_xla_function():
            raise ConfigError(
                f"{self.label!r} is read inside a tf.function(jit_compile=True), but XLA "
                f"cannot compile the op that pulls its rows from the parameter servers. Drop "
                f"jit_compile=True from that function (XLA may still compile functions that "
                f"read no table on the servers)")
        step = StepTrace.traced_here().fusion
        rows = step.lookup(self, unique) if step is not None else None
        if rows is None:
            rows = tf.numpy_function(pull, [unique], self.dtype, stateful=True, name=name)
        return rows

    def _record(self, var: tf.Variable, rows: tf.Tensor, ids: tf.Tensor) -> None:
        """Put `rows` (pulled for `ids`) on the gradient tape as a read of `var`."""
        dense_shape = tf.constant(self.shape.as_list() or [1], tf.int64)
        StepTrace.traced_here().record_lookup(dense_shape, self)  # whose gradient this will be

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
        return ids, tf.cast(values, self.dtype), pushed_rate(learning_rate)

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
