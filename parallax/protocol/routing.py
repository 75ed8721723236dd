"""Which shard owns a row, where the row sits inside it, and how a request splits by shard.

Shared by the client (to route) and the server (to validate and locate), so both sides always
agree. Fixed-vocabulary tables use MOD (`id % S`, local row `id // S`) or RANGE (blocks of
ceil(V / S) ids); keyed tables (`TableSpec.hashed_keys`) route by a 64-bit mix of the key
(the "hashed" partition kind).
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _finalise(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, in place on a uint64 array of our own; returns it."""
    with np.errstate(over="ignore"):
        z ^= z >> np.uint64(30)
        z *= _M1
        z ^= z >> np.uint64(27)
        z *= _M2
        z ^= z >> np.uint64(31)
    return z


def finalise64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser of uint64 values (wrapping arithmetic): a well-spread bijection,
    the one 64-bit hash of parallax (`mix64` adds splitmix's increment first; the servers'
    admission sketch hashes with it as it is; the compiled kernels mirror `mix64`)."""
    return _finalise(np.array(x, dtype=np.uint64, copy=True))


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's step: `finalise64(x + 0x9E3779B97F4A7C15)` (vectorised): shards of a keyed
    table's keys, initial values."""
    z = np.asarray(x).astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        z += _GOLDEN
    return _finalise(z)


def stable_order(keys: np.ndarray, bound: int) -> np.ndarray:
    """np.argsort(keys, kind="stable") for keys in [0, bound): small keys are sorted as
    uint8/uint16, which numpy radix-sorts (8x faster than int64's merge sort)."""
    if len(keys) and 0 <= keys.min() and keys.max() < bound:  # (unchecked ids may not be)
        for small in (np.uint8, np.uint16):
            if bound <= np.iinfo(small).max + 1:
                return np.argsort(keys.astype(small), kind="stable")
    return np.argsort(keys, kind="stable")


def grouped_order(keys: np.ndarray, bound: int, ids: np.ndarray) -> np.ndarray:
    """np.lexsort((ids, keys)) (by key in [0, bound), then id, then position: stable), 3-8x
    faster. When key, id and position fit one int64 together (the usual case), one sort of
    those packed values gives the order in its low bits; else keys and ids are packed when
    they fit, and sorted unstably unless two are equal."""
    n = len(ids)
    if n == 0 or int(bound) > 1 << 30 or ids.min() < 0 or keys.min() < 0:
        return np.lexsort((ids, keys))
    position_bits, id_bits = max(1, (n - 1).bit_length()), max(1, int(ids.max()).bit_length())
    key_bits = int(keys.max()).bit_length()  # (unchecked ids may give keys past `bound`)
    if position_bits + id_bits + key_bits <= 63:
        packed = (keys.astype(np.int64) << (id_bits + position_bits)) | \
            (ids.astype(np.int64) << position_bits) | np.arange(n, dtype=np.int64)
        packed.sort()  # every value differs (positions do): no stable sort needed
        return packed & ((1 << position_bits) - 1)
    if id_bits <= 32 and key_bits <= 31:
        packed = (keys.astype(np.int64) << 32) | ids
        order = np.argsort(packed)
        ordered = packed[order]
        if not bool(np.any(ordered[1:] == ordered[:-1])):
            return order
        return np.argsort(packed, kind="stable")
    return np.lexsort((ids, keys))


