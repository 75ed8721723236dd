"""The plan's default shard counts and the placement of shards on servers (pure functions)."""
from __future__ import annotations

import pytest

from dataclasses import replace

from parallax.placement.plan import (SHARD_MIN_BYTES, PlacementOptions, VariableInfo,
                                     make_plan, place_shards)
from parallax.tf.strategy.config import StrategyConfig  # (no TensorFlow: a unit test)


def _table(index: int, rows: int, dim: int = 16) -> VariableInfo:
    return VariableInfo(index, f"table_{index}", (rows, dim), "float32", True,
                        "gather on axis 0", "IndexedSlices")


def _plan(infos, servers=2, **config):
    return make_plan(PlacementOptions(**config), infos, run_id="r", num_servers=servers,
                     num_workers=4)


def test_small_tables_get_one_shard_and_big_ones_one_per_shard_min_bytes_up_to_the_servers():
    rows_per_shard = SHARD_MIN_BYTES // (16 * 4)
    plan = _plan([_table(0, 1000), _table(1, rows_per_shard - 1), _table(2, 2 * rows_per_shard),
                  _table(3, 10 * rows_per_shard)], servers=3)
    assert [v.shards for v in plan.variables] == [1, 1, 2, 3]


def test_user_shards_still_win_and_are_capped_by_rows():
    plan = _plan([_table(0, 1000), _table(1, 3)], shards=4)
    assert [v.shards for v in plan.variables] == [4, 3]
    plan = _plan([_table(0, 1000), _table(1, 1000)], shards={"table_1": 2})
    assert [v.shards for v in plan.variables] == [1, 2]


def test_one_shard_tables_spread_over_servers_by_bytes():
    # 26 CTR-like tables falling geometrically: greedy by bytes, biggest first.
    infos = [_table(i, int(3_100_000 * 0.7 ** i)) for i in range(26)]
    plan = _plan(infos, servers=2)
    load = [0.0, 0.0]
    for v in plan.on_servers:
        assert len(v.servers) == v.shards and len(set(v.servers)) == v.shards
        for server in v.servers:
            load[server] += v.bytes / v.shards
    assert min(load) / max(load) > 0.9, load
    assert {v.servers[0] for v in plan.on_servers if v.shards == 1} == {0, 1}


def test_shards_of_one_table_go_to_distinct_servers_even_when_another_is_emptier():
    rows_per_shard = SHARD_MIN_BYTES // (16 * 4)
    plan = _plan([_table(0, 4 * rows_per_shard), _table(1, 2 * rows_per_shard)], servers=3, shards=2)
    first, second = plan.variables
    assert first.servers == (0, 1)
    assert second.servers[0] == 2 and len(set(second.servers)) == 2


def test_placement_is_part_of_what_workers_agree_on_and_of_the_printed_plan():
    a = _plan([_table(0, 1000), _table(1, 2000)])
    b = _plan([_table(0, 1000), _table(1, 2000)])
    assert a.signature() == b.signature()
    assert "1 @ 1" in a.format() and "1 @ 0" in a.format()


@pytest.mark.parametrize("servers", [1, 2, 4])
def test_every_shard_has_a_server_in_range(servers):
    plan = _plan([_table(i, 500 * (i + 1)) for i in range(7)], servers=servers, shards=3)
    for v in plan.on_servers:
        assert len(v.servers) == v.shards and all(0 <= s < servers for s in v.servers)


def test_a_shard_count_for_a_name_no_variable_has_is_refused_like_placement():
    from parallax.errors import ConfigError
    with pytest.raises(ConfigError, match=r"shards names \['tabel_1'\] match no trainable"):
        _plan([_table(0, 1000), _table(1, 1000)], shards={"tabel_1": 2})
    with pytest.raises(ConfigError, match=r"placement names \['x'\] match no trainable"):
        _plan([_table(0, 1000)], placement={"x": "ps"})


@pytest.mark.parametrize("option, value", [("checkpoints_kept", True), ("shards", True),
                                           ("shards", {"table_0": True}),
                                           ("embedded_servers", 1.5),
                                           ("embedded_servers", True)])
def test_counts_must_be_ints_not_bools_or_floats(option, value):
    from parallax.errors import ConfigError
    with pytest.raises(ConfigError, match=option.split("_")[0]):
        StrategyConfig(**{option: value})


# ---- table groups ------------------------------------------------------------------------

def _grouped(infos, servers=2, keys=None, **config):
    keys = {i.index: "stream" for i in infos} if keys is None else keys
    return make_plan(PlacementOptions(**config), infos, run_id="r", num_servers=servers,
                     num_workers=4, group_keys=keys)


