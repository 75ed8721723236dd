"""A Keras learning rate of 0 on the servers: it travels as ZERO_RATE (the wire's 0 means "the
table's spec rate"), and every server optimizer then leaves the rows where Keras leaves them
at 0 while its slots move on; Ftrl, whose update divides by the rate (Keras' own gives NaN),
is refused and changes nothing. In this process (TableShard), on the compiled kernels and on
numpy."""
from __future__ import annotations

import numpy as np
import pytest

from parallax import native
from parallax.env import NATIVE_ENV
from parallax.protocol.specs import (SGD, Adagrad, Adam, Adamax, Ftrl, Lion, Nadam,
                                     RMSprop, TableSpec)
from parallax_ps import native_path
from parallax_ps.errors import RequestError
from parallax_ps.shard import TableShard

DIM = 3
ZERO_RATE = float(np.finfo(np.float64).tiny)
MOVING = [SGD(0.1), Adagrad(0.1), Adam(0.1), Adam(0.1, amsgrad=True), RMSprop(0.1),
          RMSprop(0.1, centered=True), Adamax(0.1), Nadam(0.1), Lion(0.1)]


@pytest.fixture(params=["native", "numpy"])
def path(request, monkeypatch):
    if request.param == "native" and native.kernels() is None:
        pytest.skip(f"compiled kernels: {native.describe()}")
    monkeypatch.setenv(NATIVE_ENV, "1" if request.param == "native" else "0")
    native_path.reselect()
    yield request.param
    monkeypatch.delenv(NATIVE_ENV)
    native_path.reselect()


def _shard(optimizer, dtype: str) -> TableShard:
    return TableShard(TableSpec("t", DIM, vocabulary_size=8, dtype=dtype, optimizer=optimizer),
                      0)


def _state(shard: TableShard) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    return (shard.pull(np.arange(8), 0, None)[0].copy(),
            {n: s.copy() for n, s in shard.storage.slots.items()})


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("optimizer", MOVING, ids=lambda o: repr(o)[:40])
def test_a_rate_of_zero_leaves_the_rows_and_moves_the_slots(path, optimizer, dtype):
    shard = _shard(optimizer, dtype)
    grads = np.random.default_rng(3).normal(size=(4, DIM)).astype(dtype)
    shard.push(0, 0, np.arange(4), grads, 0.1)  # slots and rows away from their start
    rows, slots = _state(shard)
    shard.push(1, 0, np.arange(4), grads, ZERO_RATE)
    after, moved = _state(shard)
    if dtype == "float32":
        np.testing.assert_array_equal(after, rows)
    else:
        np.testing.assert_allclose(after, rows, rtol=0, atol=1e-292)
    assert any(not np.array_equal(moved[n], slots[n]) for n in slots) or not slots


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("rate", [ZERO_RATE, 1e-320, 1e-46])
def test_ftrl_at_a_rate_of_zero_is_refused_and_changes_nothing(path, dtype, rate):
    """Ftrl's update divides by the rate: a float32 table's NaN was refused as an "overflow"
    (naming the rate to lower), and a float64 table's ZERO_RATE moved each row by about its
    own size and left its `linear` slot near 1e307, with no error."""
    shard = _shard(Ftrl(0.1), dtype)
    grads = np.full((4, DIM), 0.5, dtype)
    shard.push(0, 0, np.arange(4), grads, 0.1)
    rows, slots = _state(shard)
    if rate == 1e-46 and dtype == "float64":  # a rate float64 holds: applied
        shard.push(1, 0, np.arange(4), grads, rate)
        return
    with pytest.raises(RequestError, match=r"Ftrl cannot apply learning_rate .* divides by "
                                           r"the rate.*nothing was changed"):
        shard.push(1, 0, np.arange(4), grads, rate)
    after, kept = _state(shard)
    np.testing.assert_array_equal(after, rows)
    for name in slots:
        np.testing.assert_array_equal(kept[name], slots[name])
    shard.push(1, 0, np.arange(4), grads, 0.1)  # the step is still open
