"""Server-side optimizers: Keras 3 math, applied in place to the rows a step touches.

Every update is vectorised over the touched rows (gather, compute, scatter). The arithmetic
follows the Keras 3 `update_step` of each optimizer operation by operation, in the table's
dtype, so the touched rows match Keras to float rounding.

Gradients: a row's gradient is the sum of its occurrences' gradients (summed on the worker,
and across workers in sync mode), and the update is Keras' update of that sum -- what Keras
computes from a dense gradient. Keras 3's own sparse path (an `IndexedSlices` that repeats an
id) instead applies some terms once per occurrence: Adagrad adds each occurrence's square to
the accumulator, and RMSprop, Adam, Adamax, Nadam and Ftrl differ too; SGD and Lion do not
(docs/parameter-server.md, "Server-side optimizers").

Lazy (sparse) semantics, where they necessarily differ from Keras' dense update:
- SGD with momentum: Keras decays every row's momentum each step and keeps moving rows the
  step did not touch; here only touched rows update their momentum and value.
- Adam, Adamax, Nadam: Keras updates the moments (Adamax: momentum and norm) of every row each
  step (untouched rows decay and keep moving); here untouched rows and their slots stay as
  they are. Bias correction uses the table's global step count (steps applied so far), as
  Keras uses `iterations`. Nadam's `u_product` (one scalar per optimizer in Keras, the running
  product of its momentum schedule) is likewise a function of the table's step, multiplied
  up in the table's dtype step by step as Keras does, and kept per shard.
- RMSprop: Keras decays every row's velocity (and, centered, its average gradient) each step;
  with momentum it also keeps moving untouched rows by their momentum. Here untouched rows
  and their slots stay as they are. Without momentum an untouched row's value stays in Keras
  too; only its velocity differs afterwards.
- Lion: Keras moves every row each step by lr * sign(momentum * beta_1) and decays its
  momentum, so a row keeps moving by the full learning rate after its last gradient; here
  untouched rows and their momentum stay as they are.
- Ftrl: Keras recomputes every row from its linear/accumulator slots each step, which resets a
  never-touched row to 0 on the first step; here untouched rows keep their values.
Plain SGD and Adagrad are identical to Keras' dense update for every row.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from parallax.protocol.specs import (SGD, Adagrad, Adam, Adamax, Ftrl, Lion, Nadam, OptimizerSpec,
                                     RMSprop, slot_initial_value, slot_names)

Slots = dict[str, np.ndarray]


class ServerOptimizer:
    """Applies one optimizer spec to a shard's rows; owns the slot layout for checkpoints."""

    def __init__(self, spec: OptimizerSpec) -> None:
        self.spec = spec
        update = _UPDATES[type(spec)]
        self._update: Callable = update() if isinstance(update, type) else update  # own state
        self.slot_names: tuple[str, ...] = slot_names(spec)

    @property
    def state(self):
        """The update's own state where it keeps one (Nadam's u_product), else the update
        function; the compiled kernels' constants advance it as the numpy path does."""
        return self._update

    def slot_initial_value(self, name: str) -> float:
        return slot_initial_value(self.spec, name)

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


def _rmsprop(spec: RMSprop, w, s, g, lr, step, dt) -> None:
    rho = dt(spec.rho)
    velocity = s["velocity"]
    velocity[...] = rho * velocity + dt(1 - spec.rho) * np.square(g)
    if spec.centered:
        average_grad = s["average_gradient"]
        average_grad[...] = rho * average_grad + dt(1 - spec.rho) * g
        denominator = velocity - np.square(average_grad) + dt(spec.epsilon)
    else:
        denominator = velocity + dt(spec.epsilon)
    increment = (lr * g) / np.sqrt(denominator)
    if spec.momentum > 0:
        m = s["momentum"]
        m[...] = dt(spec.momentum) * m + increment
        w -= m
    else:
        w -= increment


