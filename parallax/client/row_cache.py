"""A worker's hot-row cache with bounded staleness (`TABLE_CLIENTS["row_cache"]`, picked by
`ParallaxStrategy(cache=RowCache(...))`), after HET (VLDB'22).

A fused step's pull asks `CachingClient` for every table's unique ids. Rows it holds that
are fresh enough answer from the worker's memory; the misses and the stale rows go on to
the servers through `DirectClient`, in the same one request per server. Pushes pass through
unchanged: every gradient reaches the servers, which stay the masters of every row.

Staleness is counted in steps of the worker's clock per table: the steps it has pushed to
the table (`RemoteTable.steps_pushed`). A sync pull at clock c needs the rows as of c
applied steps (`min_step`); the servers answer exactly those, so a row fetched at clock j
is a snapshot of step j, and may answer a pull at clock c while c - j <= staleness.
`staleness=0` serves a row only at the clock it was fetched (an evaluation and the next
training step share one), which trains exactly as no cache. A sync pull still waits for
its step on every shard (an empty part where every id hit): the servers refuse a push
ahead of their open step, so the cache saves rows and bytes, not the round trip. Async
pulls do not wait: a pull whose ids all hit sends nothing.

Memory is fixed when the tables are first seen: the budget is split over the tables in
proportion to their size (capped at what holds a whole table), and each table gets a
set-associative `RowStore` (WAYS slots per set, picked by a hash of the id) and a count-min
`FrequencySketch` of its ids' accesses, which ages by halving. A row enters its set only
if its estimated frequency beats the least frequent row there (TinyLFU admission, LFU
replacement); nothing grows with the number of distinct ids. `invalidate` forgets tables
whose rows changed other than by pushes (assign, restore) or whose layout changed (reshard).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, fields
from typing import Sequence

import numpy as np

from parallax.client.table import ShardedTable
from parallax.client.table_client import TABLE_CLIENTS, DirectClient, TableClient
from parallax.errors import ConfigError
from parallax.protocol.routing import Runs

WAYS = 8  # slots per set: a row may live in any of its set's WAYS slots
SKETCH_DEPTH = 4  # hash rows of the count-min sketch
SKETCH_WIDTH_PER_SLOT = 2  # counters per hash row for each slot of the store
SKETCH_MAX = np.iinfo(np.uint16).max  # counters saturate there
AGE_AFTER = 10  # the sketch halves every counter after AGE_AFTER x width accesses
SLOT_OVERHEAD_BYTES = 8 + 8 + SKETCH_DEPTH * SKETCH_WIDTH_PER_SLOT * 2  # id, version, sketch
MIN_CACHE_BYTES = 64 << 10  # 64 KiB: below this no table gets a set
_EMPTY = np.iinfo(np.int64).min  # the version of an empty slot
_SET_SALT = 0x5BD1E995
_SKETCH_SALTS = (0x9E3779B1, 0x85EBCA77)


@dataclass(frozen=True)
class RowCache:
    """`ParallaxStrategy(cache=RowCache(bytes=64 << 20, staleness=4))`: each worker keeps
    the hottest rows of its tables within `bytes` (rows, ids, versions and frequency
    counters all counted), serving a row fetched at step j to pulls up to step j +
    `staleness` (0: only the step it was fetched at, i.e. exactly synchronous training)."""

    bytes: int = 64 << 20
    staleness: int = 4

    def __post_init__(self) -> None:
        if not _is_int(self.bytes) or self.bytes < MIN_CACHE_BYTES:
            raise ConfigError(f"RowCache(bytes={self.bytes!r}) must be an int of at least "
                              f"{MIN_CACHE_BYTES} (64 KiB): the worker's memory for cached "
                              f"rows, e.g. bytes=64 << 20 for 64 MiB")
        if not _is_int(self.staleness) or self.staleness < 0:
            raise ConfigError(f"RowCache(staleness={self.staleness!r}) must be an int >= 0: "
                              f"how many steps older than the pull a served row may be "
                              f"(0: exactly synchronous)")

    def describe(self) -> str:
        return (f"worker row cache on: {self.bytes / 2**20:.1f} MiB per worker, rows at most "
                f"{self.staleness} step(s) stale")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class CacheStats:
    """What the cache did on this worker since it started (rows are table rows)."""

    pulls: int = 0  # pulls asked of the cache
    hits: int = 0  # rows answered from the cache
    misses: int = 0  # rows not held, pulled from the servers
    stale: int = 0  # rows held but too old, pulled again (stale refreshes)
    requests_saved: int = 0  # pulls that sent no request at all (async, every row a hit)
    bytes_saved: int = 0  # row bytes the servers did not send (hits x row bytes)
    invalidations: int = 0  # invalidate() calls (reshard, restore, assign)
    rows_held: int = 0  # rows in the cache now
    bytes_held: int = 0  # the cache's memory now (<= RowCache.bytes)
    capacity_rows: int = 0  # slots over every table

    @property
    def rows_saved(self) -> int:
        return self.hits

    @property
    def hit_rate(self) -> float:
        asked = self.hits + self.misses + self.stale
        return self.hits / asked if asked else 0.0


def _mixed(keys: np.ndarray, salt: int) -> np.ndarray:
    """A cheap multiply-xorshift hash of uint64 keys (two passes where splitmix64 takes
    six: the cache hashes every id of every pull several times)."""
    with np.errstate(over="ignore"):
        z = (keys ^ np.uint64(salt)) * np.uint64(0x9E3779B97F4A7C15)
    z ^= z >> np.uint64(32)
    return z


def _hashed(ids: np.ndarray, salt: int, modulo: int) -> np.ndarray:
    return (_mixed(ids.view(np.uint64), salt) % np.uint64(modulo)).astype(np.intp)


class FrequencySketch:
    """Count-min sketch of id accesses, `SKETCH_DEPTH` x `width` saturating uint16 counters
    with conservative update (an access raises only the counters at its estimate, which
    keeps the noise of a stream of cold ids low); every counter halves after `AGE_AFTER *
    width` accesses, so old popularity fades."""

    def __init__(self, width: int) -> None:
        self.counts = np.zeros((SKETCH_DEPTH, max(1, width)), np.uint16)
        self.added = 0

    def _columns(self, ids: np.ndarray) -> list[np.ndarray]:
        """Each hash row's counter of each id: h1 + d * h2 (double hashing, two mixes)."""
        width = np.uint64(self.counts.shape[1])
        keys = ids.view(np.uint64)
        first = _mixed(keys, _SKETCH_SALTS[0])
        second = _mixed(keys, _SKETCH_SALTS[1]) | np.uint64(1)
        with np.errstate(over="ignore"):
            return [((first + np.uint64(d) * second) % width).astype(np.intp)
                    for d in range(SKETCH_DEPTH)]

    def add(self, ids: np.ndarray) -> None:
        """One access of each of `ids` (distinct ids)."""
        columns = self._columns(ids)
        raised = np.minimum(self._estimate(columns) + 1, SKETCH_MAX)
        order = np.argsort(raised, kind="stable")  # of ids sharing a counter, the largest
        raised = raised[order].astype(np.uint16)   # estimate is written last and wins
        for row, column in zip(self.counts, columns):
            at = column[order]
            row[at] = np.maximum(row[at], raised)
        self.added += len(ids)
        if self.added >= AGE_AFTER * self.counts.shape[1]:
            self.counts >>= 1
            self.added //= 2

    def estimate(self, ids: np.ndarray) -> np.ndarray:
        return self._estimate(self._columns(ids))

    def _estimate(self, columns: list[np.ndarray]) -> np.ndarray:
        return np.min([row[c] for row, c in zip(self.counts, columns)],
                      axis=0).astype(np.int64)


