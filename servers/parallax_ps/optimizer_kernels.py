"""The compiled optimizer kernels' step constants: each optimizer's scalars for one step,
computed with exactly the numpy scalar arithmetic optimizers.py uses (float32 scalars, in
its order), so the kernel's element-wise work (server_optimizers.cc, numbered as `_KINDS`)
gives the numpy path's bits. None for what has no kernel (Ftrl: numpy's power function;
tables that are not float32)."""
from __future__ import annotations

from typing import Callable

import numpy as np

from parallax.protocol.specs import SGD, Adagrad, Adam, Adamax, Lion, Nadam, RMSprop

_F32 = np.float32
_KINDS = {"sgd": 0, "sgd_momentum": 1, "sgd_nesterov": 2, "adagrad": 3, "adam": 4,
          "adam_amsgrad": 5, "rmsprop": 6, "adamax": 7, "nadam": 8, "lion": 9}


def _sgd(spec: SGD, lr, step, update) -> tuple[str, list]:
    if spec.momentum == 0:
        return "sgd", [lr]
    return ("sgd_nesterov" if spec.nesterov else "sgd_momentum"), [lr, _F32(spec.momentum)]


def _adagrad(spec: Adagrad, lr, step, update) -> tuple[str, list]:
    return "adagrad", [lr, _F32(spec.epsilon)]


def _adam(spec: Adam, lr, step, update) -> tuple[str, list]:
    local_step = _F32(step + 1)
    beta_1_power = np.power(_F32(spec.beta_1), local_step)
    beta_2_power = np.power(_F32(spec.beta_2), local_step)
    alpha = lr * np.sqrt(_F32(1) - beta_2_power) / (_F32(1) - beta_1_power)
    return ("adam_amsgrad" if spec.amsgrad else "adam"), [
        alpha, _F32(1 - spec.beta_1), _F32(1 - spec.beta_2), _F32(spec.epsilon)]


def _rmsprop(spec: RMSprop, lr, step, update) -> tuple[str, list] | None:
    if spec.momentum > 0 and _F32(spec.momentum) == 0:  # its slot, but a kernel momentum of 0
        return None
    return "rmsprop", [lr, _F32(spec.rho), _F32(1 - spec.rho), _F32(spec.epsilon),
                       _F32(spec.momentum) if spec.momentum > 0 else _F32(0),
                       _F32(1 if spec.centered else 0)]


def _adamax(spec: Adamax, lr, step, update) -> tuple[str, list]:
    beta_1_power = np.power(_F32(spec.beta_1), _F32(step + 1))
    return "adamax", [lr, _F32(1 - spec.beta_1), _F32(spec.beta_2), _F32(spec.epsilon),
                      _F32(1) - beta_1_power]


def _nadam(spec: Nadam, lr, step, update) -> tuple[str, list]:
    """optimizers._Nadam's scalars; its u_product (kept per shard) is advanced as the numpy
    path would advance it."""
    beta_1, beta_2 = _F32(spec.beta_1), _F32(spec.beta_2)
    u_t, u_t_1, u_product_t, u_product_t_1, beta_2_power = update.scalars(spec, step, _F32)
    return "nadam", [lr, _F32(1) - beta_1, _F32(1) - beta_2, u_t_1, _F32(1) - u_product_t_1,
                     _F32(1) - u_t, _F32(1) - u_product_t, _F32(1) - beta_2_power,
                     _F32(spec.epsilon)]


def _lion(spec: Lion, lr, step, update) -> tuple[str, list]:
    beta_1, beta_2 = _F32(spec.beta_1), _F32(spec.beta_2)
    return "lion", [lr, beta_1, _F32(1) - beta_1, beta_2, _F32(1) - beta_2]


_CONSTANTS: dict[type, Callable] = {SGD: _sgd, Adagrad: _adagrad, Adam: _adam,
                                    RMSprop: _rmsprop, Adamax: _adamax, Nadam: _nadam,
                                    Lion: _lion}


def kernel_constants(optimizer, step: int, learning_rate: float
                     ) -> tuple[int, list[float]] | None:
    """(kernel number, float32 constants) of `optimizer` (a ServerOptimizer) for one step at
    `learning_rate`, or None where the numpy path must run."""
    constants = _CONSTANTS.get(type(optimizer.spec))
    if constants is None:
        return None
    found = constants(optimizer.spec, _F32(learning_rate), step, optimizer.state)
    if found is None:
        return None
    name, values = found
    return _KINDS[name], [float(_F32(v)) for v in values]
