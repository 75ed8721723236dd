"""The fused step's numpy core (`parallax.client.step`, `parallax.client.table_rows`) against
real servers on loopback, without TensorFlow: what TensorFlow's fused pull and push ops run,
called here with numpy arrays.

One job of two servers holds a plain table (two shards) and a table group (two variables
sharing one server table at offsets 0 and 30). Each test trains by hand with SGD and checks
the rows against the arithmetic, every error case leaves the tables, the steps and the
counters as they were, and a sync push's answers are read by the next pull (`Landing`).
"""
from __future__ import annotations

import numpy as np
import pytest

from parallax.client import PSClient
from parallax.client.local_cluster import LocalCluster
from parallax.client.row_cache import CachingClient, RowCache
from parallax.client.step import FusedPull, FusedPush, StepRouting
from parallax.client.table_rows import Landing, TablePushes, TableRows
from parallax.errors import ConfigError, ServerError
from parallax.protocol.specs import SGD, Initializer, TableSpec

DIM, LR = 4, 0.5
PLAIN_ROWS, GROUP_ROWS = 50, (30, 20)  # the group's members: rows 0-29 and 30-49


@pytest.fixture(scope="module")
def client():
    with LocalCluster(2) as cluster, PSClient(cluster.addresses) as c:
        yield c


class Job:
    """One worker's view of a plain table and a two-variable table group."""

    def __init__(self, client, name: str, sync: bool = True) -> None:
        def spec(table: str, rows: int, shards: int) -> TableSpec:
            return TableSpec(name=f"{name}_{table}", vocabulary_size=rows, dim=DIM,
                             shard_count=shards, initializer=Initializer("uniform", seed=5),
                             optimizer=SGD(learning_rate=LR),
                             sync_mode="sync" if sync else "async")
        self.plain_table = client.create_table(spec("plain", PLAIN_ROWS, 2))
        self.group_table = client.create_table(spec("group", sum(GROUP_ROWS), 1))
        shared = TablePushes()
        self.plain = TableRows("plain", (PLAIN_ROWS, DIM), np.float32, self.plain_table,
                               sync=sync)
        self.first = TableRows("first", (GROUP_ROWS[0], DIM), np.float32, self.group_table,
                               sync=sync, pushes=shared)
        self.second = TableRows("second", (GROUP_ROWS[1], DIM), np.float32, self.group_table,
                                sync=sync, offset=GROUP_ROWS[0], pushes=shared)
        self.remotes = [self.plain, self.first, self.second]
        self.routing = StepRouting()

    def rows(self, remote: TableRows, ids) -> np.ndarray:
        """The rows as the servers hold them now (read past the step core)."""
        return remote.table.pull_unique(remote.table_ids(np.asarray(ids, np.int64)))

    def pull(self, *uniques, remotes=None, client=None) -> list[np.ndarray]:
        pull = FusedPull(remotes or self.remotes, self.routing, client)
        return pull(np.float64(0.0), *[np.asarray(u, np.int64) for u in uniques])

    def push(self, ids, grads, rates=(0.0, 0.0, 0.0), client=None) -> int:
        flat = []
        for i, g, lr in zip(ids, grads, rates):
            flat += [np.asarray(i, np.int64), np.asarray(g, np.float32), np.float64(lr)]
        return int(FusedPush(self.remotes, self.routing, client)(*flat))


def _grads(ids, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(len(ids), DIM)).astype(np.float32)


def test_a_fused_step_pulls_each_tables_rows_and_trains_them_by_sgd(client):
    job = Job(client, "sgd")
    ids = [[3, 41, 7], [0, 29], [19, 2]]
    before = [job.rows(r, i) for r, i in zip(job.remotes, ids)]
    pulled = job.pull(*ids)
    for got, want in zip(pulled, before):
        np.testing.assert_array_equal(got, want)
    grads = [_grads(i, k) for k, i in enumerate(ids)]
    assert job.push(ids, grads) == 2  # one push per server table: plain and the group
    assert job.plain.steps_pushed == job.first.steps_pushed == 1
    again = job.pull(*ids)  # lands the push first (sync: the servers apply step 0)
    for got, old, grad in zip(again, before, grads):
        np.testing.assert_allclose(got, old - LR * grad, rtol=1e-6)
    assert job.plain.traffic.pulls == 2 and job.first.traffic.pulled_rows == 4
    assert job.second.traffic.pushed_rows == 2 and not job.first.pushes.in_flight


