"""Dynamic tables on real servers (loopback): the row bound under a Zipf stream checked
in Stats after every request, counters in Stats and /metrics, two sync workers seeing the
same rows, and checkpoint/restore exactness."""
from __future__ import annotations

import dataclasses
import threading
import urllib.request

import grpc
import numpy as np
import pytest

from parallax import PSClient
from parallax.client.local_cluster import LocalCluster
from parallax.client.many import push_many
from parallax.protocol import wire
from parallax.ps.v1 import ps_pb2
from parallax.protocol.initial_values import initial_rows
from parallax.protocol.specs import SGD, Adagrad, Initializer, TableSpec

DIM = 4


def _spec(name: str, **kw) -> TableSpec:
    base = dict(name=name, dim=DIM, hashed_keys=True, shard_count=2, optimizer=Adagrad(0.1),
                initializer=Initializer("normal", seed=5))
    return TableSpec(**{**base, **kw})


def _shard_stats(client, name: str) -> list:
    return [t for reply in client.stats([name]).values() for t in reply.tables]


def test_the_bound_holds_under_a_zipf_stream(client, table_name):
    table = client.create_table(_spec(table_name, max_rows_per_shard=20, eviction="lru",
                                      admit_after=2))
    rng = np.random.default_rng(1)
    for step in range(25):
        keys = np.unique(rng.zipf(1.2, 64) % 5000)
        table.pull(keys, min_step=step)
        for entry in _shard_stats(client, table_name):
            assert entry.rows <= 20
        table.push(keys, np.ones((len(keys), DIM), np.float32), step=step)
        for entry in _shard_stats(client, table_name):
            assert entry.rows <= 20
    stats = _shard_stats(client, table_name)
    assert sum(e.dynamic.evicted_capacity for e in stats) > 0
    assert sum(e.dynamic.dropped_gradients for e in stats) > 0
    assert sum(e.dynamic.default_rows for e in stats) > 0
    assert sum(e.dynamic.admitted for e in stats) == \
        sum(e.rows + e.dynamic.evicted_capacity + e.dynamic.evicted_ttl for e in stats)


def test_unadmitted_gradients_are_dropped_and_counted(client, table_name):
    spec = _spec(table_name, admit_after=3, optimizer=SGD(1.0), shard_count=1)
    table = client.create_table(spec)
    keys = np.array([11, 12])
    for step in range(2):
        table.push(keys, np.ones((2, DIM), np.float32), step=step)
    np.testing.assert_array_equal(table.pull(keys),
                                  initial_rows(spec.initializer, keys, DIM, "float32"))
    (entry,) = _shard_stats(client, table_name)
    assert entry.rows == 0 and entry.dynamic.dropped_gradients == 4
    assert entry.dynamic.default_rows == 2
    table.push(keys, np.ones((2, DIM), np.float32), step=2)
    np.testing.assert_allclose(table.pull(keys),
                               initial_rows(spec.initializer, keys, DIM, "float32") - 1)


def test_two_sync_workers_see_the_same_rows(client, table_name):
    table = client.create_table(_spec(table_name, num_workers=2, max_rows_per_shard=6,
                                      eviction="lfu", admit_after=2))
    rng = np.random.default_rng(2)
    streams = [[np.unique(rng.zipf(1.3, 12) % 40) for _ in range(15)] for _ in range(2)]
    seen: list[list[np.ndarray]] = [[], []]

    def work(worker: int) -> None:
        for step, keys in enumerate(streams[worker]):
            probe = np.arange(40)
            seen[worker].append(table.pull(probe, min_step=step))
            table.push(keys, np.full((len(keys), DIM), 0.5, np.float32), step=step,
                       worker=worker)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for mine, theirs in zip(*seen):
        np.testing.assert_array_equal(mine, theirs)


def _train(table, rng, steps: int, start: int) -> None:
    for step in range(start, start + steps):
        keys = np.unique(rng.zipf(1.2, 32) % 300)
        table.push(keys, rng.normal(size=(len(keys), DIM)).astype(np.float32), step=step)


def test_a_restored_table_admits_and_evicts_as_the_uninterrupted_one(client, table_name):
    spec = _spec(table_name, max_rows_per_shard=15, eviction="lru", admit_after=2,
                 ttl_steps=6)
    table = client.create_table(spec)
    _train(table, np.random.default_rng(3), 10, 0)
    client.save(f"dyn-{table_name}", tables=[table_name])
    after = np.random.default_rng(4)
    _train(table, after, 10, 10)
    stats_expected = sorted((e.shard_index, e.rows, e.dynamic.admitted,
                             e.dynamic.evicted_capacity, e.dynamic.evicted_ttl,
                             e.dynamic.dropped_gradients) for e in _shard_stats(client, table_name))
    probe = np.arange(300)
    rows_expected = table.pull(probe, min_step=20)
    client.restore(f"dyn-{table_name}", tables=[table_name])
    _train(table, np.random.default_rng(4), 10, 10)
    stats_got = sorted((e.shard_index, e.rows, e.dynamic.admitted,
                        e.dynamic.evicted_capacity, e.dynamic.evicted_ttl,
                        e.dynamic.dropped_gradients) for e in _shard_stats(client, table_name))
    assert stats_got == stats_expected
    np.testing.assert_array_equal(table.pull(probe, min_step=20), rows_expected)