class RowStore:
    """A fixed number of rows of one table: `sets` sets of `WAYS` slots, each slot an id,
    its row and the version (clock) the row was fetched at; plus the table's sketch."""

    def __init__(self, capacity: int, dim: int, dtype) -> None:
        self.sets = max(1, capacity // WAYS)
        slots = self.sets * WAYS
        self.keys = np.zeros(slots, np.int64)
        self.versions = np.full(slots, _EMPTY, np.int64)
        self.rows = np.zeros((slots, dim), dtype)
        self.sketch = FrequencySketch(slots * SKETCH_WIDTH_PER_SLOT)

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.versions.nbytes + self.rows.nbytes + \
            self.sketch.counts.nbytes

    @property
    def held(self) -> int:
        return int(np.count_nonzero(self.versions != _EMPTY))

    def _candidates(self, ids: np.ndarray) -> np.ndarray:
        """[len(ids), WAYS]: the slots each id may live in."""
        return (_hashed(ids, _SET_SALT, self.sets) * WAYS)[:, None] + np.arange(WAYS)

    def find(self, ids: np.ndarray) -> np.ndarray:
        """The slot holding each id, or -1."""
        slots = self._candidates(ids)
        match = (self.keys[slots] == ids[:, None]) & (self.versions[slots] != _EMPTY)
        found = slots[np.arange(len(ids)), match.argmax(axis=1)]
        return np.where(match.any(axis=1), found, -1)

    def lookup(self, ids: np.ndarray, clock: int, staleness: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """An access of `ids` at `clock`: (slot of each id or -1, fresh: held and at most
        `staleness` older than `clock`, held but stale)."""
        self.sketch.add(ids)
        slots = self.find(ids)
        held = slots >= 0
        age = clock - self.versions[np.where(held, slots, 0)]
        fresh = held & (age <= staleness) & (age >= 0)
        return slots, fresh, held & ~fresh

    def store(self, ids: np.ndarray, rows: np.ndarray, version: int) -> None:
        """Rows fetched at `version`: those held are refreshed (unless held newer), the
        others compete for a slot (`_admit`)."""
        slots = self.find(ids)
        held = slots >= 0
        newer = held.copy()
        newer[held] = self.versions[slots[held]] <= version
        self.rows[slots[newer]] = rows[newer]
        self.versions[slots[newer]] = version
        if not held.all():
            self._admit(ids[~held], rows[~held], version)

    def _admit(self, ids: np.ndarray, rows: np.ndarray, version: int) -> None:
        """Per set, the most frequent newcomer replaces the set's least frequent row (an
        empty slot first) if it is accessed more often; repeated while newcomers win."""
        freq = self.sketch.estimate(ids)
        sets = _hashed(ids, _SET_SALT, self.sets)
        todo = np.arange(len(ids))
        for _ in range(WAYS):
            if not len(todo):
                return
            order = todo[np.lexsort((-freq[todo], sets[todo]))]  # by set, most frequent first
            _, first = np.unique(sets[order], return_index=True)
            chosen = order[first]
            victims, victim_freq = self._victims(sets[chosen])
            wins = freq[chosen] > victim_freq
            won, slots = chosen[wins], victims[wins]
            self.keys[slots], self.versions[slots], self.rows[slots] = \
                ids[won], version, rows[won]
            lost = np.isin(sets[todo], sets[chosen[~wins]])
            todo = todo[~lost & ~np.isin(todo, chosen)]

    def _victims(self, sets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each set's least frequent slot and its frequency (-1: empty)."""
        slots = sets[:, None] * WAYS + np.arange(WAYS)
        freq = self.sketch.estimate(self.keys[slots].reshape(-1)).reshape(slots.shape)
        freq = np.where(self.versions[slots] == _EMPTY, -1, freq)
        way = freq.argmin(axis=1)
        rows = np.arange(len(sets))
        return slots[rows, way], freq[rows, way]


def split_budget(budget: int, tables: dict[str, tuple[int, int]]) -> dict[str, int]:
    """{table: slots} for {table: (slot bytes, rows)}: each table's rows and a quarter more
    (sets fill unevenly), whole sets; when they do not all fit, the budget is shared in
    proportion to those sizes (0 slots: too small for one set)."""
    wanted = {n: -(-(r + r // 4) // WAYS) * WAYS for n, (_, r) in tables.items()}
    total = sum(tables[n][0] * s for n, s in wanted.items())
    if total <= budget:
        return wanted
    return {n: (budget * s // total) // WAYS * WAYS for n, s in wanted.items()}


class _Ready:
    """A pull the cache answered whole: nothing in flight."""

    def __init__(self, rows: list[np.ndarray]) -> None:
        self.rows = rows

    def result(self) -> list[np.ndarray]:
        return self.rows

    def abandon(self) -> None:
        pass


class _Filling:
    """A pull whose misses are in flight: `result()` fills them in and caches them."""

    def __init__(self, cache: "CachingClient", tables, rows, missing, clocks, pending,
                 generation: int) -> None:
        self.cache, self.tables, self.rows = cache, tables, rows
        self.missing, self.clocks, self.pending = missing, clocks, pending
        self.generation = generation  # the cache's, when the pull left

    def result(self) -> list[np.ndarray]:
        fetched = self.pending.result()
        for out, (positions, ids), got in zip(self.rows, self.missing, fetched):
            out[positions] = got
        self.cache.remember(self.tables, self.missing, fetched, self.clocks, self.generation)
        return self.rows

    def abandon(self) -> None:
        self.pending.abandon()


class CachingClient(TableClient):
    """`DirectClient` behind a worker's hot-row cache (see the module docstring)."""

    name = "row_cache"
    wants_clocks = True

    def __init__(self, config: RowCache | None = None,
                 direct: TableClient | None = None) -> None:
        self.config = config or RowCache()
        self.direct = direct or DirectClient()
        self._lock = threading.Lock()
        self._sizes: dict[str, tuple[int, int]] = {}  # table -> (slot bytes, rows)
        self._stores: dict[str, RowStore | None] = {}
        self._specs: dict[str, object] = {}  # table -> the spec its store holds rows of
        self._generation = 0  # invalidations so far: a pull in flight across one stores nothing
        self._counts = {f.name: 0 for f in fields(CacheStats) if f.name in _COUNTED}

    def start_pull(self, tables, min_steps, runs, clocks=None):
        clocks = list(min_steps if clocks is None else clocks)
        with self._lock:
            stores = self._stores_for(tables)
            rows, missing = [], []
            for k, (table, store) in enumerate(zip(tables, stores)):
                out, positions = self._served(table, store, runs.run(k), clocks[k])
                rows.append(out)
                missing.append((positions, runs.run(k)[positions]))
            self._counts["pulls"] += 1
            if not any(len(ids) for _, ids in missing) and max(min_steps, default=0) <= 0:
                self._counts["requests_saved"] += 1
                return _Ready(rows)
            generation = self._generation
        every = all(len(ids) == len(runs.run(k)) for k, (_, ids) in enumerate(missing))
        asked = runs if every else Runs(runs.partitioners, [ids for _, ids in missing])
        pending = self.direct.start_pull(tables, min_steps, asked)
        return _Filling(self, tables, rows, missing, clocks, pending, generation)

    def _served(self, table: ShardedTable, store: RowStore | None, ids: np.ndarray,
                clock: int) -> tuple[np.ndarray, np.ndarray]:
        """(the rows of `ids`, fresh ones filled in; positions of the others)."""
        out = np.empty((len(ids), table.spec.dim), table.dtype)
        if store is None:
            self._counts["misses"] += len(ids)
            return out, np.arange(len(ids))
        slots, fresh, stale = store.lookup(ids, clock, self.config.staleness)
        out[fresh] = store.rows[slots[fresh]]
        hits = int(np.count_nonzero(fresh))
        self._counts["hits"] += hits
        self._counts["stale"] += int(np.count_nonzero(stale))
        self._counts["misses"] += len(ids) - hits - int(np.count_nonzero(stale))
        self._counts["bytes_saved"] += hits * table.spec.dim * _wire_itemsize(table)
        return out, np.flatnonzero(~fresh)

    def remember(self, tables, missing, fetched, clocks, generation: int) -> None:
        """Rows the servers answered at `clocks`, into the tables' stores (if still held,
        and not invalidated since the pull left)."""
        with self._lock:
            if generation != self._generation:
                return
            for table, (_, ids), rows, clock in zip(tables, missing, fetched, clocks):
                store = self._stores.get(table.name)
                if store is not None and len(ids):
                    store.store(ids, rows, clock)

    def _stores_for(self, tables: Sequence[ShardedTable]) -> list[RowStore | None]:
        """Each table's store; tables seen for the first time share out the budget again
        (stores whose share changed start empty)."""
        for t in tables:  # a table made again under the same name: not the rows held
            if self._specs.setdefault(t.name, t.spec) != t.spec:
                self._specs[t.name] = t.spec
                self._sizes.pop(t.name, None)
                self._stores.pop(t.name, None)
        new = {t.name: self._size(t) for t in tables if t.name not in self._sizes}
        if new:
            self._sizes.update(new)
            for name, slots in split_budget(self.config.bytes, self._sizes).items():
                store = self._stores.get(name)
                if store is None or store.sets * WAYS != slots:
                    table = next((t for t in tables if t.name == name), None)
                    self._stores[name] = self._made(table, store, slots)
        return [self._stores[t.name] for t in tables]

    def _size(self, table: ShardedTable) -> tuple[int, int]:
        """(slot bytes, rows) of a table; a table of hashed keys has no row count: it
        asks for the whole budget."""
        slot = table.spec.dim * table.dtype.itemsize + SLOT_OVERHEAD_BYTES
        return slot, table.spec.vocabulary_size or self.config.bytes // slot

    @staticmethod
    def _made(table: ShardedTable | None, old: RowStore | None, slots: int
              ) -> RowStore | None:
        if slots < WAYS:
            return None
        if table is not None:
            return RowStore(slots, table.spec.dim, table.dtype)
        return RowStore(slots, old.rows.shape[1], old.rows.dtype) if old is not None else None

    def start_push(self, tables, grads, steps, worker, learning_rates, runs):
        return self.direct.start_push(tables, grads, steps, worker, learning_rates, runs)

    def invalidate(self, tables: Sequence[ShardedTable] | None = None) -> None:
        """Forget the rows of these tables (None: every table), e.g. after a reshard,
        a restore or an assign; their memory is shared out again when next seen."""
        with self._lock:
            names = list(self._sizes) if tables is None else [t.name for t in tables]
            for name in names:
                self._sizes.pop(name, None)
                self._stores.pop(name, None)
                self._specs.pop(name, None)
            self._generation += 1
            self._counts["invalidations"] += 1

    def stats(self) -> CacheStats:
        with self._lock:
            stores = [s for s in self._stores.values() if s is not None]
            return CacheStats(**self._counts, rows_held=sum(s.held for s in stores),
                              bytes_held=sum(s.nbytes for s in stores),
                              capacity_rows=sum(s.sets * WAYS for s in stores))


def _wire_itemsize(table: ShardedTable) -> int:
    """Bytes an element of the table's rows takes on the wire (its wire dtype's, if any)."""
    return 2 if getattr(table.spec, "wire_dtype", "") in ("float16", "bfloat16") else \
        table.dtype.itemsize


_COUNTED = ("pulls", "hits", "misses", "stale", "requests_saved", "bytes_saved",
            "invalidations")
TABLE_CLIENTS[CachingClient.name] = CachingClient