def test_a_sync_push_is_in_flight_until_the_next_pull_reads_its_answers(client):
    job = Job(client, "landing")
    ids = [[1], [2], [3]]
    job.pull(*ids)
    job.push(ids, [_grads(i, 9) for i in ids])
    in_flight = job.first.pushes.in_flight
    assert len(in_flight) == 1 and isinstance(in_flight[0], Landing)
    assert in_flight is not job.plain.pushes.in_flight and \
        isinstance(job.plain.pushes.in_flight[0], Landing)
    job.pull(*ids)
    assert not job.plain.pushes.in_flight and not job.second.pushes.in_flight
    assert job.plain.traffic.push_seconds > 0


def test_async_pushes_land_before_they_return(client):
    job = Job(client, "async", sync=False)
    ids = [[5, 6], [7], [8]]
    before = [job.rows(r, i) for r, i in zip(job.remotes, ids)]
    job.pull(*ids)
    grads = [_grads(i, 3) for i in ids]
    job.push(ids, grads)
    assert not job.plain.pushes.in_flight
    for remote, i, old, grad in zip(job.remotes, ids, before, grads):
        np.testing.assert_allclose(job.rows(remote, i), old - LR * grad, rtol=1e-6)


def test_a_table_read_by_two_lookups_travels_once_and_answers_each(client):
    job = Job(client, "twice")
    a, b = [4, 9, 4, 11], [9, 12]
    rows_a, rows_b = job.pull(a, b, remotes=[job.plain, job.plain])
    np.testing.assert_array_equal(rows_a, job.rows(job.plain, a))
    np.testing.assert_array_equal(rows_b, job.rows(job.plain, b))
    assert job.plain.traffic.pulled_rows == 4  # 4, 9, 11, 12: once each


@pytest.mark.parametrize("where", ["plain", "second"])
def test_a_bad_id_in_a_pull_names_the_variable_and_reads_nothing(client, where):
    job = Job(client, f"badpull_{where}")
    ids = [[1], [2], [3]]
    bad = {"plain": 0, "second": 2}[where]
    ids[bad] = [1, {"plain": PLAIN_ROWS, "second": GROUP_ROWS[1]}[where]]
    with pytest.raises(ConfigError, match=f"table '{where}' has .* rows: id"):
        job.pull(*ids)
    assert all(r.traffic.pulls == 0 for r in job.remotes)


def test_a_bad_id_in_a_push_names_the_variable_and_changes_nothing(client):
    job = Job(client, "badpush")
    ids = [[1], [2], [3]]
    before = [job.rows(r, i) for r, i in zip(job.remotes, ids)]
    job.pull(*ids)
    with pytest.raises(ConfigError, match="table 'first' has 30 rows: id 30"):
        job.push([[1], [30], [3]], [_grads(i, 1) for i in ids])
    assert all(r.steps_pushed == 0 and r.traffic.pushes == 0 for r in job.remotes)
    assert not job.plain.pushes.in_flight
    for remote, i, old in zip(job.remotes, ids, before):
        np.testing.assert_array_equal(job.rows(remote, i), old)
    job.push(ids, [_grads(i, 1) for i in ids])  # the step is still open: it goes through
    assert job.plain.steps_pushed == 1


def test_a_push_error_from_a_server_is_raised_by_the_next_pull(client):
    """A sync push's answers are read later, so a server's refusal (here: a push for a step
    this worker is not at) reaches the next pull, which reads nothing."""
    job = Job(client, "refused")
    ids = [[1], [2], [3]]
    job.pull(*ids)
    job.plain.steps_pushed = 7  # not the servers' step 0: refused
    job.push(ids, [_grads(i, 2) for i in ids])
    with pytest.raises(ServerError, match="step 7 is ahead of the open step 0"):
        job.pull(*ids)
    assert job.plain.traffic.pulls == 1


def test_an_update_a_step_did_not_make_pushes_no_rows(client):
    """A table the step did not update sends an empty push (a sync step hears from every
    worker); with the group's learning rate taken from the member that sent rows."""
    job = Job(client, "silent")
    ids = [[1], [2], []]
    before = job.rows(job.first, [2])
    job.pull([1], [2], [0])
    job.push(ids, [_grads(i, 4) for i in ids[:2]] + [job.second.empty_rows()],
             rates=(0.0, 0.25, 0.0))
    job.pull([1], [2], [0])
    np.testing.assert_allclose(job.rows(job.first, [2]),
                               before - 0.25 * _grads([2], 4), rtol=1e-6)


