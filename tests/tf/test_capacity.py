"""A plan that does not fit the servers' memory is refused before any table is created,
with the numbers and the fixes; servers report the memory they may use."""
from __future__ import annotations

import time

import keras
import numpy as np
import pytest

import parallax
from parallax.client import PSClient
from parallax.client.local_cluster import LocalCluster
from parallax.placement.capacity import check_fits, server_bytes, table_bytes
from parallax.placement.planner import PlannerError
from parallax.placement.plan import PlacementOptions, VariableInfo, make_plan
from parallax.protocol.specs import SGD, Adam, TableSpec

MB = 1 << 20


def _plan(rows, servers=2, **config):
    infos = [VariableInfo(i, f"t{i}", (r, 64), "float32", True, "gather", "IndexedSlices")
             for i, r in enumerate(rows)]
    return make_plan(PlacementOptions(**config), infos, run_id="r", num_servers=servers,
                     num_workers=2)


def _specs(plan, optimizer=None):
    return {v.index: TableSpec(name=v.table, vocabulary_size=v.shape[0], dim=64,
                               shard_count=v.shards, optimizer=optimizer or SGD())
            for v in plan.on_servers}


def test_slots_count_and_placement_decides_what_each_server_holds():
    plan = _plan([4096, 1024])  # 1 MiB and 0.25 MiB of values, one shard each
    specs = _specs(plan, Adam())
    assert table_bytes(specs[0]) == 3 * MB  # values, momentum and velocity
    assert sorted(server_bytes(plan, specs)) == [3 * MB // 4, 3 * MB]
    check_fits(plan, specs, [4 * MB, 4 * MB])
    check_fits(plan, specs, [0, 0])  # servers that report nothing are not checked


def test_copies_of_the_shards_count_on_the_next_server():
    plan = _plan([4096, 1024])  # 3 MiB with Adam on one server, 0.75 MiB on the other
    specs = _specs(plan, Adam())
    assert server_bytes(plan, specs, replicas=2) == [3 * MB + 3 * MB // 4] * 2
    check_fits(plan, specs, [4 * MB, 4 * MB], replicas=2)
    with pytest.raises(PlannerError, match="copies of the shards next door"):
        check_fits(plan, specs, [3 * MB + MB // 2] * 2, replicas=2)


def test_a_plan_over_memory_names_the_numbers_and_the_fixes():
    plan = _plan([4096 * 40, 4096], servers=2, shards=1)  # 40 MiB (+ Adam's 80) on server 0
    with pytest.raises(PlannerError) as info:
        check_fits(plan, _specs(plan, Adam()), [64 * MB, 64 * MB])
    message = str(info.value)
    assert "server 0 would hold 120.0 MiB" in message and "has 64.0 MiB" in message
    assert "1. add servers" in message and "at least 2 servers" in message
    assert "shards={'t0': 2}" in message and "fewer slots" in message
    assert info.value.needed_bytes == 120 * MB and info.value.table == "t0"


def test_servers_report_their_memory_and_a_job_too_big_for_them_changes_nothing(tmp_path):
    with LocalCluster(2, extra_args=["--memory-mb", "2"]) as cluster:
        with PSClient(cluster.addresses) as client:
            assert [r.memory_bytes for r in client.stats().values()] == [2 * MB, 2 * MB]
            strategy = parallax.ParallaxStrategy(ps_addresses=cluster.addresses,
                                                 run_id=f"cap-{time.time_ns()}",
                                                 log_plan=False, search_partitions=False)
            with strategy.scope():
                model = keras.Sequential([keras.Input((2,), dtype="int64"),
                                          keras.layers.Embedding(20_000, 64),  # 4.9 MiB
                                          keras.layers.Flatten(), keras.layers.Dense(1)])
                model.compile(optimizer=keras.optimizers.Adagrad(0.1), loss="mse")
            with pytest.raises(PlannerError, match="does not fit the parameter servers' "
                                                   "memory.*9.8 MiB.*has 2.0 MiB"):
                model.fit(np.zeros((8, 2), "int64"), np.zeros((8, 1)), verbose=0)
            assert all(not r.tables for r in client.stats().values())  # nothing created
    assert cluster.exit_codes == [0, 0]
