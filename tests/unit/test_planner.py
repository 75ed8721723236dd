"""The shard-count tuner (parallax.placement.planner): pure Python, no servers, no
TensorFlow."""
from __future__ import annotations

import math
import time

import numpy as np
import pytest

from parallax.errors import ConfigError
from parallax.placement.planner import (ClusterProfile, CostPrior, GreedyProposer, GridProposer,
                                        Measurement, ModelFitProposer, PartitionPlan,
                                        PartitionPlanner, PlannerError, ServerLoadEstimator,
                                        ShardCountEnumerator,
                                        StepTimeEstimator, TableCost, TablePlacement,
                                        TableProfile, bytes_per_shard, fit_report, place,
                                        prior_cost, requests_per_step, shard_access_shares,
                                        shard_bytes)
from parallax.placement.planner.planners import grid
from parallax.placement.plan import VariablePlan, place_shards

GiB = 2**30
# Known per-table costs: A is cheapest whole (1 shard), B at 8 shards (sqrt(b / a) = 8).
TRUTH = {"A": TableCost(fixed=0.002, per_shard=0.002, divisible=0.001),
         "B": TableCost(fixed=0.003, per_shard=0.01, divisible=0.64)}
TABLES = (TableProfile("A", 10_000, 16, 10_000 * 16 * 12, unique_rows_per_step=200),
          TableProfile("B", 1_000_000, 64, 1_000_000 * 64 * 12, unique_rows_per_step=50_000))
WIDE = ClusterProfile(num_servers=16, num_workers=4)  # 16 servers: b/n holds up to 16 shards
ENUM = ShardCountEnumerator(max_shards=16)            # candidates 1, 2, 4, 8, 16


def _noise(k: int) -> float:
    return 1 + 0.01 * math.sin(7 * k + 1)  # deterministic, within 1%


def _measurements(counts, per_table=True, base=0.02):
    out = []
    for k, n in enumerate(counts):
        seconds = {t: c.seconds(n) * _noise(k + j) for j, (t, c) in enumerate(TRUTH.items())}
        out.append(Measurement({t: n for t in TRUTH}, base + sum(seconds.values()),
                               seconds if per_table else {}))
    return out


def _table(name, rows=1000, dim=16, nbytes=None, unique=0.0, **kw):
    return TableProfile(name, rows, dim, rows * dim * 12 if nbytes is None else nbytes,
                        unique_rows_per_step=unique, **kw)


def _server_totals(plan, tables, cluster, what):
    """Per server, the sum of `what(table, n)[shard]` over the shards it holds."""
    totals = np.zeros(cluster.num_servers)
    for t in tables:
        p = plan.get(t.name)
        for shard, server in enumerate(p.servers):
            totals[server] += what(t, p.shards)[shard]
    return totals


def _loads(cluster):
    return lambda t, n: ServerLoadEstimator().shard_loads(t, n, cluster)


# --- value types --------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, words", [
    (dict(rows=0), "rows of table 't' must be an int >= 1"),
    (dict(hot_ids=(1, 2), hot_shares=(0.5,)), "hot_ids and hot_shares of table 't' differ"),
    (dict(hot_ids=(1, 2), hot_shares=(0.7, 0.4)), "hot_shares of table 't' sum to 1.1"),
    (dict(hot_ids=(1,), hot_shares=(1.5,)), r"hot_shares of table 't' must be in \[0, 1\]"),
    (dict(hot_ids=(5000,), hot_shares=(0.1,)), "id 5000 is not below rows=1000"),
    (dict(unique=2000.0), "unique_rows_per_step of table 't' is 2000"),
])
def test_bad_table_profiles_name_the_field_and_table(kwargs, words):
    with pytest.raises(ConfigError, match=words):
        _table("t", **kwargs)


def test_measurements_are_immutable_and_hashable():
    counts = {"A": 2}
    m = Measurement(counts, 0.1, {"A": 0.05})
    counts["A"] = 3
    assert m.counts["A"] == 2 and hash(m) == hash(Measurement({"A": 2}, 0.1, {"A": 0.05}))
    with pytest.raises(TypeError):
        m.counts["A"] = 4
    with pytest.raises(ConfigError, match="table_seconds names 'B'"):
        Measurement({"A": 1}, 0.1, {"B": 0.1})