def test_same_shaped_tables_on_the_same_servers_share_one_table_at_offsets():
    rows_per_shard = SHARD_MIN_BYTES // (16 * 4)
    # CTR-like: two big tables of 2 shards each over both servers, many small ones spread
    infos = [_table(0, 3 * rows_per_shard), _table(1, 2 * rows_per_shard)] + \
        [_table(i, 1000 - 10 * i) for i in range(2, 12)] + [_table(12, 50, dim=8)]
    plan = _grouped(infos, servers=2)
    alone = plan.variables[12]  # another row width: a table of its own
    assert (alone.table, alone.offset, alone.table_rows) == ("r.v12.table_12", 0, 50)
    groups = {}
    for v in plan.variables[:12]:
        groups.setdefault(v.table, []).append(v)
    assert len(groups) == 3  # the 2-shard pair, and one group of small tables per server
    assert sorted(len(m) for m in groups.values()) == [2, 5, 5]
    for name, members in groups.items():
        assert name.startswith(f"r.g{members[0].index}.x{len(members)}")
        assert len({(v.shards, v.servers, v.table_rows) for v in members}) == 1
        assert [v.offset for v in members] == \
            [sum(m.shape[0] for m in members[:i]) for i in range(len(members))]
        assert members[0].table_rows == sum(v.shape[0] for v in members)
        assert plan.members(name) == tuple(members)
    # the placement is the one the tables had on their own
    assert [v.servers for v in plan.variables] == \
        [v.servers for v in _plan(infos, servers=2).variables]
    assert plan.grouped and "2 @ 0,1 in g0" in plan.format()


def test_groups_need_equal_keys_dtype_and_unnamed_shards():
    infos = [_table(0, 100), _table(1, 100), _table(2, 100), _table(3, 100),
             VariableInfo(4, "half", (100, 16), "float16", True, "gather", "IndexedSlices")]
    plan = _grouped(infos, keys={0: "a", 1: "b", 2: "a", 3: "a", 4: "a"},
                    shards={"table_3": 1}, servers=1)
    tables = {v.name: v.table for v in plan.variables}
    assert tables["table_0"] == tables["table_2"] == "r.g0.x2"
    assert len(set(tables.values())) == 4  # b alone, table_3 named, float16 alone


@pytest.mark.parametrize("kwargs", [{"group_tables": False}, {"keys": {}}])
def test_no_groups_when_turned_off_or_without_keys(kwargs):
    infos = [_table(0, 100), _table(1, 100)]
    config = {k: v for k, v in kwargs.items() if k != "keys"}
    plan = _grouped(infos, keys=kwargs.get("keys"), **config)
    assert not plan.grouped and [v.offset for v in plan.variables] == [0, 0]
    assert [v.table_rows for v in plan.variables] == [100, 100]


def test_placement_treats_a_table_group_as_one_table():
    rows_per_shard = SHARD_MIN_BYTES // (16 * 4)
    infos = [_table(0, rows_per_shard), _table(1, rows_per_shard),
             _table(2, 3 * rows_per_shard, dim=8)]
    plan = _plan(infos, servers=2, shards=1)  # 1.5 x SHARD_MIN_BYTES on 0, 1 + 1 on 1
    assert [v.servers for v in plan.variables] == [(1,), (1,), (0,)]
    merged = tuple(replace(v, table="g") if v.index < 2 else v for v in plan.variables)
    placed = place_shards(merged, 2)  # one table of 2 x SHARD_MIN_BYTES: first, on 0
    assert placed == {0: (0,), 1: (0,), 2: (1,)}
    grouped = _grouped(infos, servers=2, shards=1)
    assert grouped.variables[0].table == grouped.variables[1].table != \
        grouped.variables[2].table
    assert grouped.signature() != plan.signature()


def test_a_config_refuses_a_non_bool_group_tables():
    from parallax.errors import ConfigError
    with pytest.raises(ConfigError, match="group_tables must be True or False"):
        StrategyConfig(group_tables="yes")
    with pytest.raises(ConfigError, match="group_tables must be True or False"):
        PlacementOptions(group_tables="yes")


def test_the_strategy_s_config_makes_the_plan_s_options_checked_as_before():
    """`StrategyConfig` (the strategy's room) builds the placement's own value, which
    `make_plan` takes; a copy with other choices builds its own, and each check is made
    when the config is, with the same message."""
    from parallax.errors import ConfigError
    config = StrategyConfig(mode="ps", sync=False, placement={"t": "ps"}, shards={"t": 2},
                            group_tables=False, wire_dtype="bfloat16", embedded_servers=3)
    assert config.placement_options == PlacementOptions(
        mode="ps", sync=False, placement={"t": "ps"}, shards={"t": 2}, group_tables=False,
        wire_dtype="bfloat16")
    assert replace(config, shards=3).placement_options.shards == 3
    assert replace(config, shards=3) == replace(config, shards=3)
    with pytest.raises(ConfigError, match="placement of 't' is 'gpu'; use 'ps'"):
        StrategyConfig(placement={"t": "gpu"})
    with pytest.raises(ConfigError, match="mode 'fast' is not one of"):
        StrategyConfig(mode="fast")
    with pytest.raises(ConfigError, match="collectives 'mpi' is not one of"):
        StrategyConfig(collectives="mpi")


