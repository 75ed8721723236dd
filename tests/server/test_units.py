"""Fast unit tests: wire codec, specs, routing, deterministic initial values."""
from __future__ import annotations

from dataclasses import fields
from typing import get_args

import numpy as np
import pytest

from parallax.errors import ConfigError, ParallaxError
from parallax.protocol import wire
from parallax.protocol.initial_values import initial_rows
from parallax.protocol.routing import ShardRouter, dedup, sum_duplicates
from parallax.protocol.specs import (SGD, Adagrad, Adam, Adamax, Ftrl, Initializer, Lion, Nadam,
                                     OptimizerSpec, RMSprop, TableSpec)
from parallax.ps.v1 import ps_pb2


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "int32", "int64"])
def test_wire_round_trip_is_a_readonly_view(dtype):
    arr = (np.arange(24).reshape(4, 6) * 3).astype(dtype)
    tensor = wire.encode(arr)
    back = wire.decode(ps_pb2.Tensor.FromString(tensor.SerializeToString()))
    np.testing.assert_array_equal(back, arr)
    assert back.dtype == arr.dtype and not back.flags.writeable


def test_wire_rejects_malformed_tensors():
    tensor = wire.encode(np.zeros((3, 4), np.float32))
    del tensor.shape[:]
    tensor.shape.extend([3, 5])
    with pytest.raises(wire.WireError, match=r"needs 60 bytes, got 48"):
        wire.decode(tensor, "grads")
    with pytest.raises(wire.WireError, match="dtype is unset"):
        wire.decode(ps_pb2.Tensor(shape=[1], content=b"1234"))
    with pytest.raises(wire.WireError, match="cannot travel"):
        wire.encode(np.zeros(2, dtype=np.complex64))


def test_table_spec_round_trips_through_proto():
    spec = TableSpec(name="emb", vocabulary_size=1000, dim=8, shard_count=3, partition="range",
                     optimizer=Ftrl(l1_regularization_strength=0.1), num_workers=4,
                     sync_mode="async", aggregation="mean",
                     initializer=Initializer(kind="truncated_normal", stddev=0.1, seed=7))
    assert TableSpec.from_proto(spec.to_proto()) == spec
    for opt in (SGD(momentum=0.9, nesterov=True), Adagrad(), Adam(amsgrad=True),
                RMSprop(rho=0.8, momentum=0.5, centered=True), Adamax(beta_2=0.9),
                Nadam(epsilon=1e-5), Lion(beta_1=0.5)):
        other = TableSpec(name="x", vocabulary_size=10, dim=2, optimizer=opt)
        assert TableSpec.from_proto(other.to_proto()) == other


@pytest.mark.parametrize("cls", get_args(OptimizerSpec), ids=lambda cls: cls.kind)
def test_each_optimizer_spec_is_its_wire_message(cls):
    """One registry (the OptimizerSpec union): each dataclass is a field of the proto oneof
    named as its `kind`, whose message has the dataclass's fields, and its Keras class is
    named as it is."""
    field = ps_pb2.OptimizerSpec.DESCRIPTOR.fields_by_name[cls.kind]
    assert field.containing_oneof.name == "kind"
    assert [f.name for f in field.message_type.fields] == [f.name for f in fields(cls)]
    assert cls.__name__.lower() == cls.kind


@pytest.mark.parametrize("kwargs, message", [
    (dict(name="a/b"), "table name 'a/b' is invalid"),
    (dict(dim=0), "dim must be a positive int"),
    (dict(vocabulary_size=0), "vocabulary_size must be > 0"),
    (dict(shard_count=20), "shard_count 20 exceeds vocabulary_size 10"),
    (dict(dtype="int32"), "dtype must be 'float32' or 'float64'"),
    (dict(partition="hash"), "partition 'hash' is not supported"),
    (dict(optimizer=SGD(learning_rate=0.1), sync_mode="semi"), "sync_mode 'semi'"),
    (dict(hashed_keys=True), "set vocabulary_size=0"),
])
def test_bad_specs_name_the_field(kwargs, message):
    base = dict(name="t", vocabulary_size=10, dim=4)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        TableSpec(**{**base, **kwargs})


def test_bad_optimizer_hyper_parameters():
    with pytest.raises(ConfigError, match="learning_rate must be a finite number > 0"):
        SGD(learning_rate=0)
    with pytest.raises(ConfigError, match="beta_1 must be in"):
        Adam(beta_1=1.0)
    with pytest.raises(ConfigError, match="learning_rate_power must be <= 0"):
        Ftrl(learning_rate_power=0.5)
    with pytest.raises(ConfigError, match=r"Nadam beta_2 must be in \[0, 1\), got 1.0"):
        Nadam(beta_2=1.0)
    with pytest.raises(ConfigError, match=r"RMSprop rho must be in \[0, 1\], got 1.5"):
        RMSprop(rho=1.5)
    with pytest.raises(ConfigError, match=r"Lion beta_1 must be in \(0, 1\], got 0"):
        Lion(beta_1=0)


