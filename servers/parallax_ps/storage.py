"""Row storage of one shard: values and optimizer slots in numpy, addressed by local row.

`FixedRows` holds a fixed-vocabulary shard (rows initialised on first use). `KeyedRows` holds
a keyed table's shard (`TableSpec.hashed_keys`): rows are created on first use, found through
a sorted key index (vectorised binary search, no Python loop over ids), and arrays grow
geometrically.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from parallax.protocol.routing import ShardRouter
from parallax.protocol.specs import TableSpec
from parallax_ps import native_path
from parallax_ps.optimizers import ServerOptimizer, Slots

KEY_BYTES = 8 + 1  # a keyed shard's bytes per allocated row besides values and slots:
                   # its key and its changed flag
INDEX_BYTES = 8 + 8  # a keyed shard's bytes per held row in its sorted index: key and row
META_BYTES = 8 + 8  # a dynamic shard's bytes per allocated row: last-used step, use count
MIN_CAPACITY = 1024  # rows a keyed shard allocates at least


class FixedRows:
    """Every row of a fixed-vocabulary shard, initialised lazily on first use.

    Arrays are allocated zeroed (the kernel maps pages on first write), and a row gets its
    initial value when a request first touches it, so creating a 10M-row table is instant
    and memory grows with the rows actually used. Values never differ from eager
    initialisation: a row's initial value depends only on (seed, global id, column).
    """

    def __init__(self, spec: TableSpec, shard: int, optimizer: ServerOptimizer) -> None:
        self.spec = spec
        self.router = ShardRouter(spec.shard_count, spec.vocabulary_size, spec.partition)
        self.shard = shard
        self.optimizer = optimizer
        rows = self.router.shard_size(shard)
        self.values = np.zeros((rows, spec.dim), dtype=spec.dtype)
        self.slots: Slots = {name: np.zeros((rows, spec.dim), dtype=spec.dtype)
                             for name in optimizer.slot_names}
        self._ready = np.zeros(rows, dtype=bool)
        self._changed = np.zeros(rows, dtype=bool)  # written by training since creation

    @property
    def num_rows(self) -> int:
        return len(self.values)

    def bytes_held(self, rows: int, row_bytes: int, fresh: bool = False) -> int:
        """What the memory budget counts: every row's values and slots, claimed at creation."""
        return self.num_rows * row_bytes

    def row_ids(self) -> np.ndarray:
        return self.router.global_ids(self.shard)

    def ids_of(self, rows: np.ndarray) -> np.ndarray:
        return self.router.global_ids_of(rows, self.shard)

    def _ensure(self, rows: np.ndarray) -> None:
        """Give rows that were never touched their initial values (and slot values)."""
        fresh = rows[~self._ready[rows]]
        if len(fresh) == 0:
            return
        fresh = np.unique(fresh)
        if self.spec.initializer.kind != "zeros":
            ids = self.router.global_ids_of(fresh, self.shard)
            self.values[fresh] = native_path.initial_rows(self.spec.initializer, ids,
                                                          self.spec.dim, self.spec.dtype)
        for name, slot in self.slots.items():
            start = self.optimizer.slot_initial_value(name)
            if start:
                slot[fresh] = start
        self._ready[fresh] = True

    def locate(self, ids: np.ndarray, create: bool = False) -> np.ndarray:
        rows = self.router.local_rows(ids, self.shard)
        self._ensure(rows)
        return rows

    def materialize(self) -> None:
        """Initialise every row (before a checkpoint reads them all)."""
        self._ensure(np.flatnonzero(~self._ready))

    def count_new(self, ids: np.ndarray) -> int:
        return 0

    def forget_since(self, held: int) -> None:
        """Nothing to forget: every row exists (a refused update's rows keep their initial
        values, which is all a fresh row could hold)."""

    def trimmed(self) -> tuple[np.ndarray, Slots]:
        return self.values, self.slots

    def replace(self, ids: np.ndarray, values: np.ndarray, slots: Slots) -> None:
        """Adopt restored rows; `ids` must be exactly this shard's ids (any order)."""
        self.adopt(ids, values, slots)

    def adopt(self, ids: np.ndarray, values: np.ndarray, slots: Slots) -> None:
        """Set rows and their slots (ids owned by this shard); other rows are unchanged."""
        rows = self.router.local_rows(ids, self.shard)
        self.values[rows] = values
        for name, slot in self.slots.items():
            slot[rows] = slots[name]
        self._ready[rows] = True

    def touched(self, changed_only: bool = False) -> np.ndarray:
        """Local rows that hold more than their initial value could: every row ever
        touched, in local order (stable while no request touches a new row); with
        `changed_only`, the rows training wrote since the shard was made (imports aside)."""
        return np.flatnonzero(self._changed if changed_only else self._ready)

    def mark_changed(self, rows: np.ndarray) -> None:
        self._changed[rows] = True

    def restart_changes(self) -> None:
        self._changed[:] = False


