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
proportion to their size (capped at what holds a whole table). Tables of one row shape
(dim and dtype) share one `RowStore`, each its own segment of whole sets of WAYS slots (a
slot picked by a hash of the id) and of the store's count-min `FrequencySketch` of
accesses, which ages by halving. A row enters its set only if its estimated frequency beats
the least frequent row there (TinyLFU admission, LFU replacement); nothing grows with the
number of distinct ids. `invalidate` forgets tables whose rows changed other than by pushes
(assign, restore) or whose layout changed (reshard).

The per-pull work is a fixed number of numpy passes over all of a store's ids at once,
whatever the number of tables: each id is hashed once (`id_hashes`, a bijection of the id,
so a slot keeps the hash in place of the id) and that hash gives its set and its sketch
counters; the stale and missed ids are looked up again when their rows arrive (another
pull may have stored them meanwhile), and only the ids not held compete for slots, all
sets at once. At staleness 0 only a pull's own clock's rows may be served, so the stores
are `StepRows`: each table's rows of its latest clock, dropped when it moves on (a training
step's pull, at a new clock, then costs next to nothing; an evaluation at the same clock
is served).
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
AGE_AFTER = 10  # a table's counters halve after AGE_AFTER x its width accesses
SLOT_OVERHEAD_BYTES = 8 + 8 + SKETCH_DEPTH * SKETCH_WIDTH_PER_SLOT * 2  # hash, version, sketch
MIN_CACHE_BYTES = 64 << 10  # 64 KiB: below this no table gets a set
_EMPTY = np.uint64(0)  # the key of an empty slot; the one id hashing to it is never cached
_SALT = np.uint64(0x5BD1E995)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # odd: multiplying by it is invertible mod 2**64
_SKETCH_MULTIPLIERS = np.array([0xD6E8FEB86659FD93, 0xA0761D6478BD642F], np.uint64)  # odd
BLOCK_COUNTERS = 8  # a sketch block's counters of each row: 4 rows x 8 x 2 bytes = 64 bytes
_BLOCK = SKETCH_DEPTH * BLOCK_COUNTERS
_ROW_OFFSETS = (np.arange(SKETCH_DEPTH, dtype=np.uint64) * np.uint64(BLOCK_COUNTERS))[:, None]
_FIELD_SHIFTS = (np.arange(SKETCH_DEPTH, dtype=np.uint64) * np.uint64(3))[:, None]  # 3 bits:
_FIELD_MASK = np.uint64(BLOCK_COUNTERS - 1)  # one of a row's 8 counters in the block
_HALF = np.uint64(32)  # bits: a hash's high half picks its set, products' high halves columns
_WAY = np.arange(WAYS)
_WORD = np.dtype(f"u{WAYS}")  # WAYS bools as one unsigned int (WAYS is 1, 2, 4 or 8)


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


def id_hashes(ids: np.ndarray) -> np.ndarray:
    """Each int64 id's uint64 hash: a xor, an odd multiply and a xorshift, each invertible,
    so distinct ids have distinct hashes and a slot may keep the hash for the id."""
    z = (ids.view(np.uint64) ^ _SALT) * _GOLDEN
    return z ^ (z >> _HALF)


def _scaled(bits: np.ndarray, n: np.ndarray) -> np.ndarray:
    """32-bit values mapped onto [0, n) by a multiply and a shift (no division)."""
    return (bits * n) >> _HALF