def test_unspecified_enums_from_the_wire_are_rejected():
    msg = TableSpec(name="t", vocabulary_size=10, dim=2).to_proto()
    msg.sync_mode = ps_pb2.SYNC_MODE_UNSPECIFIED
    with pytest.raises(ConfigError, match="sync_mode code 0 is unset"):
        TableSpec.from_proto(msg)
    msg = TableSpec(name="t", vocabulary_size=10, dim=2).to_proto()
    msg.optimizer.Clear()
    with pytest.raises(ConfigError, match="optimizer is unset"):
        TableSpec.from_proto(msg)


@pytest.mark.parametrize("partition", ["mod", "range"])
@pytest.mark.parametrize("vocab, shards", [(10, 1), (10, 3), (17, 4), (100, 7)])
def test_router_covers_every_id_exactly_once(partition, vocab, shards):
    part = ShardRouter(shards, vocab, partition)
    seen = np.concatenate([part.global_ids(s) for s in range(shards)])
    np.testing.assert_array_equal(np.sort(seen), np.arange(vocab))
    for s in range(shards):
        ids = part.global_ids(s)
        assert len(ids) == part.shard_size(s)
        np.testing.assert_array_equal(part.shard_of(ids), s)
        np.testing.assert_array_equal(part.local_rows(ids, s), np.arange(len(ids)))
        np.testing.assert_array_equal(part.global_ids_of(np.arange(len(ids)), s), ids)


def test_shard_order_groups_ids_by_shard_keeping_their_order():
    part = ShardRouter(3, 100)
    ids = np.array([5, 3, 9, 4, 0, 7])
    order, offsets = part.shard_order(ids)
    grouped = ids[order]
    np.testing.assert_array_equal(grouped, [3, 9, 0, 4, 7, 5])
    for shard in range(3):
        assert (part.shard_of(grouped[offsets[shard]:offsets[shard + 1]]) == shard).all()
    assert ShardRouter(1, 100).shard_order(ids)[0] is None


@pytest.mark.parametrize("shards", [1, 3])
@pytest.mark.parametrize("ids", [[4, 1, 4, 2, 1, 4, 99], [1, 2, 5, 9], [9, 2, 5], []])
def test_push_plan_sums_duplicates_into_contiguous_shard_slices(shards, ids):
    part = ShardRouter(shards, 100)
    ids = np.array(ids, dtype=np.int64)
    grads = np.arange(2 * len(ids), dtype=np.float32).reshape(len(ids), 2)
    plan = part.route_push(ids)
    expected = {i: grads[ids == i].sum(axis=0) for i in set(ids.tolist())}
    assert sorted(plan.ids.tolist()) == sorted(expected)
    for shard in range(shards):
        lo, hi = plan.offsets[shard], plan.offsets[shard + 1]
        part_ids = plan.ids[lo:hi]
        assert (part.shard_of(part_ids) == shard).all() and (np.diff(part_ids) > 0).all()
        for cut in range(lo, hi + 1):  # any split into chunks fills the same rows
            out = np.full((hi - lo, 2), np.nan, np.float32)
            plan.fill(grads, lo, cut, out[:cut - lo])
            plan.fill(grads, cut, hi, out[cut - lo:])
            for i, row in zip(part_ids, out):
                np.testing.assert_array_equal(row, expected[i])
    assert plan.offsets[-1] == len(plan.ids)


def test_hashed_routing_spreads_keys():
    part = ShardRouter(4, 0)
    counts = np.bincount(part.shard_of(np.arange(0, 40_000) * 1024), minlength=4)
    assert counts.min() > 9000, counts


def test_dedup_and_sum_duplicates():
    ids = np.array([4, 1, 4, 2, 1, 4])
    unique, inverse = dedup(ids)
    np.testing.assert_array_equal(unique[inverse], ids)
    grads = np.arange(12, dtype=np.float32).reshape(6, 2)
    uids, sums = sum_duplicates(ids, grads)
    np.testing.assert_array_equal(uids, [1, 2, 4])
    np.testing.assert_array_equal(sums, [[2 + 8, 3 + 9], [6, 7], [0 + 4 + 10, 1 + 5 + 11]])


def test_initial_values_depend_only_on_seed_id_and_column():
    init = Initializer(kind="normal", stddev=1.0, seed=11)
    full = initial_rows(init, np.arange(1000), 8, "float32")
    subset = initial_rows(init, np.array([999, 3, 500]), 8, "float32")
    np.testing.assert_array_equal(subset, full[[999, 3, 500]])
    assert abs(full.mean()) < 0.05 and abs(full.std() - 1) < 0.05
    other_seed = initial_rows(Initializer(kind="normal", stddev=1.0, seed=12), np.arange(5), 8,
                              "float32")
    assert not np.array_equal(other_seed, full[:5])


