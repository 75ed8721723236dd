"""What parallax needs to know about Keras 3 (checked on 3.15 with TF 2.17).

- Keras' `Embedding` (and any layer calling `keras.ops.take(variable, ids, axis=0)`) reads the
  whole variable, then gathers. For a table on the servers that would pull every row, so
  `route_keras_take()` wraps the TensorFlow backend's `take` once: when `x` is a Keras
  variable whose storage is a remote `ParallaxVariable` and `axis == 0`, the lookup becomes
  the variable's `sparse_read`. Everything else goes to Keras' own `take` unchanged.
- The Keras optimizer that updates a variable is found in the update function it hands to
  `strategy.extended.update`, so the servers can apply the same optimizer.
- Keras' train_step / test_step return each worker's own metric values; the strategy averages
  them across workers, so every worker's progress bar and callbacks (EarlyStopping,
  ReduceLROnPlateau, ...) see the same, global numbers and take the same decisions.
- Optimizer slots of a table that moved to the servers are never used on the worker; their
  storage is released (the servers keep their own slots).
- `LossScaleOptimizer.check_finite` densifies every `IndexedSlices` gradient to test it: a
  table's whole size on every step, and impossible for a dynamic table, whose ids are keys
  beyond any dense shape. `check_sparse_values_only()` has it test the slices' values (the
  same answer: the rows a dense gradient adds are zeros).
- Keras writes `save_weights` files in place: a save that fails half-way (the servers refuse
  their checkpoint, a full disk) leaves `BackupAndRestore`'s only backup truncated, and no
  restart can resume. `make_weight_saves_atomic()` has local files written under a temporary
  name beside them and renamed over the old file only once complete.
"""
from __future__ import annotations

import inspect
import os

import tensorflow as tf

from parallax.tf.variables import remote_of

_ROUTED_MARK = "_parallax_routed"
_ATOMIC_MARK = "_parallax_atomic"
_WEIGHTS_SUFFIX = ".weights.h5"  # what Keras 3 requires of save_weights paths


def make_weight_saves_atomic() -> None:
    """Wrap `keras.Model.save_weights` once: a local file is written under a temporary name
    in the same directory, then renamed over `filepath` (os.replace, atomic on POSIX); on
    failure the temporary file is removed and the old file is untouched. Remote paths
    (`scheme://`) go to Keras unchanged."""
    import keras
    original = keras.Model.save_weights
    if getattr(original, _ATOMIC_MARK, False):
        return

    def save_weights(self, filepath, overwrite=True, **kwargs):
        path = os.fspath(filepath)
        if "://" in path or not path.endswith(_WEIGHTS_SUFFIX):
            return original(self, filepath, overwrite=overwrite, **kwargs)
        if not overwrite and os.path.exists(path):
            return original(self, filepath, overwrite=overwrite, **kwargs)  # Keras asks
        directory, name = os.path.split(path)
        temporary = os.path.join(directory, f".{name[:-len(_WEIGHTS_SUFFIX)]}.parallax-"
                                            f"{os.getpid()}{_WEIGHTS_SUFFIX}")
        try:
            original(self, temporary, overwrite=True, **kwargs)
            os.replace(temporary, path)
        finally:
            if os.path.exists(temporary):
                os.remove(temporary)

    setattr(save_weights, _ATOMIC_MARK, True)
    save_weights.__wrapped__ = original
    save_weights.__doc__ = original.__doc__
    keras.Model.save_weights = save_weights


def _remote_storage(x):
    value = getattr(x, "value", None) if not isinstance(x, tf.Variable) else x
    if isinstance(value, tf.Variable) and remote_of(value) is not None:
        return value
    return None


def route_keras_take() -> None:
    """Idempotent: install the `take` routing described in the module docstring."""
    from keras.src.backend.tensorflow import numpy as tf_numpy

    original = tf_numpy.take
    if getattr(original, _ROUTED_MARK, False):
        return

    def take(x, indices, axis=None):
        remote = _remote_storage(x) if axis == 0 else None
        if remote is None or isinstance(indices, tf.SparseTensor):
            return original(x, indices, axis=axis)
        return remote.sparse_read(tf.convert_to_tensor(indices))

    take.__doc__ = original.__doc__
    setattr(take, _ROUTED_MARK, True)
    take.__wrapped__ = original
    tf_numpy.take = take


def check_sparse_values_only() -> None:
    """Idempotent: LossScaleOptimizer's finite check reads IndexedSlices' values only."""
    from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer

    original = LossScaleOptimizer.check_finite
    if getattr(original, _ROUTED_MARK, False):
        return

    def check_finite(self, grads):
        return original(self, [g.values if isinstance(g, tf.IndexedSlices) else g
                               for g in grads])

    check_finite.__doc__ = original.__doc__
    setattr(check_finite, _ROUTED_MARK, True)
    check_finite.__wrapped__ = original
    LossScaleOptimizer.check_finite = check_finite


def keras_optimizer_of(update_fn):
    """The Keras optimizer whose update function this is (its closure holds `self`)."""
    import keras

    update_fn = inspect.unwrap(update_fn)  # tf.distribute wraps it for autograph
    owner = getattr(update_fn, "__self__", None)
    if isinstance(owner, keras.optimizers.Optimizer):
        return owner
    try:
        nonlocals = inspect.getclosurevars(update_fn).nonlocals
    except (TypeError, ValueError):
        return None
    for value in nonlocals.values():
        if isinstance(value, keras.optimizers.Optimizer):
            return getattr(value, "inner_optimizer", value)  # LossScaleOptimizer wraps one
    return None


def is_keras_logging_step(fn) -> bool:
    """Whether `fn` is a Keras model's train_step / test_step (they return the logs that the
    progress bar and callbacks see)."""
    import keras

    fn = inspect.unwrap(fn)
    return getattr(fn, "__name__", "") in ("train_step", "test_step") and \
        isinstance(getattr(fn, "__self__", None), keras.Model)


def keras_model_of(fn):
    """The Keras model whose step `fn` is (a bound train_step / test_step)."""
    return getattr(inspect.unwrap(fn), "__self__", None)


def is_keras_predict_step(fn) -> bool:
    """Whether `fn` is the step of a Keras model's predict function (its local
    `one_step_on_data`, which calls predict_step)."""
    name = getattr(inspect.unwrap(fn), "__qualname__", "")
    return name.endswith("make_predict_function.<locals>.one_step_on_data")


def slots_of(optimizer, variable: tf.Variable) -> list[tf.Variable]:
    """The optimizer's slot variables for `variable` (Keras names them after its path and
    gives them its shape)."""
    if optimizer is None:
        return []
    keras_var = next((v for v in getattr(optimizer, "_trainable_variables", [])
                      if getattr(v, "value", v) is variable), None)
    if keras_var is None:
        return []
    prefix = keras_var.path.replace("/", "_") + "_"
    slots = []
    for slot in optimizer.variables:
        storage = getattr(slot, "value", slot)
        if slot.name.startswith(prefix) and tuple(slot.shape) == tuple(variable.shape) \
                and isinstance(storage, tf.Variable):
            slots.append(storage)
    return slots


def keras_path_of(variable: tf.Variable, optimizer) -> str | None:
    for v in getattr(optimizer, "_trainable_variables", []) or []:
        if getattr(v, "value", v) is variable:
            return v.path
    return None