def test_table_cost_is_the_papers_curve_capped_by_parallelism():
    cost = TRUTH["B"]
    assert cost.seconds(4) == pytest.approx(0.64 / 4 + 0.01 * 3 + 0.003)
    assert cost.best([1, 2, 4, 8, 16]) == 8 and TRUTH["A"].best([16, 4, 1, 2]) == 1
    capped = TableCost(0.0, 0.01, 0.64, parallelism=4)
    assert capped.seconds(8) == pytest.approx(0.16 + 0.07) and capped.best([1, 2, 4, 8]) == 4


def test_sharding_plan_json_round_trips():
    plan = PartitionPlan((TablePlacement("a", 2, (0, 1)), TablePlacement("b", 1, (1,))),
                        0.0123, "model-fit")
    assert PartitionPlan.from_json(plan.to_json()) == plan
    assert plan.counts() == {"a": 2, "b": 1} and plan.get("b").servers == (1,)
    assert plan.format().splitlines()[1:] == ["table  shards  servers", "a           2  0,1",
                                              "b           1  1"]


@pytest.mark.parametrize("text, words", [
    ("{not json", "must be JSON"),
    ('{"version": 1, "source": "", "estimated_step_seconds": null, "tables": '
     '[{"name": "a", "shards": "2", "servers": [0, 1]}]}', r"tables\[0\]\.shards must be int"),
    ('{"version": 1, "source": "", "estimated_step_seconds": null, "tables": '
     '[{"name": "a", "shards": 2, "servers": [0]}]}', r"tables\[0\]: servers of 'a' lists 1"),
    ('{"version": 1, "source": "", "estimated_step_seconds": null, "tables": '
     '[{"name": "a", "shards": 1, "servers": [0.5]}]}', r"tables\[0\]\.servers\[0\] must be"),
    ('{"version": 1, "estimated_step_seconds": null, "tables": []}', "source is missing"),
    ('{"version": 9, "source": "", "estimated_step_seconds": null, "tables": []}',
     "version is 9"),
])
def test_bad_plan_json_names_the_field(text, words):
    with pytest.raises(ConfigError, match=words):
        PartitionPlan.from_json(text)


# --- enumerator and the pure cost functions -----------------------------------------------

def test_candidates_are_powers_of_two_plus_the_memory_minimum_and_the_capped_maximum():
    big = _table("big", rows=1000, nbytes=20 * GiB)
    assert ShardCountEnumerator(max_shards=48).candidates(big, ClusterProfile(8, 1, 8 * GiB)) \
        == (3, 4, 8, 16, 32, 48)  # 3 shards of <= 6.7 GiB fit 8 GiB servers
    assert ShardCountEnumerator().candidates(_table("tiny", rows=5), WIDE) == (1, 2, 4, 5)
    assert ShardCountEnumerator(2, 6, powers_of_two=False).candidates(big, WIDE) == \
        (2, 3, 4, 5, 6)
    with pytest.raises(ConfigError, match="max_shards=2 is below min_shards=4"):
        ShardCountEnumerator(min_shards=4, max_shards=2)


def test_shard_sizes_and_requests():
    t = _table("t", rows=10, nbytes=1000)
    assert shard_bytes(t, 4) == (300, 300, 200, 200) and bytes_per_shard(t, 4) == 300
    assert requests_per_step({"a": 4, "b": 1}, workers=3) == 2 * 3 * 5


def test_shard_access_shares_put_hot_ids_exactly_and_the_rest_uniformly():
    t = _table("zipf", rows=1000, hot_ids=(0, 4, 1), hot_shares=(0.3, 0.1, 0.1))
    # MOD 4: ids 0 and 4 on shard 0, id 1 on shard 1; the other 997 ids share the rest, 0.5.
    expected = [0.4 + 0.5 * 248 / 997, 0.1 + 0.5 * 249 / 997, 0.5 * 250 / 997,
                0.5 * 250 / 997]
    np.testing.assert_allclose(shard_access_shares(t, 4), expected, rtol=1e-12)
    assert shard_access_shares(t, 4).sum() == pytest.approx(1.0)
    np.testing.assert_allclose(shard_access_shares(_table("flat", rows=8), 4), [0.25] * 4)


