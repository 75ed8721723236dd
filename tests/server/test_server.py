"""Parameter-server behaviour through real gRPC on loopback (two server processes)."""
from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest

from parallax.client import ClientOptions, PSClient
from parallax.errors import ServerError
from parallax.ps.v1 import ps_pb2
from parallax.protocol.initial_values import initial_rows
from parallax.protocol.specs import SGD, Initializer, TableSpec


def _spec(name, **kw) -> TableSpec:
    base = dict(name=name, vocabulary_size=1000, dim=4, shard_count=3,
                initializer=Initializer(kind="uniform", seed=5), optimizer=SGD(learning_rate=0.5))
    return TableSpec(**{**base, **kw})


def test_pull_returns_initial_rows_in_callers_order(client, table_name):
    spec = _spec(table_name)
    table = client.create_table(spec)
    ids = np.array([[7, 999], [0, 7]])
    rows = table.pull(ids)
    assert rows.shape == (2, 2, 4)
    np.testing.assert_array_equal(rows.reshape(-1, 4),
                                  initial_rows(spec.initializer, ids.reshape(-1), 4, "float32"))


def test_create_is_idempotent_and_rejects_a_different_shape(client, table_name):
    table = client.create_table(_spec(table_name))
    table.push([1], [[1, 1, 1, 1]], step=0)
    before = table.pull([1])
    client.create_table(_spec(table_name))  # identical: no-op, rows kept
    np.testing.assert_array_equal(table.pull([1]), before)
    with pytest.raises(ServerError, match=r"exists with a different spec \(dim 4 != 8") as info:
        client.create_table(_spec(table_name, dim=8))
    assert info.value.code == grpc.StatusCode.ALREADY_EXISTS
    np.testing.assert_array_equal(table.pull([1]), before)


def test_sync_step_applies_once_from_all_workers_sum(client, table_name):
    spec = _spec(table_name, num_workers=2, optimizer=SGD(learning_rate=1.0))
    table = client.create_table(spec)
    start = table.pull([1, 2, 3])
    assert table.push([1, 2], [[1] * 4, [2] * 4], step=0, worker=0) is False
    np.testing.assert_array_equal(table.pull([1, 2, 3]), start)  # half a step is invisible
    assert table.push([2, 3], [[10] * 4, [20] * 4], step=0, worker=1) is True
    after = table.pull([1, 2, 3], min_step=1)
    np.testing.assert_allclose(after, start - np.array([[1] * 4, [12] * 4, [20] * 4]))


def test_mean_aggregation_divides_by_workers(client, table_name):
    table = client.create_table(_spec(table_name, num_workers=2, aggregation="mean",
                                      optimizer=SGD(learning_rate=1.0)))
    start = table.pull([4])
    table.push([4], [[2] * 4], step=0, worker=0)
    table.push([4], [[4] * 4], step=0, worker=1)
    np.testing.assert_allclose(table.pull([4], min_step=1), start - 3)


def test_pull_for_next_step_waits_until_the_step_closes(client, table_name):
    table = client.create_table(_spec(table_name, num_workers=2, optimizer=SGD(learning_rate=1)))
    start = table.pull([9])
    table.push([9], [[1] * 4], step=0, worker=0)
    result = {}
    reader = threading.Thread(target=lambda: result.update(rows=table.pull([9], min_step=1)))
    reader.start()
    reader.join(0.5)
    assert reader.is_alive(), "a pull for step 1 returned before step 0 closed"
    table.push([9], [[2] * 4], step=0, worker=1)
    reader.join(10)
    np.testing.assert_allclose(result["rows"], start - 3)