def test_only_optimizers_whose_update_ignores_the_step_count_share_tables():
    """Grouped tables share one step count (`binding.group_keys` asks `counts_steps`): the
    Keras names of the server optimizers, and an optimizer the servers do not have."""
    from parallax.protocol.specs import counts_steps

    def named(name):
        return type(name, (), {})()
    plain = ("SGD", "Adagrad", "Ftrl", "RMSprop", "Lion")
    assert [n for n in plain if counts_steps(named(n))] == []
    assert all(counts_steps(named(n)) for n in ("Adam", "Adamax", "Nadam", "AdamW", "Custom"))
    assert counts_steps(None)


def test_every_server_optimizer_declares_whether_it_counts_steps():
    """Undeclared would group a new optimizer's tables by accident (`counts_steps`
    answers True for it, but say it where the optimizer is defined)."""
    from typing import get_args

    from parallax.protocol.specs import OptimizerSpec
    undeclared = [c.__name__ for c in get_args(OptimizerSpec) if "counts_steps" not in vars(c)]
    assert undeclared == []


def _dynamic(index: int, **rows) -> VariableInfo:
    from parallax.placement.plan import DynamicRows
    return replace(_table(index, 1 << 16, dim=8), name=f"dynamic_{index}",
                   dynamic=DynamicRows(**rows))


def test_a_dynamic_table_goes_to_every_server_ungrouped_and_sized_at_its_bound():
    infos = [_dynamic(0, max_rows_per_shard=1000, eviction="lru"), _table(1, 50, 8),
             _table(2, 50, 8)]
    grouped = make_plan(PlacementOptions(), infos, run_id="r", num_servers=1, num_workers=4,
                        group_keys={0: "k", 1: "k", 2: "k"})
    assert grouped.variables[1].table == grouped.variables[2].table  # a group, without ...
    assert grouped.variables[0].table != grouped.variables[1].table  # ... the dynamic table
    plan = _plan(infos, servers=3)
    dynamic = plan.variables[0]
    assert dynamic.placement == "ps" and dynamic.shards == 3 and dynamic.kind == "sparse"
    assert dynamic.bytes == 3 * 1000 * 8 * 4  # its bound on each of its shards
    assert dynamic.dynamic.max_rows_per_shard == 1000
    text = plan.format()
    assert "keysx8" in text and "dynamic: <= 1000 rows/shard (lru)" in text
    unbounded = _plan([_dynamic(0, admit_after=3)], servers=2, shards={"dynamic_0": 1})
    assert unbounded.variables[0].shards == 1 and unbounded.variables[0].bytes == 0
    assert "dynamic: unbounded, admit after 3" in unbounded.format()
    assert plan.signature() != _plan([_dynamic(0, max_rows_per_shard=999, eviction="lru"),
                                      _table(1, 50, 8), _table(2, 50, 8)],
                                     servers=3).signature()  # workers agree on the bound


@pytest.mark.parametrize("config", [{"mode": "allreduce"},
                                    {"placement": {"dynamic_0": "allreduce"}}])
def test_a_dynamic_table_kept_on_the_workers_is_refused(config):
    from parallax.errors import ConfigError
    with pytest.raises(ConfigError, match="DynamicEmbedding table.*use mode 'hybrid'"):
        _plan([_dynamic(0)], **config)


def test_a_dynamic_tables_bound_follows_its_shards_without_inflating():
    from parallax.protocol.specs import bound_for
    plan = _plan([_dynamic(0, max_rows_per_shard=300, eviction="lru")], servers=3)
    rows = plan.variables[0].dynamic
    assert (rows.max_rows_per_shard, rows.total_rows) == (300, 900)
    one = rows.resharded(1)
    assert one.max_rows_per_shard == bound_for(900, 1) == 900 + 120  # its share, + 4 sigma
    assert one.resharded(3).resharded(1) == one  # back and forth: no ratchet ...
    assert one.resharded(3) == rows  # ... and back at the planned count, the user's bound
    assert rows.resharded(2).max_rows_per_shard == 450 + 85


def test_server_table_names_split_back_into_run_id_and_table():
    """Metrics label a plan's server tables by run id and table apart (env.split_run_id):
    the inverse of the names plan.table_name and group_table_name make."""
    from parallax.env import split_run_id
    from parallax.placement.plan import group_table_name, table_name
    assert split_run_id(table_name("1203-3fa2c1", 3, "embedding/embeddings:0")) == (
        "1203-3fa2c1", "v3.embedding_embeddings")
    assert split_run_id(group_table_name("job", 0, 2)) == ("job", "g0.x2")
    for own in ("obs", "many_x", "a.b.c", "job.v"):  # names a PSClient user chose
        assert split_run_id(own) == ("", own)


def test_a_run_id_with_a_trailing_newline_is_not_a_run_id():
    from parallax.env import is_run_id, split_run_id
    assert is_run_id("job-1") and not is_run_id("job-1\n")
    assert split_run_id("job\n.v1.emb") == ("", "job\n.v1.emb")
