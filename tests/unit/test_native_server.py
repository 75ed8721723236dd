"""The server's compiled kernels against the numpy path, byte for byte (servers/parallax_ps/
native_path.py): each kernel on hostile inputs (duplicate runs of every length, values near
float16's limits, NaN and Inf, subnormals, every optimizer over many steps), and whole
PushMany/PullMany steps through the real handlers with PARALLAX_NATIVE=1 and 0, whose tables
(rows, slots, steps), answers and refusals must be identical.

The fuzzer (test_fuzz.py) sends its cases to a server on each path too."""
from __future__ import annotations

import numpy as np
import pytest

from parallax import native
from parallax.env import NATIVE_ENV
from parallax.protocol import initial_values, routing, wire_dtypes
from parallax.protocol.specs import (SGD, Adagrad, Adam, Adamax, Ftrl, Initializer, Lion, Nadam,
                                     RMSprop)
from parallax_ps import native_path
from parallax_ps.optimizers import ServerOptimizer, quiet_float_errors

KERNELS = native.kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason=f"compiled kernels: {native.describe()}")


def same_bits(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def hostile_floats(rng: np.random.Generator, n: int) -> np.ndarray:
    """float32 values of every kind: random bits (NaNs with payloads, subnormals), values
    around float16's edges and rounding ties, signed zeros, infinities."""
    bits = rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)
    edges = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 65504, 65519.99, 65520, -65520,
                      6.1035156e-05, 5.9604645e-08, 2.9802322e-08, 2.98023259e-08, 1e-40,
                      3.3895314e38, 3.4028235e38, 1.0009765625, 1.00048828125],
                     dtype=np.float32)
    scaled = (rng.standard_normal(n) * np.exp(rng.uniform(-30, 12, n))).astype(np.float32)
    return np.concatenate([bits, edges, -edges, scaled])