@dataclass(frozen=True)
class ShardRouter:
    """Maps global ids to (shard, local row) for one table."""

    shard_count: int
    vocabulary_size: int = 0  # 0: a keyed table (its keys route hashed)
    partition: str = "mod"

    @property
    def hashed(self) -> bool:
        """Whether ids route by a hash of the key: a keyed table's."""
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
        if self.shard_count == 1:  # the ids themselves (not a copy: read them only)
            return ids
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
        order = stable_order(shards, self.shard_count)
        return order, np.searchsorted(shards[order], np.arange(self.shard_count + 1))

    def route_push(self, ids: np.ndarray) -> "PushRouting":
        """Where each row of a push goes: unique ids laid out shard after shard (sorted within
        each shard), and which input rows sum into each. Only ids are touched here."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        n, s = len(ids), self.shard_count
        if n == 0 or (s == 1 and (n == 1 or bool(np.all(ids[1:] > ids[:-1])))):
            offsets = np.array([0] * s + [n]) if n else np.zeros(s + 1, dtype=np.int64)
            return PushRouting(ids, offsets, None, None)
        shards = self.shard_of(ids) if s > 1 else np.zeros(n, dtype=np.int64)
        order = grouped_order(shards, s, ids)
        sorted_ids = ids[order]
        starts = np.flatnonzero(np.r_[True, sorted_ids[1:] != sorted_ids[:-1]])
        unique_shards = shards[order][starts]
        offsets = np.searchsorted(unique_shards, np.arange(s + 1))
        return PushRouting(sorted_ids[starts], offsets, order,
                           None if len(starts) == n else starts)


class PushRouting(NamedTuple):
    """A push grouped by shard; `fill` writes the summed rows of a slice straight into the
    message being built, so gradient bytes are copied once on the client."""

    ids: np.ndarray                # unique ids, shard after shard
    offsets: Sequence[int]         # shard s owns ids[offsets[s]:offsets[s + 1]]
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
            last = self.starts[hi] if hi < len(self.starts) else len(self.order)
            sum_runs(values, self.order, self.starts[lo:hi], last, out)


SHORT_RUN = 8  # rows: runs up to this long are summed row position by row position


def sum_runs(values: np.ndarray, order: np.ndarray, starts: np.ndarray, end: int,
             out: np.ndarray) -> None:
    """out[j] = the sum of values[order[starts[j]:starts[j + 1]]] (the last run ends at
    `end`). The sums np.add.reduceat gives over the gathered rows, up to rounding (short runs
    are added strictly in order, reduceat pairs some), without its ~0.1 µs per run: short
    runs (most: an id pushed by a few workers, or found a few times in a batch) are added
    one position at a time across all runs at once, and only runs longer than SHORT_RUN go
    to reduceat. Deterministic: the same input gives the same bits."""
    if len(starts) == 0:
        return
    counts = np.diff(starts, append=end)
    np.take(values, order[starts], axis=0, out=out, mode="clip")
    long = np.flatnonzero(counts > SHORT_RUN)
    if len(long):
        _sum_long_runs(values, order, starts[long], counts[long], out, long)
    more = np.flatnonzero((counts > 1) & (counts <= SHORT_RUN))
    k = 1
    while len(more):
        out[more] += values[order[starts[more] + k]]
        k += 1
        more = more[counts[more] > k]


def _sum_long_runs(values: np.ndarray, order: np.ndarray, starts: np.ndarray,
                   counts: np.ndarray, out: np.ndarray, where: np.ndarray) -> None:
    """out[where[j]] = the sum of run j (`counts[j]` rows from `starts[j]` in `order`)."""
    firsts = np.cumsum(counts) - counts
    positions = np.arange(int(counts.sum())) + np.repeat(starts - firsts, counts)
    out[where] = np.add.reduceat(values[order[positions]], firsts, axis=0)


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
    routing = ShardRouter(1).route_push(ids)
    if routing.order is None:
        return routing.ids, values  # already unique and sorted (what the client sends)
    summed = np.empty((len(routing.ids),) + values.shape[1:], dtype=values.dtype)
    routing.fill(values, 0, len(routing.ids), summed)
    return routing.ids, summed


# ---- many tables at once: one pass over every table's ids ------------------------------
_KINDS = {"mod": 0, "range": 1, "hashed": 2}  # as the compiled `route` numbers them


def _kind(p: ShardRouter) -> str:
    return "hashed" if p.hashed else p.partition


class FlatRouting(NamedTuple):
    """The push routing of every run of a `Runs`, flat: what `Runs.push_routings` slices
    per run, and what the compiled data path (parallax.native) reads as it is."""

    order: np.ndarray   # positions into Runs.ids, grouped by (run, shard), sorted by id
    unique: np.ndarray  # the first id of each (run, shard, id) group, in that order
    first: np.ndarray   # where each group starts in `order`
    bounds: np.ndarray  # per run k, shard_count + 1 entries: where its shards start in
                        # `unique`, then where its last ends


class Runs:
    """Consecutive runs of ids, run k belonging to table k (`routers[k]` routes it):
    what a multi-table request plans in one pass of numpy calls, instead of one pass per
    table. `ids`: every run's int64 ids in turn; `starts[k]:starts[k + 1]` is run k."""

    def __init__(self, routers: Sequence[ShardRouter], runs: Sequence[np.ndarray]) -> None:
        self.routers = list(routers)
        self.lengths = [len(r) for r in runs]
        self.starts = list(itertools.accumulate(self.lengths, initial=0))
        if len(runs) == 1:  # (a copy all the same: callers' buffers may be reused)
            self.ids = np.array(runs[0], dtype=np.int64)
        else:
            self.ids = np.concatenate([r.astype(np.int64, copy=False) for r in runs]) \
                if runs else np.empty(0, np.int64)
        self._width = max([p.shard_count for p in self.routers] + [1])
        self._routings: list[PushRouting] | None = None
        self._flat: FlatRouting | None = None
        # Set by a training step's pull, whose ids its push sends back: the pull is laid out
        # as their push routing (a sort by id within each shard), which the push then reuses.
        self.expect_push = False

    def same_ids(self, routers: Sequence[ShardRouter], runs: Sequence[np.ndarray]) -> bool:
        """Whether these runs are exactly this object's (same routers, same ids in the
        same order): a push of the ids a pull just routed can reuse its routing."""
        return len(routers) == len(self.routers) and \
            all(a is b or a == b for a, b in zip(routers, self.routers)) and \
            [len(r) for r in runs] == self.lengths and \
            (not runs or bool(np.array_equal(np.concatenate(runs), self.ids)))

    def run(self, k: int) -> np.ndarray:
        return self.ids[self.starts[k]:self.starts[k + 1]]

    def first_outside(self, limits: Sequence[int | None]) -> int | None:
        """The run holding the first id outside [0, its run's limit), or None; a run whose
        limit is None (a keyed table's: any int64) is not checked."""
        if not len(self.ids):
            return None
        if len(limits) == 1:  # one run: its smallest and largest id say it
            limit = limits[0]
            return None if limit is None or \
                (self.ids.min() >= 0 and self.ids.max() < limit) else 0
        checked = [limit is not None for limit in limits]
        bad = (self.ids < 0) | (self.ids >= self._per_id([lim or 0 for lim in limits]))
        if not all(checked):
            bad &= self._per_id(checked).astype(bool)
        if not bad.any():
            return None
        return int(np.searchsorted(self.starts, int(np.argmax(bad)), side="right")) - 1

    @functools.cached_property
    def _table(self) -> np.ndarray:
        """The run (table index) of every id, made when first asked."""
        return np.repeat(np.arange(len(self.lengths), dtype=np.int64), self.lengths)

    def _per_id(self, values: Sequence[int]) -> np.ndarray:
        return np.asarray(values, dtype=np.int64)[self._table]

    def shards(self) -> np.ndarray:
        """ShardRouter.shard_of of every id, by its run's router."""
        kinds = {("hashed" if p.hashed else p.partition) for p in self.routers}
        out = None
        for kind in sorted(kinds):
            if kind == "hashed":
                count = self._per_id([p.shard_count for p in self.routers])
                shards = (mix64(self.ids.view(np.uint64)) % count.view(np.uint64)).view(np.int64)
            elif kind == "range":
                shards = self.ids // self._per_id([max(1, p.block) for p in self.routers])
            else:
                shards = self.ids % self._per_id([p.shard_count for p in self.routers])
            if len(kinds) == 1:
                return shards
            mine = self._per_id([("hashed" if p.hashed else p.partition) == kind
                                 for p in self.routers]).astype(bool)
            out = np.where(mine, shards, 0 if out is None else out)
        return out if out is not None else np.empty(0, np.int64)

    def _keys(self) -> np.ndarray:
        """(table, shard) of every id as one sortable int64."""
        if self._width == 1:  # every table in one shard
            return self._table
        return self._table * self._width + self.shards()

    def _all_bounds(self, sorted_keys: np.ndarray) -> np.ndarray:
        """Per run k in turn, shard_count + 1 entries: where each shard of table k starts
        among `sorted_keys` (sorted `_keys`), and where its last ends; found in one search."""
        counts = [p.shard_count + 1 for p in self.routers]
        if not counts:
            return np.empty(0, np.int64)
        at = np.cumsum([0] + counts[:-1])
        shift = np.arange(len(counts), dtype=np.int64) * self._width - at
        grid = np.arange(at[-1] + counts[-1], dtype=np.int64) + np.repeat(shift, counts)
        return np.searchsorted(sorted_keys, grid).astype(np.int64, copy=False)

    def push_routings(self) -> list["PushRouting"]:
        """ShardRouter.route_push of every run: the same rows land in the same places.
        Computed once (a `Runs` is not changed after it is made). A run of distinct ids (a
        pull's) has no `starts`, and its routing is its pull's layout as well: ids by shard,
        sorted within each, from `order`."""
        if self._routings is None:
            self._routings = self._routed(self.flat_routing())
        return self._routings

    def flat_routing(self, kernel=None) -> "FlatRouting":
        """Every run's push routing as four flat arrays (`FlatRouting`), computed once: by
        `kernel` (the compiled `route` of parallax.native) when given, else by numpy. Both
        give the same arrays."""
        if self._flat is None:
            flat = None
            if kernel is not None:
                counts = [p.shard_count for p in self.routers]
                found = kernel(self.ids, np.asarray(self.starts, np.int64),
                               np.asarray(counts, np.int64),
                               np.asarray([_KINDS[_kind(p)] for p in self.routers], np.int64),
                               np.asarray([max(1, p.block) if not p.hashed else 1
                                           for p in self.routers], np.int64))
                flat = FlatRouting(*found) if found is not None else None
            self._flat = flat if flat is not None else self._numpy_flat()
        return self._flat

    def _numpy_flat(self) -> "FlatRouting":
        keys = self._keys()
        order = grouped_order(keys, len(self.routers) * self._width, self.ids)
        ids, keys = self.ids[order], keys[order]
        new = np.ones(len(ids), dtype=bool)  # where a (table, shard, id) run starts
        if len(ids) > 1:
            np.not_equal(ids[1:], ids[:-1], out=new[1:])
            new[1:] |= keys[1:] != keys[:-1]
        first = np.flatnonzero(new)
        return FlatRouting(order, ids[first], first, self._all_bounds(keys[first]))

    def _routed(self, flat: "FlatRouting") -> list["PushRouting"]:
        routings, at = [], 0
        for k, p in enumerate(self.routers):
            bounds = flat.bounds[at:at + p.shard_count + 1].tolist()
            at += p.shard_count + 1
            lo, hi = self.starts[k], self.starts[k + 1]
            u_lo, u_hi = bounds[0], bounds[-1]
            starts = None if u_hi - u_lo == hi - lo else flat.first[u_lo:u_hi] - lo
            routings.append(PushRouting(flat.unique[u_lo:u_hi], [b - u_lo for b in bounds],
                                     flat.order[lo:hi] - lo, starts))
        return routings