def test_the_row_cache_is_a_table_client_of_the_same_step(client):
    job = Job(client, "cached")
    cache = CachingClient(RowCache(bytes=1 << 20, staleness=0))
    ids = [[1, 2], [3], [4]]
    before = [job.rows(r, i) for r, i in zip(job.remotes, ids)]
    for got, want in zip(job.pull(*ids, client=cache), before):
        np.testing.assert_array_equal(got, want)
    grads = [_grads(i, 6) for i in ids]
    job.push(ids, grads, client=cache)
    for got, old, grad in zip(job.pull(*ids, client=cache), before, grads):
        np.testing.assert_allclose(got, old - LR * grad, rtol=1e-6)


def test_a_worker_that_does_not_push_counts_its_step_and_sends_nothing(client):
    """Local aggregation: only the host's first worker sends; another counts the step (its
    next pull waits for it) and sends no request."""
    job = Job(client, "silent_worker")
    for remote in job.remotes:
        remote.sends_pushes = False
    ids = [[1], [2], [3]]
    before = [job.rows(r, i) for r, i in zip(job.remotes, ids)]
    job.pull(*ids)
    assert job.push(ids, [_grads(i, 8) for i in ids]) == 0
    assert job.plain.steps_pushed == job.first.steps_pushed == 1
    assert not job.plain.pushes.in_flight and job.plain.traffic.pushes == 0
    for remote, i, old in zip(job.remotes, ids, before):
        np.testing.assert_array_equal(job.rows(remote, i), old)


def test_narrow_wire_rows_arrive_in_the_tables_dtype(client):
    """A table whose rows travel as bfloat16 answers the fused pull in float32 rows within
    bfloat16's precision of the stored ones."""
    table = client.create_table(TableSpec(
        name="narrow", vocabulary_size=40, dim=DIM, shard_count=2, wire_dtype="bfloat16",
        initializer=Initializer("uniform", seed=5), optimizer=SGD(learning_rate=LR)))
    remote = TableRows("narrow", (40, DIM), np.float32, table, sync=True)
    ids = np.array([0, 7, 39], np.int64)
    rows, = FusedPull([remote], StepRouting())(np.float64(0.0), ids)
    assert rows.dtype == np.float32
    exact = table.pull_unique(ids, full_precision=True)
    np.testing.assert_allclose(rows, exact, rtol=2 ** -7)
    assert not np.array_equal(rows, exact)  # they did travel narrowed


def test_a_keyed_table_takes_any_int64_key(client):
    """A keyed table (hashed_keys=True) has no id range: any int64 key is pulled and pushed."""
    table = client.create_table(TableSpec(
        name="keyed", hashed_keys=True, dim=DIM, shard_count=2,
        initializer=Initializer("uniform", seed=5), optimizer=SGD(learning_rate=LR)))
    remote = TableRows("keyed", (8, DIM), np.float32, table, sync=True, keyed=True)
    keys = np.array([-2 ** 62, -1, 10 ** 15], np.int64)
    routing = StepRouting()
    before, = FusedPull([remote], routing)(np.float64(0.0), keys)
    grads = _grads(keys, 7)
    FusedPush([remote], routing)(keys, grads, np.float64(0.0))
    after, = FusedPull([remote], routing)(np.float64(0.0), keys)
    np.testing.assert_allclose(after, before - LR * grads, rtol=1e-6)


@pytest.mark.parametrize("sync", [True, False], ids=["sync", "async"])
def test_a_step_larger_than_a_chunk_travels_in_chunks_and_trains_as_one(client, sync):
    """Rows of 1 KiB make a chunk (ClientOptions.chunk_mb, 4 MiB) about 4,000 rows: 12,000
    ids over two shards pull and push in two chunks a shard, and the step applies once, as
    one request would."""
    dim, rows = 256, 20_000
    table = client.create_table(TableSpec(
        name=f"chunked_{sync}", vocabulary_size=rows, dim=dim, shard_count=2,
        initializer=Initializer("uniform", seed=5), optimizer=SGD(learning_rate=LR),
        sync_mode="sync" if sync else "async"))
    remote = TableRows("chunked", (rows, dim), np.float32, table, sync=sync)
    ids = np.sort(np.random.default_rng(3).choice(rows, 12_000, replace=False))
    assert table.chunk_rows < len(ids) // 2  # every shard's part is split
    routing = StepRouting()
    before = table.pull_unique(ids)
    pulled, = FusedPull([remote], routing)(np.float64(0.0), ids)
    np.testing.assert_array_equal(pulled, before)
    grads = np.random.default_rng(4).normal(size=(len(ids), dim)).astype(np.float32)
    FusedPush([remote], routing)(ids, grads, np.float64(0.0))
    after, = FusedPull([remote], routing)(np.float64(0.0), ids)
    np.testing.assert_allclose(after, before - LR * grads, rtol=1e-6)
    assert remote.steps_pushed == 1 and remote.traffic.pushed_rows == len(ids)