def test_the_prior_splits_a_huge_hot_table_up_to_the_servers_and_keeps_a_small_one_whole():
    cluster = ClusterProfile(num_servers=4, num_workers=4)
    small = _table("small", rows=1000, unique=100)
    huge = _table("huge", rows=10_000_000, dim=64, unique=100_000)
    options = ShardCountEnumerator().candidates(huge, cluster)
    assert prior_cost(small, cluster, CostPrior()).best(options) == 1
    assert prior_cost(huge, cluster, CostPrior()).best(options) == 4  # more buys no bandwidth
    estimator = StepTimeEstimator().calibrate((), [small, huge], cluster)
    assert estimator.estimate({"small": 1, "huge": 4}) < estimator.estimate({"small": 4,
                                                                           "huge": 1})


# --- calibration and proposers -------------------------------------------------------------

def test_per_table_fit_recovers_the_costs_and_the_planner_their_optima():
    measurements = _measurements([1, 2, 4, 16])  # 8, B's optimum, never measured
    estimator = StepTimeEstimator().calibrate(measurements, TABLES, WIDE)
    fitted = estimator.table_cost("B")
    assert fitted.divisible == pytest.approx(0.64, rel=0.05)
    assert fitted.per_shard == pytest.approx(0.01, rel=0.1)
    assert estimator.base_seconds == pytest.approx(0.02, abs=0.005)
    plan = PartitionPlanner(ENUM, estimator).plan(TABLES, WIDE, measurements)
    assert plan.counts() == {"A": 1, "B": 8}
    assert plan.estimated_step_seconds == pytest.approx(
        0.02 + TRUTH["A"].seconds(1) + TRUTH["B"].seconds(8), rel=0.05)


def test_the_fit_keeps_every_coefficient_non_negative():
    # t(n) = 0.01 (1 - 1/n): least squares alone would fit b = -0.01.
    points = [(n, 0.01 * (1 - 1 / n)) for n in (1, 2, 4, 8)]
    m = [Measurement({"A": n, "B": 1}, 1.0, {"A": t}) for n, t in points]
    cost = StepTimeEstimator().calibrate(m, TABLES, WIDE).table_cost("A")
    x = np.array([[n - 1, 1.0] for n, _ in points])
    a, c = np.linalg.lstsq(x, np.array([t for _, t in points]), rcond=None)[0]
    assert cost.divisible == 0 and (cost.per_shard, cost.fixed) == pytest.approx((a, c))


def test_one_or_two_measured_counts_scale_the_prior_through_their_mean():
    m = [Measurement({"A": 2, "B": 2}, 0.5, {"A": 0.01}), Measurement({"A": 2, "B": 2}, 0.5,
                                                                      {"A": 0.03})]
    estimator = StepTimeEstimator().calibrate(m, TABLES, WIDE)
    prior = prior_cost(TABLES[0], WIDE, CostPrior())
    cost = estimator.table_cost("A")
    assert cost.seconds(2) == pytest.approx(0.02)
    assert cost.seconds(8) / cost.seconds(1) == pytest.approx(prior.seconds(8) / prior.seconds(1))


def test_a_sweep_without_table_times_fits_the_step_curve_and_grid_finds_its_best_count():
    measurements = _measurements([1, 2, 4, 16], per_table=False)
    truth = {n: 0.02 + sum(c.seconds(n) for c in TRUTH.values()) for n in (1, 2, 4, 8, 16)}
    assert min(truth, key=truth.get) == 8
    plan = PartitionPlanner(ENUM, proposers=[grid]).plan(TABLES, WIDE, measurements)
    assert plan.counts() == {"A": 8, "B": 8} and plan.source == "grid"
    estimator = StepTimeEstimator().calibrate(measurements, TABLES, WIDE)
    assert estimator.residual() < 0.02
    curve = dict(fit_report(estimator, {t.name: ENUM.candidates(t, WIDE) for t in TABLES}))
    assert curve.keys() == truth.keys() and min(curve, key=curve.get) == 8
    for n, seconds in curve.items():
        assert seconds == pytest.approx(truth[n], rel=0.03)
    step_points = [p for p in estimator.fitted_points() if not p.table]
    assert [p.shards for p in step_points] == [1, 2, 4, 16]


