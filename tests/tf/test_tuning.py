"""The partition search's schedule, settings and saved decisions (pure functions), and the
search in a real one-worker job: it samples, decides, saves, and the next run starts there."""
from __future__ import annotations

import json
import time

import keras
import numpy as np
import pytest

import parallax
from parallax.errors import ConfigError
from parallax.placement import tuning
from parallax.placement.planner import Measurement
from parallax.placement.plan import PlacementOptions, VariableInfo, make_plan
from parallax.placement.tuning import PartitionSearch, next_uniform, sweep_counts

ROWS = {"a": 1000, "b": 3}


def _measure(counts, cost):
    return Measurement(counts=counts, step_seconds=cost(counts))


def _run_sweep(config, cost, start):
    """Measure like the tuner: the start, then each proposal, until the sweep ends."""
    measured = [_measure(start, cost)]
    while (counts := next_uniform(config, ROWS, measured)) is not None:
        measured.append(_measure(counts, cost))
    return measured


def test_sweep_stops_once_the_step_time_climbs_past_the_minimum():
    # t(n) = 8/n + n: minimum at n = 2 or 4 (6.0 each); 8 is 9.0 > 1.1 x 6.0: stop there.
    cost = lambda counts: 8 / counts["a"] + counts["a"]  # noqa: E731
    measured = _run_sweep(PartitionSearch(max_samples=10), cost, {"a": 2, "b": 2})
    assert [m.counts["a"] for m in measured] == [2, 1, 4, 8]
    assert [m.counts["b"] for m in measured] == [2, 1, 3, 3]  # capped by its 3 rows


def test_sweep_respects_bounds_and_keeps_a_sample_for_the_model():
    config = PartitionSearch(min_shards=3, max_shards=20, max_samples=4)
    assert sweep_counts(config) == [3, 4, 8, 16]
    measured = _run_sweep(config, lambda counts: 1.0, {"a": 1, "b": 1})
    assert len(measured) == 3  # the start plus two sweep points: one left for the model
    assert [m.counts["a"] for m in measured] == [1, 3, 4]


@pytest.mark.parametrize("field,value,match", [
    ("min_shards", 0, "min_shards must be an int >= 1"),
    ("max_shards", 2, "max_shards 2 is below min_shards 4"),
    ("stop_ratio", 1.0, "stop_ratio must be > 1"),
    ("confirm_ratio", 0.9, "confirm_ratio must be > 1"),
    ("steps_per_sample", 1.5, "steps_per_sample must be an int"),
])
def test_bad_settings_are_named(field, value, match):
    kwargs = {"min_shards": 4} if field == "max_shards" else {}
    with pytest.raises(ConfigError, match=match):
        PartitionSearch(**{**kwargs, field: value})
    with pytest.raises(ConfigError, match="search_partitions must be"):
        tuning.check_setting("yes")


def _plan(workers=2, **config):
    infos = [VariableInfo(0, "emb", (1000, 8), "float32", True, "gather", "IndexedSlices"),
             VariableInfo(1, "dense", (8, 1), "float32", False, "matmul", "Tensor")]
    options = PlacementOptions(**config)
    return make_plan(options, infos, run_id="r", num_servers=2, num_workers=workers), options


def test_auto_searches_with_several_workers_and_no_fixed_counts():
    assert tuning.resolve("auto", *_plan(workers=2)) == PartitionSearch()
    assert tuning.resolve("auto", *_plan(workers=1)) is None
    assert tuning.resolve("auto", *_plan(workers=4, shards=2)) is None
    assert tuning.resolve(True, *_plan(workers=1)) == PartitionSearch()
    assert tuning.resolve(False, *_plan(workers=4)) is None
    assert tuning.resolve("auto", *_plan(workers=4, mode="allreduce")) is None  # no tables


def test_decisions_are_saved_per_job_and_bad_files_are_ignored(tmp_path, capsys):
    config = PartitionSearch(cache_dir=str(tmp_path))
    plan, _ = _plan()
    assert tuning.load_decision(config, plan) is None
    saved = tuning.with_layouts(plan, {"emb": (1, 0, 1)})
    path = tuning.save_decision(config, saved, {"chosen": {"emb": 3}})
    capsys.readouterr()
    loaded = tuning.load_decision(config, plan)
    assert loaded["layouts"] == {"emb": (1, 0, 1)} and loaded["report"]["chosen"] == {"emb": 3}
    assert (f"partition decision loaded from {path} (shard counts emb 3): the search is "
            f"skipped") in capsys.readouterr().err  # applied with a word, not silently
    other, _ = _plan(workers=3)  # another cluster shape: another decision
    assert tuning.load_decision(config, other) is None
    path.write_text(json.dumps({"layouts": {"emb": [0, 7]}}))  # server 7 does not exist
    assert tuning.load_decision(config, plan) is None
    path.write_text("{not json")
    assert tuning.load_decision(config, plan) is None
    assert "parallax: WARNING: ignoring the saved partition decision" in capsys.readouterr().err
    assert PartitionSearch(cache_dir="").cache_root() is None


