"""routing.Runs: many tables' routing in one pass gives exactly what each table's own
ShardRouter gives (fast tier: no servers, no TensorFlow)."""
from __future__ import annotations

import numpy as np
import pytest

from parallax.protocol.routing import (SHORT_RUN, Runs, ShardRouter, grouped_order, stable_order,
                                       sum_runs)

ROUTERS = [ShardRouter(2, 1000), ShardRouter(1, 50), ShardRouter(3, 1000, "range"),
           ShardRouter(4), ShardRouter(5, 17), ShardRouter(2, 9, "range")]


def _runs(rng, duplicates: bool):
    out = []
    for p in ROUTERS:
        n = int(rng.integers(0, 40))
        if p.hashed:
            ids = rng.integers(-2**62, 2**62, n)
        else:
            ids = rng.integers(0, p.vocabulary_size, n) if duplicates else \
                rng.permutation(p.vocabulary_size)[:n]
        out.append(ids.astype(np.int64))
    return out


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("duplicates", [False, True])
def test_push_routings_match_each_router(seed, duplicates):
    rng = np.random.default_rng(seed)
    runs = _runs(rng, duplicates)
    many = Runs(ROUTERS, runs)
    assert many.push_routings() is many.push_routings()  # planned once
    for p, ids, plan in zip(ROUTERS, runs, many.push_routings()):
        want = p.route_push(ids)
        np.testing.assert_array_equal(plan.ids, want.ids)
        np.testing.assert_array_equal(plan.offsets, want.offsets)
        grads = rng.standard_normal((len(ids), 3))
        for lo, hi in [(0, len(plan.ids)), (0, len(plan.ids) // 2),
                       (len(plan.ids) // 3, len(plan.ids))]:
            got, expected = np.zeros((hi - lo, 3)), np.zeros((hi - lo, 3))
            plan.fill(grads, lo, hi, got)
            want.fill(grads, lo, hi, expected)
            np.testing.assert_allclose(got, expected, rtol=1e-12)


@pytest.mark.parametrize("seed", range(10))
def test_a_plan_of_distinct_ids_is_their_pull_layout(seed):
    """A pull routes its (distinct) ids by the push routing: plan.order puts each id at its
    shard's place, and shard s's ids are exactly those the router gives it."""
    rng = np.random.default_rng(seed)
    runs = _runs(rng, duplicates=False)
    for p, ids, plan in zip(ROUTERS, runs, Runs(ROUTERS, runs).push_routings()):
        assert plan.starts is None
        np.testing.assert_array_equal(ids[plan.order], plan.ids)
        owner = p.shard_of(plan.ids)
        for s in range(p.shard_count):
            lo, hi = plan.offsets[s], plan.offsets[s + 1]
            assert (owner[lo:hi] == s).all()
            assert sorted(plan.ids[lo:hi].tolist()) == sorted(ids[p.shard_of(ids) == s]
                                                               .tolist())


def test_same_ids_recognises_only_the_very_same_runs():
    ids = [np.array([5, 1, 7]), np.array([], np.int64), np.array([3])]
    runs = Runs(ROUTERS[:3], ids)
    assert runs.same_ids(ROUTERS[:3], [i.copy() for i in ids])
    assert not runs.same_ids(ROUTERS[:3], [np.array([1, 5, 7]), ids[1], ids[2]])
    assert not runs.same_ids(ROUTERS[:3], [np.array([5, 1]), np.array([7]), ids[2]])
    assert not runs.same_ids([ROUTERS[1], ROUTERS[0], ROUTERS[2]], ids)
    assert not runs.same_ids(ROUTERS[:2], ids[:2])


def test_first_outside_names_the_run():
    runs = Runs(ROUTERS[:3], [np.array([1, 999]), np.array([3, 50]), np.array([0])])
    assert runs.first_outside([1000, 50, 1000]) == 1
    assert runs.first_outside([1000, 51, 1000]) is None
    assert Runs(ROUTERS[:1], [np.array([-1])]).first_outside([10]) == 0
    assert Runs([], []).first_outside([]) is None


def test_unsigned_ids_stay_integers():
    runs = Runs(ROUTERS[:2], [np.array([3, 5], np.uint64), np.array([7], np.int32)])
    assert runs.ids.dtype == np.int64 and runs.ids.tolist() == [3, 5, 7]


def test_hashed_keys_are_not_range_checked_and_do_not_hide_other_runs():
    """A reviewer's finding: a negative key of a keyed table was flagged as out of range, and
    only the first flagged run was looked at, so a bad id of a later fixed table went unchecked."""
    runs = Runs([ShardRouter(4), ShardRouter(2, 10, "range")],
                [np.array([-5, 2**62]), np.array([1, 12])])
    assert runs.first_outside([None, 10]) == 1
    assert Runs([ShardRouter(4)], [np.array([-5])]).first_outside([None]) is None


def test_every_run_empty():
    """A push of no rows to every table (a step that touched none) plans empty pushes."""
    runs = Runs(ROUTERS[:3], [np.empty(0, np.int64)] * 3)
    for p, plan in zip(ROUTERS, runs.push_routings()):
        assert len(plan.ids) == 0 and list(plan.offsets) == [0] * (p.shard_count + 1)


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("bound", [1, 7, 256, 257, 70_000, 1 << 31])
def test_fast_orders_equal_numpys_stable_sorts(seed, bound):
    """stable_order and grouped_order are the argsort/lexsort they replace, ties included
    (the order of equal ids decides the order in which duplicate gradients are summed)."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 300))
    keys = rng.integers(0, bound, n)
    for ids in (rng.integers(0, 50, n), rng.integers(0, 1 << 40, n),
                rng.integers(-2**62, 2**62, n), rng.permutation(n)):
        ids = ids.astype(np.int64)
        np.testing.assert_array_equal(grouped_order(keys, bound, ids),
                                      np.lexsort((ids, keys)))
    # keys past `bound` (a range router's shards of unchecked ids), a numpy bound
    wild = rng.integers(0, 1 << 40, n)
    np.testing.assert_array_equal(grouped_order(wild, np.int64(bound), keys),
                                  np.lexsort((keys, wild)))
    np.testing.assert_array_equal(stable_order(keys, bound), np.argsort(keys, kind="stable"))


@pytest.mark.parametrize("seed", range(20))
def test_sum_runs_adds_each_run_of_a_slice_of_the_layout(seed):
    """Runs of every length, short (summed position by position) and long (reduceat), in
    any slice of a push's layout: the sums of the rows in `order`, to float32's rounding."""
    rng = np.random.default_rng(seed)
    counts = rng.choice([1, 1, 1, 2, 3, SHORT_RUN, SHORT_RUN + 1, 40], int(rng.integers(0, 60)))
    n = int(counts.sum())
    values = rng.standard_normal((n, int(rng.integers(1, 9)))).astype(np.float32)
    order = rng.permutation(n)
    starts = np.cumsum(counts) - counts
    lo = int(rng.integers(0, len(counts) + 1))
    hi = int(rng.integers(lo, len(counts) + 1))
    end = int(starts[hi]) if hi < len(counts) else n
    out = np.full((hi - lo, values.shape[1]), np.nan, np.float32)
    sum_runs(values, order, starts[lo:hi], end, out)
    expected = [values[order[a:a + c]].astype(np.float64).sum(axis=0)
                for a, c in zip(starts[lo:hi], counts[lo:hi])]
    np.testing.assert_allclose(out, np.reshape(expected, out.shape), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("expect_push", [False, True])
def test_a_pulls_layout_puts_every_id_in_its_shard(seed, expect_push):
    """A pull's layout (client.many._pull_layout): every id once, in its shard's slice; by
    the push routing (ids sorted within a shard) only when a push of the same ids follows."""
    from parallax.client.many import _pull_layout
    rng = np.random.default_rng(seed)
    ids = _runs(rng, duplicates=False)
    runs = Runs(ROUTERS, ids)
    runs.expect_push = expect_push
    for k, (p, run) in enumerate(zip(ROUTERS, ids)):
        order, offsets, grouped = _pull_layout(runs, k)
        np.testing.assert_array_equal(grouped, run if order is None else run[order])
        assert sorted(grouped.tolist()) == sorted(run.tolist())
        owner = p.shard_of(grouped)
        for s in range(p.shard_count):
            assert (owner[offsets[s]:offsets[s + 1]] == s).all()
            if expect_push and p.shard_count > 1:
                part = grouped[offsets[s]:offsets[s + 1]]
                assert (np.diff(part) > 0).all()
    assert (runs._routings is not None) == (expect_push and any(p.shard_count > 1
                                                              for p in ROUTERS))


def test_one_64_bit_hash_in_the_tree():
    """splitmix64 is written once in Python (`routing.finalise64`, and `mix64` over it) and
    once in the compiled kernels, which mirror it: its known first output from seed 0, and
    no other module spelling its multipliers."""
    from pathlib import Path

    from parallax.protocol.routing import finalise64, mix64
    assert mix64(np.array([0], np.uint64))[0] == 0xE220A8397B1DCDAF  # splitmix64(0)'s first
    assert finalise64(np.uint64(0x9E3779B97F4A7C15)) == 0xE220A8397B1DCDAF
    root = Path(__file__).resolve().parents[2]
    spelled = sorted(str(p.relative_to(root)) for top in ("parallax", "servers")
                     for p in (root / top).rglob("*") if p.suffix in (".py", ".h", ".cc")
                     and "bf58476d1ce4e5b9" in p.read_text().lower())
    assert spelled == ["parallax/native/src/hash64.h", "parallax/protocol/routing.py"]
