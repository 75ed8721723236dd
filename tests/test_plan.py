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
