"""The plan's default shard counts and the placement of shards on servers (pure functions)."""
from __future__ import annotations

import pytest

from parallax.placement.plan import SHARD_MIN_BYTES, StrategyConfig, VariableInfo, make_plan


def _table(index: int, rows: int, dim: int = 16) -> VariableInfo:
    return VariableInfo(index, f"table_{index}", (rows, dim), "float32", True,
                        "gather on axis 0", "IndexedSlices")


def _plan(infos, servers=2, **config):
    return make_plan(StrategyConfig(**config), infos, run_id="r", num_servers=servers,
                     num_workers=4)


def test_small_tables_get_one_shard_and_big_ones_one_per_64mb_up_to_the_servers():
    rows_64mb = SHARD_MIN_BYTES // (16 * 4)
    plan = _plan([_table(0, 1000), _table(1, rows_64mb - 1), _table(2, 2 * rows_64mb),
                  _table(3, 10 * rows_64mb)], servers=3)
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
    rows_64mb = SHARD_MIN_BYTES // (16 * 4)
    plan = _plan([_table(0, 4 * rows_64mb), _table(1, 2 * rows_64mb)], servers=3, shards=2)
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
    return make_plan(StrategyConfig(**config), infos, run_id="r", num_servers=servers,
                     num_workers=4, group_keys=keys)


def test_same_shaped_tables_share_one_table_at_consecutive_offsets():
    infos = [_table(0, 1000), _table(1, 300), _table(2, 50, dim=8), _table(3, 20)]
    plan = _grouped(infos, servers=3)
    group = [v for v in plan.variables if v.index in (0, 1, 3)]
    assert {v.table for v in group} == {"r.g0.x3"}
    assert [v.offset for v in group] == [0, 1000, 1300]
    assert {v.table_rows for v in group} == {1320}
    # a group is spread over every server, each member with the group's shards
    assert {(v.shards, v.servers) for v in group} == {(3, (0, 1, 2))}
    alone = plan.variables[2]  # another row width: a table of its own
    assert (alone.table, alone.offset, alone.table_rows) == ("r.v2.table_2", 0, 50)
    assert plan.grouped and [v.name for v in plan.members("r.g0.x3")] == \
        ["table_0", "table_1", "table_3"]
    assert "3 @ 0,1,2 in g0" in plan.format()


def test_groups_need_equal_keys_dtype_and_unnamed_shards():
    infos = [_table(0, 100), _table(1, 100), _table(2, 100), _table(3, 100),
             VariableInfo(4, "half", (100, 16), "float16", True, "gather", "IndexedSlices")]
    plan = _grouped(infos, keys={0: "a", 1: "b", 2: "a", 3: "a", 4: "a"},
                    shards={"table_3": 1})
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


def test_an_int_shard_count_applies_to_a_group_and_placement_treats_it_as_one_table():
    rows_64mb = SHARD_MIN_BYTES // (16 * 4)
    infos = [_table(0, rows_64mb), _table(1, rows_64mb), _table(2, 3 * rows_64mb, dim=8)]
    plan = _grouped(infos, servers=2, shards=1)
    a, b, c = plan.variables
    assert a.table == b.table and a.servers == b.servers and a.shards == 1
    assert c.servers != a.servers  # the group counts as its whole bytes on its server
    assert plan.signature() != _plan(infos, servers=2, shards=1).signature()


def test_a_config_refuses_a_non_bool_group_tables():
    from parallax.errors import ConfigError
    with pytest.raises(ConfigError, match="group_tables must be True or False"):
        StrategyConfig(group_tables="yes")
