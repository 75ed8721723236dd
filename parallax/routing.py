"""Which shard owns a row, where the row sits inside it, and how a request splits by shard.

Shared by the client (to route) and the server (to validate and locate), so both sides always
agree. Fixed-vocabulary tables use MOD (`id % S`, local row `id // S`) or RANGE (blocks of
ceil(V / S) ids); hashed-key tables route by a 64-bit mix of the key.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a fast, well-spread bijection on uint64 (vectorised)."""
    z = np.asarray(x).astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        z += _GOLDEN
        z ^= z >> np.uint64(30)
        z *= _M1
        z ^= z >> np.uint64(27)
        z *= _M2
        z ^= z >> np.uint64(31)
    return z


@dataclass(frozen=True)
class Partitioner:
    """Maps global ids to (shard, local row) for one table."""

    shard_count: int
    vocabulary_size: int = 0  # 0: hashed keys
    partition: str = "mod"

    @property
    def hashed(self) -> bool:
        return self.vocabulary_size == 0

    @property
    def block(self) -> int:
        return -(-self.vocabulary_size // self.shard_count)

    def shard_of(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        if self.hashed:
            return (mix64(ids.view(np.uint64)) % np.uint64(self.shard_count)).astype(np.int64)
        if self.partition == "range":
            return ids // self.block
        return ids % self.shard_count

    def shard_size(self, shard: int) -> int:
        """Rows a fixed-vocabulary shard holds."""
        v, s = self.vocabulary_size, self.shard_count
        if self.partition == "range":
            return max(0, min(v, (shard + 1) * self.block) - shard * self.block)
        return (v - shard + s - 1) // s

    def local_rows(self, ids: np.ndarray, shard: int) -> np.ndarray:
        """Local row index inside `shard` of ids the shard owns (fixed vocabulary)."""
        ids = np.asarray(ids, dtype=np.int64)
        if self.partition == "range":
            return ids - shard * self.block
        return ids // self.shard_count

    def global_ids_of(self, local_rows: np.ndarray, shard: int) -> np.ndarray:
        """Global ids of local rows of a fixed-vocabulary shard (inverse of `local_rows`)."""
        local_rows = np.asarray(local_rows, dtype=np.int64)
        if self.partition == "range":
            return local_rows + shard * self.block
        return local_rows * self.shard_count + shard

    def global_ids(self, shard: int) -> np.ndarray:
        """Every global id a fixed-vocabulary shard holds, in local-row order."""
        if self.partition == "range":
            start = shard * self.block
            return np.arange(start, start + self.shard_size(shard), dtype=np.int64)
        return np.arange(shard, self.vocabulary_size, self.shard_count, dtype=np.int64)

    def shard_order(self, ids: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
        """(order, offsets): ids[order][offsets[s]:offsets[s + 1]] are shard s's ids, in their
        original relative order. `order` is None when it is the identity (one shard)."""
        if self.shard_count == 1:
            return None, np.array([0, len(ids)])
        shards = self.shard_of(ids)
        order = np.argsort(shards, kind="stable")
        return order, np.searchsorted(shards[order], np.arange(self.shard_count + 1))

    def plan_push(self, ids: np.ndarray) -> "PushPlan":
        """Where each row of a push goes: unique ids laid out shard after shard (sorted within
        each shard), and which input rows sum into each. Only ids are touched here."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        n, s = len(ids), self.shard_count
        if n == 0 or (s == 1 and (n == 1 or bool(np.all(ids[1:] > ids[:-1])))):
            offsets = np.array([0] * s + [n]) if n else np.zeros(s + 1, dtype=np.int64)
            return PushPlan(ids, offsets, None, None)
        shards = self.shard_of(ids) if s > 1 else np.zeros(n, dtype=np.int64)
        order = np.lexsort((ids, shards))
        sorted_ids = ids[order]
        starts = np.flatnonzero(np.r_[True, sorted_ids[1:] != sorted_ids[:-1]])
        unique_shards = shards[order][starts]
        offsets = np.searchsorted(unique_shards, np.arange(s + 1))
        return PushPlan(sorted_ids[starts], offsets, order,
                        None if len(starts) == n else starts)


@dataclass(frozen=True)
class PushPlan:
    """A push grouped by shard; `fill` writes the summed rows of a slice straight into the
    message being built, so gradient bytes are copied once on the client."""

    ids: np.ndarray                # unique ids, shard after shard
    offsets: np.ndarray            # shard s owns ids[offsets[s]:offsets[s + 1]]
    order: np.ndarray | None       # input rows in wire order (None: the identity)
    starts: np.ndarray | None      # where each unique id's run starts in `order` (None: no dups)

    def fill(self, values: np.ndarray, lo: int, hi: int, out: np.ndarray) -> None:
        """out[:] = the summed rows of ids[lo:hi]."""
        if hi <= lo:
            return
        if self.order is None:
            out[...] = values[lo:hi]
        elif self.starts is None:
            np.take(values, self.order[lo:hi], axis=0, out=out, mode="clip")
        else:
            first = self.starts[lo]
            last = self.starts[hi] if hi < len(self.starts) else len(self.order)
            np.add.reduceat(values[self.order[first:last]], self.starts[lo:hi] - first, axis=0,
                            out=out)


def out_of_range(ids: np.ndarray, size: int) -> np.ndarray | None:
    """Positions of ids outside [0, size), or None when every id is inside (the common case:
    two reductions, no temporary arrays)."""
    if len(ids) == 0 or (ids.min() >= 0 and ids.max() < size):
        return None
    return np.flatnonzero((ids < 0) | (ids >= size))


def dedup(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(unique ids, inverse) with ids == unique[inverse]; the wire carries each id once."""
    unique, inverse = np.unique(np.asarray(ids, dtype=np.int64).reshape(-1), return_inverse=True)
    return unique, inverse.reshape(-1)


def sum_duplicates(ids: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sorted unique ids, per-id sums of `values` rows); vectorised, no Python loop over rows.

    Sorted unique input is returned as is (no copy)."""
    plan = Partitioner(1).plan_push(ids)
    if plan.order is None:
        return plan.ids, values  # already unique and sorted (what the client sends)
    summed = np.empty((len(plan.ids),) + values.shape[1:], dtype=values.dtype)
    plan.fill(values, 0, len(plan.ids), summed)
    return plan.ids, summed
