"""The server's per-part hot work on the compiled kernels (`parallax.native`), or in numpy.

Why compiled: a step's requests carry one part per table shard (13 on each of ctr's two
servers), and each part's work is a dozen numpy calls on a few kilobytes (checks, duplicate
sums, the optimizer's element-wise steps, the wire dtype's encoding), so the server's CPU went
to calling numpy, not to arithmetic (examples/benchmarks/server_handlers.py --profile). Each
kernel here does one of those dozens-of-calls pieces in one call, with the GIL released
when its work is over 256 KiB (below that, giving the GIL up to the data plane's other
threads and waiting to take it back costs more than the work). C++
with pybind11: it reads numpy arrays without copies, builds with the compiler every Linux box
has, and the worker side builds its kernels the same way (one extension, module.cc).

Which path runs is `parallax.native.kernels()` (PARALLAX_NATIVE=auto|1|0), chosen once a
process (`reselect` chooses again: tests run both paths in one process); the server logs it
at start, and PARALLAX_NATIVE=1 without the build stops it there. The numpy path is the
reference: every kernel repeats its float operations in numpy's order (C++ compiled without
fused multiply-add), so rows, slots and steps are bit-identical, and a kernel refuses
nothing itself: where a check fails (an id out of range, a non-finite value, a wire dtype
overflow) the numpy code runs again to raise its own error, before any state has changed.
Float64 tables and Ftrl (numpy's power function) stay in numpy. tests/unit/test_native_server.py
and test_native_server_steps.py run both paths and compare bytes; the fuzzer hits both.
"""
from __future__ import annotations

from types import ModuleType
from typing import Sequence

import numpy as np

from parallax import native
from parallax.protocol import initial_values, routing
from parallax.protocol.specs import Initializer
from parallax_ps.optimizer_kernels import kernel_constants

_F32 = np.dtype(np.float32)
_INIT_DTYPES = (_F32, np.dtype(np.float64))  # uniform_rows' outputs
_F32_MAX = float(np.finfo(np.float32).max)  # (past it, a float32 table's rows overflow in numpy)
_WIRE_CODES = {_F32: 0, np.dtype("<f2"): 1, np.dtype("<u2"): 2}  # gather's `wire` argument
_chosen: list = []  # [the kernels or None], once chosen


def kernels() -> ModuleType | None:
    """The compiled kernels, or None for the numpy path: chosen once a process (by
    PARALLAX_NATIVE, when first needed), or again after `reselect`."""
    if not _chosen:
        _chosen.append(native.kernels())
    return _chosen[0]


def reselect() -> ModuleType | None:
    """Choose the path again from PARALLAX_NATIVE now (tests run both in one process)."""
    _chosen.clear()
    return kernels()


def _f32_rows(array: np.ndarray) -> bool:
    return array.dtype == _F32 and array.ndim == 2 and array.flags.c_contiguous