@pytest.mark.parametrize("kind, check", [
    ("zeros", lambda x: (x == 0).all()),
    ("constant", lambda x: (x == 0.5).all()),
    ("uniform", lambda x: x.min() >= -0.2 and x.max() < 0.2 and x.std() > 0.1),
    ("truncated_normal", lambda x: np.abs(x).max() <= 0.2 and 0.08 < x.std() < 0.1),
])
def test_initializer_kinds(kind, check):
    init = Initializer(kind=kind, value=0.5, minval=-0.2, maxval=0.2, stddev=0.1, seed=3)
    assert check(initial_rows(init, np.arange(2000), 16, "float64"))


# ---- the `parallax` command line --------------------------------------------------------
@pytest.mark.parametrize("flag", ["--version", "-V", "version"])
def test_cli_prints_its_version(flag, capsys):
    from parallax import cli
    from parallax.version import __version__
    assert cli.main([flag]) == 0
    assert capsys.readouterr().out.startswith(f"parallax {__version__} ")


@pytest.mark.parametrize("error, code", [(ConfigError("--servers -1 must be >= 0"), 2),
                                         (ParallaxError("server 10.0.0.1:7000 is gone"), 1)])
def test_cli_reports_a_parallax_error_in_one_line(error, code, capsys, monkeypatch):
    from parallax import cli

    def fails(argv):
        raise error
    monkeypatch.setitem(cli.COMMANDS, "status", (fails, "fails"))
    assert cli.main(["status"]) == code
    err = capsys.readouterr().err
    assert err == f"parallax status: error: {error}\n"


def test_an_internal_error_says_it_is_a_bug_and_keeps_its_traceback(monkeypatch):
    """A broken invariant is no user's mistake: the message asks for a report, and the CLI
    lets the traceback through (a one-line error would lose what the report needs)."""
    from parallax import InternalError, cli
    error = InternalError("table 'a' has an id out of range that its own check let through")
    assert isinstance(error, ParallaxError) and not isinstance(error, ConfigError)
    assert "bug in parallax" in str(error) and "report" in str(error)
    import copy
    import pickle
    for again in (copy.copy(error), pickle.loads(pickle.dumps(error))):  # (a worker's, sent)
        assert str(again) == str(error)

    def fails(argv):
        raise error
    monkeypatch.setitem(cli.COMMANDS, "status", (fails, "fails"))
    with pytest.raises(InternalError):
        cli.main(["status"])


# ---- TF_CONFIG as a cluster description ------------------------------------------------
def _tf_config(task: dict, ps=("10.0.0.5:7000", "10.0.0.6:7000")) -> str:
    import json
    return json.dumps({"cluster": {"worker": ["10.0.0.1:2222", "10.0.0.2:2222"], "ps": list(ps)},
                       "task": task})


def test_tf_config_ps_tasks_are_the_servers_and_every_worker_derives_one_run_id():
    from parallax.client.cluster import resolve_cluster
    specs = [resolve_cluster(environ={"TF_CONFIG": _tf_config({"type": "worker", "index": i})})
             for i in range(2)]
    assert specs[0].ps_addresses == ("10.0.0.5:7000", "10.0.0.6:7000")
    assert specs[0].run_id == specs[1].run_id and specs[0].run_id.startswith("tf-")
    other = resolve_cluster(environ={"TF_CONFIG": _tf_config({}, ps=["10.0.0.7:7000"])})
    assert other.run_id != specs[0].run_id
    explicit = resolve_cluster(environ={"TF_CONFIG": _tf_config({}),
                                        "PARALLAX_PS_ADDRESSES": "127.0.0.1:7000",
                                        "PARALLAX_RUN_ID": "mine"})
    assert explicit.ps_addresses == ("127.0.0.1:7000",) and explicit.run_id == "mine"


def test_tf_config_without_ps_tasks_is_left_to_the_other_sources():
    from parallax.client.cluster import resolve_cluster
    spec = resolve_cluster(environ={"TF_CONFIG": '{"cluster": {"worker": ["a:1", "b:1"]}}'},
                           start=False)
    assert spec.embedded


@pytest.mark.parametrize("text, words", [
    ("not json", "is not a TensorFlow cluster description"),
    ('{"task": {}}', "is not a TensorFlow cluster description"),
    ('{"cluster": {"ps": "a:1"}}', "cluster.ps must be a list"),
    ('{"cluster": {"ps": ["nohost"]}}', "is not host:port"),
])
def test_bad_tf_config_is_named(text, words):
    from parallax.client.cluster import resolve_cluster
    with pytest.raises(ConfigError, match=words):
        resolve_cluster(environ={"TF_CONFIG": text})


def test_an_unknown_table_client_is_refused_naming_the_registered_ones():
    from parallax.client.table_client import TABLE_CLIENTS, DirectClient, table_client
    assert isinstance(table_client(), DirectClient) and "direct" in TABLE_CLIENTS
    with pytest.raises(ConfigError, match=r"no table client named 'cache'; registered: direct"):
        table_client("cache")
