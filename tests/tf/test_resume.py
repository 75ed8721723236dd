"""Exact resume through the standard APIs (issue 13, defects 2 and 11), on 2 workers and 2
real servers on loopback.

Each case trains 12 steps three ways, every job a fresh `parallax run` (new servers, one
data directory for all):
- full:   12 steps without a stop;
- stop:   6 steps, checkpointed (CheckpointManager in the MWMS custom-loop tutorial's shape,
          or Keras BackupAndRestore every epoch), then the job ends;
- resume: a new job restores that checkpoint and trains steps 6-12.
Resumed losses and predictions must equal the uninterrupted job's within 1e-6. Before the
fix the optimizer slots of the tables restarted from their initial values (Adagrad diverged)
and the custom loop could not even name its chief (`strategy.cluster_resolver` was None).

The in-process tests below check the files themselves against real servers: files loaded where
the servers lack their tables checkpoint (another data directory, none, or pruned) restore
the rows they hold; a failing disk fails the save; async tables resume exactly.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import subprocess
import sys
import time
import warnings
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import parallax
from parallax.client.local_cluster import LocalCluster
from parallax.errors import ConfigError, ServerError
from parallax.protocol import bulk_codec

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "helpers" / "resume_worker.py"
PARALLAX = str(Path(sys.executable).parent / "parallax")
CASES = ["custom-sgd", "custom-adagrad", "fit-sgd", "fit-adagrad"]
STEPS, STOP = 12, 6
_ids = itertools.count()

pytestmark = pytest.mark.multiprocess


def _job(data_dir: Path, out: Path, phase: str, *extra: str) -> None:
    command = [PARALLAX, "run", "-np", "2", "--servers", "2", "--data-dir", str(data_dir),
               "--", sys.executable, str(WORKER), "--cases", ",".join(CASES), "--phase",
               phase, "--steps", str(STEPS), "--out", str(out), *extra]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(command)} exited {proc.returncode}:\n"
                             f"{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("resume")
    _job(base / "data", base / "full", "full")
    _job(base / "data", base / "resumed", "stop", "--stop-at", str(STOP))
    _job(base / "data", base / "resumed", "resume")
    return {"full": base / "full", "resumed": base / "resumed"}


def _result(runs, run: str, case: str, phase: str) -> dict:
    return json.loads((runs[run] / case / f"{phase}.json").read_text())


@pytest.mark.parametrize("case", CASES)
@pytest.mark.timeout(900)  # the first test to need `runs` trains its three 2-worker jobs
def test_resumed_training_equals_uninterrupted_training(runs, case):
    full = _result(runs, "full", case, "full")
    stopped = _result(runs, "resumed", case, "stop")
    resumed = _result(runs, "resumed", case, "resume")
    done = len(stopped["losses"])
    assert done == (STOP if case.startswith("custom") else STOP // 3)
    losses = np.array(stopped["losses"] + resumed["losses"])
    assert losses.shape == np.shape(full["losses"])
    np.testing.assert_allclose(losses, full["losses"], rtol=0, atol=1e-6)
    np.testing.assert_allclose(resumed["prediction"], full["prediction"], rtol=0, atol=1e-6)
    assert not np.allclose(stopped["prediction"], full["prediction"], atol=1e-3)  # it trained
    assert full["grouped"] and resumed["grouped"]  # its two tables shared one server table


@pytest.mark.timeout(900)  # the first test to need `runs` trains its three 2-worker jobs
def test_cluster_resolver_names_the_chief_and_the_cluster(runs):
    result = _result(runs, "full", "custom-sgd", "full")
    assert result["task"] == ["worker", 0]
    cluster = result["cluster"]
    assert len(cluster["worker"]) == 2 and len(cluster["ps"]) == 2
    assert all(address.startswith("127.0.0.1:") for address in cluster["ps"])
    # Only the chief's CheckpointManager directory exists; worker 1 saved into a temporary
    # one and removed it, as the tutorial does.
    assert sorted(p.name for p in (runs["full"] / "custom-sgd").iterdir()) == \
        ["ckpt", "full.json"]


# ---- files against real servers, in this process ----

def _model():
    keras.utils.set_random_seed(3)
    inputs = keras.Input((3,), dtype="int64")
    rows = keras.layers.Embedding(300, 4, name="embedding")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(1, name="dense")(
        keras.layers.Flatten()(rows)))
    model.compile(keras.optimizers.Adagrad(0.3), loss="mse")
    return model


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 300, size=(64, 3)), rng.normal(size=(64, 1)).astype("float32")


@contextlib.contextmanager
def _servers(count=1, data_dir=None, **options):
    """A job's strategy on `count` fresh servers (on `data_dir`, or none)."""
    with LocalCluster(count, data_dir=data_dir) as cluster:
        yield parallax.ParallaxStrategy(ps_addresses=cluster.addresses, log_plan=False,
                                        run_id=f"files{next(_ids)}-{int(time.time())}",
                                        **options)


