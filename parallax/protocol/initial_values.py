"""Deterministic initial rows: value(seed, row id, column) computed by a counter-based hash.

Because every element is a pure function of its coordinates, a shard computes only its own
rows, and a table has the same initial state whatever its shard count or partitioning.
"""
from __future__ import annotations

import functools
from typing import Callable

import numpy as np

from parallax.protocol.routing import mix64
from parallax.protocol.specs import Initializer

_ROW_STRIDE = np.uint64(0xD6E8FEB86659FD93)
_ROUND_STRIDE = np.uint64(0xA0761D6478BD642F)
_CHUNK_ELEMENTS = 1 << 22  # bounds temporary memory to a few tens of MB
_MAX_TRUNCATION_ROUNDS = 64


def _uniform01(seed_key: np.uint64, ids: np.ndarray, dim: int, stream: int, rnd: int) -> np.ndarray:
    """Uniform [0, 1) doubles of shape [len(ids), dim] for one (stream, round)."""
    with np.errstate(over="ignore"):
        row = mix64(ids.astype(np.int64).view(np.uint64) * _ROW_STRIDE ^ seed_key)
        col = np.arange(dim, dtype=np.uint64) * np.uint64(2) + np.uint64(stream)
        counter = row[:, None] + col[None, :] + np.uint64(rnd) * _ROUND_STRIDE
    return (mix64(counter) >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


Uniform01 = Callable[[np.uint64, np.ndarray, int, int, int], np.ndarray]  # `_uniform01`'s


def _standard_normal(seed_key: np.uint64, ids: np.ndarray, dim: int, rnd: int,
                     uniform01: Uniform01) -> np.ndarray:
    u1 = 1.0 - uniform01(seed_key, ids, dim, 0, rnd)  # (0, 1]: log is finite
    u2 = uniform01(seed_key, ids, dim, 1, rnd)
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)


def _truncated_normal(seed_key: np.uint64, ids: np.ndarray, dim: int,
                      uniform01: Uniform01) -> np.ndarray:
    z = _standard_normal(seed_key, ids, dim, 0, uniform01)
    for rnd in range(1, _MAX_TRUNCATION_ROUNDS):
        bad = np.abs(z) > 2.0
        if not bad.any():
            break
        rows = np.flatnonzero(bad.any(axis=1))
        redraw = _standard_normal(seed_key, ids[rows], dim, rnd, uniform01)
        sub = z[rows]
        sub_bad = bad[rows]
        sub[sub_bad] = redraw[sub_bad]
        z[rows] = sub
    return np.clip(z, -2.0, 2.0)


def _compute(init: Initializer, ids: np.ndarray, dim: int, uniform01: Uniform01) -> np.ndarray:
    n = len(ids)
    if init.kind == "zeros":
        return np.zeros((n, dim))
    if init.kind == "constant":
        return np.full((n, dim), init.value)
    key = seed_key(init)
    if init.kind == "uniform":
        u = uniform01(key, ids, dim, 0, 0)
        return init.minval + (init.maxval - init.minval) * u
    if init.kind == "normal":
        return init.mean + init.stddev * _standard_normal(key, ids, dim, 0, uniform01)
    return init.mean + init.stddev * _truncated_normal(key, ids, dim, uniform01)


@functools.lru_cache(maxsize=1024)
def seed_key(init: Initializer) -> np.uint64:
    """The hashed seed every draw of `init` starts from (kept: a table's first touches ask
    for it every step)."""
    return mix64(np.array([init.seed], dtype=np.uint64))[0]


def initial_rows(init: Initializer, ids: np.ndarray, dim: int, dtype: str,
                 uniform01: Uniform01 | None = None) -> np.ndarray:
    """Initial values of the rows with these global ids (or a keyed table's keys), shape
    [n, dim]. `uniform01`: what draws the counter-based uniforms (`_uniform01`, or a
    compiled twin giving the same bits: the server's, `parallax_ps.native_path`)."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    out = np.empty((len(ids), dim), dtype=dtype)
    rows_per_chunk = max(1, _CHUNK_ELEMENTS // dim)
    for start in range(0, len(ids), rows_per_chunk):
        stop = start + rows_per_chunk
        out[start:stop] = _compute(init, ids[start:stop], dim, uniform01 or _uniform01)
    return out