def _adamax(spec: Adamax, w, s, g, lr, step, dt) -> None:
    beta_1_power = np.power(dt(spec.beta_1), dt(step + 1))
    m, u = s["momentum"], s["norm"]
    m += (g - m) * dt(1 - spec.beta_1)
    np.maximum(dt(spec.beta_2) * u, np.abs(g), out=u)
    w -= (lr * m) / ((dt(1) - beta_1_power) * (u + dt(spec.epsilon)))


class _Nadam:
    """Nadam's update, with Keras' `u_product` (the product over steps t = 1, 2, ... of
    beta_1 * (1 - 0.5 * 0.96**t), one multiplication a step in the table's dtype) carried
    from one step to the next; a step behind the last one (a restore) multiplies up from 1,
    which stops where the product stops changing: it underflows to a fixed point, 0 or a
    subnormal (float32, beta_1 0.9: within about 1,000 steps; 0.999: about 100,000)."""

    def __init__(self) -> None:
        self._steps, self._u_product = 0, None

    def u_product(self, spec: Nadam, steps: int, dt):
        """Keras' `u_product` once `steps` steps have multiplied into it."""
        if self._u_product is None or self._steps > steps or self._u_product.dtype != dt:
            self._steps, self._u_product = 0, dt(1)
        while self._steps < steps:
            self._steps += 1
            last, self._u_product = self._u_product, self._u_product * dt(spec.beta_1) * \
                (dt(1) - dt(0.5) * np.power(dt(0.96), dt(self._steps)))
            if self._u_product == last:  # every later factor rounds it to itself too
                self._steps = steps
        return self._u_product

    def scalars(self, spec: Nadam, step, dt) -> tuple:
        """The step's scalars, in `dt`: u_t, u_t_1, u_product_t, u_product_t_1 and
        beta_2**(step + 1) (the numpy path and the compiled one's constants alike)."""
        local_step, decay = dt(step + 1), dt(0.96)
        beta_1, beta_2 = dt(spec.beta_1), dt(spec.beta_2)
        u_t = beta_1 * (dt(1) - dt(0.5) * np.power(decay, local_step))
        u_t_1 = beta_1 * (dt(1) - dt(0.5) * np.power(decay, dt(step + 2)))
        u_product_t = self.u_product(spec, step + 1, dt)
        return u_t, u_t_1, u_product_t, u_product_t * u_t_1, np.power(beta_2, local_step)

    def __call__(self, spec: Nadam, w, s, g, lr, step, dt) -> None:
        beta_1, beta_2 = dt(spec.beta_1), dt(spec.beta_2)
        u_t, u_t_1, u_product_t, u_product_t_1, beta_2_power = self.scalars(spec, step, dt)
        m, v = s["momentum"], s["velocity"]
        m += (g - m) * (dt(1) - beta_1)
        v += (np.square(g) - v) * (dt(1) - beta_2)
        m_hat = (u_t_1 * m) / (dt(1) - u_product_t_1) + \
            ((dt(1) - u_t) * g) / (dt(1) - u_product_t)
        v_hat = v / (dt(1) - beta_2_power)
        w -= (m_hat * lr) / (np.sqrt(v_hat) + dt(spec.epsilon))


def _lion(spec: Lion, w, s, g, lr, step, dt) -> None:
    beta_1, beta_2 = dt(spec.beta_1), dt(spec.beta_2)
    m = s["momentum"]
    w -= lr * np.sign(m * beta_1 + g * (dt(1) - beta_1))
    m[...] = m * beta_2 + g * (dt(1) - beta_2)


# Each spec's update: a function, or a class (one instance per shard) where it keeps state.
_UPDATES: dict[type, Callable] = {SGD: _sgd, Adagrad: _adagrad, Adam: _adam, Ftrl: _ftrl,
                                  RMSprop: _rmsprop, Adamax: _adamax, Nadam: _Nadam,
                                  Lion: _lion}