def _first_loss(model) -> float:
    """The loss of one training step on the whole batch: the loaded weights' loss."""
    return model.fit(*_batch(), batch_size=64, epochs=1, verbose=0).history["loss"][0]


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    """One job's files (on data directory `data`): m.keras, w-1 after one step, w-2 after
    another, then m.keras (checkpoints_kept=2: w-1's tables checkpoint is gone), each
    file's loss."""
    base = tmp_path_factory.mktemp("files")
    losses = {}
    with _servers(data_dir=base / "data", checkpoints_kept=2) as strategy:
        with strategy.scope():
            model = _model()
        for name in ("w-1.weights.h5", "w-2.weights.h5"):
            _first_loss(model)
            model.save_weights(base / name)
            losses[name] = model.evaluate(*_batch(), batch_size=64, verbose=0)
        model.save(base / "m.keras")
        losses["m.keras"] = losses["w-2.weights.h5"]
        _first_loss(model)
        losses["a step after w-2"] = model.evaluate(*_batch(), batch_size=64, verbose=0)
    return {"base": base, "losses": losses}


@pytest.mark.parametrize("where", ["other-data-dir", "no-data-dir"])
def test_a_keras_model_file_loads_in_another_job_from_its_rows(saved, where, caplog):
    """Before: ServerError NOT_FOUND / FAILED_PRECONDITION at the first step."""
    data_dir = saved["base"] / "other" if where == "other-data-dir" else None
    with _servers(data_dir=data_dir) as strategy, caplog.at_level("WARNING", "parallax"):
        with strategy.scope():
            model = keras.models.load_model(saved["base"] / "m.keras")
        assert _first_loss(model) == pytest.approx(saved["losses"]["m.keras"], abs=1e-6)
        model.save_weights(saved["base"] / f"{where}.weights.h5")  # rows only without a dir
    warned = [w for w in _warnings(caplog) if "m.keras" in w]
    assert len(warned) == 1, _warnings(caplog)
    assert "restart from their initial values" in warned[0]
    assert "ckpt-" in warned[0] and "resume/files" in warned[0]


@pytest.mark.parametrize("name, exact", [("w-1.weights.h5", False), ("w-2.weights.h5", True)])
def test_weights_files_older_than_checkpoints_kept_load_their_rows(saved, name, exact,
                                                                   caplog):
    """Before: w-1 (its tables checkpoint pruned by w-2's save) failed with NOT_FOUND."""
    with _servers(data_dir=saved["base"] / "data") as strategy, \
            caplog.at_level("WARNING", "parallax"):
        with strategy.scope():
            model = _model()
        model.load_weights(saved["base"] / name)
        assert _first_loss(model) == pytest.approx(saved["losses"][name], abs=1e-6)
    warned = [w for w in _warnings(caplog) if "parameter-server tables" in w]
    assert (warned == []) if exact else (len(warned) == 1 and name in warned[0]), warned