def _job(cluster, search, run_id):
    """(strategy, model) after one epoch of Keras fit on a 500-row table."""
    strategy = parallax.ParallaxStrategy(ps_addresses=cluster.addresses, run_id=run_id,
                                         log_plan=False, search_partitions=search)
    with strategy.scope():
        keras.utils.set_random_seed(5)
        inputs = keras.Input((3,), dtype="int64")
        h = keras.layers.Embedding(500, 4, name="table")(inputs)
        model = keras.Model(inputs, keras.layers.Dense(1, name="out")(keras.layers.Flatten()(h)),
                            name="tuned")
        model.compile(optimizer=keras.optimizers.Adagrad(0.1), loss="mse")
    rng = np.random.default_rng(0)
    ids = np.minimum(rng.zipf(1.3, (480, 3)), 499)
    model.fit(ids, rng.normal(size=(480, 1)), batch_size=16, epochs=1, verbose=0,
              shuffle=False)
    return strategy, model


def test_a_search_decides_saves_and_the_next_run_starts_from_its_decision(cluster, tmp_path):
    # stop_ratio 50: the model's forecasts never end the sweep early, so it samples
    search = PartitionSearch(steps_per_sample=3, warmup_steps=1, settle_steps=2, max_shards=4,
                             stop_ratio=50.0, cache_dir=str(tmp_path))
    first, _ = _job(cluster, search, f"tune-a-{time.time_ns()}")
    report = first.partition_search.report()
    assert first.partition_search.done and not report["from_cache"]
    assert len(report["samples"]) >= 2 and report["decided_at_step"] < 30
    chosen = first.plan.get("table/embeddings")
    assert report["chosen"] == {"table/embeddings": chosen.shards}
    assert report["servers"] == {"table/embeddings": list(chosen.servers)}
    assert list(tmp_path.glob("*.json"))
    second, _ = _job(cluster, search, f"tune-b-{time.time_ns()}")
    assert second.partition_search.done and second.partition_search.report()["from_cache"]
    assert second.plan.get("table/embeddings").servers == chosen.servers


def test_the_model_skips_sweep_points_it_expects_to_be_slower(cluster):
    """A 500-row table: more shards only add requests, so after measuring the start the
    calibrated model expects 2 shards to be slower than stop_ratio allows, and the search
    ends without moving the table."""
    search = PartitionSearch(steps_per_sample=3, warmup_steps=1, settle_steps=2, cache_dir="")
    strategy, _ = _job(cluster, search, f"tune-s-{time.time_ns()}")
    report = strategy.partition_search.report()
    assert len(report["samples"]) == 1 and report["moves"][-1]["tables"] == 0
    (skipped,) = report["skipped"]
    assert skipped["counts"] == {"table/embeddings": 2}
    assert skipped["predicted_step_seconds"] > 1.1 * report["chosen_step_seconds"]


def test_reshard_errors_name_the_table_and_the_fix(cluster):
    strategy, _ = _job(cluster, False, f"tune-c-{time.time_ns()}")
    name = "table/embeddings"
    with pytest.raises(ConfigError, match="'nope': it is not a table"):
        strategy.reshard({"nope": 2})
    with pytest.raises(ConfigError, match=f"cannot give '{name}' 501 shards: it has 500 rows"):
        strategy.reshard(501)
    with pytest.raises(ConfigError, match="2 shards but 3 servers given"):
        strategy.reshard({name: 2}, servers={name: [0, 1, 1]})
    with pytest.raises(ConfigError, match="on server 5: the job has servers 0 to 1"):
        strategy.reshard({name: 2}, servers={name: [0, 5]})
    before = strategy.tables[name].pull_all_rows()
    report = strategy.reshard({name: 3})
    assert report.tables == (name,) and strategy.plan.get(name).shards == 3
    np.testing.assert_array_equal(strategy.tables[name].pull_all_rows(), before)
    assert strategy.reshard({name: 3}).tables == ()  # already so: nothing moves


def test_going_back_to_the_kept_table_copies_only_what_changed(cluster):
    """keep_previous (how the search samples): the table moved from is kept; going back to
    its layout copies only the rows training wrote since, and every row, slot and the step
    are then exactly what training on the new table produced; the table left is kept in
    turn, so going forward again is as cheap."""
    from parallax.tf.state.resharding import Layout
    strategy, keras_model = _job(cluster, False, f"tune-r-{time.time_ns()}")
    extended, name = strategy.extended, "table/embeddings"
    table = strategy.tables[name]
    start = strategy.plan.get(name)
    first = extended.reshard({name: Layout((1, 0, 1))}, keep_previous=True)
    assert first.rows == 500  # every row was streamed: the whole table moves
    ids = np.array([[1, 2, 3], [3, 4, 5]])
    keras_model.train_on_batch(ids, np.ones((2, 1)))
    trained = table.pull_all_rows()
    back = extended.reshard({name: Layout(start.servers)}, keep_previous=True)
    assert 0 < back.rows <= 6  # the rows the batch touched, not the table
    assert strategy.plan.get(name).table == start.table  # the kept table, caught up
    np.testing.assert_array_equal(table.pull_all_rows(), trained)
    keras_model.train_on_batch(ids, np.ones((2, 1)))  # and training goes on there
    trained = table.pull_all_rows()
    again = extended.reshard({name: Layout((1, 0, 1))}, keep_previous=True)  # kept in turn
    assert 0 < again.rows <= 6
    np.testing.assert_array_equal(table.pull_all_rows(), trained)
    extended.release_previous()
    assert not extended._resharder.previous
    held = {t.table for r in extended._binder.client.stats().values() for t in r.tables}
    assert start.table not in held and strategy.plan.get(name).table in held
