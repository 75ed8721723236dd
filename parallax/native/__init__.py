"""The compiled data path, and which path runs: `kernels()` is the compiled module
(`parallax.native._kernels`, built from src/ by setup.py) or None for the pure-Python path.

PARALLAX_NATIVE selects it in every process (workers and servers alike):
  auto  (default) the compiled kernels where they were built, else pure Python
  1     the compiled kernels; a process without them stops with a ConfigError naming the fix
  0     pure Python (the reference: both paths give bit-identical rows, slots and steps)
"""
from __future__ import annotations

import functools
import importlib
import os
from types import ModuleType

from parallax.env import NATIVE_ENV, NATIVE_MODES
from parallax.errors import ConfigError

ABI = 5  # must equal the compiled module's ABI (src/module.cc)


def mode() -> str:
    return _mode_of(os.environ.get(NATIVE_ENV, "auto"))


@functools.lru_cache(maxsize=16)
def _mode_of(setting: str) -> str:
    """The mode a PARALLAX_NATIVE setting names (asked on every request: the setting is
    read each time, its checking done once per value)."""
    value = setting.strip().lower() or "auto"
    if value not in NATIVE_MODES:
        raise ConfigError(f"{NATIVE_ENV}={value!r} must be one of {', '.join(NATIVE_MODES)} "
                          f"(auto: the compiled kernels where built)")
    return value


@functools.lru_cache(maxsize=None)
def _load() -> tuple[ModuleType | None, str]:
    """The compiled module, or None and why it is missing."""
    try:
        module = importlib.import_module("parallax.native._kernels")
    except ImportError as err:
        return None, f"not built ({err})"
    if getattr(module, "ABI", None) != ABI:
        return None, (f"stale build (ABI {getattr(module, 'ABI', None)}, this parallax needs "
                      f"{ABI}): rebuild it")
    return module, ""


def kernels() -> ModuleType | None:
    """The compiled kernels when they are to run, else None (pure Python)."""
    chosen = mode()
    if chosen == "0":
        return None
    module, why = _load()
    if module is None and chosen == "1":
        raise ConfigError(f"{NATIVE_ENV}=1 but parallax's compiled kernels are {why}; build "
                          f"them (pip install -e . with a C++ compiler and pybind11, or make "
                          f"env) or set {NATIVE_ENV}=auto")
    return module


def describe() -> str:
    """One line for plans and logs: which data path runs in this process."""
    if kernels() is not None:
        return "native (compiled kernels)"
    return f"python ({'selected' if mode() == '0' else _load()[1]})"
