"""TensorFlow's peers (MWMS, ParameterServerStrategy) as real processes on loopback.

Each test starts `python -m parallax.bench.worker` processes with their TF_CONFIG, waits for
the trainers (every exit code must be 0), kills the TF servers (which serve until killed)
and reads the BENCH_RESULT line of rank 0 / the chief.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from parallax.bench import measure

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 120
WINDOW_ARGS = ["--warmup-steps", "2", "--calibration-steps", "2", "--windows", "2",
               "--window-seconds", "0.5"]


def _cluster(jobs: dict[str, int]) -> dict[str, list[str]]:
    from conftest import free_ports  # here: this file also runs as a script (_dump_command),
    # where tests/ (conftest's folder) is not on sys.path
    ports = iter(free_ports(sum(jobs.values())))
    return {job: [f"127.0.0.1:{next(ports)}" for _ in range(n)] for job, n in jobs.items()}


def _start(cluster, job, index, command, log_dir: Path):
    env = dict(os.environ, TF_CONFIG=json.dumps(
        {"cluster": cluster, "task": {"type": job, "index": index}}),
        PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="")
    log = open(log_dir / f"{job}{index}.log", "w+")
    proc = subprocess.Popen(command, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    proc.log = log
    return proc


def _tail(proc, lines: int = 30) -> str:
    proc.log.seek(0)
    return "".join(proc.log.readlines()[-lines:])


def _worker_command(system: str, workload: str, role: str) -> list[str]:
    return [sys.executable, "-m", "parallax.bench.worker", "--system", system,
            "--workload", workload, "--size", "short", "--role", role, *WINDOW_ARGS]


def run_cluster(tmp_path: Path, system: str, workload: str, jobs: dict[str, int],
                trainer_command: list[str] | None = None) -> dict | None:
    """Start the cluster's processes, wait for the trainers, return rank 0's result.

    Trainers are the `worker` tasks under mwms and the `chief` under tf_ps (running
    `trainer_command` instead of the benchmark worker when given); the tf_ps `worker` and
    `ps` tasks are TF servers that run until killed.
    """
    cluster = _cluster(jobs)
    servers, trainers = [], []
    try:
        for job, n in jobs.items():
            for index in range(n):
                if system == "tf_ps" and job != "chief":
                    command = _worker_command(system, workload, job)
                    servers.append(_start(cluster, job, index, command, tmp_path))
                else:
                    command = trainer_command or _worker_command(system, workload, job)
                    trainers.append(_start(cluster, job, index, command, tmp_path))
        deadline = time.monotonic() + TIMEOUT_S
        for proc in trainers:
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{system} trainer timed out; its log:\n{_tail(proc)}")
        for proc in servers:
            assert proc.poll() is None, f"TF server died early:\n{_tail(proc)}"
        for proc in trainers:
            assert proc.returncode == 0, f"trainer exited {proc.returncode}:\n{_tail(proc)}"
        if trainer_command:
            return None
        trainers[0].log.seek(0)
        results = [r for r in map(measure.parse_result, trainers[0].log) if r]
        assert len(results) == 1, f"no single BENCH_RESULT line:\n{_tail(trainers[0])}"
        return results[0]
    finally:
        for proc in servers + trainers:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            proc.log.close()


def _check_windows(result: dict, system: str, workload: str, workers: int, batch: int):
    assert (result["system"], result["workload"]) == (system, workload)
    assert result["workers"] == workers
    assert result["global_batch"] == workers * batch
    windows = result["windows"]
    assert len(windows) == 2
    assert windows[0]["steps"] == windows[1]["steps"] >= 2
    for w in windows:
        assert w["t1"] > w["t0"]
        assert w["samples"] == w["steps"] * workers * batch
    assert math.isfinite(result["loss"])


def test_mwms_two_workers_lm(tmp_path):
    result = run_cluster(tmp_path, "mwms", "lm", {"worker": 2})
    _check_windows(result, "mwms", "lm", workers=2, batch=32)


def test_tf_ps_ctr(tmp_path):
    result = run_cluster(tmp_path, "tf_ps", "ctr", {"chief": 1, "worker": 2, "ps": 2})
    _check_windows(result, "tf_ps", "ctr", workers=2, batch=32)


def test_tf_ps_lm(tmp_path):
    result = run_cluster(tmp_path, "tf_ps", "lm", {"chief": 1, "worker": 2, "ps": 2})
    _check_windows(result, "tf_ps", "lm", workers=2, batch=32)


# --------------------------------------------------------------------------- exact SGD

STEPS = 4
TABLE_OPS = "table_ops.json"


def _snapshot(model) -> dict:
    """Every trainable value by position: tables whole (shards concatenated), then the rest."""
    import numpy as np

    out = {}
    for t, table in enumerate(model.tables):
        parts = getattr(table, "variables", [table])
        out[f"table_{t}"] = np.concatenate([p.numpy() for p in parts])
    dense = [v for v in model.trainable_variables if not v.name.startswith("table_")]
    out.update({f"dense_{i}": v.numpy() for i, v in enumerate(dense)})
    return out


def _table_handle_consumers(built, spec) -> list[str]:
    """Op types in the traced step that take a table (shard) handle: a whole-table read to
    the worker would show up as ReadVariableOp."""
    import tensorflow as tf

    from parallax.bench import workloads

    signature = {k: tf.TensorSpec(v.shape, tf.as_dtype(v.dtype))
                 for k, v in workloads.local_batch(spec, 0, 0).items()}
    strategy = built.strategy
    traced = tf.function(lambda batch: strategy.run(built.step_fn, args=(batch,)))
    graph = traced.get_concrete_function(signature).graph
    handles = {id(p.handle) for table in built.model.tables
               for p in getattr(table, "variables", [table])}
    kinds = set()
    for external, internal in graph.captures:
        if id(external) in handles:
            kinds.update(op.type for op in internal.consumers())
    return sorted(kinds)


def _train_and_dump(system: str, workload: str, out_dir: str) -> None:
    """Subprocess entry: STEPS steps of `system`, then rank 0's (or each MWMS worker's)
    variables to out_dir/vars<rank>.npz."""
    import numpy as np

    from parallax.bench import tf_peers, workloads

    spec = workloads.get(workload, "short")
    built = tf_peers.build(system, spec)
    for _ in range(STEPS):
        built.trainer.step()
    built.trainer.sync()
    np.savez(Path(out_dir) / f"vars{built.trainer.rank}.npz", **_snapshot(built.model))
    if system == "tf_ps":
        (Path(out_dir) / TABLE_OPS).write_text(json.dumps(_table_handle_consumers(built, spec)))


def _reference(workload: str, ranks: int) -> tuple[dict, dict]:
    """Plain single-process SGD, step i on the mean loss of the ranks' batch i: the
    variables before and after."""
    import keras
    import tensorflow as tf

    from parallax.bench import models, workloads

    spec = workloads.get(workload, "short")
    model = models.BenchModel(spec)
    optimizer = keras.optimizers.SGD(learning_rate=spec.lr)
    start = _snapshot(model)
    for i in range(STEPS):
        with tf.GradientTape() as tape:
            loss = tf.add_n([model.loss(workloads.local_batch(spec, r, i))
                             for r in range(ranks)]) / ranks
        variables = model.trainable_variables
        optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
    return start, _snapshot(model)


def _assert_same_updates(got_path: Path, start: dict, want: dict) -> None:
    """The system's total update of every variable equals the reference's, to 0.1% of the
    largest element of that update (the updates are small next to the weights, so
    comparing weights alone would hide a wrong update)."""
    import numpy as np

    got = dict(np.load(got_path))
    assert got.keys() == want.keys()
    for key, end in want.items():
        want_delta, got_delta = end - start[key], got[key] - start[key]
        scale = float(np.abs(want_delta).max())
        assert scale > 1e-6, f"{key} does not move in {STEPS} steps: nothing to compare"
        error = float(np.abs(got_delta - want_delta).max())
        print(f"{got_path.name} {key}: update {scale:.2e}, error {error:.2e}")
        assert error <= 1e-3 * scale, f"{key}: update differs by {error:.3g} (of {scale:.3g})"


def _dump_command(system: str, workload: str, out_dir: Path) -> list[str]:
    return [sys.executable, __file__, system, workload, str(out_dir)]


def test_mwms_equals_sgd_on_the_mean_gradient(tmp_path):
    """Two MWMS workers after STEPS steps hold exactly the variables of one process doing
    SGD on the mean loss of both workers' batches (sparse gradients all-gathered)."""
    run_cluster(tmp_path, "mwms", "lm", {"worker": 2},
                trainer_command=_dump_command("mwms", "lm", tmp_path))
    start, want = _reference("lm", ranks=2)
    _assert_same_updates(tmp_path / "vars0.npz", start, want)
    _assert_same_updates(tmp_path / "vars1.npz", start, want)