def test_counters_reach_the_metrics_endpoint():
    with LocalCluster(1, extra_args=["--metrics-port", "0"]) as cluster, \
            PSClient(cluster.addresses) as client:
        ready = next(line for line in cluster.servers[0].lines
                     if line.startswith("PARALLAX_SERVER_READY"))
        address = dict(f.split("=", 1) for f in ready.split()[1:])["metrics"]
        table = client.create_table(_spec("m", shard_count=1, max_rows_per_shard=2,
                                          eviction="lru", admit_after=2, ttl_steps=3))
        for step in range(6):
            keys = np.array([step, step + 1, step + 2, 100])
            table.pull(keys, min_step=step)
            table.push(keys, np.ones((4, DIM), np.float32), step=step)
        (entry,) = _shard_stats(client, "m")
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
            text = reply.read().decode()
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines()
                   if line.startswith("parallax_table_"))
    labels = 'run_id="",shard="0",table="m"'
    counters = entry.dynamic
    assert counters.admitted and counters.evicted_capacity and counters.dropped_gradients
    expected = {
        f"parallax_table_admitted_total{{{labels}}}": counters.admitted,
        f'parallax_table_evicted_total{{reason="capacity",{labels}}}':
            counters.evicted_capacity,
        f'parallax_table_evicted_total{{reason="ttl",{labels}}}': counters.evicted_ttl,
        f"parallax_table_dropped_gradients_total{{{labels}}}": counters.dropped_gradients,
        f"parallax_table_default_rows_total{{{labels}}}": counters.default_rows,
        f"parallax_table_rows{{{labels}}}": entry.rows}
    got = {k: float(samples.get(k, "nan")) for k in expected}
    assert got == {k: float(v) for k, v in expected.items()}, sorted(samples)


def test_a_dynamic_table_reshards_through_a_checkpoint(client, snapshot, table_name):
    spec = _spec(table_name, max_rows_per_shard=12, eviction="lfu", admit_after=2)
    table = client.create_table(spec)
    _train(table, np.random.default_rng(6), 8, 0)
    saved = snapshot(table_name)
    client.save(f"dyn-reshard-{table_name}", [table_name])
    client.delete_table(table)
    table = client.create_table(dataclasses.replace(spec, shard_count=3))
    client.restore(f"dyn-reshard-{table_name}", [table_name])
    after = snapshot(table_name)
    for key in ("ids", "values", "slot_accumulator", "dyn_last_used", "dyn_uses"):
        np.testing.assert_array_equal(after.arrays[key], saved.arrays[key], err_msg=key)
    summed = saved.arrays["dyn_sketch"].sum(axis=0)
    for sketch in after.arrays["dyn_sketch"]:  # each shard: the sum of the saved ones
        np.testing.assert_array_equal(sketch, summed)
    assert not after.arrays["dyn_counters"].any()
    _train(table, np.random.default_rng(7), 5, 8)
    assert all(e.rows <= 12 for e in _shard_stats(client, table_name))


def _push_part(table, ids, grads, step: int) -> ps_pb2.PushRequest:
    part = ps_pb2.PushRequest(table=table.name, shard_index=0, step=step)
    wire.encode(np.asarray(ids, np.int64), part.ids)
    wire.encode(np.asarray(grads, np.float32), part.grads)
    return part


def test_a_push_many_refused_in_a_later_part_takes_back_admission_and_eviction(
        client, snapshot, table_name):
    dyn = client.create_table(_spec(f"{table_name}_d", shard_count=1, max_rows_per_shard=3,
                                    eviction="lru", admit_after=2), [0])
    other = client.create_table(TableSpec(name=f"{table_name}_o", vocabulary_size=10, dim=2,
                                          optimizer=SGD(10.0)), [0])
    for step in range(2):
        push_many([dyn, other], [np.array([1, 2, 3, 8, 9]), np.array([0])],
                  [np.ones((5, DIM)), np.ones((1, 2))], [step, step], 0, [0.0, 0.0])
    before = [snapshot(dyn.name), snapshot(other.name)]
    stats_before = _shard_stats(client, dyn.name)[0].dynamic
    assert (stats_before.admitted, stats_before.evicted_capacity) == (3, 0)  # 1, 2, 3
    request = ps_pb2.PushManyRequest(parts=[  # 8 (third sighting) admitted, evicting 1
        _push_part(dyn, [4, 5, 8], np.ones((3, DIM)), 2),
        _push_part(other, [1], np.full((1, 2), 3e38), 2)])  # overflows: refused at apply
    with pytest.raises(grpc.RpcError) as info:
        dyn.shards[0].stub().PushMany(request, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    for snap, table in zip(before, (dyn, other)):
        snapshot(table.name).assert_equal(snap)
    assert _shard_stats(client, dyn.name)[0].dynamic == stats_before
    push_many([dyn, other], [np.array([4, 5, 8]), np.array([1])],
              [np.ones((3, DIM)), np.ones((1, 2))], [2, 2], 0, [0.0, 0.0])
    assert _shard_stats(client, dyn.name)[0].dynamic.evicted_capacity == 1  # it would have


def test_parallax_status_json_carries_the_counters(cluster, client, table_name):
    from parallax.client import ClientOptions
    from parallax.launch.status import collect
    table = client.create_table(_spec(table_name, shard_count=1, admit_after=2), [0])
    table.push([1, 2], np.ones((2, DIM), np.float32), step=0)
    (server, *_) = collect(cluster.addresses[:1], ClientOptions())
    (mine,) = [t for t in server["tables"] if t["table"] == table_name]
    assert mine["dynamic"] == {"admitted": 0, "evicted_capacity": 0, "evicted_ttl": 0,
                               "dropped_gradients": 2, "default_rows": 0}
