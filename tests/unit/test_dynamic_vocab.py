"""Dynamic tables in process (unit tier): admission, eviction order, TTL, the bound,
dropped gradients, undo, and the spec's validation. Real servers: test_dynamic_server.py."""
from __future__ import annotations

import numpy as np
import pytest

from parallax.errors import ConfigError
from parallax.protocol.initial_values import initial_rows
from parallax.protocol.specs import SGD, Initializer, TableSpec
from parallax_ps.admission import SKETCH_BYTES, Sketch, draws
from parallax_ps.budget import MemoryBudget
from parallax_ps.errors import RequestError
from parallax_ps.shard import TableShard

DIM = 2


def _spec(**kw) -> TableSpec:
    base = dict(name="t", dim=DIM, hashed_keys=True, optimizer=SGD(1.0),
                initializer=Initializer("uniform", minval=-1, maxval=1, seed=3))
    return TableSpec(**{**base, **kw})


def _push(shard: TableShard, keys, step: int, worker: int = 0, value: float = 1.0) -> None:
    keys = np.asarray(keys, dtype=np.int64)
    shard.push(step, worker, keys, np.full((len(keys), DIM), value, np.float32), 0.0)


def _held(shard: TableShard) -> list[int]:
    return sorted(shard.storage.row_ids().tolist())


def test_admission_after_k_sightings():
    shard = TableShard(_spec(admit_after=3), 0)
    for step in range(2):
        _push(shard, [7, 8], step)
        assert _held(shard) == []
    assert shard.vocab.counters.dropped_gradients == 4
    _push(shard, [7], 2)  # third sighting of 7: admitted, its gradient applied
    assert _held(shard) == [7]
    start = initial_rows(shard.spec.initializer, np.array([7]), DIM, "float32")
    np.testing.assert_allclose(shard.pull(np.array([7]), 0, None)[0], start - 1)
    assert shard.vocab.counters.admitted == 1


def test_unadmitted_pull_answers_the_initial_row_and_creates_nothing():
    shard = TableShard(_spec(admit_after=2), 0)
    keys = np.array([5, -9, 2**40])
    rows, _ = shard.pull(keys, 0, None)
    np.testing.assert_array_equal(rows, initial_rows(shard.spec.initializer, keys, DIM,
                                                     "float32"))
    assert _held(shard) == [] and shard.vocab.counters.default_rows == 3


def test_probability_admission_is_deterministic_and_near_its_rate():
    keys = np.arange(20_000)
    first = [TableShard(_spec(admit_probability=0.25), 0) for _ in range(2)]
    for shard in first:
        _push(shard, keys, 0)
    assert _held(first[0]) == _held(first[1])
    assert 0.23 < len(_held(first[0])) / len(keys) < 0.27
    np.testing.assert_array_equal(draws(keys, np.ones_like(keys)),
                                  draws(keys, np.ones_like(keys)))


def test_sketch_is_fixed_size_and_undo_exact():
    sketch = Sketch(_spec(admit_after=2))
    assert sketch.counts.nbytes == SKETCH_BYTES
    keys = np.arange(100_000)
    sketch.add(keys)
    assert (sketch.estimate(keys) >= 1).all()
    sketch.add(keys, sign=-1)
    assert not sketch.counts.any()


def test_lru_evicts_the_least_recently_used_ties_by_key():
    shard = TableShard(_spec(max_rows_per_shard=3, eviction="lru"), 0)
    _push(shard, [1, 2, 3], 0)
    _push(shard, [1], 1)
    _push(shard, [4, 5], 2)  # 2 and 3 (last used at 0; tie: 2 first) make room
    assert _held(shard) == [1, 4, 5]
    _push(shard, [6], 3)  # 1 (step 1) is now the oldest
    assert _held(shard) == [4, 5, 6]
    assert shard.vocab.counters.evicted_capacity == 3


def test_lfu_evicts_the_least_frequently_used():
    shard = TableShard(_spec(max_rows_per_shard=3, eviction="lfu"), 0)
    _push(shard, [1, 2, 3], 0)
    _push(shard, [3, 1], 1)
    _push(shard, [3], 2)
    _push(shard, [9], 3)  # uses 1:2, 2:1, 3:3: 2 goes
    assert _held(shard) == [1, 3, 9]


def test_an_update_larger_than_the_bound_keeps_it():
    shard = TableShard(_spec(max_rows_per_shard=4, eviction="lru"), 0)
    _push(shard, np.arange(10), 0)
    assert _held(shard) == [0, 1, 2, 3]
    assert shard.vocab.counters.dropped_gradients == 6


def test_without_eviction_a_full_table_refuses_and_changes_nothing():
    shard = TableShard(_spec(max_rows_per_shard=2, admit_after=1, ttl_steps=5), 0)
    _push(shard, [1, 2], 0)
    with pytest.raises(RequestError, match="eviction='lru'"):
        _push(shard, [3], 1)
    assert _held(shard) == [1, 2] and shard.steps.step == 1


def test_ttl_evicts_rows_unused_for_ttl_steps():
    shard = TableShard(_spec(ttl_steps=2), 0)
    _push(shard, [1, 2], 0)
    _push(shard, [2], 1)
    assert _held(shard) == [1, 2]
    _push(shard, [], 2)  # 1 unused since step 0: 2 steps
    assert _held(shard) == [2]
    assert shard.vocab.counters.evicted_ttl == 1