def test_greedy_reaches_the_optimum_of_a_separable_convex_cost_without_trying_everything():
    costs = {"A": TRUTH["A"], "B": TRUTH["B"], "C": TableCost(0.0, 0.004, 0.064)}  # C: 4
    candidates = {t: (1, 2, 4, 8, 16, 32) for t in costs}
    proposer, tried, best = GreedyProposer(candidates), 0, (math.inf, None)
    assert proposer.propose() == {"A": 1, "B": 1, "C": 1}  # each table's smallest first
    proposer = GreedyProposer(candidates)
    while (counts := proposer.propose()) is not None:
        cost = sum(costs[t].seconds(n) for t, n in counts.items())
        proposer.feedback(counts, cost)
        tried, best = tried + 1, min(best, (cost, sorted(counts.items())))
    assert dict(best[1]) == {"A": 1, "B": 8, "C": 4}
    assert tried < 6**3 / 4
    model = ModelFitProposer(candidates, costs.__getitem__)
    assert model.propose() == {"A": 1, "B": 8, "C": 4}


def test_grid_caps_the_shared_count_to_each_tables_candidates():
    proposer = GridProposer({"small": (1, 2), "big": (4, 8, 16)})
    seen = []
    while (counts := proposer.propose()) is not None:
        seen.append(counts)
    assert seen == [{"small": 1, "big": 4}, {"small": 2, "big": 4}, {"small": 2, "big": 8},
                    {"small": 2, "big": 16}]


# --- placement ----------------------------------------------------------------------------

