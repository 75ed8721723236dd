"""The worker's compiled data path (parallax.client.native_many) against the numpy path: the
same ids and gradients through both give the same request bytes, byte for byte, and the
same rows, bit for bit, against real servers on loopback."""
from __future__ import annotations

import numpy as np
import pytest

from parallax import native
from parallax.client import ClientOptions, PSClient, native_many
from parallax.client.many import (_checked_runs, pull_many, pull_parts, pull_requests,
                                  push_parts, push_requests, start_push_many)
from parallax.env import NATIVE_ENV
from parallax.protocol.packed_codec import PULL_ANSWER_PART
from parallax.protocol.routing import Runs, ShardRouter
from parallax.protocol.specs import SGD, Initializer, TableSpec
from parallax.protocol.wire_dtypes import WireOverflowError

pytestmark = pytest.mark.skipif(native.kernels() is None,
                                reason=f"compiled kernels not in use: {native.describe()}")

# (suffix, spec fields, placement): one to three shards, MOD, RANGE, keyed tables, dim 1,
# both compressed wire dtypes; every table float32 (the kernels' rows)
LAYOUTS = [
    ("one", dict(shard_count=1, dim=4), [1]),
    ("range2", dict(shard_count=2, dim=3, partition="range", vocabulary_size=500), [1, 0]),
    ("mod3", dict(shard_count=3, dim=8, vocabulary_size=777), [1, 1, 0]),
    ("hashed", dict(hashed_keys=True, vocabulary_size=0, shard_count=2, dim=5), None),
    ("dim1", dict(shard_count=2, dim=1, vocabulary_size=300), [0, 0]),
    ("f16", dict(shard_count=2, dim=6, wire_dtype="float16"), None),
    ("bf16", dict(shard_count=3, dim=2, wire_dtype="bfloat16", partition="range"), None),
]


@pytest.fixture
def tables(client, table_name):
    base = dict(vocabulary_size=1000, dim=4, shard_count=2,
                initializer=Initializer("uniform", seed=3), optimizer=SGD(learning_rate=0.5))
    return [client.create_table(TableSpec(name=f"{table_name}_{suffix}", **{**base, **kw}),
                                placement) for suffix, kw, placement in LAYOUTS]