@pytest.mark.parametrize("frozen", [False, True], ids=["trainable", "frozen-while-loading"])
def test_weights_loaded_before_the_first_step_bring_back_the_dense_optimizer_state(
        saved, frozen):
    """`load_weights` in a new job, before any step (its optimizer not built yet): Keras
    skipped the optimizer's variables ("Skipping variable loading for optimizer 'adagrad',
    because it has 2 variables whereas the saved optimizer has 5"), so the dense layer's
    Adagrad accumulators restarted while the table's came back from the servers, and the
    next step differed from the uninterrupted job's. The optimizer now keeps the file's
    state until `fit` builds it, with the variables trainable then (a layer frozen while
    loading, unfrozen before training: building it at the load crashed that `fit`)."""
    with _servers(data_dir=saved["base"] / "data") as strategy, \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with strategy.scope():
            model = _model()
        model.get_layer("dense").trainable = not frozen
        model.load_weights(saved["base"] / "w-2.weights.h5")
        model.get_layer("dense").trainable = True
        _first_loss(model)
        loss = model.evaluate(*_batch(), batch_size=64, verbose=0)
    assert loss == pytest.approx(saved["losses"]["a step after w-2"], abs=1e-6)
    assert not [w for w in caught if "Skipping variable loading" in str(w.message)]


def test_a_later_fit_with_a_new_backup_directory_starts_afresh(tmp_path, monkeypatch):
    """Held backups (PARALLAX_HELD_BACKUPS=3): a fit that ended with
    `delete_checkpoint=False` left its held backup on the servers (the tables' mark and the
    dense state), and a later fit of the same job with a new, empty `BackupAndRestore`
    directory resumed from it, skipping 2 of its 3 epochs."""
    monkeypatch.setenv("PARALLAX_HELD_BACKUPS", "3")
    x, y = _batch()
    with _servers(data_dir=tmp_path / "data") as strategy:
        with strategy.scope():
            model = _model()
        first = keras.callbacks.BackupAndRestore(tmp_path / "a", delete_checkpoint=False)
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[first])
        second = keras.callbacks.BackupAndRestore(tmp_path / "b")
        history = model.fit(x, y, batch_size=16, epochs=3, verbose=0, callbacks=[second])
    assert len(history.history["loss"]) == 3


@pytest.mark.parametrize("obstacle, error", [
    ("file", "cannot write checkpoint file"),  # the data directory cannot be written
    ("ckpt-99999999999999999999-ffffffff", "FAILED_PRECONDITION: .* would sort before")])
def test_a_failing_save_of_the_tables_fails_the_save(tmp_path, caplog, obstacle, error):
    """A save the servers refuse or fail (the checkpoint path is a file; a newer checkpoint is
    in the way) fails `save_weights` and `Checkpoint.save`. Before, every FAILED_PRECONDITION
    was taken for "no --data-dir": one warning, then files holding the rows only."""
    with _servers(data_dir=tmp_path) as strategy, caplog.at_level("WARNING", "parallax"):
        with strategy.scope():
            model = _model()
        _first_loss(model)
        path = tmp_path / "resume" / strategy.extended.cluster.run_id
        if obstacle == "file":
            path.parent.mkdir()
            path.write_text("in the way")
        else:
            (path / obstacle).mkdir(parents=True)
        with pytest.raises(ServerError, match=error):
            model.save_weights(tmp_path / "w.weights.h5")
        with pytest.raises(ServerError, match=error):
            tf.train.Checkpoint(optimizer=model.optimizer).save(tmp_path / "ckpt")
    assert not [w for w in _warnings(caplog) if "cannot write checkpoints" in w]


def test_async_shards_at_different_steps_resume_exactly(tmp_path):
    """Async shards of one table saved at different steps (another worker's push has reached
    one shard only): the reference kept the last shard's step, the restore gave every shard
    the highest, and the resume was refused as "changed since"."""
    options = {"sync": False, "shards": 2}
    with _servers(2, tmp_path, **options) as strategy:
        with strategy.scope():
            model = _model()
        _first_loss(model)
        table = strategy.tables["embedding/embeddings"].table
        row = int(np.flatnonzero(table.router.shard_of(np.arange(300)) == 0)[0])
        push = bulk_codec.encode_push_request(table.name, 0, 0, 0, np.array([row]),
                                              np.ones((1, 4), np.float32))
        table.shards[0].stub().Push(push, timeout=10)
        path = tf.train.Checkpoint(optimizer=model.optimizer, model=model).save(
            tmp_path / "ckpt")
        steps = [s.step for s in strategy.extended.client.save("probe", [table.name])]
        assert len(set(steps)) == 2, steps  # the shards are at different steps
        loss = model.evaluate(*_batch(), batch_size=64, verbose=0)
    with _servers(2, tmp_path, **options) as strategy:
        with strategy.scope():
            model = _model()
        tf.train.Checkpoint(optimizer=model.optimizer, model=model).restore(path)
        assert _first_loss(model) == pytest.approx(loss, abs=1e-6)