def sum_duplicates(ids: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """routing.sum_duplicates: (sorted unique ids, per-id sums of `values` rows)."""
    return aggregate([(ids, values)], 0)


def aggregate(batches: Sequence[tuple[np.ndarray, np.ndarray]], divisor: int
              ) -> tuple[np.ndarray, np.ndarray]:
    """The batches' rows summed by id, as routing.sum_duplicates sums their concatenation,
    then divided by `divisor` (0: not divided)."""
    module = kernels()
    if module is not None and all(_f32_rows(g) for _, g in batches) and \
            all(i.dtype == np.int64 for i, _ in batches):
        return module.aggregate([i for i, _ in batches], [g for _, g in batches],
                                float(divisor))
    ids = np.concatenate([b[0] for b in batches]) if len(batches) > 1 else batches[0][0]
    grads = np.concatenate([b[1] for b in batches]) if len(batches) > 1 else batches[0][1]
    unique, summed = routing.sum_duplicates(ids, grads)
    if divisor:
        summed = summed / summed.dtype.type(divisor)
    return unique, summed


def update(optimizer, values: np.ndarray, slots: dict[str, np.ndarray], rows: np.ndarray,
           grads: np.ndarray, step: int, learning_rate: float
           ) -> tuple[np.ndarray, dict[str, np.ndarray], bool] | None:
    """(new values, new slots, all finite) of `rows` after one step, computed by the kernel;
    None where the numpy path must run (no kernels, float64, an optimizer without one)."""
    module = kernels()
    if module is None or not _f32_rows(values) or grads.dtype != _F32 or \
            not all(_f32_rows(s) for s in slots.values()):
        return None
    constants = kernel_constants(optimizer, step, learning_rate)
    if constants is None:
        return None
    kind, consts = constants
    names = optimizer.slot_names  # the order each kernel reads its slots in
    w, new_slots, finite = module.update(kind, consts, values,
                                         [slots[n] for n in names], rows,
                                         np.ascontiguousarray(grads))
    return w, dict(zip(names, new_slots)), finite


def gather(values: np.ndarray, rows: np.ndarray, out: np.ndarray) -> bool:
    """values[rows] into `out` (the table's dtype, or float16/bfloat16 bits); False where the
    numpy path must run (no kernels, another dtype, or a float16 overflow to refuse)."""
    module = kernels()
    code = _WIRE_CODES.get(out.dtype)
    if module is None or code is None or not _f32_rows(values) or not out.flags.c_contiguous:
        return False
    return module.gather(values, rows, out, code) < 0


def scatter(values: np.ndarray, rows: np.ndarray, rows_values: np.ndarray) -> bool:
    """values[rows] = rows_values in place (float32 storage: one pass, each row's miss asked
    for ahead); False where the numpy path must run (no kernels, another dtype or layout)."""
    module = kernels()
    if module is None or not _f32_rows(values) or not values.flags.writeable or \
            rows.dtype != np.int64 or rows.ndim != 1 or not _f32_rows(rows_values):
        return False
    module.scatter(values, rows, rows_values)
    return True


def all_finite(values: np.ndarray) -> bool | None:
    """Whether every value is finite; None where the numpy path must say."""
    module = kernels()
    if module is None or values.dtype.kind != "f" or values.dtype.itemsize < 4 or \
            not values.flags.c_contiguous:
        return None
    return module.all_finite(values)


def owns_all(ids: np.ndarray, router, shard: int) -> bool | None:
    """Whether every (int64) id is in a fixed vocabulary and shard `shard`'s under
    `router`; None where the numpy path must say (no kernels)."""
    module = kernels()
    if module is None or ids.dtype != np.int64:
        return None
    return module.first_foreign(ids, router.vocabulary_size, router.shard_count, shard,
                                router.partition == "range",
                                max(1, router.block)) < 0


def initial_rows(init: Initializer, ids: np.ndarray, dim: int, dtype: str) -> np.ndarray:
    """initial_values.initial_rows with its uniform draws made by the kernels: a "uniform"
    initializer's rows whole (float32 and float64 tables, bounds within float32), the other
    random kinds' draws under numpy's shaping. A long-tailed workload meets new rows every
    step, and their hashing was most of a first touch's numpy work."""
    module, out_dtype = kernels(), np.dtype(dtype)
    if module is None:
        return initial_values.initial_rows(init, ids, dim, dtype)
    ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
    if init.kind == "uniform" and out_dtype in _INIT_DTYPES and \
            max(abs(init.minval), abs(init.maxval)) <= _F32_MAX:
        out = np.empty((len(ids), dim), out_dtype)
        module.uniform_rows(int(initial_values.seed_key(init)), ids, dim, float(init.minval),
                            float(init.maxval), out)
        return out

    def uniform01(seed_key, ids: np.ndarray, dim: int, stream: int, rnd: int) -> np.ndarray:
        out = np.empty((len(ids), dim), np.float64)
        module.uniform01(int(seed_key), np.ascontiguousarray(ids, dtype=np.int64), dim,
                         stream, rnd, out)
        return out
    return initial_values.initial_rows(init, ids, dim, dtype, uniform01)
