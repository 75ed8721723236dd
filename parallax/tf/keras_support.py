"""What parallax reads of Keras 3 (the versions in `keras_patches.KERAS_VERSIONS`); what it
changes of Keras is `keras_patches`.

- The Keras optimizer that updates a variable is found in the update function it hands to
  `strategy.extended.update`, so the servers can apply the same optimizer.
- Keras' train_step / test_step return each worker's own metric values; the strategy averages
  them across workers, so every worker's progress bar and callbacks (EarlyStopping,
  ReduceLROnPlateau, ...) see the same, global numbers and take the same decisions.
- Optimizer slots of a table that moved to the servers are never used on the worker; their
  storage is released (the servers keep their own slots).
- Horovod's `hvd.DistributedOptimizer(opt)` (a class Horovod makes from `opt`'s) is refused
  (`refuse_horovod_optimizer`): the strategy already sums the workers' gradients, and Horovod
  0.28.1's wrapper fails under Keras 3 (its `variables` calls Keras 3's list).
"""
from __future__ import annotations

import inspect

import tensorflow as tf

from parallax.errors import ConfigError

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


def refuse_horovod_optimizer(optimizer) -> None:
    """Refuse Horovod's `DistributedOptimizer`, left in from a Horovod script."""
    cls = type(optimizer)
    if not _horovods(cls):
        return
    wrapped = next((base.__name__ for base in cls.__mro__[1:] if not _horovods(base)),
                   cls.__name__)
    raise ConfigError(
        f"the optimizer is Horovod's DistributedOptimizer around {wrapped} (`hvd."
        f"DistributedOptimizer(...)`, left from a Horovod script): ParallaxStrategy sums the "
        f"workers' gradients itself, and Horovod's wrapper does not work with Keras 3 (its "
        f"`variables` fails). Use the {wrapped} optimizer it wraps, made inside "
        f"`strategy.scope()` (a learning rate scaled by hvd.size() stays right with the "
        f"global batch: docs/migration.md)")


def _horovods(cls: type) -> bool:
    """Whether `cls` is defined in Horovod's package (not in a user's `horovod_utils`)."""
    module = cls.__module__ or ""
    return module == "horovod" or module.startswith("horovod.")


def slots_of(optimizer, variable: tf.Variable) -> list[tf.Variable]:
    """The optimizer's slot variables for `variable` (Keras names them after its path and
    gives them its shape)."""
    keras_var = _keras_variable(variable, optimizer)
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


def _keras_variable(variable: tf.Variable, optimizer):
    """The Keras variable of `optimizer` whose storage is `variable` (None: not trained by
    it, or no optimizer)."""
    return next((v for v in getattr(optimizer, "_trainable_variables", None) or []
                 if getattr(v, "value", v) is variable), None)


def keras_path_of(variable: tf.Variable, optimizer) -> str | None:
    keras_var = _keras_variable(variable, optimizer)
    return None if keras_var is None else keras_var.path


def constraint_of(variable: tf.Variable, optimizer):
    """The Keras constraint of `variable` (`embeddings_constraint=`, `kernel_constraint=`),
    which the optimizer applies after each update by assigning the whole variable; None."""
    return getattr(_keras_variable(variable, optimizer), "constraint", None)
