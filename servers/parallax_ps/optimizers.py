"""Server-side optimizers: Keras 3 math, applied in place to the rows a step touches.

Every update is vectorised over the touched rows (gather, compute, scatter). The arithmetic
follows the Keras 3 `update_step` of each optimizer operation by operation, in the table's
dtype, so the touched rows match Keras to float rounding.

Lazy (sparse) semantics, where they necessarily differ from Keras' dense update:
- SGD with momentum: Keras decays every row's momentum each step and keeps moving rows the
  step did not touch; here only touched rows update their momentum and value.
- Adam: Keras updates the moments of every row each step (untouched rows decay and keep
  moving); here untouched rows and their moments stay as they are. Bias correction uses the
  table's global step count (steps applied so far), as Keras uses `iterations`.
- Ftrl: Keras recomputes every row from its linear/accumulator slots each step, which resets a
  never-touched row to 0 on the first step; here untouched rows keep their values.
Plain SGD and Adagrad are identical to Keras for every row.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from parallax.specs import SGD, Adagrad, Adam, Ftrl, OptimizerSpec, slot_names

Slots = dict[str, np.ndarray]


class ServerOptimizer:
    """Applies one optimizer spec to a shard's rows; owns the slot layout for checkpoints."""

    def __init__(self, spec: OptimizerSpec) -> None:
        self.spec = spec
        self._update: Callable = _UPDATES[type(spec)]
        self.slot_names: tuple[str, ...] = slot_names(spec)

    def slot_initial_value(self, name: str) -> float:
        spec = self.spec
        if name == "accumulator":
            return float(spec.initial_accumulator_value)
        return 0.0

    def new_slots(self, rows: int, dim: int, dtype: np.dtype) -> Slots:
        return {name: np.full((rows, dim), self.slot_initial_value(name), dtype=dtype)
                for name in self.slot_names}

    def updated(self, values: np.ndarray, slots: Slots, rows: np.ndarray, grads: np.ndarray,
                step: int, learning_rate: float) -> tuple[np.ndarray, Slots]:
        """New values and slots of `rows` (unique), computed on copies: the caller checks
        them before writing them back, and runs this under `quiet_float_errors()` (once per
        request: numpy's errstate costs more than a small update)."""
        dtype = values.dtype.type
        w = np.take(values, rows, axis=0)
        s = {name: np.take(slot, rows, axis=0) for name, slot in slots.items()}
        g = grads.astype(dtype, copy=False)
        self._update(self.spec, w, s, g, dtype(learning_rate), step, dtype)
        return w, s


def quiet_float_errors() -> np.errstate:
    """Overflow, invalid and divide-by-zero without warnings: updates are checked for
    non-finite results explicitly, and refused."""
    return np.errstate(over="ignore", invalid="ignore", divide="ignore")


def _sgd(spec: SGD, w, s, g, lr, step, dt) -> None:
    if spec.momentum == 0:
        w -= g * lr
        return
    momentum = dt(spec.momentum)
    m = s["momentum"]
    m[...] = m * momentum - g * lr
    if spec.nesterov:
        w += m * momentum - g * lr
    else:
        w += m


def _adagrad(spec: Adagrad, w, s, g, lr, step, dt) -> None:
    acc = s["accumulator"]
    acc += np.square(g)
    w -= (lr * g) / np.sqrt(acc + dt(spec.epsilon))


def _adam(spec: Adam, w, s, g, lr, step, dt) -> None:
    local_step = dt(step + 1)
    beta_1_power = np.power(dt(spec.beta_1), local_step)
    beta_2_power = np.power(dt(spec.beta_2), local_step)
    alpha = lr * np.sqrt(dt(1) - beta_2_power) / (dt(1) - beta_1_power)
    m, v = s["momentum"], s["velocity"]
    m += (g - m) * dt(1 - spec.beta_1)
    v += (np.square(g) - v) * dt(1 - spec.beta_2)
    if spec.amsgrad:
        v_hat = s["velocity_hat"]
        np.maximum(v_hat, v, out=v_hat)
        v = v_hat
    w -= (m * alpha) / (np.sqrt(v) + dt(spec.epsilon))


def _ftrl(spec: Ftrl, w, s, g, lr, step, dt) -> None:
    accum, linear = s["accumulator"], s["linear"]
    lr_power = dt(spec.learning_rate_power)
    l2_reg = dt(spec.l2_regularization_strength) + dt(spec.beta) / (dt(2.0) * lr)
    grad_to_use = g + dt(2 * spec.l2_shrinkage_regularization_strength) * w
    new_accum = accum + np.square(g)
    linear += grad_to_use - ((np.power(new_accum, -lr_power) - np.power(accum, -lr_power)) / lr) * w
    quadratic = np.power(new_accum, -lr_power) / lr + dt(2) * l2_reg
    l1 = dt(spec.l1_regularization_strength)
    w[...] = (np.clip(linear, -l1, l1) - linear) / quadratic
    accum[...] = new_accum


_UPDATES: dict[type, Callable] = {SGD: _sgd, Adagrad: _adagrad, Adam: _adam, Ftrl: _ftrl}