def _ids(table, rng, n: int, unique: bool) -> np.ndarray:
    if table.spec.hashed_keys:
        keys = rng.choice(2**40, size=max(1, n), replace=False) - 2**39  # negative keys too
        return keys[:n] if unique else rng.choice(keys[:max(1, n // 3)], size=n)
    vocab = table.spec.vocabulary_size
    return rng.choice(vocab, size=min(n, vocab), replace=False) if unique else \
        rng.zipf(1.3, size=n) % vocab  # long runs of a few ids


def _python(monkeypatch):
    monkeypatch.setenv(NATIVE_ENV, "0")


def test_the_compiled_route_is_numpys():
    rng = np.random.default_rng(1)
    routers = [ShardRouter(1, 100), ShardRouter(2, 500, "range"), ShardRouter(3, 777),
               ShardRouter(2, 0), ShardRouter(3, 90, "range"), ShardRouter(4, 10)]
    for trial in range(50):
        ids = [rng.integers(-2**40, 2**40, rng.integers(0, 40)) if p.hashed else
               rng.integers(0, p.vocabulary_size, rng.integers(0, 40)) for p in routers]
        compiled = Runs(routers, ids).flat_routing(native.kernels().route)
        for mine, numpys in zip(compiled, Runs(routers, ids).flat_routing()):
            np.testing.assert_array_equal(mine, numpys, err_msg=f"trial {trial}")


def test_a_groups_ids_join_as_numpy_joins_them():
    """parallax.client.step._table_ids: members' ids plus their offsets, and the first bad member."""
    rng = np.random.default_rng(2)
    rows = np.array([50, 7, 300, 1])
    offsets = np.cumsum(rows) - rows
    for trial in range(30):
        ids = [rng.integers(0, r + (trial % 3 == 0), rng.integers(0, 20)) for r in rows]
        joined, bad = native.kernels().join_ids(ids, rows, offsets)
        np.testing.assert_array_equal(joined, np.concatenate(ids) + np.repeat(
            offsets, [len(i) for i in ids]))
        outside = [k for k, (i, r) in enumerate(zip(ids, rows)) if len(i) and i.max() >= r]
        assert bad == (outside[0] if outside else -1)


@pytest.mark.parametrize("expect_push", [True, False])
def test_pull_requests_are_byte_for_byte_numpys(tables, expect_push):
    rng = np.random.default_rng(7)
    for n, min_step in ((40, 0), (0, 2), (1, 0), (200, 5)):
        ids = [_ids(t, rng, n, unique=True) for t in tables]
        steps = [min_step if k % 2 else 0 for k in range(len(tables))]
        runs, again = _checked_runs(tables, ids), _checked_runs(tables, ids)
        runs.expect_push = again.expect_push = expect_push
        _, _, compiled = native_many.pull_requests(tables, runs, steps)
        orders, grouped, parts = pull_parts(tables, again, steps)
        waits, numpys = pull_requests(tables, grouped, parts, steps)
        assert not waits
        assert [(c, r.packed()) for c, _, r in compiled] == \
            [(c, r.packed()) for c, _, r in numpys]


def test_pulled_rows_are_bit_for_bit_numpys(tables, monkeypatch):
    rng = np.random.default_rng(3)
    ids = [_ids(t, rng, 60, unique=True) for t in tables]
    before = native_many.ran["pull"]
    compiled = pull_many(tables, ids, [0] * len(tables))
    assert native_many.ran["pull"] == before + 1
    _python(monkeypatch)
    numpys = pull_many(tables, ids, [0] * len(tables))
    assert native_many.ran["pull"] == before + 1
    for mine, theirs in zip(compiled, numpys):
        assert mine.dtype == theirs.dtype and mine.shape == theirs.shape
        assert mine.tobytes() == theirs.tobytes()


def _grads(tables, ids, rng) -> list[np.ndarray]:
    """Gradients of every magnitude: float16 subnormals and underflow, ties, Inf, NaN."""
    out = []
    for t, i in zip(tables, ids):
        g = rng.normal(size=(len(i), t.spec.dim)) * 10.0 ** rng.integers(-9, 4, (len(i), 1))
        g = g.astype(np.float32)
        if g.size > 3:
            g.flat[:3] = [np.inf, np.nan, -np.float32(2.0 ** -24 * 1.5)]
        out.append(g)
    return out


def test_push_requests_are_byte_for_byte_numpys(tables):
    rng = np.random.default_rng(11)
    for n in (0, 1, 30, 700):  # 700 zipf ids: runs longer than 8 and 128 (pairwise sums)
        ids = [_ids(t, rng, n, unique=False) for t in tables]
        grads = _grads(tables, ids, rng)
        steps, rates = list(range(len(tables))), [0.5 * k for k in range(len(tables))]
        runs, again = _checked_runs(tables, ids), _checked_runs(tables, ids)
        compiled = native_many.push_requests(tables, runs, grads, steps, 3, rates)
        plans, narrow, parts = push_parts(tables, again, grads)
        numpys = push_requests(tables, plans, (grads, narrow), parts, steps, 3, rates, True)
        assert [(c, r.packed()) for c, _, r in compiled] == \
            [(c, r.packed()) for c, _, r in numpys]


def test_a_gradient_beyond_its_wire_dtype_is_refused_as_numpy_refuses_it(tables):
    ids = [np.arange(3) for _ in tables]
    grads = [np.ones((3, t.spec.dim), np.float32) * (1e6 if t.name.endswith("f16") else 1)
             for t in tables]
    before = native_many.ran["push"]
    with pytest.raises(WireOverflowError, match="f16'.*1e\\+06.*float16"):
        start_push_many(tables, ids, grads, [0] * len(tables), 0, [0.0] * len(tables))
    assert native_many.ran["push"] == before


def test_an_answer_that_is_not_what_was_asked_is_left_to_numpy():
    kernels = native.kernels()
    rows = np.full(8, 7.0, np.float32)
    record = np.zeros(1, PULL_ANSWER_PART)
    record["count"], record["dim"], record["dtype"] = 2, 4, 1  # two float32 rows of 4
    body = np.array([1, 0], "<u4").tobytes() + record.tobytes() + bytes(8) + \
        np.arange(8, dtype=np.float32).tobytes()
    args = (np.array([[0, 0, 2]]), np.arange(2), np.array([0, 2]), np.array([4]),
            np.array([0]), rows, np.zeros(65536, np.float32), np.array([1, 3, 6]))
    assert kernels.pull_scatter(body, *args)
    np.testing.assert_array_equal(rows, np.arange(8))
    rows[:] = 7.0
    wrong_count = body[:16] + bytes(8) + body[24:]  # the record's count: 0 rows
    wrong_dtype = body[:32] + np.int64(9).tobytes() + body[40:]
    for bad in (body[:-4], body + bytes(16), wrong_count, wrong_dtype):
        assert not kernels.pull_scatter(bad, *args)
        assert (rows == 7.0).all()  # nothing written


def test_a_training_step_pulls_and_pushes_natively_with_numpys_rows(cluster, table_name,
                                                                     monkeypatch):
    """Two clients train the same two tables' twins, one per path: every row ends equal."""
    results = []
    for path in ("1", "0"):
        monkeypatch.setenv(NATIVE_ENV, path)
        with PSClient(cluster.addresses, ClientOptions(timeout=20)) as client:
            specs = [TableSpec(name=f"{table_name}_{path}_{k}", vocabulary_size=300, dim=4,
                               shard_count=2, wire_dtype=wire,
                               initializer=Initializer("uniform", seed=5),
                               optimizer=SGD(learning_rate=0.5))
                     for k, wire in enumerate(("", "bfloat16"))]
            tabs = [client.create_table(s) for s in specs]
            rng = np.random.default_rng(5)
            for step in range(3):
                ids = [rng.integers(0, 300, 50) for _ in tabs]
                pull_many(tabs, [np.unique(i) for i in ids], [step, step])
                grads = [rng.normal(size=(50, 4)).astype(np.float32) for _ in tabs]
                start_push_many(tabs, ids, grads, [step, step], 0, [0.0, 0.0]).result()
            results.append(pull_many(tabs, [np.arange(300)] * 2, [3, 3]))
    for mine, numpys in zip(*results):
        assert mine.tobytes() == numpys.tobytes()


def test_answers_over_grpc_land_through_the_numpy_scatter(cluster, client, tables,
                                                          monkeypatch):
    """Without the data plane the answers come decoded (gRPC): the compiled requests' rows
    land through the numpy path's scatter, in the compiled layout, as numpy's own."""
    rng = np.random.default_rng(9)
    ids = [_ids(t, rng, 40, unique=True) for t in tables]
    with PSClient(cluster.addresses, ClientOptions(timeout=20, data_plane=False)) as grpc_only:
        again = [grpc_only.table(t.spec, [client.servers.index(c) for c in t.shards])
                 for t in tables]
        runs = _checked_runs(again, ids)
        runs.expect_push = True  # the compiled layout (a push routing), not numpy's
        before = native_many.ran["pull"]
        compiled = pull_many(again, ids, [0] * len(again), checked=runs)
        assert native_many.ran["pull"] == before + 1
    _python(monkeypatch)
    for mine, numpys in zip(compiled, pull_many(tables, ids, [0] * len(tables))):
        assert mine.tobytes() == numpys.tobytes()
