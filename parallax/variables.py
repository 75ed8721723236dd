"""The variable the strategy creates in its scope: an ordinary resource variable until the
plan moves it to the parameter servers, then a view of remote rows.

Every variable made in `strategy.scope()` is a `ParallaxVariable`, because which ones are
sparse is only known after the first step is traced. Once the plan binds a `RemoteTable`:
- `sparse_read(ids)` (what `tf.gather(var, ids)` and `tf.nn.embedding_lookup` call, and what
  parallax routes Keras' `ops.take` to) pulls only the rows of `ids`; its gradient is an
  `IndexedSlices` over global row ids, pushed to the servers instead of applied here;
- a whole read (`value()`, `numpy()`, `model.save`) pulls every row, so saving and exporting
  see the trained table; in the `ps` run mode dense variables are read this way every step;
- local storage is released: the worker keeps no copy of the table.
"""
from __future__ import annotations

import inspect

import tensorflow as tf
from tensorflow.python.ops import gen_resource_variable_ops, resource_variable_ops

from parallax.errors import ParallaxError

_INIT_PARAMETERS = frozenset(inspect.signature(
    resource_variable_ops.ResourceVariable.__init__).parameters) - {"self"}


class ParallaxVariable(resource_variable_ops.ResourceVariable):
    """A resource variable that the strategy may bind to rows held by parameter servers."""

    _parallax_remote = None  # the RemoteTable holding the rows, once the plan moved them
    _parallax_index = -1     # creation order in the strategy: the same on every worker
    _parallax_fill = None    # set on released optimizer slots: what a read returns

    @classmethod
    def create(cls, index: int, **kwargs) -> "ParallaxVariable":
        var = cls(**{k: v for k, v in kwargs.items() if k in _INIT_PARAMETERS})
        var._parallax_index = index
        return var

    @property
    def remote(self):
        return self._parallax_remote

    def bind_remote(self, remote) -> None:
        """Hand the rows to `remote` and free the local copy (shape metadata is kept)."""
        release_storage(self)
        self._parallax_remote = remote

    def release_as_constant(self) -> None:
        """For optimizer slots of a table on the servers (the servers keep the real slots):
        free the storage; reads return the slot's initial fill, so saving a model with its
        optimizer still works, and assignments (loading such a model) are ignored."""
        with tf.init_scope():
            flat = tf.reshape(self.read_value(), [-1])
            self._parallax_fill = float(flat[0]) if int(tf.size(flat)) else 0.0
        release_storage(self)

    def sparse_read(self, indices, name=None):
        if self._parallax_remote is None:
            return super().sparse_read(indices, name=name)
        return self._parallax_remote.gather(self, indices)

    def _read_variable_op(self, no_copy=False):
        if self._parallax_remote is not None:
            return self._parallax_remote.read_all(self)
        if self._parallax_fill is not None:
            return tf.fill(self.shape, tf.constant(self._parallax_fill, self.dtype))
        return super()._read_variable_op(no_copy=no_copy)

    def assign(self, value, use_locking=None, name=None, read_value=True):
        if self._parallax_fill is not None:
            return self if read_value else None
        if self._parallax_remote is None:
            return super().assign(value, use_locking=use_locking, name=name,
                                  read_value=read_value)
        self._parallax_remote.assign_all(value)
        return self if read_value else None

    def _refuse(self, what: str):
        raise ParallaxError(
            f"variable {self.name!r} lives on the parameter servers; {what} cannot change it "
            f"there. Update it through a Keras optimizer (apply_gradients / fit), which the "
            f"strategy forwards to the servers, or assign() a whole new value eagerly")

    def _maybe_refuse(self, what: str) -> None:
        if self._parallax_remote is not None:
            self._refuse(what)

    def assign_add(self, delta, use_locking=None, name=None, read_value=True):
        self._maybe_refuse("assign_add")
        return super().assign_add(delta, use_locking=use_locking, name=name,
                                  read_value=read_value)

    def assign_sub(self, delta, use_locking=None, name=None, read_value=True):
        self._maybe_refuse("assign_sub")
        return super().assign_sub(delta, use_locking=use_locking, name=name,
                                  read_value=read_value)

    def scatter_add(self, sparse_delta, use_locking=False, name=None):
        self._maybe_refuse("scatter_add")
        return super().scatter_add(sparse_delta, use_locking=use_locking, name=name)

    def scatter_sub(self, sparse_delta, use_locking=False, name=None):
        self._maybe_refuse("scatter_sub")
        return super().scatter_sub(sparse_delta, use_locking=use_locking, name=name)

    def scatter_update(self, sparse_delta, use_locking=False, name=None):
        self._maybe_refuse("scatter_update")
        return super().scatter_update(sparse_delta, use_locking=use_locking, name=name)


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