class FrequencySketch:
    """Count-min sketch of id accesses: `SKETCH_DEPTH` rows of saturating uint16 counters,
    segment k (a table) its own `widths[k]` counters of each row; conservative update (an
    access raises only the counters at its estimate, which keeps the noise of a stream of
    cold ids low); a segment's counters halve after `AGE_AFTER * widths[k]` accesses of it,
    so old popularity fades. Ids come as their `id_hashes`.

    Blocked, as Caffeine's: the counters are laid out in blocks of one cache line,
    `BLOCK_COUNTERS` of each row, and an id's counters are all in one block (picked by its
    hash, a counter of each row within it by more bits of the hash), so an access reads one
    line of memory, not one per row."""

    def __init__(self, widths: Sequence[int]) -> None:
        blocks = [max(1, -(-int(w) // BLOCK_COUNTERS)) for w in widths]
        self.blocks = np.array(blocks, np.uint64)
        self.starts = np.cumsum([0] + blocks).astype(np.int64)
        self.counts = np.zeros((int(self.starts[-1]), _BLOCK), np.uint16)
        self.added = np.zeros(len(blocks), np.int64)
        self._age_at = AGE_AFTER * BLOCK_COUNTERS * np.array(blocks, np.int64)

    def cells(self, hashes: np.ndarray, segments: np.ndarray) -> np.ndarray:
        """[SKETCH_DEPTH, n]: each hash's counter in each row, as indices into the flat
        counts (its block from the high half of the hash times one odd number, its counter
        of each row from 3-bit fields of the high half of it times another)."""
        block = _scaled((hashes * _SKETCH_MULTIPLIERS[0]) >> _HALF, self.blocks[segments]) + \
            self.starts[segments].astype(np.uint64)
        fields = ((hashes * _SKETCH_MULTIPLIERS[1]) >> _HALF) >> _FIELD_SHIFTS
        return (block * np.uint64(_BLOCK) + _ROW_OFFSETS + (fields & _FIELD_MASK)).astype(np.intp)

    def add(self, cells: np.ndarray, segments: np.ndarray) -> np.ndarray:
        """One access of each id (distinct ids) at its `cells`; their estimates after it."""
        flat = self.counts.reshape(-1)
        raised = np.minimum(flat[cells].min(axis=0).astype(np.int64) + 1, SKETCH_MAX)
        np.maximum.at(flat, cells.reshape(-1), np.tile(raised.astype(np.uint16), SKETCH_DEPTH))
        self.added += np.bincount(segments, minlength=len(self.added))
        for k in np.flatnonzero(self.added >= self._age_at):
            self.counts[self.starts[k]:self.starts[k + 1]] >>= 1
            self.added[k] //= 2
            raised[segments == k] >>= 1  # estimates as the counters are now
        return raised

    def estimate(self, cells: np.ndarray) -> np.ndarray:
        return self.counts.reshape(-1)[cells].min(axis=0).astype(np.int64)

    def clear(self, segment: int) -> None:
        self.counts[self.starts[segment]:self.starts[segment + 1]] = 0
        self.added[segment] = 0


@dataclass(frozen=True)
class Probe:
    """What one pass over a store's ids found: per id its hash, its table's segment, its
    set, its estimated frequency (this access counted), its slot (-1: not held), whether
    that row is fresh enough to serve, and whether it is held but too old."""

    hashes: np.ndarray
    segments: np.ndarray
    sets: np.ndarray
    freq: np.ndarray
    slots: np.ndarray
    fresh: np.ndarray
    stale: np.ndarray

    def subset(self, which: np.ndarray) -> "Probe":
        return Probe(*(getattr(self, f.name)[which] for f in fields(Probe)))


class RowStore:
    """A fixed number of rows of one shape (dim, dtype) for one or more tables: table k's
    segment is `slots[k] // WAYS` whole sets of `WAYS` slots, each slot an id's hash (0:
    empty), its row and the version (clock) the row was fetched at; plus their sketch."""

    def __init__(self, slots: Sequence[int], dim: int, dtype) -> None:
        sets = [max(1, int(n) // WAYS) for n in slots]
        self.sets = np.array(sets, np.uint64)
        self.set_starts = np.cumsum([0] + sets).astype(np.int64)
        capacity = int(self.set_starts[-1]) * WAYS
        # written through now (np.zeros would map its pages at their first write, one page
        # fault per row stored during the first steps of training)
        self.keys = _touched(capacity, np.uint64)
        self.versions = _touched(capacity, np.int64)
        self.rows = _touched((capacity, dim), dtype)
        self.sketch = FrequencySketch([n * WAYS * SKETCH_WIDTH_PER_SLOT for n in sets])
        self.writes = 0  # calls that changed a slot: a probe's slots hold while it stands
        self.empty = np.array(sets, np.int64) * WAYS  # each segment's empty slots

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.versions.nbytes + self.rows.nbytes + \
            self.sketch.counts.nbytes

    @property
    def held(self) -> int:
        return int(np.count_nonzero(self.keys))

    @property
    def capacity(self) -> int:
        return len(self.keys)

    def set_of(self, hashes: np.ndarray, segments: np.ndarray) -> np.ndarray:
        """Each hash's set, within its segment's (from the high half of the hash)."""
        within = _scaled(hashes >> _HALF, self.sets[segments]).astype(np.int64)
        return self.set_starts[segments] + within

    def find(self, hashes: np.ndarray, sets: np.ndarray) -> np.ndarray:
        """The slot holding each hash, or -1 (a set's WAYS keys are read as one row)."""
        match = np.take(self.keys.reshape(-1, WAYS), sets, axis=0) == hashes[:, None]
        found = match.view(_WORD)[:, 0] != 0  # a set's WAYS bools read as one word: any
        return np.where(found & (hashes != _EMPTY), sets * WAYS + match.argmax(axis=1), -1)

    def lookup(self, ids: np.ndarray, segments: np.ndarray, clocks: np.ndarray,
               staleness: int) -> Probe:
        """An access of `ids` (each of its table's `segments`) at their tables' `clocks`."""
        hashes = id_hashes(ids)
        freq = self.sketch.add(self.sketch.cells(hashes, segments), segments)
        sets = self.set_of(hashes, segments)
        slots = self.find(hashes, sets)
        held = slots >= 0
        age = clocks - self.versions[slots]  # slot -1 reads the last slot: masked by held
        fresh = held & (age <= staleness) & (age >= 0)
        return Probe(hashes, segments, sets, freq, slots, fresh, held & ~fresh)

    def store(self, probe: Probe, rows: np.ndarray, versions: np.ndarray,
              seen: int | None = None) -> None:
        """Rows fetched at `versions` for the ids of `probe`: those held now are refreshed
        (unless held newer), the others compete for a slot (`_admit`). `seen`: `writes`
        when the probe was taken; if nothing was written since, its slots are still right
        and are not looked up again."""
        slots = probe.slots if seen == self.writes else self.find(probe.hashes, probe.sets)
        held = slots >= 0
        self.writes += 1
        if held.all():
            self._refresh(slots, rows, versions)
            return
        if held.any():
            self._refresh(slots[held], rows[held], versions[held])
        # an id seen once (estimate 1) takes only an empty slot: no held row is less frequent
        # but one whose counters aged to 0, and most ids of a Zipf stream are seen once
        new = ~held & (probe.hashes != _EMPTY) & \
            ((probe.freq > 1) | (self.empty[probe.segments] > 0))
        if new.any():
            self._admit(probe.subset(new), rows[new], versions[new])

    def _refresh(self, slots: np.ndarray, rows: np.ndarray, versions: np.ndarray) -> None:
        """Held rows fetched again, written unless the slot holds a newer version."""
        newer = self.versions[slots] <= versions
        if not newer.all():
            slots, rows, versions = slots[newer], rows[newer], versions[newer]
        put_rows(self.rows, slots, rows)
        self.versions[slots] = versions

    def _admit(self, probe: Probe, rows: np.ndarray, versions: np.ndarray) -> None:
        """In every set at once, the newcomers by falling frequency against the set's slots
        by rising frequency (empty ones first), pair by pair: a newcomer more frequent than
        its slot's row takes the slot. (Admitting one at a time while newcomers win picks
        the same: the pairs after a lost one lose too.)"""
        order = np.lexsort((-probe.freq, probe.sets))  # by set, most frequent first
        sets = probe.sets[order]
        first = np.flatnonzero(np.r_[True, sets[1:] != sets[:-1]])
        group = np.repeat(np.arange(len(first)), np.diff(np.r_[first, len(sets)]))
        rank = np.arange(len(sets)) - first[group]
        victims, victim_freq = self._victims(sets[first], probe.segments[order][first])
        keep = rank < WAYS
        group, rank, order = group[keep], rank[keep], order[keep]
        wins = probe.freq[order] > victim_freq[group, rank]
        won, slots = order[wins], victims[group[wins], rank[wins]]
        self.keys[slots], self.versions[slots] = probe.hashes[won], versions[won]
        put_rows(self.rows, slots, rows[won])
        filled = victim_freq[group[wins], rank[wins]] < 0
        self.empty -= np.bincount(probe.segments[won][filled], minlength=len(self.empty))

    def _victims(self, sets: np.ndarray, segments: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray]:
        """[len(sets), WAYS]: each set's slots from least to most frequent, and their
        frequencies (-1: empty)."""
        slots = sets[:, None] * WAYS + _WAY
        keys = np.take(self.keys.reshape(-1, WAYS), sets, axis=0).reshape(-1)
        freq = self.sketch.estimate(self.sketch.cells(keys, np.repeat(segments, WAYS)))
        freq = np.where(keys == _EMPTY, -1, freq).reshape(slots.shape)
        order = np.argsort(freq, axis=1, kind="stable")
        return np.take_along_axis(slots, order, 1), np.take_along_axis(freq, order, 1)

    def clear(self, segment: int) -> None:
        """Forget every row of one table."""
        lo, hi = (int(self.set_starts[segment + i]) * WAYS for i in (0, 1))
        self.keys[lo:hi] = _EMPTY
        self.empty[segment] = hi - lo
        self.sketch.clear(segment)
        self.writes += 1


class StepRows:
    """The store of a cache of staleness 0, with `RowStore`'s interface: there only rows
    fetched at a pull's own clock may be served, so each table's segment keeps the rows
    fetched at its latest clock (up to `slots[k]` of them, appended in fetch order) and
    drops them all when its clock moves on; no sets, no sketch, no admission. A training
    step's pull, whose clock is new, costs one comparison per id; a pull at the same clock
    (an evaluation, the next step's reads after it) searches the segment's sorted hashes."""

    def __init__(self, slots: Sequence[int], dim: int, dtype) -> None:
        sizes = [max(WAYS, int(n)) for n in slots]
        self.starts = np.cumsum([0] + sizes).astype(np.int64)
        self.sizes = np.array(sizes, np.int64)
        self.used = np.zeros(len(sizes), np.int64)  # rows held per segment
        self.clocks = np.full(len(sizes), np.iinfo(np.int64).min, np.int64)  # theirs
        self.keys = _touched(int(self.starts[-1]), np.uint64)
        self.rows = _touched((int(self.starts[-1]), dim), dtype)
        self.writes = 0
        self._sorted: dict[int, np.ndarray] = {}  # segment -> its held slots by hash

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.rows.nbytes + self.used.nbytes + self.clocks.nbytes

    @property
    def held(self) -> int:
        return int(self.used.sum())

    @property
    def capacity(self) -> int:
        return len(self.keys)

    def lookup(self, ids: np.ndarray, segments: np.ndarray, clocks: np.ndarray,
               staleness: int) -> Probe:
        """Rows held at the ids' own clocks (`staleness` is 0 here)."""
        hashes = id_hashes(ids)
        slots = np.full(len(ids), -1, np.int64)
        live = (self.clocks[segments] == clocks) & (self.used[segments] > 0)
        if live.any():
            for k in np.unique(segments[live]).tolist():
                mine = np.flatnonzero(live & (segments == k))
                slots[mine] = self._find(k, hashes[mine])
        fresh = slots >= 0  # (a probe's sets and frequencies are not used here)
        return Probe(hashes, segments, slots, slots, slots, fresh, np.zeros_like(fresh))

    def _find(self, segment: int, hashes: np.ndarray) -> np.ndarray:
        order = self._sorted.get(segment)
        lo = int(self.starts[segment])
        if order is None:
            order = lo + np.argsort(self.keys[lo:lo + int(self.used[segment])], kind="stable")
            self._sorted[segment] = order
        at = np.minimum(np.searchsorted(self.keys[order], hashes), len(order) - 1)
        return np.where(self.keys[order[at]] == hashes, order[at], -1)

    def store(self, probe: Probe, rows: np.ndarray, versions: np.ndarray,
              seen: int | None = None) -> None:
        """Rows fetched at `versions`: a segment whose clock moved on starts empty; each
        keeps what fits of them after those it holds (copied as whole runs: the ids come
        table by table)."""
        segments = probe.segments
        if len(segments):
            bounds = np.flatnonzero(np.r_[True, segments[1:] != segments[:-1], True])
            for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
                self._append(int(segments[lo]), int(versions[lo]), probe.hashes[lo:hi],
                             rows[lo:hi])
        self.writes += 1
        self._sorted.clear()

    def _append(self, segment: int, clock: int, hashes: np.ndarray, rows: np.ndarray) -> None:
        if self.clocks[segment] != clock:
            self.clocks[segment], self.used[segment] = clock, 0
        used = int(self.used[segment])
        n = min(len(hashes), int(self.sizes[segment]) - used)
        at = int(self.starts[segment]) + used
        self.keys[at:at + n] = hashes[:n]
        self.rows[at:at + n] = rows[:n]
        self.used[segment] = used + n

    def clear(self, segment: int) -> None:
        self.used[segment] = 0
        self.writes += 1
        self._sorted.pop(segment, None)


def put_rows(dest: np.ndarray, at: np.ndarray, rows: np.ndarray) -> None:
    """`dest[at] = rows` for 2-D rows, each row moved as one item (numpy's 2-D fancy
    assignment sets a row up element by element: about 3x slower)."""
    rows = np.ascontiguousarray(rows, dest.dtype)
    if dest.ndim != 2 or not dest.flags.c_contiguous or not dest.shape[1]:
        dest[at] = rows
        return
    item = np.dtype((np.void, dest.shape[1] * dest.itemsize))
    dest.view(item).reshape(-1)[at] = rows.view(item).reshape(-1)


def _touched(shape, dtype) -> np.ndarray:
    """Zeros whose memory is already in place (every page written once)."""
    out = np.empty(shape, dtype)
    out.fill(0)
    return out


def split_budget(budget: int, tables: dict[str, tuple[int, int]]) -> dict[str, int]:
    """{table: slots} for {table: (slot bytes, rows)}: each table's rows and a quarter more
    (sets fill unevenly), whole sets; when they do not all fit, the budget is shared in
    proportion to those sizes (0 slots: too small for one set)."""
    wanted = {n: -(-(r + r // 4) // WAYS) * WAYS for n, (_, r) in tables.items()}
    total = sum(tables[n][0] * s for n, s in wanted.items())
    if total <= budget:
        return wanted
    return {n: (budget * s // total) // WAYS * WAYS for n, s in wanted.items()}


@dataclass
class _Pool:
    """The store of the tables of one row shape (dim, dtype): segment k holds table
    `names[k]` in `slots[k]` slots."""

    shape: tuple[int, np.dtype]
    store: RowStore | StepRows
    names: tuple[str, ...]
    slots: tuple[int, ...]

    def same_layout(self, members: dict[str, int]) -> bool:
        return dict(zip(self.names, self.slots)) == members


class _Served:
    """One pool's part of a pull: the tables it covers (their positions `ks` in the pull),
    its rows with the fresh ones filled in, and the probe of its ids."""

    def __init__(self, pool: _Pool, ks: list[int], lengths: list[int], ids: np.ndarray,
                 out: np.ndarray, probe: Probe, clocks: np.ndarray) -> None:
        self.pool, self.ks, self.out, self.probe, self.clocks = pool, ks, out, probe, clocks
        self.ids = ids
        self.seen = pool.store.writes  # the store as the probe saw it
        self.bounds = np.cumsum([0] + lengths).tolist()
        self.hits = int(np.count_nonzero(probe.fresh))

    def missing(self, ids: np.ndarray) -> list[np.ndarray]:
        """Of `ids` (the covered tables' runs joined), each table's that the servers must
        answer."""
        asked = ~self.probe.fresh
        before = np.r_[0, np.cumsum(asked)][self.bounds]  # asked ids before each bound
        return np.split(ids[asked], before[1:-1])

    def tables(self) -> list[np.ndarray]:
        """Each covered table's rows (views of `out`)."""
        return [self.out[lo:hi] for lo, hi in zip(self.bounds[:-1], self.bounds[1:])]

    def filled(self, got: list[np.ndarray]) -> tuple[list[np.ndarray], np.ndarray]:
        """Each covered table's rows once the servers answered `got` (their misses, in
        order), and those fetched rows joined (what the store takes)."""
        joined = got[0] if len(got) == 1 else np.concatenate(got)
        if not self.hits:
            return got, joined
        put_rows(self.out, ~self.probe.fresh, joined)
        return self.tables(), joined


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

    def __init__(self, cache: "CachingClient", parts: list[_Served], pending,
                 generation: int) -> None:
        self.cache, self.parts, self.pending = cache, parts, pending
        self.generation = generation  # the cache's, when the pull left

    def result(self) -> list[np.ndarray]:
        rows = list(self.pending.result())  # a table no store covers: as the servers sent it
        stored = []
        for part in self.parts:
            tables, joined = part.filled([rows[k] for k in part.ks])
            for k, table_rows in zip(part.ks, tables):
                rows[k] = table_rows
            stored.append(joined)
        self.cache.remember(self.parts, stored, self.generation)
        return rows

    def abandon(self) -> None:
        self.pending.abandon()


class CachingClient(TableClient):
    """`DirectClient` behind a worker's hot-row cache (see the module docstring)."""

    name = "row_cache"

    def __init__(self, config: RowCache | None = None,
                 direct: TableClient | None = None) -> None:
        self.config = config or RowCache()
        self.direct = direct or DirectClient()
        self._lock = threading.Lock()
        self._sizes: dict[str, tuple[int, int]] = {}  # table -> (slot bytes, rows)
        self._shapes: dict[str, tuple[int, np.dtype]] = {}  # table -> (dim, dtype)
        self._specs: dict[str, object] = {}  # table -> the spec its segment holds rows of
        self._pools: dict[tuple[int, np.dtype], _Pool] = {}  # row shape -> its tables' store
        self._where: dict[str, tuple[_Pool, int]] = {}  # table -> (pool, segment)
        self._generation = 0  # invalidations so far: a pull in flight across one stores nothing
        self._counts = {f.name: 0 for f in fields(CacheStats) if f.name in _COUNTED}

    def start_pull(self, tables, min_steps, runs, clocks):
        clocks = np.asarray(list(clocks), np.int64)
        with self._lock:
            parts = [self._served(pool, ks, tables, runs, clocks)
                     for pool, ks in self._by_pool(tables)]
            missing = [runs.run(k) for k in range(len(tables))]
            for part in parts:
                if part.hits:
                    for k, ids in zip(part.ks, part.missing(part.ids)):
                        missing[k] = ids
            self._count(tables, runs, parts)
            if not any(len(ids) for ids in missing) and max(min_steps, default=0) <= 0:
                self._counts["requests_saved"] += 1
                return _Ready(self._answered(len(tables), parts))
            generation = self._generation
        every = not any(part.hits for part in parts)
        asked = runs if every else Runs(runs.routers, missing)
        pending = self.direct.start_pull(tables, min_steps, asked, clocks)
        return _Filling(self, parts, pending, generation)

    def _by_pool(self, tables: Sequence[ShardedTable]) -> list[tuple[_Pool, list[int]]]:
        """The pools that hold these tables, each with the positions of its tables."""
        self._place(tables)
        groups: dict[int, tuple[_Pool, list[int]]] = {}
        for k, table in enumerate(tables):
            where = self._where.get(table.name)
            if where is not None:
                groups.setdefault(id(where[0]), (where[0], []))[1].append(k)
        return list(groups.values())

    def _served(self, pool: _Pool, ks: list[int], tables, runs: Runs,
                clocks: np.ndarray) -> _Served:
        """One pool's lookup of its tables' ids, the fresh rows copied out."""
        lengths = [runs.lengths[k] for k in ks]
        whole = ks == list(range(len(runs.lengths)))
        ids = runs.ids if whole else np.concatenate([runs.run(k) for k in ks])
        segments = np.repeat(np.array([self._where[tables[k].name][1] for k in ks]), lengths)
        id_clocks = np.repeat(clocks[ks], lengths)
        probe = pool.store.lookup(ids, segments, id_clocks, self.config.staleness)
        out = np.empty((len(ids), pool.store.rows.shape[1]), pool.store.rows.dtype)
        if probe.fresh.any():
            held = np.take(pool.store.rows, probe.slots[probe.fresh], axis=0)
            put_rows(out, probe.fresh, held)
        return _Served(pool, ks, lengths, ids, out, probe, id_clocks)

    def _count(self, tables, runs: Runs, parts: list[_Served]) -> None:
        counts = self._counts
        counts["pulls"] += 1
        counts["misses"] += len(runs.ids)
        for part in parts:
            stale = int(np.count_nonzero(part.probe.stale))
            counts["hits"] += part.hits
            counts["stale"] += stale
            counts["misses"] -= part.hits + stale
            if part.hits:
                per_segment = np.bincount(part.probe.segments[part.probe.fresh],
                                          minlength=len(part.pool.names))
                row_bytes = {tables[k].name: tables[k].spec.dim * _wire_itemsize(tables[k])
                             for k in part.ks}
                counts["bytes_saved"] += sum(int(n) * row_bytes.get(name, 0)
                                             for n, name in zip(per_segment, part.pool.names))

    @staticmethod
    def _answered(count: int, parts: list[_Served]) -> list[np.ndarray]:
        rows: list[np.ndarray] = [np.empty(0)] * count
        for part in parts:
            for k, table_rows in zip(part.ks, part.tables()):
                rows[k] = table_rows
        return rows

    def remember(self, parts: list[_Served], fetched: list[np.ndarray],
                 generation: int) -> None:
        """Rows the servers answered, into their pools' stores (if still held, and not
        invalidated since the pull left)."""
        with self._lock:
            if generation != self._generation:
                return
            for part, rows in zip(parts, fetched):
                if self._pools.get(part.pool.shape) is not part.pool or not len(rows):
                    continue
                probe, clocks = part.probe, part.clocks
                if part.hits:
                    which = ~probe.fresh
                    probe, clocks = probe.subset(which), clocks[which]
                part.pool.store.store(probe, rows, clocks, part.seen)

    def _place(self, tables: Sequence[ShardedTable]) -> None:
        """Tables seen for the first time (or made again with another spec) share out the
        budget again; pools whose tables or shares changed start empty."""
        for t in tables:  # a table made again under the same name: not the rows held
            if self._specs.setdefault(t.name, t.spec) != t.spec:
                self._forget(t.name)
                self._specs[t.name] = t.spec
        new = {t.name: self._size(t) for t in tables if t.name not in self._sizes}
        if not new:
            return
        self._sizes.update(new)
        self._shapes.update({t.name: (t.spec.dim, t.dtype) for t in tables if t.name in new})
        members: dict[tuple[int, np.dtype], dict[str, int]] = {}
        for name, slots in split_budget(self.config.bytes, self._sizes).items():
            if slots >= WAYS:
                members.setdefault(self._shapes[name], {})[name] = slots
        pools = {}
        for shape, layout in members.items():
            old = self._pools.get(shape)
            pools[shape] = old if old is not None and old.same_layout(layout) else \
                _Pool(shape, self._store_kind(list(layout.values()), *shape), tuple(layout),
                      tuple(layout.values()))
        self._pools = pools
        self._where = {name: (pool, k) for pool in pools.values()
                       for k, name in enumerate(pool.names)}

    def _store_kind(self, slots: list[int], dim: int, dtype) -> RowStore | StepRows:
        return (StepRows if self.config.staleness == 0 else RowStore)(slots, dim, dtype)

    def _forget(self, name: str) -> None:
        """One table's rows and share of the budget (shared out again when next seen)."""
        where = self._where.pop(name, None)
        if where is not None:
            where[0].store.clear(where[1])
        for held in (self._sizes, self._shapes, self._specs):
            held.pop(name, None)

    def _size(self, table: ShardedTable) -> tuple[int, int]:
        """(slot bytes, rows) of a table; a keyed table has no row count: it
        asks for the whole budget."""
        slot = table.spec.dim * table.dtype.itemsize + SLOT_OVERHEAD_BYTES
        return slot, table.spec.vocabulary_size or self.config.bytes // slot

    def start_push(self, tables, grads, steps, worker, learning_rates, runs):
        return self.direct.start_push(tables, grads, steps, worker, learning_rates, runs)

    def invalidate(self, tables: Sequence[ShardedTable] | None = None) -> None:
        """Forget the rows of these tables (None: every table), e.g. after a reshard,
        a restore or an assign; their memory is shared out again when next seen."""
        with self._lock:
            if tables is None:
                self._pools, self._where = {}, {}
                for held in (self._sizes, self._shapes, self._specs):
                    held.clear()
            for t in tables or ():
                self._forget(t.name)
            self._generation += 1
            self._counts["invalidations"] += 1

    def stats(self) -> CacheStats:
        with self._lock:
            stores = [p.store for p in self._pools.values()]
            return CacheStats(**self._counts, rows_held=sum(s.held for s in stores),
                              bytes_held=sum(s.nbytes for s in stores),
                              capacity_rows=sum(s.capacity for s in stores))


def _wire_itemsize(table: ShardedTable) -> int:
    """Bytes an element of the table's rows takes on the wire (its wire dtype's, if any)."""
    return 2 if getattr(table.spec, "wire_dtype", "") in ("float16", "bfloat16") else \
        table.dtype.itemsize


_COUNTED = ("pulls", "hits", "misses", "stale", "requests_saved", "bytes_saved",
            "invalidations")
TABLE_CLIENTS[CachingClient.name] = CachingClient
