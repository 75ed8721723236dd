"""A dynamic table's rows with their use history, on real servers (loopback): a live reshard
keeps uses and last-used steps (LRU and LFU go on evicting the same rows), an import into
fewer bounded shards keeps the bound by evicting per the policy, an import past the bound
without eviction is refused with nothing changed, and `ShardedTable.export_rows` reads given
keys, the most used or every row across shards."""
from __future__ import annotations

import dataclasses

import grpc
import numpy as np
import pytest

from parallax.client.dynamic_rows import PRUNE_ROWS
from parallax.client.row_mover import move_rows
from parallax.errors import ConfigError, ServerError
from parallax.protocol import wire
from parallax.protocol.specs import Adagrad, Initializer, TableSpec
from parallax.ps.v1 import ps_pb2

DIM = 4


def _spec(name: str, **kw) -> TableSpec:
    base = dict(name=name, dim=DIM, hashed_keys=True, shard_count=2, optimizer=Adagrad(0.1),
                initializer=Initializer("normal", seed=5))
    return TableSpec(**{**base, **kw})


def _train(table, seed: int, steps: int, start: int = 0, keys: int = 300, size: int = 32,
           a: float = 1.2) -> None:
    """Steps of a Zipf(`a`) stream of `size` draws a step over `keys` keys."""
    rng = np.random.default_rng(seed)
    for step in range(start, start + steps):
        ids = np.unique(rng.zipf(a, size) % keys)
        table.push(ids, rng.normal(size=(len(ids), DIM)).astype(np.float32), step=step)


def _dynamic(client, name: str) -> list:
    return sorted(((t.shard_index, t.rows, t.dynamic.evicted_capacity)
                   for reply in client.stats([name]).values() for t in reply.tables))


ROW_ARRAYS = ("ids", "values", "slot_accumulator", "dyn_last_used", "dyn_uses")


def _assert_same_rows(a, b) -> None:
    for key in ROW_ARRAYS:
        np.testing.assert_array_equal(a.arrays[key], b.arrays[key], err_msg=key)


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_a_reshard_keeps_the_use_history_and_evicts_the_same_rows(client, snapshot,
                                                                  table_name, eviction):
    source = client.create_table(_spec(table_name, max_rows_per_shard=12, eviction=eviction))
    _train(source, 1, 8)
    before = snapshot(table_name)
    assert before.arrays["dyn_uses"].max() > 1  # a history to lose
    target, _ = client.reshard(source, table_name + ".r", 2, [1, 0])  # the other servers
    _assert_same_rows(snapshot(target.name), before)
    _train(source, 2, 10, start=8)
    _train(target, 2, 10, start=8)
    _assert_same_rows(snapshot(target.name), snapshot(table_name))
    assert sum(e for _, _, e in _dynamic(client, target.name)) > 0  # it evicted since


def _policy_kept(snap, eviction: str, bound: int) -> np.ndarray:
    """The keys a single shard of `bound` rows keeps of every row in `snap`."""
    ids = snap.arrays["ids"]
    rank = snap.arrays["dyn_last_used" if eviction == "lru" else "dyn_uses"]
    order = np.lexsort((ids, rank))  # first to evict first, ties by the smaller key
    return np.sort(ids[order[len(ids) - bound:]])


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_an_import_into_fewer_bounded_shards_keeps_the_bound_by_the_policy(
        client, snapshot, table_name, eviction):
    spec = _spec(table_name, shard_count=3, max_rows_per_shard=10, eviction=eviction)
    source = client.create_table(spec)
    _train(source, 3, 12)
    held = snapshot(table_name)
    assert len(held.arrays["ids"]) > 10
    target = client.create_table(dataclasses.replace(spec, name=table_name + ".one",
                                                     shard_count=1), [1])
    move_rows(source, target, page_rows=4)  # many pages, each ranked against the held rows
    got = snapshot(target.name)
    kept = _policy_kept(held, eviction, 10)
    np.testing.assert_array_equal(got.arrays["ids"], kept)
    where = np.searchsorted(held.arrays["ids"], kept)
    for key in ROW_ARRAYS[1:]:
        np.testing.assert_array_equal(got.arrays[key], held.arrays[key][where], err_msg=key)
    assert _dynamic(client, target.name) == [(0, 10, len(held.arrays["ids"]) - 10)]


def _page(table, ids, *, uses=None, last_used=None, step=0) -> ps_pb2.ShardRows:
    ids = np.asarray(ids, np.int64)
    page = ps_pb2.ShardRows(table=table.name, shard_index=0, step=step,
                            slot_names=["accumulator"])
    wire.encode(ids, page.ids)
    wire.encode(np.ones((len(ids), DIM), np.float32), page.values)
    wire.encode(np.full((len(ids), DIM), 0.5, np.float32), page.slots.add())
    for field, array in (("uses", uses), ("last_used", last_used)):
        if array is not None:
            wire.encode(np.asarray(array, np.int64), getattr(page, field))
    return page


def test_an_import_past_the_bound_without_eviction_is_refused_and_changes_nothing(
        client, snapshot, table_name):
    table = client.create_table(_spec(table_name, shard_count=1, max_rows_per_shard=3,
                                      admit_after=2), [0])  # dynamic, eviction "none"
    conn = table.shards[0]
    conn.call("ImportRows", _page(table, [1, 2], uses=[4, 1], last_used=[3, 2], step=5),
              table.name)
    before = snapshot(table.name)
    np.testing.assert_array_equal(before.arrays["dyn_uses"], [4, 1])  # adopted as sent
    with pytest.raises(ServerError, match=r"max_rows_per_shard=3 .*eviction='lru' or 'lfu'"
                       ) as info:
        conn.call("ImportRows", _page(table, [7, 8], uses=[1, 1], last_used=[5, 5], step=6),
                  table.name)
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert table_name in str(info.value)
    snapshot(table.name).assert_equal(before)
    assert table.wait_step(0) == 5  # not the refused page's step


