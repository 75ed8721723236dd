"""The variable the strategy creates in its scope: an ordinary resource variable until the
plan moves it to the parameter servers, then a view of remote rows.

Every variable made in `strategy.scope()` is a `ParallaxVariable`, because which ones are
sparse is only known after the first step is traced. Two consequences shape this class:
- Initialisation is deferred: a variable is created with empty storage and its initial
  value is computed the first time something reads it locally. Tables that go to the servers
  are never computed in full on a worker: the chief streams their initial rows chunk by chunk,
  the other workers never compute them. (TensorFlow's oneDNN CPU allocator keeps freed memory
  pooled, so a table computed once would stay in the worker's RSS for good.)
- Once the plan binds a `RemoteTable`, `sparse_read(ids)` (what `tf.gather(var, ids)` and
  `tf.nn.embedding_lookup` call, and what Keras' `ops.take` is routed to) pulls only the rows
  of `ids`, with an `IndexedSlices` gradient over global ids that is pushed, not applied; a
  whole read (`value()`, `numpy()`, `model.save`) pulls every row.
- A table's optimizer slots are released as constants (the servers keep the real ones): a
  read returns the slot's initial fill, except an eager read on the chief (a checkpoint's or
  Keras file's save, `optimizer.variables`), which exports the servers' slot, so such files
  restore into plain Keras with the optimizer's state.
"""
from __future__ import annotations

import contextlib
import contextvars
import inspect
import math
import logging
import threading
from typing import Callable, Iterator

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import gen_resource_variable_ops, resource_variable_ops

from parallax.errors import ConfigError, ParallaxError, ServerError

log = logging.getLogger("parallax")

_INIT_PARAMETERS = frozenset(inspect.signature(
    resource_variable_ops.ResourceVariable.__init__).parameters) - {"self"}
_tracing = threading.local()
# Set while a checkpoint whose tables the servers hold is written (a custom loop's held
# save: parallax.tf.state.held_checkpoints): tables and their released slots then save an
# empty value, not every row read from the servers, and restoring one leaves them as they
# are (the checkpoint's reference rolls the servers back to its mark).
WITHOUT_ROWS: contextvars.ContextVar[bool] = contextvars.ContextVar("parallax_without_rows",
                                                                    default=False)


@contextlib.contextmanager
def analysis_trace() -> Iterator[None]:
    """Reads made inside are traced, never run: they must not compute deferred values."""
    _tracing.active = True
    try:
        yield
    finally:
        _tracing.active = False


def _in_analysis() -> bool:
    return getattr(_tracing, "active", False)


_raised_in_ops: list = [None]  # the last ParallaxError a traced op raised (TF wraps it)


def raised_in_op(exc: Exception) -> ParallaxError | None:
    """The ParallaxError that a traced op raised, when `exc` is TF's error wrapping it."""
    error = _raised_in_ops[0]
    if error is not None and isinstance(exc, tf.errors.OpError) and str(error) in str(exc):
        return error
    return None