class KeyedRows:
    """Rows keyed by arbitrary int64 keys, created (initialised by key) on first use."""

    def __init__(self, spec: TableSpec, shard: int, optimizer: ServerOptimizer) -> None:
        self.spec = spec
        self.shard = shard
        self.optimizer = optimizer
        self._keys_sorted = np.empty(0, dtype=np.int64)
        self._rows_sorted = np.empty(0, dtype=np.int64)
        self._keys = np.empty(0, dtype=np.int64)  # key of each local row
        self._changed = np.empty(0, dtype=bool)  # written by training since creation
        self.values = np.empty((0, spec.dim), dtype=spec.dtype)
        self.slots: Slots = optimizer.new_slots(0, spec.dim, self.values.dtype)
        self.last_used = np.empty(0, dtype=np.int64)  # dynamic tables: step of last update
        self.uses = np.empty(0, dtype=np.int64)  # dynamic tables: updates of each row
        self._count = 0
        self._row_bytes = self.values.itemsize * spec.dim * (1 + len(self.slots)) + \
            (META_BYTES if spec.dynamic else 0)
        self.fixed_bytes = 0  # held whatever the rows (a dynamic shard's sketch)
        # claims spare bytes beyond what the request was admitted with; False: refused
        self.reserve: Callable[[int], bool] = lambda spare: True

    @property
    def num_rows(self) -> int:
        return self._count

    def bytes_at(self, capacity: int, rows: int) -> int:
        """Values, slots, keys and flags of `capacity` rows, plus the index of `rows`."""
        return capacity * (self._row_bytes + KEY_BYTES) + rows * INDEX_BYTES + \
            self.fixed_bytes

    def bytes_held(self, rows: int, row_bytes: int, fresh: bool = False) -> int:
        """What holding `rows` rows needs at least (what the memory budget checks): the
        arrays as allocated, or just grown to `rows`; `fresh`, in new arrays (a restore's)."""
        capacity = max(rows, MIN_CAPACITY) if fresh else max(len(self.values), rows)
        return self.bytes_at(capacity, rows)

    def _grown(self, rows: int) -> int:
        """The capacity to grow to for `rows`: geometric when the budget grants the spare
        rows (`reserve`, atomically), else exactly `rows` (already admitted)."""
        geometric = max(rows, 2 * len(self.values), MIN_CAPACITY)
        if self.spec.dynamic and self.spec.max_rows_per_shard:  # never more than it holds
            geometric = min(geometric, max(rows, self.spec.max_rows_per_shard))
        if geometric > rows and not self.reserve(self.bytes_at(geometric, rows)
                                                 - self.bytes_at(rows, rows)):
            return rows
        return geometric

    def row_ids(self) -> np.ndarray:
        return self._keys[: self._count].copy()

    def ids_of(self, rows: np.ndarray) -> np.ndarray:
        return self._keys[rows]

    def find(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self._find(np.asarray(keys, dtype=np.int64))

    def _find(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(local row or -1, found) for each key, by binary search of the sorted index."""
        held = len(self._keys_sorted)
        if held == 0:
            return np.full(len(keys), -1, dtype=np.int64), np.zeros(len(keys), dtype=bool)
        pos = np.minimum(np.searchsorted(self._keys_sorted, keys), held - 1)
        found = self._keys_sorted[pos] == keys
        return np.where(found, self._rows_sorted[pos], -1), found

    def count_new(self, ids: np.ndarray) -> int:
        _, found = self._find(np.asarray(ids, dtype=np.int64))
        return int(len(np.unique(ids[~found])))

    def locate(self, ids: np.ndarray, create: bool = False) -> np.ndarray:
        """Local rows of keys, creating missing ones when asked (the shard has already checked
        them against max_rows_per_shard, before changing anything)."""
        keys = np.asarray(ids, dtype=np.int64)
        rows, found = self._find(keys)
        if found.all() or not create:
            return rows
        self._append(np.unique(keys[~found]))
        return self._find(keys)[0]

    def forget_since(self, held: int) -> None:
        """Drop the rows created since the shard held `held` rows (the new keys of an update
        that was refused or taken back): rows are appended, so they are the last ones."""
        if held >= self._count:
            return
        keep = self._rows_sorted < held
        self._keys_sorted, self._rows_sorted = self._keys_sorted[keep], self._rows_sorted[keep]
        self._changed[held:self._count] = False  # a later key reusing the row starts clean
        self._count = held

    def _append(self, new_keys: np.ndarray, initialise: bool = True) -> None:
        """Create rows for keys that are unique and not held yet."""
        new_keys = np.sort(new_keys)
        start, stop = self._count, self._count + len(new_keys)
        if stop > len(self.values):
            self._grow(self._grown(stop))
        self._keys[start:stop] = new_keys
        if initialise:
            self.values[start:stop] = native_path.initial_rows(
                self.spec.initializer, new_keys, self.spec.dim, self.spec.dtype)
            for name, slot in self.slots.items():
                slot[start:stop] = self.optimizer.slot_initial_value(name)
        if self.spec.dynamic:
            self.last_used[start:stop], self.uses[start:stop] = 0, 0
        self._count = stop
        # merge the (sorted, absent) new keys into the index in O(n): no re-sort
        at = np.searchsorted(self._keys_sorted, new_keys)
        self._keys_sorted = np.insert(self._keys_sorted, at, new_keys)
        self._rows_sorted = np.insert(self._rows_sorted, at, np.arange(start, stop))

    def _grow(self, capacity: int) -> None:
        def grown(arr: np.ndarray) -> np.ndarray:
            out = np.zeros((capacity,) + arr.shape[1:], dtype=arr.dtype)
            out[: self._count] = arr[: self._count]
            return out

        self._keys = grown(self._keys)
        self._changed = grown(self._changed)
        self.values = grown(self.values)
        self.slots = {name: grown(slot) for name, slot in self.slots.items()}
        if self.spec.dynamic:
            self.last_used, self.uses = grown(self.last_used), grown(self.uses)

    # ---- dynamic tables (eviction.py decides, these change the arrays) -----------------
    def meta(self) -> tuple[np.ndarray, np.ndarray]:
        """(last-used step, use count) of every held row, in local order."""
        return self.last_used[: self._count], self.uses[: self._count]

    def used_meta(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        rows = self._find(keys)[0]
        return keys, self.last_used[rows], self.uses[rows]

    def set_meta(self, keys: np.ndarray, last_used: np.ndarray, uses: np.ndarray) -> None:
        rows = self._find(keys)[0]
        self.last_used[rows], self.uses[rows] = last_used, uses

    def mark_used(self, keys: np.ndarray, step: int) -> None:
        rows = self._find(keys)[0]
        self.last_used[rows] = step
        self.uses[rows] += 1

    def extract(self, keys: np.ndarray) -> tuple:
        """Copies of (keys, values, slots, last_used, uses) of held keys."""
        rows = self._find(keys)[0]
        return (keys, self.values[rows], {n: s[rows] for n, s in self.slots.items()},
                self.last_used[rows], self.uses[rows])

    def _arrays(self) -> list[np.ndarray]:
        extra = [self.last_used, self.uses] if self.spec.dynamic else []
        return [self._keys, self._changed, self.values, *self.slots.values(), *extra]

    def remove(self, keys: np.ndarray) -> None:
        """Drop held keys and their rows: the last rows move into the holes (O(removed)
        rows copied) and the index forgets them (O(held))."""
        if not len(keys):
            return
        rows = np.sort(self._find(keys)[0])
        count, left = self._count, self._count - len(rows)
        holes = rows[rows < left]
        tail = np.setdiff1d(np.arange(left, count), rows)  # as many as holes
        for arr in self._arrays():
            arr[holes] = arr[tail]
        keep = np.ones(len(self._keys_sorted), dtype=bool)
        keep[np.searchsorted(self._keys_sorted, keys)] = False
        self._keys_sorted, self._rows_sorted = self._keys_sorted[keep], self._rows_sorted[keep]
        self._rows_sorted[np.searchsorted(self._keys_sorted, self._keys[holes])] = holes
        self._changed[left:count] = False
        self._count = left

    def replace(self, ids: np.ndarray, values: np.ndarray, slots: Slots) -> None:
        """Adopt restored rows: the shard then holds exactly these keys."""
        self._count = 0
        self._keys_sorted = np.empty(0, dtype=np.int64)
        self._rows_sorted = np.empty(0, dtype=np.int64)
        self._grow(max(len(ids), MIN_CAPACITY))
        self.adopt(ids, values, slots)

    def adopt(self, ids: np.ndarray, values: np.ndarray, slots: Slots) -> None:
        """Set rows and their slots (unique keys), creating the keys not held yet."""
        ids = np.asarray(ids, dtype=np.int64)
        if not len(ids):
            return
        _, found = self._find(ids)
        if not found.all():
            self._append(ids[~found], initialise=False)  # overwritten next
        rows = self.locate(ids)
        self.values[rows] = values
        for name, slot in self.slots.items():
            slot[rows] = slots[name]

    def touched(self, changed_only: bool = False) -> np.ndarray:
        """Every local row (each was created by a request), in creation order; with
        `changed_only`, those training wrote since the shard was made (imports aside)."""
        if changed_only:
            return np.flatnonzero(self._changed[: self._count])
        return np.arange(self._count)

    def mark_changed(self, rows: np.ndarray) -> None:
        self._changed[rows] = True

    def restart_changes(self) -> None:
        self._changed[:] = False

    def trimmed(self) -> tuple[np.ndarray, Slots]:
        return self.values[: self._count], {n: s[: self._count] for n, s in self.slots.items()}

    def materialize(self) -> None:
        """Every row held is initialised already."""


def new_storage(spec: TableSpec, shard: int, optimizer: ServerOptimizer) -> FixedRows | KeyedRows:
    return (KeyedRows if spec.hashed_keys else FixedRows)(spec, shard, optimizer)