@pytest.mark.parametrize("case,match", [
    ("negative", "uses -1 .* must be in"),
    ("short", r"last_used must be int64 \[2\]"),
    ("alone", "uses without last_used"),
])
def test_bad_use_history_is_refused_and_changes_nothing(client, snapshot, table_name, case,
                                                        match):
    table = client.create_table(_spec(table_name, shard_count=1, max_rows_per_shard=3,
                                      eviction="lfu"), [0])
    conn = table.shards[0]
    conn.call("ImportRows", _page(table, [1, 2, 3], uses=[4, 1, 2], last_used=[3, 2, 1],
                                  step=5), table.name)
    before = snapshot(table.name)
    history = {"negative": dict(uses=[-1, 1], last_used=[5, 5]),  # would evict 2 and 3
               "short": dict(uses=[1, 1], last_used=[5]),
               "alone": dict(uses=[1, 1])}[case]
    with pytest.raises(ServerError, match=match) as info:
        conn.call("ImportRows", _page(table, [7, 8], step=6, **history), table.name)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    snapshot(table.name).assert_equal(before)
    assert _dynamic(client, table.name) == [(0, 3, 0)]


# ---- export_rows ---------------------------------------------------------------------------
@pytest.fixture
def trained(client, snapshot, table_name):
    """A dynamic LFU table of 3 shards trained on a Zipf stream, and its snapshot."""
    table = client.create_table(_spec(table_name, shard_count=3, max_rows_per_shard=800,
                                      eviction="lfu"))
    _train(table, 4, 8, keys=100_000, size=400, a=1.1)
    snap = snapshot(table_name)
    assert len(snap.arrays["ids"]) > PRUNE_ROWS  # the top_n selection prunes as pages come
    return table, snap


def test_export_rows_reads_every_row_across_shards(trained):
    table, snap = trained
    keys, values, uses = table.export_rows()
    np.testing.assert_array_equal(keys, snap.arrays["ids"])
    np.testing.assert_array_equal(values, snap.arrays["values"])
    np.testing.assert_array_equal(uses, snap.arrays["dyn_uses"])
    assert keys.dtype == np.int64 and uses.dtype == np.int64 and values.dtype == np.float32


def test_export_rows_of_given_keys_leaves_out_those_not_held(client, trained):
    table, snap = trained
    held = snap.arrays["ids"][[0, 5, 17, -1]]
    missing = np.array([10**12, 10**12 + 1])
    rows_before = _dynamic(client, table.name)
    keys, values, uses = table.export_rows(keys=np.concatenate([missing, held[::-1], held]))
    np.testing.assert_array_equal(keys, held)
    where = np.searchsorted(snap.arrays["ids"], held)
    np.testing.assert_array_equal(values, snap.arrays["values"][where])
    np.testing.assert_array_equal(uses, snap.arrays["dyn_uses"][where])
    assert _dynamic(client, table.name) == rows_before  # reading creates no row
    assert [len(a) for a in table.export_rows(keys=missing)] == [0, 0, 0]


def test_export_rows_top_n_ranks_by_uses_then_key(trained):
    table, snap = trained
    ids, counts = snap.arrays["ids"], snap.arrays["dyn_uses"]
    order = np.lexsort((ids, -counts))
    n = 50
    assert counts[order[n - 1]] == counts[order[n]]  # the cut falls among ties
    keys, values, uses = table.export_rows(top_n=n)
    np.testing.assert_array_equal(keys, ids[order[:n]])
    np.testing.assert_array_equal(uses, counts[order[:n]])
    np.testing.assert_array_equal(values, snap.arrays["values"][order[:n]])
    some = ids[order[::7]]  # of given keys too
    mine = np.lexsort((some, -counts[order[::7]]))[:3]
    np.testing.assert_array_equal(table.export_rows(keys=some, top_n=3)[0], some[mine])
    with pytest.raises(ConfigError, match="top_n must be an int >= 0"):
        table.export_rows(top_n=-1)


def test_export_rows_of_a_plain_hashed_table_has_no_use_counts(client, snapshot, table_name):
    table = client.create_table(_spec(table_name, max_rows_per_shard=1000))
    _train(table, 5, 3)
    snap = snapshot(table_name)
    keys, values, uses = table.export_rows()
    np.testing.assert_array_equal(keys, snap.arrays["ids"])
    np.testing.assert_array_equal(values, snap.arrays["values"])
    assert uses.dtype == np.int64 and len(uses) == 0
    assert len(table.export_rows(keys=snap.arrays["ids"][:3])[0]) == 3
    with pytest.raises(ConfigError, match="is not a dynamic table: its rows keep no use counts"):
        table.export_rows(top_n=5)


def test_export_rows_mid_step_is_refused_clearly(client, table_name):
    table = client.create_table(_spec(table_name, num_workers=2, max_rows_per_shard=50,
                                      eviction="lru"))
    table.push([1, 2, 3], np.ones((3, DIM), np.float32), step=0, worker=0)  # half a step
    with pytest.raises(ServerError, match="export_rows reads between steps only") as info:
        table.export_rows()
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "export between steps" in str(info.value)
    table.push([4], np.ones((1, DIM), np.float32), step=0, worker=1)
    assert table.wait_step(1) == 1
    np.testing.assert_array_equal(table.export_rows()[0], [1, 2, 3, 4])