def test_a_re_admitted_key_starts_from_its_initial_value():
    shard = TableShard(_spec(max_rows_per_shard=1, eviction="lru"), 0)
    _push(shard, [1], 0)
    _push(shard, [2], 1)
    _push(shard, [1], 2, value=0.0)
    start = initial_rows(shard.spec.initializer, np.array([1]), DIM, "float32")
    np.testing.assert_allclose(shard.pull(np.array([1]), 0, None)[0], start)


def test_sync_eviction_spares_the_open_step_and_the_bound_holds():
    shard = TableShard(_spec(max_rows_per_shard=8, eviction="lru", num_workers=2), 0)
    rng = np.random.default_rng(0)
    for step in range(30):
        for worker in range(2):
            keys = np.unique(rng.zipf(1.3, 6) % 50)
            _push(shard, keys, step, worker)
            assert shard.storage.num_rows <= 8
    assert shard.steps.step == 30


def test_rows_of_the_steps_buffered_pushes_are_never_evicted():
    shard = TableShard(_spec(max_rows_per_shard=2, eviction="lru", num_workers=2), 0)
    _push(shard, [1], 0, worker=0)
    _push(shard, [2], 0, worker=1)
    _push(shard, [2], 1, worker=0)
    _push(shard, [], 1, worker=1)  # 1 last used at step 0, 2 at step 1
    _push(shard, [1], 2, worker=0)  # buffered: nothing decided yet
    assert _held(shard) == [1, 2] and shard.steps.step == 2
    _push(shard, [3], 2, worker=1)  # room for 3: not 1 (the step's own), 2 goes
    assert _held(shard) == [1, 3]


def test_undo_takes_back_admission_and_eviction_exactly():
    shard = TableShard(_spec(max_rows_per_shard=3, eviction="lru", admit_after=2), 0)
    for step in range(3):
        _push(shard, [1, 2, 3], step)
    ids = np.array([4, 5], dtype=np.int64)
    _push(shard, ids, 3)  # first sighting: dropped

    def state():
        keys = shard.storage.row_ids()
        order = np.argsort(keys)
        rows = shard.storage.find(keys[order])[0]
        return (keys[order].tolist(), shard.storage.values[rows].copy(),
                shard.storage.values[rows].copy(), shard.storage.last_used[rows].copy(),
                shard.storage.uses[rows].copy(), shard.vocab.sketch.counts.copy(),
                shard.vocab.counters.as_dict(), shard.steps.step)

    before = state()
    journal: list = []
    with shard.cond:
        shard.apply_push_held(4, 0, ids, np.ones((2, DIM), np.float32), 1.0, 0, 1, 0, journal)
        assert shard.vocab.counters.evicted_capacity == 2
        shard.undo(journal[0][1])
    after = state()
    assert after[6] == before[6] and after[7] == before[7]  # counters, step
    for mine, theirs in zip(after[:6], before[:6]):
        np.testing.assert_array_equal(mine, theirs)


def test_the_sketch_is_claimed_at_creation():
    budget = MemoryBudget(10 * SKETCH_BYTES)
    TableShard(_spec(admit_after=2), 0, budget)
    assert budget._total >= SKETCH_BYTES
    with pytest.raises(RequestError, match="RESOURCE|memory|MiB"):
        TableShard(_spec(admit_after=2), 0, MemoryBudget(SKETCH_BYTES // 2))


@pytest.mark.parametrize("fields, words", [
    (dict(admit_after=-1), "admit_after must be an int >= 0"),
    (dict(admit_probability=0.0), "admit_probability must be in (0, 1]"),
    (dict(admit_probability=1.5), "admit_probability must be in (0, 1]"),
    (dict(eviction="fifo"), "eviction 'fifo' is not supported"),
    (dict(eviction="lru"), "max_rows_per_shard is 0"),
    (dict(ttl_steps=-2), "ttl_steps must be an int >= 0"),
    (dict(hashed_keys=False, vocabulary_size=10, admit_after=2),
     "keyed tables (hashed_keys=True) only"),
])
def test_spec_validation_names_the_value_and_the_fix(fields, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        _spec(**fields)


def test_spec_round_trips_through_the_proto():
    spec = _spec(admit_after=3, admit_probability=0.5, eviction="lfu", ttl_steps=4,
                 max_rows_per_shard=9)
    assert TableSpec.from_proto(spec.to_proto()) == spec
    assert TableSpec.from_proto(_spec().to_proto()) == _spec()


def test_eviction_keeps_the_memory_claim_within_the_bound():
    budget = MemoryBudget(1 << 30)
    shard = TableShard(_spec(max_rows_per_shard=3000, eviction="lru"), 0, budget)
    for step in range(12):
        _push(shard, np.arange(step * 1000, step * 1000 + 1000), step)
        assert shard.storage.num_rows <= 3000
        assert budget._total <= shard.storage.bytes_at(3000, 3000)
    assert len(shard.storage.values) <= 3000


def test_admission_only_tables_skip_the_eviction_pass():
    shard = TableShard(_spec(admit_after=2), 0)
    for step in range(3):
        _push(shard, np.arange(100), step)
    assert shard.storage.num_rows == 100 and shard.vocab.counters.admitted == 100