def test_sync_pull_waits_on_every_shard_even_where_no_id_falls(client, table_name):
    # The pull below waits inside the Pull request itself (one chunk per shard); it must
    # still reach shard 1, where step 0 is open: a push of step 1 would be refused there.
    table = client.create_table(_spec(table_name, num_workers=2, shard_count=2,
                                      optimizer=SGD(learning_rate=1)))
    start = table.pull([0])
    table.push([0, 1], [[1] * 4, [1] * 4], step=0, worker=0)
    _raw_push(table, [0], [[2] * 4], step=0, worker=1, shard=0)  # worker 1: shard 0 only
    result = {}
    reader = threading.Thread(target=lambda: result.update(rows=table.pull([0], min_step=1)))
    reader.start()
    reader.join(0.5)
    assert reader.is_alive(), "a pull of shard 0's ids returned while shard 1 had step 0 open"
    _raw_push(table, [1], [[2] * 4], step=0, worker=1, shard=1)
    reader.join(10)
    np.testing.assert_allclose(result["rows"], start - 3)
    assert table.wait_step(0) == 1


def test_waiting_pull_times_out_with_who_is_missing(cluster, client, table_name):
    spec = _spec(table_name, num_workers=2, shard_count=1)
    client.create_table(spec).push([0], [[1] * 4], step=0, worker=1)
    with PSClient(cluster.addresses, ClientOptions(timeout=0.5)) as impatient:
        with pytest.raises(ServerError, match=r"DEADLINE_EXCEEDED") as info:
            impatient.table(spec).pull([0], min_step=1)
        assert cluster.addresses[0] in str(info.value) and table_name in str(info.value)
        assert "worker(s) [0] of 2 have not pushed step 0" in str(info.value)
        assert "complete pushes: [1]" in str(info.value)


def test_async_mode_applies_each_push_on_arrival(client, table_name):
    table = client.create_table(_spec(table_name, num_workers=2, sync_mode="async",
                                      optimizer=SGD(learning_rate=1.0)))
    start = table.pull([5])
    assert table.push([5, 5], [[1] * 4, [1] * 4], step=0, worker=1) is True
    np.testing.assert_allclose(table.pull([5]), start - 2)
    table.push([5], [[1] * 4], step=0, worker=0)
    np.testing.assert_allclose(table.pull([5]), start - 3)


def test_explicit_initial_values_streamed_in_chunks(cluster, table_name):
    with PSClient(cluster.addresses, ClientOptions(max_message_mb=1)) as small_messages:
        spec = _spec(table_name, vocabulary_size=200_000, dim=8)
        table = small_messages.create_table(spec)
        assert table.chunk_rows < 50_000  # forces several chunks per shard
        values = np.random.default_rng(0).normal(size=(200_000, 8)).astype(np.float32)
        assert table.assign(np.arange(200_000), values) == 200_000
        np.testing.assert_array_equal(table.pull_all(), values)


def test_hashed_keys_create_rows_on_first_use(client, table_name, snapshot):
    spec = TableSpec(name=table_name, hashed_keys=True, dim=3, shard_count=2,
                     initializer=Initializer(kind="normal", seed=2), optimizer=SGD(1.0))
    table = client.create_table(spec)
    keys = np.array([-5, 2**40, 17, 2**40])
    rows = table.pull(keys)
    np.testing.assert_array_equal(rows, initial_rows(spec.initializer, keys, 3, "float32"))
    table.push([17], [[1, 1, 1]], step=0)
    np.testing.assert_allclose(table.pull([17]), rows[[2]] - 1)
    snap = snapshot(table_name)
    assert sorted(snap.arrays["ids"]) == sorted({-5, 2**40, 17})


def test_hashed_keys_respect_max_rows(client, table_name):
    spec = TableSpec(name=table_name, hashed_keys=True, dim=2, max_rows_per_shard=3)
    table = client.create_table(spec)
    table.pull([1, 2, 3])
    with pytest.raises(ServerError, match="exceed max_rows_per_shard=3") as info:
        table.pull([4])
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert table.pull([1, 2, 3]).shape == (3, 2)