class ParallaxVariable(resource_variable_ops.ResourceVariable):
    """A resource variable that the strategy may bind to rows held by parameter servers."""

    _parallax_remote = None  # the RemoteTable holding the rows, once the plan moved them
    _parallax_index = -1     # creation order in the strategy: the same on every worker
    _parallax_fill = None    # set on released optimizer slots: what a read returns
    _parallax_slot = None    # (RemoteTable, slot name): where the chief reads a released one
    _parallax_init = None    # the deferred initial value (a callable), until computed
    _parallax_planned = False  # True once the plan decided where this variable lives
    _parallax_across_workers = None  # sync-on-read (metrics): local value -> all workers'
    dynamic_rows = None  # a parallax.placement.plan.DynamicRows: a DynamicEmbedding's table
    dynamic_initializer = None  # its Keras initializer, which the servers draw new rows from

    @classmethod
    def create(cls, index: int, **kwargs) -> "ParallaxVariable":
        """A deferred variable when the initial value is a Keras initializer call (the
        shape is then known without computing it), else an ordinary one."""
        kwargs = {k: v for k, v in kwargs.items() if k in _INIT_PARAMETERS}
        spec = _keras_initializer(kwargs.get("initial_value"))
        if spec is not None and spec[1].rank:
            _, full, dtype = spec
            kwargs.update(initial_value=tf.zeros([0] + full.as_list()[1:], dtype),
                          shape=tf.TensorShape([None] + full.as_list()[1:]), dtype=dtype)
            var = cls(**kwargs)
            var._shape = full  # noqa: SLF001 - TF's field: the logical shape (storage later)
            var._parallax_init = _DeferredValue(*spec)  # noqa: SLF001 - this module's class
        else:
            var = cls(**kwargs)
        var._parallax_index = index  # noqa: SLF001 - this module's class
        return var

    @property
    def remote(self):
        """The RemoteTable holding this variable's rows, or None while it is local."""
        return self._parallax_remote

    @property
    def parallax_index(self) -> int:
        """Creation order in the strategy: the same on every worker (the plan's key)."""
        return self._parallax_index

    @property
    def parallax_planned(self) -> bool:
        """Whether the plan has decided where this variable lives (then local reads need no
        run-time check)."""
        return self._parallax_planned

    @parallax_planned.setter
    def parallax_planned(self, planned: bool) -> None:
        self._parallax_planned = planned

    def aggregate_reads_with(self, aggregate) -> None:
        """A sync-on-read variable (a metric) reads `aggregate(local value)`: every worker's
        value combined, as MWMS does."""
        self._parallax_across_workers = aggregate

    def unbind_remote(self) -> None:
        """Read and write the local storage again (`ParallaxStrategy.local_tables`); the
        caller restores the storage's value and binds the table back after."""
        self._parallax_remote = None

    # ---- deferred initial values ----

    def materialize(self) -> None:
        """Compute the deferred initial value into local storage (idempotent)."""
        init, self._parallax_init = self._parallax_init, None
        if init is not None:
            with tf.init_scope():  # possibly called while a function is being traced
                restore_storage(self, init())

    def _before_local_run(self) -> np.bool_:
        """Runs before a local read traced before the plan: the variable may have moved."""
        if self._parallax_remote is not None:
            error = ParallaxError(
                f"variable {self.name!r} moved to the parameter servers after this function "
                f"was traced (before the first training step made the plan), so it would "
                f"read an empty local copy; trace the function again (a tf.function: call "
                f"a new one; Keras' own evaluate/predict functions are traced again by "
                f"themselves; others: model.make_predict_function(force=True) / "
                f"make_test_function(force=True))")
            _raised_in_ops[0] = error
            raise error
        self.materialize()
        return np.bool_(True)

    def _local_ready(self):
        """A context in which local reads and writes see the initial value. Eagerly: compute
        it now. While tracing: compute it when the traced op first runs (a graph traced only
        to infer shapes, like Keras' symbolic build, then never computes it); a function
        traced before the plan also checks, when it runs, that the variable did not move."""
        if _in_analysis() or (self._parallax_init is None and self._parallax_planned):
            return contextlib.nullcontext()
        if tf.executing_eagerly():
            self.materialize()
            return contextlib.nullcontext()
        ready = tf.numpy_function(self._before_local_run, [], tf.bool, stateful=True,
                                  name="parallax_local_value")
        return tf.control_dependencies([ready])

    def initial_chunks(self, chunk_bytes: int) -> Iterator[tuple[int, np.ndarray]]:
        """(first row, rows) of the initial value, without ever holding all of it when the
        initializer is a Keras initializer: chunks are drawn from the same distribution (not
        the same random draws as one call for the whole shape, for tables over chunk_bytes)."""
        if self._parallax_init is None:
            yield 0, self.numpy()
            return
        rows, rest = self.shape[0], self.shape.as_list()[1:]
        row_bytes = max(1, int(math.prod(rest)) * self.dtype.size)
        initializer = self._parallax_init.initializer
        if rows * row_bytes <= chunk_bytes:
            yield 0, np.asarray(self._parallax_init())
            return
        step = max(1, chunk_bytes // row_bytes)
        for lo in range(0, rows, step):
            hi = min(rows, lo + step)
            yield lo, np.asarray(initializer((hi - lo, *rest), dtype=self.dtype.name))

    @property
    def keras_initializer(self):
        """The Keras initializer of a deferred initial value (None once computed)."""
        init = self._parallax_init
        return init.initializer if isinstance(init, _DeferredValue) else None

    def forget_initial_value(self) -> None:
        self._parallax_init = None

    # ---- placement ----

    def bind_remote(self, remote) -> None:
        """Hand the rows to `remote` and free the local copy (shape metadata is kept)."""
        self._parallax_init = None
        release_storage(self)
        self._parallax_remote = remote

    def release_as_constant(self, source=None) -> None:
        """For optimizer slots of a table on the servers (the servers keep the real slots):
        free the storage; reads return the slot's initial fill, so saving a model with its
        optimizer still works, and assignments (loading such a model) are ignored. With
        `source` ((RemoteTable, slot name), given on the chief), eager reads (a checkpoint's
        or Keras file's save, `optimizer.variables`) return the servers' slot instead, so the
        file restores into plain Keras with the optimizer's real state."""
        self._parallax_slot = source
        first = next(self.initial_chunks(self.dtype.size))[1] if self._parallax_init \
            else self.numpy()
        flat = np.asarray(first).reshape(-1)
        self._parallax_fill = float(flat[0]) if flat.size else 0.0
        self._parallax_init = None
        release_storage(self)

    # ---- reads and writes ----

    def sparse_read(self, indices, name=None):
        if self._parallax_remote is not None:
            return self._parallax_remote.gather(self, indices)
        with self._local_ready():
            return super().sparse_read(indices, name=name)

    def _read_variable_op(self, no_copy=False):
        if self._parallax_remote is not None:
            return self._parallax_remote.read_all(self)
        if self._parallax_fill is not None:
            if self._parallax_slot is not None and tf.executing_eagerly():
                return tf.constant(self._servers_slot(), self.dtype)
            return tf.fill(self.shape, tf.constant(self._parallax_fill, self.dtype))
        with self._local_ready():
            value = super()._read_variable_op(no_copy=no_copy)
        value.set_shape(self.shape)  # deferred storage is [None, ...]; the value is not
        if self._parallax_across_workers is not None and tf.executing_eagerly() \
                and not self._in_own_replica_step():
            # A metric read outside a step (Keras' epoch logs, evaluate's result): like
            # MWMS' sync-on-read variables, the aggregate over all workers.
            value = self._parallax_across_workers(value, self.aggregation)
        return value

    def _servers_slot(self) -> np.ndarray:
        """A released slot's rows as the servers hold them; its initial fill, with a
        warning, when a shard is mid-step (another worker already pushed the next step while
        this one saves): a restore by parallax stays exact (the servers' checkpoint or the
        file's inline rows), one without parallax starts the slot afresh."""
        remote, name = self._parallax_slot
        try:
            return remote.slot_values(name, self._parallax_fill)
        except (ServerError, ConfigError) as err:
            log.warning("optimizer slot %r of %r was read as its initial value %g: the "
                        "servers' could not be read now (%s); a file saved now restores it "
                        "exactly with parallax only", name, remote.label,
                        self._parallax_fill, err)
            return np.full(self.shape, self._parallax_fill, remote.np_dtype)

    def _in_own_replica_step(self) -> bool:
        context = tf.distribute.get_replica_context()
        return context is not None and context.strategy is self._distribute_strategy

    def assign(self, value, use_locking=None, name=None, read_value=True):
        if self._parallax_fill is not None:
            return self if read_value else None
        if self._parallax_remote is not None:
            if not tf.executing_eagerly():
                raise ParallaxError(f"variable {self.name!r} lives on the parameter servers: "
                                    f"assign() a new value eagerly, not inside a tf.function")
            self._parallax_remote.assign_all(value)
            return self if read_value else None
        with self._local_ready():
            return super().assign(value, use_locking=use_locking, name=name,
                                  read_value=read_value)

    def _local_update(self, what: str):
        if self._parallax_remote is not None:
            raise ParallaxError(
                f"variable {self.name!r} lives on the parameter servers; {what} cannot change "
                f"it there. Update it through a Keras optimizer (apply_gradients / fit), which "
                f"the strategy forwards to the servers, or assign() a whole new value eagerly")
        return self._local_ready()

    def gather_nd(self, indices, name=None):
        with self._local_update("gather_nd"):
            return super().gather_nd(indices, name=name)

    def _export_to_saved_model_graph(self, object_map, tensor_map, options, **kwargs):
        if self._parallax_remote is not None and self._parallax_remote.keyed:
            raise ConfigError(
                f"variable {self.name!r} is a DynamicEmbedding's table, keyed rows on the "
                f"parameter servers: export a serving copy of the model, "
                f"`parallax.layers.serving_model(model, top_n=N)` (or keys=[...]), built "
                f"outside strategy.scope(); it holds those rows in a static lookup")
        if self._parallax_remote is not None:
            raise ConfigError(
                f"variable {self.name!r} lives on the parameter servers: a SavedModel exported "
                f"now would read it through a call back into this process and fail when served "
                f"anywhere else. Export inside `with strategy.local_tables():` (it pulls every "
                f"table into this worker for the duration), e.g. `with "
                f"strategy.local_tables(): model.export(path)`")
        return super()._export_to_saved_model_graph(object_map, tensor_map, options, **kwargs)

    def _serialize_to_tensors(self):
        if WITHOUT_ROWS.get() and (self._parallax_remote is not None or
                                   self._parallax_fill is not None):
            return {"VARIABLE_VALUE": tf.zeros([0], self.dtype)}  # (the servers hold them)
        return super()._serialize_to_tensors()

    def _restore_from_tensors(self, restored_tensors):
        value = next(iter(restored_tensors.values()))
        if value is not None and tf.executing_eagerly() and value.shape.num_elements() == 0 \
                and self.shape.num_elements():
            return None  # a held checkpoint's table (`WITHOUT_ROWS`): the servers hold it
        self._parallax_init = None  # a checkpoint's value replaces the deferred one
        if self._parallax_fill is not None:
            return None  # a released slot: the servers hold the real one
        if self._parallax_remote is not None and self._parallax_remote.keyed:
            return None  # a keyed table: the servers' checkpoint holds its rows
        if self._parallax_remote is not None:  # a table: the restored rows go to the servers
            self.assign(next(iter(restored_tensors.values())))
            return None
        return super()._restore_from_tensors(restored_tensors)


def _guarded(name: str):
    """An update method that refuses remote variables and computes deferred values first."""
    parent = getattr(resource_variable_ops.ResourceVariable, name)

    def method(self, *args, **kwargs):
        with self._local_update(name):
            return parent(self, *args, **kwargs)

    method.__name__ = name
    method.__doc__ = parent.__doc__
    return method


for _name in ("assign_add", "assign_sub", "scatter_add", "scatter_sub", "scatter_update",
              "scatter_max", "scatter_min", "scatter_mul", "scatter_div",
              "batch_scatter_update", "scatter_nd_add", "scatter_nd_sub", "scatter_nd_update",
              "scatter_nd_max", "scatter_nd_min"):
    setattr(ParallaxVariable, _name, _guarded(_name))


class _DeferredValue:
    """`initializer(shape, dtype)`, called when the value is needed."""

    def __init__(self, initializer: Callable, shape: tf.TensorShape, dtype: tf.DType) -> None:
        self.initializer, self.shape, self.dtype = initializer, shape, dtype

    def __call__(self):
        return self.initializer(tuple(self.shape.as_list()), dtype=self.dtype.name)


def _keras_initializer(init_fn) -> tuple[Callable, tf.TensorShape, tf.DType] | None:
    """Keras 3 passes `lambda: initializer(self._shape, dtype=self._dtype)` (self: the Keras
    variable): return (initializer, shape, dtype) read from that closure, or None."""
    if not callable(init_fn) or not getattr(init_fn, "__closure__", None):
        return None
    try:
        nonlocals = inspect.getclosurevars(init_fn).nonlocals
    except (TypeError, ValueError):
        return None
    initializer, owner = nonlocals.get("initializer"), nonlocals.get("self")
    shape, dtype = getattr(owner, "_shape", None), getattr(owner, "_dtype", None)
    if not callable(initializer) or shape is None or dtype is None:
        return None
    shape = tf.TensorShape(shape)
    return (initializer, shape, tf.as_dtype(dtype)) if shape.is_fully_defined() else None


def remote_of(variable) -> object | None:
    """The RemoteTable holding `variable`'s rows: None for a local variable, or one that is
    not a ParallaxVariable."""
    return getattr(variable, "_parallax_remote", None)


def is_released(variable) -> bool:
    """Whether `variable` is an optimizer slot released as a constant (it holds no storage)."""
    return getattr(variable, "_parallax_fill", None) is not None


def release_storage(variable: tf.Variable) -> None:
    """Free a variable's buffer; its Python object (and shape metadata) stays valid."""
    with tf.init_scope():
        empty = tf.zeros([0] + variable.shape.as_list()[1:], dtype=variable.dtype)
        gen_resource_variable_ops.assign_variable_op(variable.handle, empty,
                                                     validate_shape=False)


def restore_storage(variable: tf.Variable, value) -> None:
    """Give a released variable a full local value again (the shape check of `assign` would
    compare with the empty storage)."""
    with tf.init_scope():
        gen_resource_variable_ops.assign_variable_op(
            variable.handle, tf.convert_to_tensor(value, dtype=variable.dtype),
            validate_shape=False)


def is_liftable(initial_value) -> bool:
    """Whether the value can be computed outside the graph being traced (Keras passes a
    callable; a tensor computed inside a tf.function cannot be lifted)."""
    if callable(initial_value):
        return True
    return not isinstance(initial_value, tf.Tensor) or hasattr(initial_value, "numpy")