def test_tf_ps_one_worker_is_plain_sgd_with_lookups_on_the_servers(tmp_path):
    """With one worker the coordinator's steps run in order, so the sharded tables on two ps
    must end exactly as single-process SGD leaves them; and the traced step touches table
    handles only through gathers and scatter-subs (no whole-table read to the worker)."""
    run_cluster(tmp_path, "tf_ps", "ctr", {"chief": 1, "worker": 1, "ps": 2},
                trainer_command=_dump_command("tf_ps", "ctr", tmp_path))
    _assert_same_updates(tmp_path / "vars0.npz", *_reference("ctr", ranks=1))
    consumers = json.loads((tmp_path / TABLE_OPS).read_text())
    assert "ResourceGather" in consumers and "ReadVariableOp" not in consumers, consumers


@pytest.mark.parametrize("value, needle", [
    (None, "TF_CONFIG is not set"),
    ("{not json", "TF_CONFIG is not JSON"),
    ('{"cluster": {"chief": ["a:1"], "worker": ["b:1"]}, "task": {"type": "chief", "index": 0}}',
     "no ps job"),
    ('{"cluster": {"chief": ["a:1"], "worker": ["b:1"], "ps": ["c:1"]}, '
     '"task": {"type": "worker", "index": 3}}', "is not in its cluster"),
])
def test_tf_ps_names_a_bad_tf_config(monkeypatch, value, needle):
    from parallax.bench import tf_peers
    from parallax.errors import ConfigError

    if value is None:
        monkeypatch.delenv("TF_CONFIG", raising=False)
    else:
        monkeypatch.setenv("TF_CONFIG", value)
    with pytest.raises(ConfigError, match=needle):
        tf_peers.tf_config(("chief", "worker", "ps"))


if __name__ == "__main__":
    _train_and_dump(*sys.argv[1:4])