def test_a_hot_one_shard_table_gets_a_server_to_itself_and_loads_balance():
    cluster = ClusterProfile(num_servers=2, num_workers=4, server_memory_bytes=64 * GiB)
    hot = _table("hot", rows=100_000, dim=64, unique=5465)  # as much traffic as the 4 below
    cold = [_table(f"cold{i}", rows=10_000_000, dim=64, nbytes=5 * GiB // 2, unique=1000)
            for i in range(4)]
    tables = [hot, *cold]
    plan = place({t.name: 1 for t in tables}, tables, cluster)
    assert plan.get("hot").servers[0] not in {plan.get(t.name).servers[0] for t in cold}
    loads = _server_totals(plan, tables, cluster, _loads(cluster))
    print(f"server loads {loads * 1e3} ms/step, max/min {loads.max() / loads.min():.3f}")
    assert loads.max() / loads.min() < 1.05  # balancing bytes alone: about 3


def test_zipf_shard_zero_is_hotter_and_the_placer_pairs_it_with_a_cold_shard():
    cluster = ClusterProfile(num_servers=2, num_workers=4, server_memory_bytes=64 * GiB)
    zipf = dict(rows=1000, dim=64, unique=500, hot_ids=(0, 2), hot_shares=(0.4, 0.2))
    tables = [_table("z1", **zipf), _table("z2", **zipf)]
    shares = shard_access_shares(tables[0], 2)
    assert shares[0] > 2 * shares[1]  # ids 0 and 2 are both on shard 0
    plan = place({"z1": 2, "z2": 2}, tables, cluster)
    assert plan.get("z1").servers[0] != plan.get("z2").servers[0]
    loads = _server_totals(plan, tables, cluster, _loads(cluster))
    assert loads.max() / loads.min() < 1.01  # shard i on server i: about 2


def test_shards_of_a_table_spread_over_distinct_servers_deterministically():
    cluster = ClusterProfile(num_servers=4, num_workers=2)
    tables = [_table("a", rows=10_000, nbytes=GiB), _table("b", rows=10_000, nbytes=GiB),
              _table("c", rows=100)]
    counts = {"a": 4, "b": 6, "c": 1}
    plan = place(counts, tables, cluster)
    assert sorted(plan.get("a").servers) == [0, 1, 2, 3]
    assert sorted(set(plan.get("b").servers)) == [0, 1, 2, 3]
    assert max(plan.get("b").servers.count(s) for s in range(4)) == 2
    assert all(place(dict(counts), list(tables), cluster) == plan for _ in range(3))
    # Even when the emptier server could take both: a table's shards spread while they can.
    tables = [_table("x", rows=10_000, nbytes=8 * GiB), _table("y", rows=100)]
    two = ClusterProfile(num_servers=2, num_workers=2)
    assert sorted(place({"x": 1, "y": 2}, tables, two).get("y").servers) == [0, 1]


def test_unmeasured_tables_are_placed_whole_by_bytes_as_a_plan_places_them():
    """Nothing measured: the biggest table first, each shard onto the server with the fewest
    bytes its table does not use yet (lowest index on ties). Two big sharded tables get the
    same servers in the same order (so a plan can group them), small ones fill in."""
    cluster = ClusterProfile(num_servers=2, num_workers=4)
    tables = [_table("small", rows=100), _table("a", rows=10**6), _table("b", rows=10**6),
              _table("mid", rows=5000), _table("tiny", rows=10)]
    plan = place({"small": 1, "a": 2, "b": 2, "mid": 1, "tiny": 1}, tables, cluster)
    assert [plan.get(n).servers for n in ("a", "b", "mid", "small", "tiny")] == \
        [(0, 1), (0, 1), (0,), (1,), (1,)]
    variables = tuple(VariablePlan(index=i, name=t.name, kind="sparse", placement="ps",
                                   reason="", shape=(t.rows, t.dim), dtype="float32",
                                   bytes=t.bytes, shards=plan.get(t.name).shards)
                      for i, t in enumerate(tables))
    assert place_shards(variables, 2) == {i: plan.get(t.name).servers
                                          for i, t in enumerate(tables)}


def test_memory_is_respected_by_splitting_tables_that_do_not_pack_whole():
    cluster = ClusterProfile(num_servers=2, num_workers=2, server_memory_bytes=10 * GiB)
    tables = [_table(f"t{i}", rows=1_000_000, nbytes=6 * GiB) for i in range(3)]
    with pytest.raises(PlannerError, match=r"fits on no server(.|\n)*\n  1\. add servers"):
        place({t.name: 1 for t in tables}, tables, cluster)
    plan = PartitionPlanner(ShardCountEnumerator(max_shards=4)).plan(tables, cluster)
    used = _server_totals(plan, tables, cluster, shard_bytes)
    assert used.max() <= 10 * GiB and sum(plan.counts().values()) > 3


# --- errors -------------------------------------------------------------------------------

def test_tables_over_the_total_server_memory_raise_a_planner_error_with_numbers_and_fixes():
    cluster = ClusterProfile(num_servers=4, num_workers=2, server_memory_bytes=8 * GiB)
    tables = [_table("big", rows=10**6, nbytes=30 * GiB), _table("mid", rows=10**6,
                                                                  nbytes=10 * GiB)]
    with pytest.raises(PlannerError) as info:
        PartitionPlanner().plan(tables, cluster)
    text = str(info.value)
    assert "tables need 40.0 GiB of server memory but 4 servers have 8.0 GiB each (32.0 GiB)" \
        in text
    assert "\n  1. add servers: at least 5" in text and "\n  2. start the servers with more " \
        "memory: at least 10.0 GiB each" in text
    assert "\n  3. place the largest table, big (30.0 GiB)" in text
    assert (info.value.needed_bytes, info.value.server_memory_bytes, info.value.num_servers,
            info.value.table) == (40 * GiB, 8 * GiB, 4, "big")


def test_a_table_too_big_for_one_server_with_too_few_shards_allowed():
    cluster = ClusterProfile(num_servers=4, num_workers=2, server_memory_bytes=8 * GiB)
    table = _table("wide", rows=10**6, nbytes=20 * GiB)  # fits 32 GiB in all, not 2 servers
    with pytest.raises(PlannerError) as info:
        PartitionPlanner(ShardCountEnumerator(max_shards=2)).plan([table], cluster)
    text = str(info.value)
    assert "largest shard is 10.0 GiB but a server has 8.0 GiB" in text
    assert "\n  1. allow more shards: ShardCountEnumerator(max_shards>=3)" in text
    assert info.value.table == "wide" and info.value.shards == 2


# --- the planner: cache and time budget ----------------------------------------------------

def test_a_cache_hit_returns_the_same_plan_without_planning_again(tmp_path):
    calls = []

    def counting_grid(candidates, table_cost):
        calls.append(1)
        return GridProposer(candidates)

    planner = PartitionPlanner(ENUM, proposers=[counting_grid], cache_dir=str(tmp_path))
    first = planner.plan(TABLES, WIDE, _measurements([1, 2, 4]))
    again = planner.plan(TABLES, WIDE, _measurements([1, 2, 4]))
    assert again == first and len(calls) == 1
    [stored] = tmp_path.glob("*.json")
    assert len(stored.stem) == 64 and PartitionPlan.from_json(stored.read_text()) == first
    planner.plan(TABLES, ClusterProfile(8, 4), _measurements([1, 2, 4]))
    assert len(calls) == 2 and len(list(tmp_path.glob("*.json"))) == 2


class _Endless:
    """Proposes the same counts forever, slowly."""

    name = "endless"

    def __init__(self, candidates, table_cost):
        self.counts, self.proposed = {t: c[0] for t, c in candidates.items()}, 0

    def propose(self):
        self.proposed += 1
        time.sleep(0.005)
        return self.counts

    def feedback(self, counts, cost):
        pass


@pytest.mark.parametrize("budget", [0.0, 0.1])
def test_the_time_budget_is_respected(budget):
    made = []
    planner = PartitionPlanner(ENUM,
                               proposers=[lambda c, f: made.append(_Endless(c, f)) or made[-1]],
                               time_budget_seconds=budget)
    start = time.monotonic()
    plan = planner.plan(TABLES, WIDE)
    assert time.monotonic() - start < budget + 0.5
    assert plan.counts() == {"A": 1, "B": 1} and plan.source == "endless"
    assert made[0].proposed == 1 if budget == 0 else made[0].proposed > 1


def test_a_zero_budget_still_plans_with_the_default_proposers():
    plan = PartitionPlanner(ENUM, time_budget_seconds=0).plan(TABLES, WIDE,
                                                              _measurements([1, 2, 4, 16]))
    candidates = {t.name: ENUM.candidates(t, WIDE) for t in TABLES}
    assert all(plan.get(t).shards in candidates[t] for t in candidates)
    assert all(len(set(p.servers)) == p.shards for p in plan.tables)


def test_kept_tables_stay_where_they_are_and_count_as_load():
    from parallax.placement.planner import ClusterProfile, TableProfile, place
    tables = [TableProfile(f"t{i}", rows=1000, dim=4, bytes=(8 - i) * 1000) for i in range(6)]
    cluster = ClusterProfile(num_servers=2, num_workers=2)
    counts = {t.name: 1 for t in tables}
    free = place(counts, tables, cluster)
    keep = {t.name: (1,) for t in tables[:3]}  # the three biggest all on server 1
    kept = place({**counts, "t0": 1}, tables, cluster, keep=keep)
    assert all(kept.get(n).servers == (1,) for n in keep)
    assert all(kept.get(f"t{i}").servers == (0,) for i in range(3, 6))  # the rest balance
    changed = place({**counts, "t0": 2}, tables, cluster, keep=keep)  # t0's count changes:
    assert changed.get("t0").shards == 2 and changed.get("t1").servers == (1,)  # t0 moves
    assert free != kept


def test_the_placement_caches_are_named_by_their_key_and_written_whole(tmp_path):
    from parallax.placement.json_cache import cache_path, write_atomically
    a = cache_path(tmp_path, {"b": [1, 2], "a": 1})
    assert a == cache_path(tmp_path, {"a": 1, "b": [1, 2]})  # canonical JSON
    assert a != cache_path(tmp_path, {"a": 1, "b": [2, 1]}) and len(a.stem) == 64
    assert len(cache_path(tmp_path, [1], digits=24).stem) == 24
    write_atomically(a, "old")
    with pytest.raises(TypeError):
        write_atomically(a, object())  # fails while writing: the old file stays whole
    assert a.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == [a.name]  # no temporary left


def test_unmeasured_tables_under_a_memory_limit_pack_shard_by_shard():
    """With server memory limited, unmeasured shards still go heaviest first (whole tables
    by bytes could leave no room for a big one-shard table)."""
    cluster = ClusterProfile(num_servers=2, num_workers=1, server_memory_bytes=1000)
    tables = [_table("A", rows=1000, nbytes=1000), _table("B", rows=900, nbytes=900)]
    plan = place({"A": 10, "B": 1}, tables, cluster)
    used = _server_totals(plan, tables, cluster, shard_bytes)
    assert used.max() <= 1000 and plan.get("B").shards == 1