def _grouped_model(big_rows: int = 600_000):
    """One table the servers draw (over 8 MB, a Keras initializer) and two small streamed
    ones, which share one server table (a table group) on one server."""
    keras.utils.set_random_seed(3)
    inputs = keras.Input((3,), dtype="int64")
    big = keras.layers.Embedding(big_rows, 4, name="big")
    small = [keras.layers.Embedding(1000, 4, name=f"small{i}") for i in range(2)]
    rows = [big(inputs[:, :1]), small[0](inputs[:, 1:2]), small[1](inputs[:, 2:3])]
    h = keras.layers.Concatenate(axis=1)([keras.layers.Flatten()(r) for r in rows])
    model = keras.Model(inputs, keras.layers.Dense(1, name="dense")(h))
    model.compile(keras.optimizers.Adagrad(0.3), loss="mse")
    return model




@pytest.mark.parametrize("now", [{}, {"group_tables": False}], ids=["same", "groups-off"])
def test_a_restore_before_the_first_step_keeps_the_checkpoints_table_groups(tmp_path, now):
    """A restore clears the variables' deferred initial values, which made the big table
    "drawn by the servers" and the small ones "streamed": the plan then grouped the big one
    with the small ones, unlike the checkpoint, and the resume was refused. The plan now
    takes the checkpoint's groups (even with group_tables=False now) and resumes exactly."""
    with _servers(1, tmp_path) as strategy:
        with strategy.scope():
            model = _grouped_model()
        _first_loss(model)
        saved = {v.name: (v.table, v.offset) for v in strategy.plan.on_servers}
        assert saved["small0/embeddings"][0] == saved["small1/embeddings"][0] != \
            saved["big/embeddings"][0]
        path = tf.train.Checkpoint(optimizer=model.optimizer, model=model).save(
            tmp_path / "ckpt")
        losses = [_first_loss(model) for _ in range(2)]  # the next two steps
    with _servers(1, tmp_path, **now) as strategy:
        with strategy.scope():
            model = _grouped_model()
        tf.train.Checkpoint(optimizer=model.optimizer, model=model).restore(path)
        resumed = [_first_loss(model) for _ in range(2)]
        assert {v.name: (v.table, v.offset) for v in strategy.plan.on_servers} == saved
    np.testing.assert_allclose(resumed, losses, rtol=0, atol=1e-6)


@contextlib.contextmanager
def _servers_with_own_dirs(tmp_path: Path, **options):
    """A job's strategy on 2 fresh servers, each with a data directory of its own (as
    `parallax k8s` gives them): each restores only the shards it saved."""
    with contextlib.ExitStack() as stack:
        clusters = [stack.enter_context(LocalCluster(1, data_dir=tmp_path / f"d{k}"))
                    for k in range(2)]
        yield parallax.ParallaxStrategy(ps_addresses=[a for c in clusters for a in c.addresses],
                                        log_plan=False,
                                        run_id=f"own{next(_ids)}-{int(time.time())}",
                                        **options)


def _trained_and_saved(strategy, tmp_path: Path, layout=None):
    """(checkpoint path, the next two steps' losses, the table's servers) after a step,
    resharded to `layout` ({"shards": n, "servers": [...]}) first when given."""
    with strategy.scope():
        model = _model()
    _first_loss(model)
    if layout is not None:
        strategy.reshard({"embedding/embeddings": layout["shards"]},
                         servers={"embedding/embeddings": layout["servers"]})
    path = tf.train.Checkpoint(optimizer=model.optimizer, model=model).save(tmp_path / "ckpt")
    servers = strategy.plan.get("embedding/embeddings").servers
    return path, [_first_loss(model) for _ in range(2)], servers


def _resumed(strategy, path) -> tuple[list[float], tuple[int, ...]]:
    with strategy.scope():
        model = _model()
    tf.train.Checkpoint(optimizer=model.optimizer, model=model).restore(path)
    return ([_first_loss(model) for _ in range(2)],
            strategy.plan.get("embedding/embeddings").servers)


