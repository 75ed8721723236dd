"""The worker row cache's structures and client (parallax.client.row_cache), without servers:
behind it stands `VersionedRows`, a table client whose every row spells its own id and the
step it was read at, so every row the cache serves says how old it is. Checked by
construction: no row older than the staleness bound is ever served (nor one from the
future, after a restore sets the clock back); staleness 0 serves only the current step's
rows; memory stays within the budget and flat as distinct ids grow; hot rows stay;
async all-hit pulls send nothing, sync ones still wait for the step."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from parallax.client.row_cache import (MIN_CACHE_BYTES, WAYS, CachingClient, FrequencySketch,
                                       RowCache, RowStore, StepRows, id_hashes, split_budget)
from parallax.client.table_client import TABLE_CLIENTS, TableClient, table_client
from parallax.errors import ConfigError
from parallax.protocol.routing import Runs, ShardRouter

DIM, VOCAB = 4, 100_000


def fake_table(name: str, vocab: int = VOCAB, shards: int = 2):
    spec = SimpleNamespace(dim=DIM, vocabulary_size=vocab, hashed_keys=False)
    return SimpleNamespace(name=name, spec=spec, dtype=np.dtype(np.float32),
                           router=ShardRouter(shards, vocab, "mod"))


class VersionedRows(TableClient):
    """Row id read at step s is [id, s, ...]; counts what it was asked."""

    name = "versioned"

    def __init__(self) -> None:
        self.steps: dict[str, int] = {}  # the "server" step of each table
        self.requests, self.rows, self.waits = 0, 0, 0

    def start_pull(self, tables, min_steps, runs, clocks):
        self.requests += 1
        self.waits += sum(1 for m in min_steps if m > 0)
        out = []
        for k, table in enumerate(tables):
            ids = runs.run(k)
            self.rows += len(ids)
            step = self.steps.get(table.name, 0)
            rows = np.zeros((len(ids), DIM), np.float32)
            rows[:, 0], rows[:, 1] = ids, step
            out.append(rows)
        return SimpleNamespace(result=lambda: out, abandon=lambda: None)

    def start_push(self, tables, grads, steps, worker, learning_rates, runs):
        raise AssertionError("not pushed here")


def pull(cache, tables, ids, clocks, sync=True):
    runs = Runs([t.router for t in tables], ids)
    return cache.start_pull(tables, list(clocks) if sync else [0] * len(tables), runs,
                            clocks).result()


def zipf_ids(rng, n, vocab=VOCAB, a=1.2):
    return np.unique(np.minimum(rng.zipf(a, n) - 1, vocab - 1)).astype(np.int64)


def test_config_is_validated_naming_the_value_and_the_fix():
    with pytest.raises(ConfigError, match=r"bytes=1000.*at least 65536.*64 << 20"):
        RowCache(bytes=1000)
    with pytest.raises(ConfigError, match=r"staleness=-1.*int >= 0"):
        RowCache(staleness=-1)
    with pytest.raises(ConfigError, match=r"staleness=True"):
        RowCache(staleness=True)
    assert "4 step(s) stale" in RowCache(staleness=4).describe()
    assert TABLE_CLIENTS["row_cache"] is CachingClient
    assert isinstance(table_client("row_cache", RowCache()), CachingClient)


@pytest.mark.parametrize("staleness", [0, 1, 3])
def test_no_row_older_than_the_bound_is_ever_served(staleness):
    rng = np.random.default_rng(staleness)
    server = VersionedRows()
    cache = CachingClient(RowCache(bytes=256 << 10, staleness=staleness), server)
    tables = [fake_table("a"), fake_table("b", vocab=500, shards=1)]
    clock = 0
    for pull_no in range(300):
        if rng.random() < 0.7:  # a step closes (an evaluation pull in between: it does not)
            clock += 1
            for t in tables:
                server.steps[t.name] = clock
        if pull_no == 150:  # a restore to an earlier step: the strategy invalidates
            clock -= 20
            for t in tables:
                server.steps[t.name] = clock
            cache.invalidate()
        ids = [zipf_ids(rng, 200), zipf_ids(rng, 50, vocab=500)]
        for got, want in zip(pull(cache, tables, ids, [clock, clock]), ids):
            np.testing.assert_array_equal(got[:, 0], want)  # each row is its id's
            age = clock - got[:, 1]
            assert age.min() >= 0 and age.max() <= staleness, (pull_no, age.max())
    stats = cache.stats()
    assert stats.hits > 0 and stats.hits + stats.misses + stats.stale == server.rows + \
        stats.hits
    if staleness == 0:  # rows of an earlier step are dropped as the clock moves: misses
        assert stats.stale == 0 and isinstance(cache._pools[(DIM, tables[0].dtype)].store,
                                               StepRows)
    else:
        assert stats.stale > 0  # rows held from an earlier step were pulled again


def test_staleness_zero_serves_rows_of_the_same_step_only():
    server = VersionedRows()
    cache = CachingClient(RowCache(staleness=0), server)
    table = [fake_table("a")]
    ids = [np.arange(10, dtype=np.int64)]
    pull(cache, table, ids, [5])
    pull(cache, table, ids, [5])  # an evaluation at the same step: all hits
    assert cache.stats().hits == 10 and server.rows == 10
    server.steps["a"] = 6
    rows = pull(cache, table, ids, [6])[0]
    assert (rows[:, 1] == 6).all() and server.rows == 20 and cache.stats().misses == 20


def test_staleness_zero_keeps_each_tables_rows_of_its_own_clock_within_its_share():
    server = VersionedRows()
    cache = CachingClient(RowCache(bytes=4 * MIN_CACHE_BYTES, staleness=0), server)
    tables = [fake_table("a", vocab=30_000), fake_table("b", vocab=100, shards=1)]
    big, small = np.arange(0, 20_000, 2, dtype=np.int64), np.arange(10, dtype=np.int64)
    pull(cache, tables, [big, small], [3, 7])
    store = cache._pools[(DIM, tables[0].dtype)].store
    held_a = int(store.used[0])
    assert 0 < held_a < len(big) and store.used[1] == 10  # a: what its share holds
    got = pull(cache, tables, [big, small], [3, 7])  # an evaluation: the same clocks
    assert cache.stats().hits == held_a + 10 and server.rows == 2 * len(big) + 10 - held_a
    np.testing.assert_array_equal(got[0][:, 0], big)
    pull(cache, tables, [big, small], [4, 7])  # a's clock moved on, b's did not
    assert cache.stats().hits == held_a + 20
    assert store.used[0] == held_a and store.clocks[0] == 4  # a kept its new rows instead


def test_async_all_hit_pulls_send_nothing_and_sync_ones_still_wait_for_the_step():
    server = VersionedRows()
    cache = CachingClient(RowCache(staleness=2), server)
    table = [fake_table("a")]
    ids = [np.arange(100, dtype=np.int64)]
    pull(cache, table, ids, [1], sync=False)
    pull(cache, table, ids, [2], sync=False)
    assert server.requests == 1 and cache.stats().requests_saved == 1
    pull(cache, table, ids, [3], sync=True)  # every row a hit, but the step is waited for
    assert server.requests == 2 and server.rows == 100 and server.waits == 1
    assert cache.stats().bytes_saved == 200 * DIM * 4


def test_memory_stays_within_the_budget_and_flat_as_distinct_ids_grow():
    budget = 1 << 20
    cache = CachingClient(RowCache(bytes=budget, staleness=8), VersionedRows())
    tables = [fake_table("a", vocab=10**9), fake_table("b", vocab=10**7)]
    held = []
    for step in range(40):  # 40 x 20k fresh ids per table: 1.6 M distinct ids
        ids = [np.arange(step * 20_000, (step + 1) * 20_000, dtype=np.int64) * 7 + k
               for k in range(2)]
        pull(cache, tables, ids, [step, step])
        held.append(cache.stats().bytes_held)
    assert max(held) <= budget and len(set(held)) == 1
    stores = [p.store for p in cache._pools.values()]
    arrays = [a for s in stores for a in (s.keys, s.versions, s.rows, s.sketch.counts)]
    assert sum(a.nbytes for a in arrays) == held[-1]


def held_ids(store: RowStore, ids: np.ndarray, segment: int = 0) -> np.ndarray:
    hashes = id_hashes(ids)
    return store.find(hashes, store.set_of(hashes, np.full(len(ids), segment))) >= 0


@pytest.mark.parametrize("tables", [1, 3])
def test_hot_rows_are_kept_over_a_stream_of_cold_ones(tables):
    rng = np.random.default_rng(0)
    store = RowStore([512] * tables, DIM, np.float32)
    hot = np.arange(100, dtype=np.int64)
    for step in range(30):
        ids = np.unique(np.concatenate([hot, rng.integers(1000, 10**9, 2000)]))
        ids, segments = np.tile(ids, tables), np.repeat(np.arange(tables), len(ids))
        probe = store.lookup(ids, segments, np.full(len(ids), step), 100)
        missed = ~probe.fresh
        store.store(probe.subset(missed), np.zeros((int(missed.sum()), DIM), np.float32),
                    np.full(int(missed.sum()), step))
    for k in range(tables):  # the hot ids won their sets, in every table's segment
        assert held_ids(store, hot, k).mean() > 0.95
    assert store.held == 512 * tables


def test_two_tables_of_one_store_keep_their_rows_apart():
    # the same ids in two tables: each table's rows in its own segment, served its own
    store = RowStore([64, 64], DIM, np.float32)
    ids = np.arange(20, dtype=np.int64)
    both, segments = np.tile(ids, 2), np.repeat([0, 1], 20)
    probe = store.lookup(both, segments, np.zeros(40, np.int64), 0)
    rows = np.repeat(np.arange(40, dtype=np.float32)[:, None], DIM, axis=1)
    store.store(probe, rows, np.zeros(40, np.int64))
    again = store.lookup(both, segments, np.zeros(40, np.int64), 0)
    assert again.fresh.all()
    np.testing.assert_array_equal(store.rows[again.slots][:, 0], np.arange(40))
    store.clear(0)  # one table forgotten, the other kept
    after = store.lookup(both, segments, np.zeros(40, np.int64), 0)
    assert not after.fresh[:20].any() and after.fresh[20:].all()


def test_a_refresh_after_another_pull_stored_finds_its_slots_again():
    # a probe's slots are reused only while nothing was written since it was taken
    store = RowStore([64], DIM, np.float32)
    ids, zeros = np.arange(8, dtype=np.int64), np.zeros(8, np.int64)
    first = store.lookup(ids, zeros, zeros, 0)
    seen = store.writes
    store.store(first, np.ones((8, DIM), np.float32), zeros)  # another pull stored them
    store.store(first, np.full((8, DIM), 2, np.float32), zeros, seen)  # stale slots (-1)
    assert store.held == 8  # refreshed in place, not admitted twice
    np.testing.assert_array_equal(store.rows[store.lookup(ids, zeros, zeros, 0).slots],
                                  np.full((8, DIM), 2, np.float32))


def test_sketch_estimates_are_upper_bounds_and_age():
    sketch = FrequencySketch([64, 32])
    ids = np.arange(10, dtype=np.int64)
    first, second = np.zeros(10, np.int64), np.ones(10, np.int64)
    cells = sketch.cells(id_hashes(ids), first)
    for _ in range(5):
        sketch.add(cells, first)
    assert (sketch.estimate(cells) >= 5).all()
    assert sketch.estimate(sketch.cells(id_hashes(ids), second)).max() == 0  # apart
    one = np.array([1000], np.int64)
    for _ in range(600):  # 10 x 64 accesses in all: every counter of the segment halves
        sketch.add(sketch.cells(id_hashes(one), first[:1]), first[:1])
    assert sketch.estimate(cells).max() < 5


def test_id_hashes_are_distinct_for_distinct_ids():
    ids = np.concatenate([np.arange(-5000, 5000), np.iinfo(np.int64).max - np.arange(100),
                          np.arange(1, 101) << 40]).astype(np.int64)
    assert len(np.unique(id_hashes(ids))) == len(ids)


def test_the_budget_is_split_in_proportion_and_small_tables_are_held_whole():
    tables = {"small": (48, 100), "big": (48, 10**6), "mid": (80, 10**4)}
    slots = split_budget(1 << 20, tables)
    assert sum(tables[n][0] * s for n, s in slots.items()) <= 1 << 20
    assert all(s % WAYS == 0 for s in slots.values())
    assert split_budget(1 << 30, tables)["small"] >= 100  # everything fits: whole tables


def test_invalidate_forgets_the_tables_rows():
    server = VersionedRows()
    cache = CachingClient(RowCache(staleness=10), server)
    tables = [fake_table("a"), fake_table("b")]
    ids = [np.arange(50, dtype=np.int64)] * 2
    pull(cache, tables, ids, [1, 1])
    cache.invalidate([tables[0]])
    pull(cache, tables, ids, [1, 1])
    assert server.rows == 150  # table a pulled again, b answered from the cache
    cache.invalidate()
    pull(cache, tables, ids, [1, 1])
    assert server.rows == 250 and cache.stats().invalidations == 2


def test_a_pull_in_flight_across_an_invalidation_stores_nothing():
    # its rows were read before the invalidation (a restore, an assign): the store made
    # after it must not take them
    server = VersionedRows()
    cache = CachingClient(RowCache(staleness=10), server)
    tables, ids = [fake_table("a")], [np.arange(50, dtype=np.int64)]
    runs = Runs([t.router for t in tables], ids)
    in_flight = cache.start_pull(tables, [1], runs, [1])  # read at the server's step 0
    server.steps["a"] = 5  # the table changed (restored, assigned) ...
    cache.invalidate()  # ... and the cache was told
    pull(cache, tables, [np.arange(100, 110, dtype=np.int64)], [1])  # a new store
    in_flight.result()
    rows = pull(cache, tables, ids, [1])[0]
    assert (rows[:, 1] == 5).all(), rows[:, 1]


def test_a_table_made_again_under_its_name_is_not_served_the_old_rows():
    server = VersionedRows()
    cache = CachingClient(RowCache(staleness=10), server)
    ids = [np.arange(50, dtype=np.int64)]
    pull(cache, [fake_table("a")], ids, [1])
    again = fake_table("a")
    again.spec = SimpleNamespace(dim=DIM, vocabulary_size=VOCAB // 2, hashed_keys=False)
    pull(cache, [again], ids, [1])
    assert server.rows == 100 and cache.stats().hits == 0