@pytest.mark.parametrize("wire", ["float32", "float16", "bfloat16"])
def test_gather_encodes_every_value_as_the_wire_dtypes_do(wire):
    rng = np.random.default_rng(1)
    values = hostile_floats(rng, 1 << 18)
    values = values[: len(values) // 8 * 8].reshape(-1, 8)
    dtype = wire_dtypes.get(wire)
    rows = rng.permutation(len(values))
    out = np.empty((len(rows), 8), dtype.storage)
    overflow = KERNELS.gather(values, rows, out, {"float32": 0, "float16": 1,
                                                  "bfloat16": 2}[wire])
    same_bits(out, dtype.encode(values[rows]))
    expected = wire_dtypes.first_overflow(values[rows], dtype)
    assert overflow == (-1 if expected is None else expected)


@pytest.mark.parametrize("dim", [0, 1, 3, 16, 33, 300])
def test_scatter_writes_rows_in_place_as_numpys_assignment_does(dim):
    """Every row width (the prefetch covers rows of up to 8 cache lines, unaligned ones
    too), rows in any order, the storage's other rows untouched."""
    rng = np.random.default_rng(dim)
    table = hostile_floats(rng, 4000)[: 4000 // max(dim, 1) * max(dim, 1)]
    table = table.reshape(-1, dim) if dim else np.empty((50, 0), np.float32)
    rows = rng.permutation(len(table))[: len(table) // 2].astype(np.int64)
    new = hostile_floats(rng, len(rows) * dim)[: len(rows) * dim].reshape(len(rows), dim)
    expected = table.copy()
    expected[rows] = new
    KERNELS.scatter(table, rows, new)
    same_bits(table, expected)


def test_scatter_refuses_a_row_outside_and_writes_nothing():
    table = np.zeros((4, 2), np.float32)
    with pytest.raises(IndexError, match="row 4 is outside the shard's 4 rows"):
        KERNELS.scatter(table, np.array([1, 4], np.int64), np.ones((2, 2), np.float32))
    assert not table.any()
    with pytest.raises(ValueError, match="writable"):
        KERNELS.scatter(table[:, :1], np.array([1], np.int64), np.ones((1, 1), np.float32))


def test_every_float16_rounding_case_matches_over_a_sweep_of_float32_bits():
    bits = np.arange(0, 1 << 32, 997, dtype=np.uint64).astype(np.uint32)
    values = bits.view(np.float32)[: len(bits) // 16 * 16].reshape(-1, 16)
    out = np.empty(values.shape, np.float16)
    KERNELS.gather(values, np.arange(len(values)), out, 1)
    same_bits(out, wire_dtypes.f16_encode(values))


@pytest.mark.parametrize("runs", [1, 2, 8, 9, 17, 130, 300])
def test_duplicate_sums_add_in_numpys_order(runs):
    rng = np.random.default_rng(runs)
    ids = np.repeat(rng.choice(10_000, 40, replace=False), rng.integers(1, runs + 1, 40))
    rng.shuffle(ids)
    values = (rng.standard_normal((len(ids), 5)) * 1e3).astype(np.float32)
    values[rng.random(values.shape) < 0.05] = -0.0
    unique, summed = KERNELS.aggregate([ids], [values], 0.0)
    expected_ids, expected = routing.sum_duplicates(ids, values)
    same_bits(unique, expected_ids)
    same_bits(summed, expected)


@pytest.mark.parametrize("repeats", [False, True], ids=["unique", "repeating"])
def test_a_sync_steps_chunks_sum_and_divide_as_concatenated(repeats):
    rng = np.random.default_rng(3)
    chunks = [(np.sort(rng.choice(500, 200, replace=repeats)),
               rng.standard_normal((200, 7)).astype(np.float32)) for _ in range(4)]
    unique, summed = KERNELS.aggregate([c[0] for c in chunks], [c[1] for c in chunks], 4.0)
    ids, total = routing.sum_duplicates(np.concatenate([c[0] for c in chunks]),
                                        np.concatenate([c[1] for c in chunks]))
    same_bits(unique, ids)
    same_bits(summed, total / np.float32(4))


OPTIMIZERS = [SGD(0.1), SGD(0.05, momentum=0.9), SGD(0.05, momentum=0.9, nesterov=True),
              Adagrad(0.1), Adam(0.01), Adam(0.01, amsgrad=True), RMSprop(0.01),
              RMSprop(0.01, momentum=0.5, centered=True), RMSprop(0.01, centered=True),
              Adamax(0.02), Nadam(0.01), Lion(0.001)]


def _rows(rng, n: int, dim: int) -> np.ndarray:
    return (rng.standard_normal((n, dim)) * rng.choice([1e-3, 1.0, 1e3], (n, 1))
            ).astype(np.float32)


@pytest.mark.parametrize("spec", OPTIMIZERS, ids=lambda s: repr(s)[:60])
def test_each_optimizer_kernel_gives_the_numpy_updates_bits(spec):
    rng = np.random.default_rng(7)
    numpy_opt, native_opt = ServerOptimizer(spec), ServerOptimizer(spec)
    values = _rows(rng, 300, 6)
    slots = {n: np.abs(_rows(rng, 300, 6)) for n in numpy_opt.slot_names}
    mine = (values.copy(), {n: s.copy() for n, s in slots.items()})
    for step in range(40):
        rows = np.sort(rng.choice(300, 50, replace=False))
        grads = _rows(rng, 50, 6)
        grads[0, 0] = 0.0
        with quiet_float_errors():
            w, s = numpy_opt.updated(values, slots, rows, grads, step, 0.01 * (step % 3))
        native_path.reselect()
        got = native_path.update(native_opt, mine[0], mine[1], rows, grads, step,
                                 0.01 * (step % 3))
        assert got is not None
        same_bits(got[0], w)
        for name in s:
            same_bits(got[1][name], s[name])
        assert got[2] == bool(np.isfinite(w).all() and all(np.isfinite(v).all()
                                                           for v in s.values()))
        values[rows], mine[0][rows] = w, got[0]
        for name in s:
            slots[name][rows], mine[1][name][rows] = s[name], got[1][name]


def test_ftrl_and_float64_tables_stay_on_the_numpy_path():
    native_path.reselect()
    rows, grads = np.arange(3), np.ones((3, 2), np.float32)
    ftrl = ServerOptimizer(Ftrl(0.1))
    slots = ftrl.new_slots(3, 2, np.float32)
    assert native_path.update(ftrl, np.zeros((3, 2), np.float32), slots, rows, grads, 0,
                              0.1) is None
    assert native_path.update(ServerOptimizer(SGD(0.1)), np.zeros((3, 2)), {}, rows,
                              grads.astype(np.float64), 0, 0.1) is None


INITIALIZERS = [Initializer("uniform", seed=0, minval=-0.05, maxval=0.05),
                Initializer("uniform", seed=2**64 - 1, minval=-3e38, maxval=3e38),
                Initializer("uniform", seed=1, minval=1e-45, maxval=2e-45),
                Initializer("normal", seed=7, mean=1.0, stddev=0.5),
                Initializer("normal", seed=2**63, stddev=1e-30),
                Initializer("truncated_normal", seed=12345, stddev=2.0),  # (redraw rounds)
                Initializer("truncated_normal", seed=99, mean=-3.0, stddev=1e3),
                Initializer("zeros"), Initializer("constant", value=0.25)]


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # (3e38 as float16)
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
@pytest.mark.parametrize("init", INITIALIZERS, ids=lambda i: f"{i.kind}-{i.seed}")
def test_initial_rows_are_numpys_bits(init, dtype):
    """Every initializer over ids of every size and sign (a keyed table's keys are any
    int64) and several widths: the rows drawn with the kernel's uniforms against
    initial_values' numpy rows, bit for bit."""
    native_path.reselect()
    rng = np.random.default_rng(init.seed % 1000)
    ids = np.concatenate([np.arange(-3, 300), rng.integers(-2**63, 2**63 - 1, 500),
                          [2**63 - 1, -2**63]]).astype(np.int64)
    for dim in (1, 3, 16, 64):
        expected = initial_values.initial_rows(init, ids, dim, dtype)
        same_bits(native_path.initial_rows(init, ids, dim, dtype), expected)
        same_bits(native_path.initial_rows(init, ids[7:9][::-1], dim, dtype),
                  expected[7:9][::-1])  # (a view with negative strides)


def test_the_uniform_kernels_refuse_what_they_cannot_fill():
    ids = np.arange(4)
    for out in (np.empty((4, 3), np.float32), np.empty((3, 3)), np.empty((4, 3))[:, :2],
                np.empty(12), np.empty((4, 3), np.int64)):
        with pytest.raises(ValueError):
            KERNELS.uniform01(1, ids, 3, 0, 0, out)
    for out in (np.empty((4, 3), np.float16), np.empty((4, 2), np.float32),
                np.empty((4, 3), np.int32), np.empty((4, 3))[:, ::-1]):
        with pytest.raises(ValueError):
            KERNELS.uniform_rows(1, ids, 3, 0.0, 1.0, out)


def test_selecting_python_leaves_no_kernel_in_use(monkeypatch):
    monkeypatch.setenv(NATIVE_ENV, "0")
    try:
        assert native_path.reselect() is None
        assert native_path.all_finite(np.ones(3, np.float32)) is None
        assert not native_path.gather(np.ones((2, 2), np.float32), np.arange(2),
                                      np.empty((2, 2), np.float32))
    finally:
        monkeypatch.delenv(NATIVE_ENV)
        native_path.reselect()