@pytest.mark.parametrize("saved_with, layout", [
    ({"shards": 2}, None),                                  # a count the default would not give
    ({}, {"shards": 1, "servers": [1]}),                    # moved by a reshard (or the search)
], ids=["counts", "resharded"])
def test_a_restore_plans_where_the_checkpoints_shards_are(tmp_path, saved_with, layout):
    """A job on as many servers as saved the checkpoint restores each shard where it was
    saved: with a data directory per server, another count or server was refused
    (DATA_LOSS), e.g. after an upgrade changed the default, or after a reshard. It resumes
    exactly."""
    with _servers_with_own_dirs(tmp_path, **saved_with) as strategy:
        path, losses, servers = _trained_and_saved(strategy, tmp_path, layout)
    assert servers == ((0, 1) if layout is None else (1,))
    with _servers_with_own_dirs(tmp_path) as strategy:  # the default: one shard, on server 0
        resumed, restored_servers = _resumed(strategy, path)
    assert restored_servers == servers
    np.testing.assert_allclose(resumed, losses, rtol=0, atol=1e-6)


@pytest.mark.parametrize("saved, then", [
    ({"shards": 3, "servers": [0, 1, 2]}, {"shards": 3, "servers": [0, 2, 1]}),
    ({"shards": 1, "servers": [1]}, {"shards": 2, "servers": [0, 1]}),
], ids=["servers-swapped", "count"])
def test_a_table_restored_from_a_reshard_reshards_again(tmp_path, saved, then):
    """A restored table keeps the name its reshard gave it (`.r1`); the next reshard named
    its copy `.r1` again: the same name as the live table (ALREADY_EXISTS, or the copy
    deleted as the old table and the table lost)."""
    with _servers(3, tmp_path) as strategy:
        path, losses, _ = _trained_and_saved(strategy, tmp_path, saved)
    with _servers(3, tmp_path) as strategy:
        with strategy.scope():
            model = _model()
        tf.train.Checkpoint(optimizer=model.optimizer, model=model).restore(path)
        resumed = [_first_loss(model)]
        strategy.reshard({"embedding/embeddings": then["shards"]},
                         servers={"embedding/embeddings": then["servers"]})
        resumed.append(_first_loss(model))
        assert strategy.plan.get("embedding/embeddings").servers == tuple(then["servers"])
    np.testing.assert_allclose(resumed, losses, rtol=0, atol=1e-6)


def test_a_restore_keeps_the_users_shards_and_another_clusters_default(tmp_path):
    """The saved layout is the default only: the user's shards= wins, and on another number
    of servers (one shared data directory, which reshards on restore) the plan is today's."""
    with _servers(2, tmp_path, shards=2) as strategy:
        path, losses, _ = _trained_and_saved(strategy, tmp_path)
    with _servers(2, tmp_path, shards=1) as strategy:
        resumed, servers = _resumed(strategy, path)
    assert len(servers) == 1
    np.testing.assert_allclose(resumed, losses, rtol=0, atol=1e-6)
    with _servers(3, tmp_path) as strategy:
        resumed, servers = _resumed(strategy, path)
    assert len(servers) == 1  # today's default for a 4.8 kB table, not the saved 2
    np.testing.assert_allclose(resumed, losses, rtol=0, atol=1e-6)


def test_a_checkpoints_table_groups_this_job_cannot_push_together_are_refused(tmp_path):
    """Restored into a job whose optimizer counts steps (Adam), a group's members would each
    advance the group's step: the first step refuses, naming the grouped variables."""
    with _servers(1, tmp_path) as strategy:
        with strategy.scope():
            model = _grouped_model()
        _first_loss(model)
        path = tf.train.Checkpoint(optimizer=model.optimizer, model=model).save(
            tmp_path / "ckpt")
    with _servers(1, tmp_path) as strategy:
        with strategy.scope():
            model = _grouped_model()
            model.compile(keras.optimizers.Adam(0.01), loss="mse")
        tf.train.Checkpoint(optimizer=model.optimizer, model=model).restore(path)
        with pytest.raises(ConfigError, match=r"small0/embeddings.*table groups.*Adam"):
            _first_loss(model)