def test_stats_count_rows_bytes_requests(client, table_name):
    table = client.create_table(_spec(table_name, shard_count=1))
    table.pull(np.arange(100))
    table.push(np.arange(10), np.ones((10, 4)), step=0)
    stats = client.stats([table_name])[client.addresses[0]]
    (entry,) = stats.tables
    methods = {m.method: m for m in entry.methods}
    assert entry.rows == 1000 and entry.bytes == 1000 * 4 * 4 and entry.step == 1
    assert methods["Pull"].rows == 100 and methods["Pull"].bytes == 100 * 16
    assert methods["Push"].requests == 1 and methods["Push"].rows == 10
    assert methods["Pull"].total_seconds > 0 and stats.pid > 0


def test_health_and_barrier(client):
    assert all(s.healthy() for s in client.servers)
    results = []
    threads = [threading.Thread(target=lambda r=r: results.append(client.barrier("b1", r, 3)))
               for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert results == [0, 0, 0]
    with pytest.raises(ServerError, match="rank 5 must be in"):
        client.barrier("b2", 5, 2)


def test_a_barrier_outlives_the_job_that_met_in_it(client, table_name):
    """parallax run keeps the servers across a job's restarts and elastic stops: a rank whose
    caller was killed while it waited (its RPC cancelled) leaves the barrier (it stayed: the
    restarted rank 0 was refused as already waiting, a restarted rank 1 passed with it), and
    a barrier nobody waits in is met by a new worker count (it was refused for good)."""
    name = f"{table_name}-end"
    waiting = client.servers[0].stub().Barrier.future(
        ps_pb2.BarrierRequest(name=name, rank=0, count=2))
    time.sleep(0.5)
    waiting.cancel()  # as a killed worker's
    time.sleep(1.5)
    with pytest.raises(ServerError, match="1 of 2 ranks arrived before the deadline"):
        client.barrier(name, 1, 2, timeout=1.5)  # the killed rank 0 is not there
    results = []
    threads = [threading.Thread(target=lambda r=r: results.append(client.barrier(name, r, 2)))
               for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert results == [0, 0]
    assert client.barrier(name, 0, 1) == 1  # one worker now


def test_unreachable_server_error_names_address_after_bounded_retries():
    with PSClient(["127.0.0.1:1"], ClientOptions(timeout=1, retries=2, backoff=0.05)) as c:
        with pytest.raises(ServerError, match=r"on server 127\.0\.0\.1:1 failed after 3 "
                                              r"attempts: UNAVAILABLE") as info:
            c.create_table(_spec("unreachable"))
        assert info.value.table == "unreachable"
        with pytest.raises(ServerError, match=r"server 127\.0\.0\.1:1 is not serving after 1s"):
            c.wait_ready(timeout=1)


def test_concurrent_async_pushes_from_many_clients_lose_nothing(cluster, table_name):
    """8 clients x 25 pushes of overlapping ids: every single update lands exactly once."""
    spec = _spec(table_name, num_workers=8, sync_mode="async", optimizer=SGD(learning_rate=1.0),
                 vocabulary_size=64, shard_count=2)
    clients = [PSClient(cluster.addresses) for _ in range(8)]
    try:
        table = clients[0].create_table(spec)
        start = table.pull(np.arange(64))
        errors = []

        def worker(rank: int) -> None:
            mine = clients[rank].table(spec)
            try:
                for step in range(25):
                    ids = np.arange(rank, rank + 40) % 64  # overlaps every other worker
                    mine.push(ids, np.ones((40, 4)), step=step, worker=rank)
            except Exception as exc:  # surfaced by the assertion below
                errors.append(exc)
        threads = [threading.Thread(target=worker, args=(r,)) for r in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        touched = np.zeros(64)
        for rank in range(8):
            touched[np.arange(rank, rank + 40) % 64] += 25
        np.testing.assert_allclose(table.pull(np.arange(64)), start - touched[:, None],
                                   rtol=1e-6)
    finally:
        for c in clients:
            c.close()


def _raw_push(table, ids, grads, step, worker=0, chunk=0, chunks=1, shard=0, session=7):
    from parallax.protocol import bulk_codec
    data = bulk_codec.encode_push_request(table.name, shard, step, worker, np.asarray(ids),
                                          np.asarray(grads, np.float32), 0.0, chunk, chunks,
                                          session)
    return table.shards[shard].stub().Push(data, timeout=10)


def test_async_push_sums_duplicate_ids_sent_by_any_client(client, table_name):
    table = client.create_table(_spec(table_name, shard_count=1, sync_mode="async",
                                      optimizer=SGD(learning_rate=1.0)))
    start = table.pull([1])
    _raw_push(table, [1, 1, 1], np.ones((3, 4)), step=0)  # bypasses the client's dedup
    np.testing.assert_allclose(table.pull([1]), start - 3)


def test_async_repeated_chunk_of_an_older_step_is_refused(client, table_name):
    table = client.create_table(_spec(table_name, shard_count=1, sync_mode="async",
                                      optimizer=SGD(learning_rate=1.0)))
    start = table.pull([1])
    _raw_push(table, [1], np.ones((1, 4)), step=0, chunk=0, chunks=2)
    _raw_push(table, [1], np.ones((1, 4)), step=1)
    assert _raw_push(table, [1], np.ones((1, 4)), step=0, chunk=1, chunks=2).applied
    with pytest.raises(grpc.RpcError) as info:
        _raw_push(table, [1], np.ones((1, 4)), step=0, chunk=0, chunks=2)
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
    with pytest.raises(grpc.RpcError) as info:
        _raw_push(table, [1], np.ones((1, 4)), step=2, chunk=0, chunks=2)
        _raw_push(table, [1], np.ones((1, 4)), step=2, chunk=1, chunks=3)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "chunk_count 3 differs from the 2" in info.value.details()
    np.testing.assert_allclose(table.pull([1]), start - 4)


def test_restore_starts_push_bookkeeping_afresh(client, table_name):
    table = client.create_table(_spec(table_name, shard_count=1, sync_mode="async"))
    client.save(f"fresh-{table_name}", [table_name])
    table.push([1], np.ones((1, 4)), step=0)
    client.restore(f"fresh-{table_name}", [table_name])
    table.push([1], np.ones((1, 4)), step=0)  # the replayed step is accepted again


def test_async_restarted_worker_counting_from_zero_is_not_taken_for_a_retry(cluster, table_name):
    spec = _spec(table_name, shard_count=1, sync_mode="async", optimizer=SGD(learning_rate=1.0))
    with PSClient(cluster.addresses) as first:
        table = first.create_table(spec)
        start = table.pull([1])
        table.push([1], np.ones((1, 4)), step=0)
    with PSClient(cluster.addresses) as restarted:  # a new process: a new session
        restarted.table(spec).push([1], np.ones((1, 4)), step=0)
        np.testing.assert_allclose(restarted.table(spec).pull([1]), start - 2, rtol=1e-6)


def test_a_table_made_again_after_its_deletion_counts_from_zero(client, table_name):
    """A restarted job on servers kept running drops its tables and makes them again under
    the same names: their counts (the Stats the progress lines read) start again, not on top
    of the dropped table's."""
    def pulled() -> int:  # (a server reports a table's counts with each of its shards)
        per_server = [next(t for t in reply.tables if t.table == table_name)
                      for reply in client.stats([table_name]).values()]
        return sum(m.rows for t in per_server for m in t.methods if m.method == "Pull")
    table = client.create_table(_spec(table_name))
    table.pull(np.arange(30))
    assert pulled() == 30
    assert client.delete_tables(table_name) == [table_name]
    client.create_table(_spec(table_name)).pull(np.arange(5))
    assert pulled() == 5
