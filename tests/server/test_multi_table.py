"""Multi-table requests (PullMany, PushMany) against real servers on loopback.

`pull_many` / `push_many` must give exactly what per-table pulls and pushes give, keep each
table's sync and async semantics, split into several requests per server under small message
limits, and refuse a bad request as a whole: raw requests (generated messages or bulk_codec
bytes) are sent through a real channel, and "nothing changed" is checked on rows, optimizer
slots and step of every table.
"""
from __future__ import annotations

import os
import signal
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest

from conftest import freeze
from parallax.client import ClientOptions, PSClient
from parallax.client.local_cluster import LocalCluster
from parallax.client.many import pull_many, push_many, start_pull_many, start_push_many
from parallax.errors import ConfigError, ServerError
from parallax.protocol import bulk_codec, wire
from parallax.protocol.initial_values import initial_rows
from parallax.protocol.specs import SGD, Adagrad, Adam, Initializer, TableSpec
from parallax.ps.v1 import ps_pb2
from parallax_ps.service import SERVICE_NAME

SMALL = ClientOptions(timeout=30, chunk_mb=1, max_message_mb=2)  # with --max-message-mb 2
# (suffix, spec fields, placement): shard counts 1-3, dims, dtypes, both servers, MOD and
# RANGE, keyed tables.
LAYOUTS = [
    ("one", dict(shard_count=1, dim=4), [1]),
    ("range2", dict(shard_count=2, dim=3, dtype="float64", partition="range",
                    vocabulary_size=500), [1, 0]),
    ("mod3", dict(shard_count=3, dim=8, vocabulary_size=777), [1, 1, 0]),
    ("hashed", dict(hashed_keys=True, vocabulary_size=0, shard_count=2, dim=5,
                    dtype="float64"), None),
    ("dim1", dict(shard_count=2, dim=1, vocabulary_size=300), [0, 0]),
    ("range3", dict(shard_count=3, dim=2, vocabulary_size=90, partition="range",
                    dtype="float64"), None),
]
OPTIMIZERS = [Adagrad(learning_rate=0.1), Adam(learning_rate=0.01),
              SGD(learning_rate=0.1, momentum=0.9)]


def _spec(name: str, **kw) -> TableSpec:
    base = dict(name=name, vocabulary_size=1000, dim=4, shard_count=2,
                initializer=Initializer("uniform", seed=3), optimizer=SGD(learning_rate=1.0))
    return TableSpec(**{**base, **kw})


def _tables(client, prefix: str, optimizers=None, **kw) -> list:
    return [client.create_table(_spec(f"{prefix}_{suffix}", **fields, **kw,
                                      **({"optimizer": optimizers[k % len(optimizers)]}
                                         if optimizers else {})), placement)
            for k, (suffix, fields, placement) in enumerate(LAYOUTS)]


def _unique(table, rng, n: int) -> np.ndarray:
    if table.spec.hashed_keys:
        return rng.choice(2**40, size=n, replace=False) - 2**39  # negative keys too
    return rng.choice(table.spec.vocabulary_size, size=n, replace=False)


