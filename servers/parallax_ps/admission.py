"""Admission of a dynamic table's keys: a fixed-size count-min sketch of sightings per shard.

A key not held by its shard is *sighted* once per applied update that carries its gradient
(one sync step, or one async push, whatever the number of workers or duplicates in it). It
is admitted at the first sighting at which its count has reached `admit_after` and its draw
for that sighting is below `admit_probability`. The draw is a hash of (key, count), so
retries, replicas and a restored shard decide alike. The sketch never shrinks: a key that was
evicted is admitted again at its next sighting when its count had reached the threshold.

Memory is flat: SKETCH_DEPTH x SKETCH_WIDTH uint32 counters (SKETCH_BYTES) per shard that
needs them, whatever the number of distinct keys. Counts are over-estimates (count-min), so a
key may be admitted a little early when the shard sees many more distinct keys than
SKETCH_WIDTH; never late.
"""
from __future__ import annotations

import numpy as np

from parallax.protocol.routing import finalise64
from parallax.protocol.specs import TableSpec

SKETCH_DEPTH = 4  # hash rows of the count-min sketch
SKETCH_WIDTH = 1 << 15  # counters per hash row
SKETCH_BYTES = SKETCH_DEPTH * SKETCH_WIDTH * 4  # 512 KiB a shard (uint32 counters)
_SEEDS = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9,
                   0x27D4EB2F165667C5], dtype=np.uint64)[:SKETCH_DEPTH]
_DRAW_SEED = np.uint64(0xD6E8FEB86659FD93)


def draws(keys: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """A uniform number in [0, 1) for each (key, sighting count): a pure function of both."""
    with np.errstate(over="ignore"):
        h = finalise64(finalise64(keys.astype(np.int64).view(np.uint64) ^ _DRAW_SEED)
                 + counts.astype(np.uint64))
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def needs_sketch(spec: TableSpec) -> bool:
    """Whether admission depends on sightings (else every key is admitted at once)."""
    return spec.hashed_keys and (spec.admit_after > 1 or spec.admit_probability < 1)


class Sketch:
    """Count-min sketch of key sightings, with the admission rule of one table."""

    def __init__(self, spec: TableSpec) -> None:
        self.admit_after = max(spec.admit_after, 1)
        self.probability = spec.admit_probability
        self.counts = np.zeros((SKETCH_DEPTH, SKETCH_WIDTH), dtype=np.uint32)

    def _cells(self, keys: np.ndarray) -> np.ndarray:
        """[depth, n] column of each key in each hash row."""
        k = keys.astype(np.int64).view(np.uint64)
        with np.errstate(over="ignore"):
            cells = finalise64(k[None, :] ^ _SEEDS[:, None]) % np.uint64(SKETCH_WIDTH)
        return cells.astype(np.intp)

    def estimate(self, keys: np.ndarray) -> np.ndarray:
        """Sightings recorded for each key (an over-estimate under collisions)."""
        if not len(keys):
            return np.zeros(0, dtype=np.int64)
        cells = self._cells(keys)
        return self.counts[np.arange(SKETCH_DEPTH)[:, None], cells].min(axis=0).astype(np.int64)

    def admits(self, keys: np.ndarray) -> np.ndarray:
        """Whether each (unique, unheld) key is admitted at the sighting being recorded;
        changes nothing (`add` records the sightings)."""
        counts = self.estimate(keys) + 1
        ok = counts >= self.admit_after
        if self.probability < 1:
            ok &= draws(keys, counts) < self.probability
        return ok

    def add(self, keys: np.ndarray, sign: int = 1) -> None:
        """Record one sighting of each unique key (`sign=-1` takes it back)."""
        if not len(keys):
            return
        cells = self._cells(keys)
        rows = np.broadcast_to(np.arange(SKETCH_DEPTH)[:, None], cells.shape)
        delta = np.uint32(1) if sign > 0 else np.uint32(0xFFFFFFFF)  # -1, wrapping
        with np.errstate(over="ignore"):
            np.add.at(self.counts, (rows, cells), delta)