def _ids(table, rng, n: int) -> np.ndarray:
    """n ids with duplicates."""
    if table.spec.hashed_keys:
        return rng.choice(_unique(table, rng, max(1, n // 2)), size=n)
    return rng.integers(0, table.spec.vocabulary_size, size=n)


def _grads(tables, ids, rng) -> list[np.ndarray]:
    return [rng.normal(size=(len(i), t.spec.dim)).astype(t.dtype) for t, i in zip(tables, ids)]


def _applied(start: np.ndarray, unique: np.ndarray, pushes) -> np.ndarray:
    """Rows of `unique` after SGD(1.0) applied the sum of every (ids, grads) push."""
    out = start.copy()
    where = {int(k): n for n, k in enumerate(unique)}
    for ids, grads in pushes:
        for k, g in zip(ids, grads):
            if int(k) in where:
                out[where[int(k)]] -= g
    return out


def _calls(client, method: str) -> dict[str, int]:
    """Requests of `method` each server handled so far (server-wide, not per table)."""
    return {addr: next((m.requests for m in s.methods if m.method == method), 0)
            for addr, s in client.stats().items()}


def _moved(before: dict, after: dict) -> dict:
    return {addr: after[addr] - before[addr] for addr in after}


def _background(fn) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except Exception as exc:  # noqa: BLE001 - checked by the test
            out["error"] = exc
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def _finished(thread: threading.Thread, out: dict):
    thread.join(20)
    assert not thread.is_alive(), "the waiting pull never returned"
    assert "error" not in out, out.get("error")
    return out["value"]


# ---- 1, 2: the same rows as per-table calls ------------------------------------------------
def test_pull_many_equals_per_table_pulls_in_callers_order(client, table_name):
    tables = _tables(client, table_name)
    rng = np.random.default_rng(0)
    ids = [_unique(t, rng, n) for t, n in zip(tables, (40, 100, 300, 50, 0, 60))]
    rows = pull_many(tables, ids, [0] * len(tables))
    for table, unique, got in zip(tables, ids, rows):
        assert got.shape == (len(unique), table.spec.dim) and got.dtype == table.dtype
        np.testing.assert_array_equal(got, initial_rows(table.spec.initializer, unique,
                                                        table.spec.dim, table.spec.dtype))
    assert push_many(tables, ids, _grads(tables, ids, rng), [0] * 6, 0, [0.0] * 6) == [True] * 6
    trained = pull_many(tables, ids, [1] * len(tables))
    for table, unique, got, old in zip(tables, ids, trained, rows):
        np.testing.assert_array_equal(got, table.pull_unique(unique))
        assert len(unique) == 0 or not np.array_equal(got, old)
    reverse = pull_many(tables, [i[::-1] for i in ids], [0] * len(tables))
    for got, forward in zip(reverse, trained):
        np.testing.assert_array_equal(got, forward[::-1])
    empty = pull_many(tables, [np.empty(0, np.int64)] * 6, [1] * 6)  # waits, reads nothing
    assert [e.shape for e in empty] == [(0, t.spec.dim) for t in tables]
    assert pull_many([], [], []) == []
    twice = pull_many([tables[2], tables[2]], [ids[2][:5], ids[2][5:9]], [0, 0])
    np.testing.assert_array_equal(np.concatenate(twice), trained[2][:9])


def test_push_many_equals_per_table_pushes_rows_and_slots(client, snapshot, table_name):
    fused = _tables(client, f"{table_name}_a", OPTIMIZERS)
    single = _tables(client, f"{table_name}_b", OPTIMIZERS)
    rng = np.random.default_rng(1)
    rates = [0.0, 0.05, 0.0, 0.2, 0.0, 0.01]
    for step in range(3):
        ids = [_ids(t, rng, n) for t, n in zip(fused, (30, 80, 200, 40, 25, 70))]
        ids[4] = ids[4][:0] if step == 1 else ids[4]  # a table with nothing this step
        grads = _grads(fused, ids, rng)
        assert push_many(fused, ids, grads, [step] * 6, 0, rates) == [True] * 6
        for table, i, g, lr in zip(single, ids, grads, rates):
            assert table.push(i, g, step=step, learning_rate=lr)
    for a, b in zip(fused, single):
        snap_a, snap_b = snapshot(a.name), snapshot(b.name)
        assert set(snap_a.arrays) > {"ids", "values"}, "the optimizer keeps slots"
        assert set(snap_a.step.values()) == {3}
        snap_a.assert_equal(snap_b)


def test_push_many_sums_duplicate_ids(client, table_name):
    tables = [client.create_table(_spec(f"{table_name}_{k}", shard_count=s))
              for k, s in enumerate((1, 3))]
    start = pull_many(tables, [np.array([3, 5])] * 2, [0, 0])
    ids = np.array([3, 5, 3, 3])
    grads = np.arange(16, dtype=np.float32).reshape(4, 4)
    push_many(tables, [ids, ids], [grads, grads], [0, 0], 0, [0.0, 0.0])
    for rows, before in zip(pull_many(tables, [np.array([3, 5])] * 2, [1, 1]), start):
        np.testing.assert_allclose(rows, before - np.stack([grads[[0, 2, 3]].sum(0), grads[1]]))


# ---- 3: sync semantics per table ------------------------------------------------------------
def test_sync_two_workers_half_step_invisible_then_waiting_pull_sees_it(cluster, client,
                                                                       table_name):
    specs = [_spec(f"{table_name}_{k}", num_workers=2, shard_count=s, **extra)
             for k, (s, extra) in enumerate([(1, {}), (2, dict(dtype="float64")),
                                             (3, dict(partition="range"))])]
    mine = [client.create_table(s) for s in specs]
    with PSClient(cluster.addresses, ClientOptions(timeout=20)) as other_process:
        theirs = [other_process.table(s) for s in specs]
        rng = np.random.default_rng(2)
        unique = [np.arange(0, 1000, 37) for _ in specs]
        start = pull_many(mine, unique, [0] * 3)
        for step in range(2):
            ids0, ids1 = [_ids(t, rng, 20) for t in mine], [_ids(t, rng, 15) for t in mine]
            ids1[0] = ids1[0][:0]  # worker 1 has nothing for table 0: its empty parts count
            g0, g1 = _grads(mine, ids0, rng), _grads(mine, ids1, rng)
            assert push_many(mine, ids0, g0, [step] * 3, 0, [0.0] * 3) == [False] * 3
            for now, before in zip(pull_many(theirs, unique, [0] * 3), start):
                np.testing.assert_array_equal(now, before)  # half a step is invisible
            reader, out = _background(lambda s=step + 1: pull_many(mine, unique, [s] * 3))
            reader.join(0.5)
            assert reader.is_alive(), "pull_many for the next step returned before it closed"
            assert push_many(theirs, ids1, g1, [step] * 3, 1, [0.0] * 3) == [True] * 3
            rows = _finished(reader, out)
            for k, (got, before) in enumerate(zip(rows, start)):
                expected = _applied(before, unique[k], [(ids0[k], g0[k]), (ids1[k], g1[k])])
                np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
            start = rows
    assert [t.wait_step(0) for t in mine] == [2, 2, 2]


def _raw_push(table, shard, ids, grads, step, worker):
    data = bulk_codec.encode_push_request(table.name, shard, step, worker, np.asarray(ids),
                                          np.asarray(grads, np.float32))
    return table.shards[shard].stub().Push(data, timeout=10)


def test_every_shard_gets_a_part_even_where_no_id_falls(cluster, client, table_name):
    spec = _spec(table_name, num_workers=2, shard_count=2)  # MOD: even ids on shard 0
    mine = client.create_table(spec)
    with PSClient(cluster.addresses, ClientOptions(timeout=20)) as other_process:
        theirs = other_process.table(spec)
        start = mine.pull([0, 2])
        ones = np.ones((2, 4), np.float32)
        push_many([mine], [np.array([0, 1])], [ones], [0], 0, [0.0])
        _raw_push(theirs, 0, [0], [[2] * 4], step=0, worker=1)  # shard 0 closes step 0
        reader, out = _background(lambda: pull_many([mine], [np.array([0, 2])], [1]))
        reader.join(0.5)
        assert reader.is_alive(), "ids only on shard 0, yet the pull did not wait on shard 1"
        _raw_push(theirs, 1, np.empty(0, np.int64), np.empty((0, 4)), step=0, worker=1)
        (rows,) = _finished(reader, out)
        np.testing.assert_allclose(rows, start - np.array([[3] * 4, [0] * 4]))
        # Step 1: worker 1's ids all fall on shard 0; its empty part closes shard 1 too.
        assert push_many([mine], [np.array([0, 1])], [ones], [1], 0, [0.0]) == [False]
        assert push_many([theirs], [np.array([2])], [ones[:1]], [1], 1, [0.0]) == [True]
        assert mine.wait_step(2) == 2


def test_waiting_pull_many_times_out_naming_who_pushed(cluster, client, table_name):
    specs = [_spec(f"{table_name}_{k}", num_workers=2, shard_count=s)
             for k, s in enumerate((1, 2))]
    tables = [client.create_table(s) for s in specs]
    push_many(tables, [np.array([0]), np.array([1])], [np.ones((1, 4))] * 2, [0, 0], 1,
              [0.0, 0.0])
    with PSClient(cluster.addresses, ClientOptions(timeout=0.5, retries=0)) as impatient:
        with pytest.raises(ServerError, match="DEADLINE_EXCEEDED") as info:
            pull_many([impatient.table(s) for s in specs], [np.array([0]), np.array([1])],
                      [1, 1])
    assert "worker(s) [0] of 2 have not pushed step 0" in str(info.value)
    assert "complete pushes: [1]" in str(info.value)
    assert "PullMany" in str(info.value) and table_name in str(info.value)


# ---- 4: async -------------------------------------------------------------------------------
def _push_many_bytes(parts) -> bytes:
    """A PushManyRequest from (table, shard, ids, grads, step, worker, chunk, chunks,
    session, learning rate) tuples, through the bulk codec."""
    headers = [(bulk_codec.PushHeader(t.name, s, step, w, lr, c, n, session), len(i),
                t.spec.dim, t.dtype) for t, s, i, _, step, w, c, n, session, lr in parts]
    writer = bulk_codec.PushManyRequestWriter(headers)
    for k, (_, _, ids, grads, *_) in enumerate(parts):
        writer.ids[k][...] = ids
        writer.grads[k][...] = grads
    return writer.data()


def _rejected(stub_call, request, code, pattern: str = "") -> None:
    with pytest.raises(grpc.RpcError) as info:
        stub_call(request, timeout=10)
    assert info.value.code() == code, info.value.details()
    assert pattern in info.value.details(), info.value.details()


def test_async_applies_on_arrival_and_a_repeated_push_many_once(client, snapshot, table_name):
    specs = [_spec(f"{table_name}_{k}", num_workers=2, sync_mode="async", shard_count=s)
             for k, s in enumerate((2, 1))]
    a, b = [client.create_table(s, placement) for s, placement in zip(specs, ([0, 1], [0]))]
    ids = [np.array([0, 1, 2, 4]), np.array([7, 7])]
    start = pull_many([a, b], [np.array([0, 1, 2, 4]), np.array([7])], [0, 0])
    grads = [np.ones((4, 4), np.float32), np.ones((2, 4), np.float32)]
    assert push_many([a, b], ids, grads, [0, 0], 1, [0.0, 0.0]) == [True, True]
    now = pull_many([a, b], [np.array([0, 1, 2, 4]), np.array([7])], [0, 0])
    np.testing.assert_allclose(now[0], start[0] - 1)
    np.testing.assert_allclose(now[1], start[1] - 2)
    one = np.ones((1, 4), np.float32)
    request = _push_many_bytes([(a, 0, [2], one, 5, 0, 0, 1, 77, 0.0),
                                (b, 0, [7], one, 5, 0, 0, 1, 77, 0.0)])
    stub = a.shards[0].stub()  # both parts live on server 0
    assert [p.applied for p in stub.PushMany(request, timeout=10).parts] == [True, True]
    after = [snapshot(a.name), snapshot(b.name)]
    _rejected(stub.PushMany, request, grpc.StatusCode.ALREADY_EXISTS,
              "worker 0 already sent the push for step 5")
    # One repeated part refuses the whole request: b's new step is not applied either.
    _rejected(stub.PushMany, _push_many_bytes([(a, 0, [2], one, 5, 0, 0, 1, 77, 0.0),
                                               (b, 0, [7], one, 6, 0, 0, 1, 77, 0.0)]),
              grpc.StatusCode.ALREADY_EXISTS)
    for snap, table in zip(after, (a, b)):
        snapshot(table.name).assert_equal(snap)
    rows = pull_many([a, b], [np.array([2]), np.array([7])], [0, 0])
    np.testing.assert_allclose(rows[0], start[0][[2]] - 2)
    np.testing.assert_allclose(rows[1], start[1] - 3)


# ---- 5: chunking ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_cluster():
    with LocalCluster(2, extra_args=["--max-message-mb", "2"]) as c:
        yield c
    assert c.exit_codes == [0, 0]


def _big_tables(client, prefix: str, **kw) -> list:
    layouts = [(dict(dim=16, shard_count=2), None),  # 64 B rows, both servers
               (dict(dim=8, dtype="float64", shard_count=3, partition="range"), [0, 1, 1]),
               (dict(dim=1, shard_count=1), [0])]  # ids weigh more than rows
    return [client.create_table(_spec(f"{prefix}_{k}", vocabulary_size=300_000, **fields,
                                      **kw), placement)
            for k, (fields, placement) in enumerate(layouts)]


def test_large_pull_and_push_many_split_per_server_and_stay_exact(small_cluster, table_name):
    rng = np.random.default_rng(3)
    with PSClient(small_cluster.addresses, SMALL) as client:
        fused = _big_tables(client, f"{table_name}_a", optimizer=Adagrad(learning_rate=0.1))
        single = _big_tables(client, f"{table_name}_b", optimizer=Adagrad(learning_rate=0.1))
        unique = [rng.choice(300_000, size=n, replace=False) for n in (60_000, 40_000, 200_000)]
        before = _calls(client, "PullMany")
        rows = pull_many(fused, unique, [0, 0, 0])
        first = _moved(before, _calls(client, "PullMany"))
        assert min(first.values()) >= 3, first  # several MB per server, 2 MB messages
        for got, table, i in zip(rows, single, unique):
            np.testing.assert_array_equal(got, table.pull_unique(i))
        ids = [rng.choice(i, size=len(i) + 1000) for i in unique]  # duplicates
        grads = _grads(fused, ids, rng)
        before = _calls(client, "PushMany")
        assert push_many(fused, ids, grads, [0] * 3, 0, [0.0] * 3) == [True] * 3
        assert min(_moved(before, _calls(client, "PushMany")).values()) >= 3
        for table, i, g in zip(single, ids, grads):
            assert table.push(i, g, step=0)
        before = _calls(client, "PullMany")
        rows = pull_many(fused, unique, [1, 1, 1])
        waited = _moved(before, _calls(client, "PullMany"))
        assert waited == {a: n + 1 for a, n in first.items()}, (first, waited)  # wait first
        for got, table, i in zip(rows, single, unique):
            np.testing.assert_array_equal(got, table.pull_unique(i, min_step=1))


def test_large_sync_pull_many_waits_first_then_reads_every_request(small_cluster, table_name):
    rng = np.random.default_rng(4)
    with PSClient(small_cluster.addresses, SMALL) as w0, \
            PSClient(small_cluster.addresses, SMALL) as w1:
        mine = _big_tables(w0, table_name, num_workers=2)
        theirs = [w1.table(t.spec, [w0.addresses.index(c.address) for c in t.shards])
                  for t in mine]
        unique = [rng.choice(300_000, size=n, replace=False) for n in (60_000, 40_000, 200_000)]
        start = pull_many(mine, unique, [0] * 3)
        g0, g1 = _grads(mine, unique, rng), _grads(mine, unique, rng)
        push_many(mine, unique, g0, [0] * 3, 0, [0.0] * 3)
        reader, out = _background(lambda: pull_many(mine, unique, [1] * 3))
        reader.join(0.5)
        assert reader.is_alive(), "a multi-request pull_many read before the step closed"
        assert push_many(theirs, unique, g1, [0] * 3, 1, [0.0] * 3) == [True] * 3
        for got, before, a, b in zip(_finished(reader, out), start, g0, g1):
            np.testing.assert_allclose(got, before - (a + b), rtol=1e-6, atol=1e-6)


def test_a_small_step_is_one_pull_many_and_one_push_many_per_server(client, table_name):
    tables = [client.create_table(_spec(f"{table_name}_{k}", shard_count=s, dim=d), p)
              for k, (s, d, p) in enumerate([(1, 4, [1]), (2, 8, None), (3, 2, [0, 1, 1])])]
    rng = np.random.default_rng(5)
    names = ("PullMany", "PushMany", "Pull", "Push")
    for step in range(2):
        before = {m: _calls(client, m) for m in names}
        ids = [_ids(t, rng, 50) for t in tables]
        push_many(tables, ids, _grads(tables, ids, rng), [step] * 3, 0, [0.0] * 3)
        pull_many(tables, [np.unique(i) for i in ids], [step + 1] * 3)
        moved = {m: _moved(before[m], _calls(client, m)) for m in names}
        assert moved == {"PullMany": {a: 1 for a in client.addresses},
                         "PushMany": {a: 1 for a in client.addresses},
                         "Pull": {a: 0 for a in client.addresses},
                         "Push": {a: 0 for a in client.addresses}}, moved


def test_pull_many_answer_checked_at_its_exact_size(small_cluster, table_name):
    """Rows a little under the limit are answered; rows plus headers over it are refused."""
    with PSClient(small_cluster.addresses, SMALL) as client:
        table = client.create_table(_spec(table_name, vocabulary_size=10_000, dim=64,
                                          shard_count=1), [0])
        stub = table.shards[0].stub()
        request = ps_pb2.PullManyRequest()
        wire.encode(np.arange(8000, dtype=np.int64), request.parts.add(table=table.name).ids)
        ((values, _),) = stub.PullMany(request, timeout=10)  # 2,048,000 bytes of rows
        np.testing.assert_array_equal(values, table.pull_unique(np.arange(8000)))
        wire.encode(np.arange(8192, dtype=np.int64), request.parts[0].ids)  # 2 MiB of rows
        _rejected(stub.PullMany, request, grpc.StatusCode.RESOURCE_EXHAUSTED,
                  "over the server's message limit of 2097152 bytes")
        # ClientOptions.chunk_mb equal to the server's limit: pull_many packs to fit it.
        with PSClient(small_cluster.addresses, ClientOptions(chunk_mb=2, max_message_mb=2,
                                                             timeout=30)) as tight:
            wide = tight.table(table.spec, [0])
            narrow = tight.create_table(_spec(f"{table_name}_1", vocabulary_size=600_000,
                                              dim=1, shard_count=1), [0])
            ids = [np.arange(10_000)[::-1], np.arange(600_000)]
            for step in range(2):
                rows = pull_many([wide, narrow], ids, [step, step])
                np.testing.assert_array_equal(rows[0], wide.pull_unique(ids[0]))
                np.testing.assert_array_equal(rows[1], narrow.pull_unique(ids[1]))
                grads = [np.ones((10_000, 64)), np.ones((600_000, 1))]
                assert push_many([wide, narrow], ids, grads, [step, step], 0, [0.0, 0.0]) \
                    == [True, True]


# ---- 6: every bad request is refused whole and changes nothing ------------------------------
@pytest.fixture
def pair(client, table_name):
    """Table a (2 shards, Adam) and b (1 shard on server 0, float64, Adagrad), both with
    optimizer state and at step 1; a's shard 0 and b live on server 0."""
    a = client.create_table(_spec(f"{table_name}_a", vocabulary_size=100, shard_count=2,
                                  optimizer=Adam(learning_rate=0.1)))
    b = client.create_table(_spec(f"{table_name}_b", vocabulary_size=50, dim=3, shard_count=1,
                                  dtype="float64", optimizer=Adagrad(learning_rate=0.1)), [0])
    ids = [np.arange(0, 100, 7), np.arange(0, 50, 3)]
    push_many([a, b], ids, [np.ones((15, 4)), np.ones((17, 3))], [0, 0], 0, [0.0, 0.0])
    return a, b


def _part(table, shard=0, ids=(0, 2), grads=None, step=1, worker=0, **kw):
    dim, dtype = table.spec.dim, table.dtype
    grads = np.ones((len(ids), dim), dtype) if grads is None else grads
    part = ps_pb2.PushRequest(table=table.name, shard_index=shard, step=step, worker=worker,
                              **kw)
    wire.encode(np.asarray(ids, np.int64), part.ids)
    wire.encode(np.asarray(grads), part.grads)
    return part


def _good_push(a, b) -> ps_pb2.PushManyRequest:
    """Valid on its own: a's shard 0 and b's only shard, step 1 (it would close both)."""
    return ps_pb2.PushManyRequest(parts=[_part(a), _part(b, ids=(1, 4))])


def _also(**kw):
    """Mutation: add a part for b with these fields (a chunk of the same shard)."""
    return lambda r, a, b: r.parts.append(_part(b, **{"ids": (7,), **kw}))


def _then(*mutations):
    def mutate(r, a, b):
        for m in mutations:
            m(r, a, b)
    return mutate


def _second(**fields):
    def mutate(r, a, b):
        for name, value in fields.items():
            if name in ("ids", "grads"):
                getattr(r.parts[1], name).CopyFrom(wire.encode(np.asarray(value)))
            else:
                setattr(r.parts[1], name, value)
    return mutate


INVALID, NOT_FOUND = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
BAD_PUSH_MANY = [
    ("empty request", lambda r, a, b: r.ClearField("parts"), INVALID,
     "PushMany carries no parts; send at least one"),
    ("unknown table in part 2", _second(table="nope"), NOT_FOUND,
     "table 'nope' shard 0 does not exist"),
    ("shard held by the other server", lambda r, a, b: r.parts.append(_part(a, shard=1, ids=(1,))),
     NOT_FOUND, "shard 1 does not exist on this server"),
    ("id out of the vocabulary", _second(ids=np.array([1, 50])), INVALID,
     "id 50 (position 1) is outside the vocabulary [0, 50)"),
    ("id of another shard", lambda r, a, b: r.parts[0].ids.CopyFrom(
        wire.encode(np.array([0, 3]))), INVALID, "id 3 belongs to shard 1 of 2"),
    ("wrong row dim", _second(grads=np.ones((2, 4))), INVALID,
     "grads must have shape [n, 3], got [2, 4]"),
    ("wrong dtype", _second(grads=np.ones((2, 3), np.float32)), INVALID,
     "grads dtype float32 does not match the table dtype float64"),
    ("ids and grads lengths differ", _second(grads=np.ones((3, 3))), INVALID,
     "grads has 3 rows but ids has 2"),
    ("NaN gradient", _second(grads=np.array([[0, 0, 0], [0, np.nan, 0]])), INVALID,
     "grads row 1 column 1 is nan; NaN/Inf are rejected"),
    ("negative learning rate", _second(learning_rate=-1.0), INVALID,
     "learning_rate -1.0 must be finite and >= 0"),
    ("closed step", _second(step=0), PRECONDITION,
     "step 0 is already closed (the shard has applied 1 steps); push step 1"),
    ("step ahead", _second(step=5), PRECONDITION, "step 5 is ahead of the open step 1"),
    ("worker out of range", _second(worker=3), INVALID,
     "worker 3 is out of range; the table has num_workers=1"),
    ("chunk repeated in the request", lambda r, a, b: r.parts.append(r.parts[1]), INVALID,
     "shard 0) repeats chunk 0; send each chunk once"),
    ("chunks disagree on chunk_count",
     _then(_second(chunk_count=2), _also(chunk_index=1, chunk_count=3)), INVALID,
     "differ from (1, 0, 0, 2) of an earlier chunk"),
    ("chunks disagree on step",
     _then(_second(chunk_count=2), _also(chunk_index=1, chunk_count=2, step=2)), INVALID,
     "differ from (1, 0, 0, 2) of an earlier chunk"),
    ("chunks disagree on learning rate",
     _then(_second(chunk_count=2, learning_rate=0.5),
           _also(chunk_index=1, chunk_count=2, learning_rate=0.25)),
     INVALID, "learning_rate 0.25 differs from the 0.5 of part 1"),
    ("chunk index outside its count", _second(chunk_index=2, chunk_count=2), INVALID,
     "chunk_index 2 is outside [0, chunk_count=2)"),
    ("float ids", _second(ids=np.array([1.0, 4.0])), INVALID,
     "ids must be int32 or int64, got float64"),
    ("truncated tensor bytes", lambda r, a, b: setattr(r.parts[1].grads, "content", bytes(12)),
     INVALID, "malformed PushManyRequest part 1: grads: shape [2, 3] of float64 needs 48"),
    ("truncated message", lambda r, a, b: r.SerializeToString()[:-5], INVALID,
     "malformed PushManyRequest part 1"),
]


@pytest.mark.parametrize("case", BAD_PUSH_MANY, ids=[c[0] for c in BAD_PUSH_MANY])
def test_bad_push_many_is_refused_whole_and_changes_nothing(pair, snapshot, case):
    _, mutate, code, pattern = case
    a, b = pair
    before = [snapshot(a.name), snapshot(b.name)]
    request = _good_push(a, b)
    replaced = mutate(request, a, b)
    if isinstance(replaced, bytes):
        request = replaced
    _rejected(a.shards[0].stub().PushMany, request, code, pattern)
    for snap, table in zip(before, (a, b)):
        snapshot(table.name).assert_equal(snap)  # part 1 was valid, and not applied either
    ids = [np.array([0, 1]), np.array([1])]
    assert push_many([a, b], ids, [np.ones((2, 4)), np.ones((1, 3))], [1, 1], 0,
                     [0.0, 0.0]) == [True, True]  # both still take a good push


def _pull_part(request, table, shard, ids, min_step=0):
    wire.encode(np.asarray(ids), request.parts.add(table=table.name, shard_index=shard,
                                                   min_step=min_step).ids)


BAD_PULL_MANY = [  # (case, parts as (table a or b, shard 0 ids), mutation, code, message)
    ("empty request", [], None, INVALID, "PullMany carries no parts"),
    ("unknown table in part 2", [("a", [0]), ("b", [1])],
     lambda r: setattr(r.parts[1], "table", "nope"), NOT_FOUND,
     "table 'nope' shard 0 does not exist"),
    ("id out of the vocabulary", [("a", [0]), ("b", [1, 50])], None, INVALID,
     "_b' shard 0: id 50 (position 1) is outside the vocabulary [0, 50)"),
    ("id of another shard", [("b", [1]), ("a", [2, 5])], None, INVALID,
     "id 5 belongs to shard 1 of 2"),
    ("float ids", [("a", np.array([0.0]))], None, INVALID,
     "part 0 ids must be int32 or int64, got float64"),
    ("2-D ids", [("b", [1]), ("a", [[0, 2]])], None, INVALID,
     "part 1 ids must be 1-D, got shape [1, 2]"),
    ("truncated ids bytes", [("a", [0, 2])],
     lambda r: setattr(r.parts[0].ids, "content", bytes(9)), INVALID,
     "part 0 ids: shape [2] of int64 needs 16 bytes, got 9"),
]


@pytest.mark.parametrize("case", BAD_PULL_MANY, ids=[c[0] for c in BAD_PULL_MANY])
def test_bad_pull_many_is_refused(pair, snapshot, case):
    _, parts, mutate, code, pattern = case
    tables = dict(zip("ab", pair))
    before = [snapshot(t.name) for t in pair]
    request = ps_pb2.PullManyRequest()
    for which, ids in parts:
        _pull_part(request, tables[which], 0, ids)
    if mutate:
        mutate(request)
    _rejected(pair[0].shards[0].stub().PullMany, request, code, pattern)
    for snap, table in zip(before, pair):
        snapshot(table.name).assert_equal(snap)


def test_undecodable_pull_many_bytes_leave_the_server_serving(cluster, pair, snapshot):
    a, b = pair
    before = snapshot(b.name)
    request = ps_pb2.PullManyRequest()
    _pull_part(request, b, 0, [1, 2])
    with grpc.insecure_channel(cluster.addresses[0]) as channel:
        raw = channel.unary_unary(f"/{SERVICE_NAME}/PullMany")
        with pytest.raises(grpc.RpcError) as info:
            raw(request.SerializeToString()[:-3], timeout=10)
    assert info.value.code() != grpc.StatusCode.OK
    snapshot(b.name).assert_equal(before)
    np.testing.assert_array_equal(pull_many([b], [np.array([2, 1])], [1])[0],
                                  b.pull_unique([2, 1]))


def test_undecodable_pull_many_bytes_are_invalid_argument(cluster, pair):
    request = ps_pb2.PullManyRequest()
    _pull_part(request, pair[1], 0, [1, 2])
    with grpc.insecure_channel(cluster.addresses[0]) as channel:
        raw = channel.unary_unary(f"/{SERVICE_NAME}/PullMany")
        _rejected(raw, request.SerializeToString()[:-3], INVALID)


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_pull_many_over_the_message_limit_is_refused_before_allocating(cluster, client,
                                                                       table_name):
    table = client.create_table(_spec(table_name, vocabulary_size=300_000, dim=64,
                                      shard_count=1), [0])
    request = ps_pb2.PullManyRequest()
    _pull_part(request, table, 0, np.arange(200_000))  # 51 MB of rows, 8 MiB limit
    pid = cluster.servers[0].proc.pid
    rss = _rss_bytes(pid)
    _rejected(table.shards[0].stub().PullMany, request, grpc.StatusCode.RESOURCE_EXHAUSTED,
              "PullMany would answer at least 51200000 bytes, over the server's message limit "
              "of 8388608 bytes")
    assert _rss_bytes(pid) - rss < 24 << 20  # neither the answer nor the rows were made
    assert table.pull_unique([5]).shape == (1, 64)


def test_hashed_parts_of_one_shard_count_together_against_max_rows(client, snapshot,
                                                                   table_name):
    table = client.create_table(TableSpec(name=table_name, hashed_keys=True, dim=2,
                                          max_rows_per_shard=4, optimizer=SGD(1.0)), [0])
    table.pull([1, 2])
    before = snapshot(table.name)
    stub = table.shards[0].stub()
    pull = ps_pb2.PullManyRequest()
    _pull_part(pull, table, 0, [10, 11])  # 2 + 2 rows fit, and 2 + 1 do, but not 2 + 3
    _pull_part(pull, table, 0, [12, 10])
    _rejected(stub.PullMany, pull, grpc.StatusCode.RESOURCE_EXHAUSTED,
              "3 new keys would exceed max_rows_per_shard=4 (holding 2)")
    push = ps_pb2.PushManyRequest(parts=[
        _part(table, ids=(10, 11), step=0, chunk_index=0, chunk_count=2),
        _part(table, ids=(12,), step=0, chunk_index=1, chunk_count=2)])
    _rejected(stub.PushMany, push, grpc.StatusCode.RESOURCE_EXHAUSTED,
              "3 new keys would exceed max_rows_per_shard=4")
    missing = ps_pb2.PullManyRequest()
    _pull_part(missing, table, 0, [13])
    _pull_part(missing, table, 0, [1])
    missing.parts[1].table = "nope"
    _rejected(stub.PullMany, missing, NOT_FOUND)
    snapshot(table.name).assert_equal(before)  # no key created by any of them
    del pull.parts[1]
    assert [v.shape for v, _ in stub.PullMany(pull, timeout=10)] == [(2, 2)]
    assert sorted(snapshot(table.name).arrays["ids"]) == [1, 2, 10, 11]


# ---- 7: metrics -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def metered():
    with LocalCluster(1, extra_args=["--metrics-port", "0"]) as cluster:
        ready = next(line for line in cluster.servers[0].lines
                     if line.startswith("PARALLAX_SERVER_READY"))
        yield cluster, dict(f.split("=", 1) for f in ready.split()[1:])["metrics"]


def _scrape(address: str) -> dict[tuple[str, frozenset], float]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, number = line.rpartition(" ")
            metric, _, labels = name.partition("{")
            pairs = [kv.split("=", 1) for kv in labels.rstrip("}").split(",") if kv]
            samples[(metric, frozenset((k, v.strip('"')) for k, v in pairs))] = float(number)
    return samples


def test_metrics_and_stats_count_requests_once_and_rows_per_table(metered):
    cluster, address = metered
    dim = 4
    with PSClient(cluster.addresses) as client:
        x = client.create_table(_spec("many_x", dim=dim, shard_count=2))
        y = client.create_table(_spec("many_y", dim=dim, shard_count=1))
        before = _scrape(address)
        pull_many([x, y], [np.arange(10), np.arange(5)], [0, 0])
        push_many([x, y], [np.arange(4), np.array([1, 2, 2])],
                  [np.ones((4, dim)), np.ones((3, dim))], [0, 0], 0, [0.0, 0.0])
        bad = ps_pb2.PullManyRequest()
        _pull_part(bad, x, 0, [0])
        _pull_part(bad, x, 0, [2])
        bad.parts[1].table = "nope"
        _rejected(x.shards[0].stub().PullMany, bad, NOT_FOUND)
        stats = client.stats()[cluster.addresses[0]]
    after = _scrape(address)

    def moved(name, **labels):
        key = (name, frozenset((k, str(v)) for k, v in labels.items()))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert moved("parallax_requests_total", method="PullMany", code="OK") == 1
    assert moved("parallax_requests_total", method="PullMany", code="NOT_FOUND") == 1
    assert moved("parallax_requests_total", method="PushMany", code="OK") == 1
    assert moved("parallax_requests_total", method="Pull", code="OK") == 0
    assert moved("parallax_request_seconds_count", method="PullMany") == 2
    assert moved("parallax_rows_total", method="PullMany", run_id="", table="many_x") == 10
    assert moved("parallax_rows_total", method="PullMany", run_id="", table="many_y") == 5
    assert moved("parallax_rows_total", method="PushMany", run_id="", table="many_x") == 4
    assert moved("parallax_rows_total", method="PushMany", run_id="",
                 table="many_y") == 2  # summed
    assert moved("parallax_bytes_total", method="PullMany", direction="out") == 15 * dim * 4
    assert moved("parallax_bytes_total", method="PushMany", direction="in") == 6 * dim * 4
    server = {m.method: m for m in stats.methods}
    assert (server["PullMany"].requests, server["PullMany"].errors) == (2, 1)
    assert (server["PullMany"].rows, server["PushMany"].requests) == (15, 1)
    per_table = {(t.table, m.method): m for t in stats.tables for m in t.methods}
    assert per_table["many_x", "PullMany"].requests == 2  # one part per shard
    assert per_table["many_x", "PullMany"].rows == 10
    assert per_table["many_y", "PushMany"].requests == 1
    assert per_table["many_y", "PushMany"].rows == 2


def test_a_hashed_key_never_hides_another_tables_bad_id(client, table_name):
    """A negative key of a keyed table (any int64 is a key) is not out of range, and a range table's
    id past its vocabulary beside it is refused on the client, naming that table, before
    anything is pulled or pushed (a reviewer's finding: it went unchecked, read other rows
    and pushed its gradient into row 1)."""
    hashed = client.create_table(_spec(f"{table_name}_h", hashed_keys=True, vocabulary_size=0,
                                       shard_count=2))
    ranged = client.create_table(_spec(f"{table_name}_r", partition="range"))
    before = pull_many([ranged], [np.arange(1000)], [0])[0]
    for ids in ([1, 1002], [-3, 1]):
        with pytest.raises(ConfigError, match=f"table '{table_name}_r' has 1000 rows: id"):
            pull_many([hashed, ranged], [np.array([-5]), np.array(ids)], [0, 0])
        with pytest.raises(ConfigError, match=f"table '{table_name}_r' has 1000 rows: id"):
            push_many([hashed, ranged], [np.array([-5]), np.array(ids)],
                      [np.ones((1, 4), np.float32), np.ones((2, 4), np.float32)], [0, 0], 0,
                      [0.0, 0.0])
    np.testing.assert_array_equal(pull_many([ranged], [np.arange(1000)], [0])[0], before)


def test_a_push_of_no_rows_to_every_table_closes_the_step(client, table_name):
    """A step that touched no table still pushes (empty parts close it) and the next pull
    waits for it (a reviewer's finding: the one-pass plan raised IndexError)."""
    tables = [client.create_table(_spec(f"{table_name}_{k}")) for k in range(2)]
    empty, no_grads = np.empty(0, np.int64), np.empty((0, 4), np.float32)
    assert push_many(tables, [empty, empty], [no_grads, no_grads], [0, 0], 0, [0.0, 0.0]) == \
        [True, True]
    assert [len(r) for r in pull_many(tables, [empty, empty], [1, 1])] == [0, 0]


# ---- calls started now, answers read later (the fused step's push) -------------------------
def _step_of(client, name: str, shard: int = 0) -> int:
    return client.servers[shard].call("WaitStep", ps_pb2.StepRequest(
        table=name, shard_index=shard, min_step=0)).step


def _wait_for_step(client, name: str, step: int, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while _step_of(client, name) < step:
        assert time.monotonic() < deadline, f"{name} never reached step {step}"
        time.sleep(0.02)


def test_a_started_push_lands_before_anyone_reads_its_answer(client, table_name):
    """start_push_many sends now: the server applies the step although nobody asked for the
    answer yet; the gradients may be overwritten at once."""
    table = client.create_table(_spec(table_name, shard_count=1, num_workers=1),
                                placement=[0])
    ids, grads = np.array([1, 2, 3]), np.ones((3, table.spec.dim), np.float32)
    start = table.pull_unique(ids)
    pending = start_push_many([table], [ids], [grads], [0], 0, [0.0])
    grads[...] = np.nan  # TensorFlow reuses a numpy_function's buffers once it returns
    _wait_for_step(client, table_name, 1)
    assert pending.result() == [True]
    np.testing.assert_allclose(table.pull_unique(ids), start - 1.0, rtol=1e-6)  # SGD(1.0)


def test_a_started_pull_abandoned_lets_go_of_its_connection(client, table_name):
    """A pull left waiting (the step failed) closes its connection: nothing stale is ever
    read from a pooled connection by the next call."""
    table = client.create_table(_spec(table_name, shard_count=1, num_workers=2), placement=[0])
    ids = np.arange(4)
    pending = start_pull_many([table], [ids], [1])  # waits for a step nobody pushes
    pending.abandon()
    began = time.monotonic()
    with pytest.raises(ServerError, match="CANCELLED.*abandoned"):
        pending.result()  # at once: not sent again to wait for the step (it waited 20 s)
    assert time.monotonic() - began < 5.0
    np.testing.assert_array_equal(pull_many([table], [ids], [0])[0], table.pull_unique(ids))


class _Pushing:
    """What `land_pushes_of` asks of a table: its label and pushes in flight."""

    label = "hung"

    def __init__(self) -> None:
        self.in_flight: list = []

    def take_in_flight(self) -> list:
        taken, self.in_flight = self.in_flight, []
        return taken

    def add_push_seconds(self, seconds: float) -> None:
        pass


def test_landing_a_started_push_is_bounded_by_the_callers_timeout():
    """A fused push whose server hangs does not hold `land_pushes_of(timeout=...)` (the exit
    drain) past that timeout, although its own call's deadline is longer."""
    from parallax.client.table_rows import Landing, land_pushes_of
    with LocalCluster(1) as hung, \
            PSClient(hung.addresses, ClientOptions(timeout=20, retries=0)) as c:
        table = c.create_table(_spec("hung", shard_count=1, num_workers=2))
        ids, grads = np.arange(3), np.ones((3, 4), np.float32)
        start_push_many([table], [ids], [grads], [0], 0, [0.0]).result()  # plane connected
        freeze(hung.servers[0].proc.pid)
        try:
            pushing = _Pushing()
            pushing.in_flight.append(Landing(start_push_many([table], [ids], [grads], [0], 1,
                                                             [0.0]), [pushing], [3], 0.0))
            began = time.monotonic()
            with pytest.raises(ServerError, match="did not land within 1 s"):
                land_pushes_of([pushing], timeout=1.0)
            assert time.monotonic() - began < 5.0
        finally:
            os.kill(hung.servers[0].proc.pid, signal.SIGCONT)
