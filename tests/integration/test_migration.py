"""The migration guide's snippets (docs/migration.md), run for real.

The guide shows the files of examples/migration/ verbatim: each code block follows a
`<!-- file: examples/migration/NAME.py -->` line, and the first test checks that block and
file are identical, so what runs here is what the guide shows.

Every snippet trains the same model on the same global batches with SGD
(examples/migration/your_model.py: fixed initial weights, fixed data) and prints
`epoch N: loss X`. The reference is `mwms_before.py`, TensorFlow's MultiWorkerMirroredStrategy
with one worker; every other run must print the reference's losses within TOLERANCE, which
checks both that it trains (the reference's loss falls by a third in 3 epochs) and that the
code after the migration trains exactly as the code before it.

- Before, run here: mwms_before (one worker, the reference), horovod_tape_before (one Horovod
  process, no horovodrun) and tf_ps_before (a ClusterCoordinator with one TF worker and one
  TF ps task, all on loopback).
- Before, not runnable here: horovod_keras_before. Horovod 0.28.1's Keras callbacks call
  `Variable.ref()`, which Keras 3 variables lack, so it fails at its first batch; the test
  checks that it fails that way, as the guide says, and its "after" is compared with the
  reference instead.
- After: every "after" snippet on one worker (embedded servers; tf_ps_after also against a
  real `parallax server` named by TF_CONFIG's "ps" task), and mwms_after and tf_ps_after on
  2 workers and 2 servers through `parallax run -np 2`. The model tf_ps_after exports on 2
  workers is loaded in a process without parallax and must predict what plain Keras,
  trained on the same batches, predicts.
- The "before" snippets are not run on several workers (MWMS with TF_CONFIG, horovodrun -np
  2, several TF workers): each costs another set of processes, and the comparison does not
  need it, since the 2-worker "after" runs already equal the one-worker reference.

Every snippet, launcher and helper process carries the test's LAUNCH_TEST_MARK
(tests/parallel/test_launch.py): after each test no process with it may be left. Every exit code is
checked, the `parallax server` of the TF_CONFIG test's LocalCluster included.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from parallax.client import PSClient
from parallax.client.local_cluster import LocalCluster
from conftest import free_ports
from launching import MARK, Launcher, mark, port_closed, wait_gone  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "migration.md"
SNIPPETS = ROOT / "examples" / "migration"
TIMEOUT = 180
TOLERANCE = {"rel": 1e-5, "abs": 2e-6}  # losses are printed with 6 decimals
LOSS = re.compile(r"epoch (\d+): loss ([0-9.]+)$")
BLOCK = re.compile(r"<!-- file: (\S+) -->\n```python\n(.*?)```", re.DOTALL)

SERVE_WITHOUT_PARALLAX = """
import sys
sys.path.insert(0, sys.argv[2])
import keras, numpy as np, tensorflow as tf
from your_model import EPOCHS, GLOBAL_BATCH, LEARNING_RATE, build_model, load_data
served = tf.saved_model.load(sys.argv[1])
model = build_model()
model.compile(optimizer=keras.optimizers.SGD(LEARNING_RATE), loss="mse")
ids, labels = load_data()
model.fit(ids, labels, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
assert not any(m.startswith("parallax") for m in sys.modules), "parallax was imported"
got = served.serve(tf.constant(ids)).numpy()
print("DIFF", float(abs(got - model.predict(ids, verbose=0)).max()))
"""


def _env(mark: str, **extra: str) -> dict[str, str]:
    """Our environment without a launcher's or Horovod's variables (a fresh single worker),
    with the orphan check's mark."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PARALLAX_", "HOROVOD_", "OMPI_", "PMI_")) and k != "TF_CONFIG"}
    env.update(PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    env[MARK] = mark
    env.update(extra)
    # The plan cache of conftest.py, which the filter above dropped with the PARALLAX_ ones.
    if "PARALLAX_PLAN_CACHE" in os.environ:
        env["PARALLAX_PLAN_CACHE"] = os.environ["PARALLAX_PLAN_CACHE"]
    return env


def _explain(proc: subprocess.CompletedProcess) -> str:
    return (f"exit code {proc.returncode}\n--- stdout (end) ---\n{proc.stdout[-3000:]}\n"
            f"--- stderr (end) ---\n{proc.stderr[-5000:]}")


def losses_in(lines: list[str]) -> list[float]:
    """The `epoch N: loss X` values of `lines`, in order, checked to number 0, 1, ..."""
    found = [(int(m[1]), float(m[2])) for line in lines if (m := LOSS.search(line))]
    assert [epoch for epoch, _ in found] == list(range(len(found))), lines[-40:]
    return [loss for _, loss in found]


def run_snippet(name: str, cwd: Path, mark: str, **env: str) -> subprocess.CompletedProcess:
    """python examples/migration/NAME.py, as a user runs it, in `cwd`."""
    return subprocess.run([sys.executable, str(SNIPPETS / name)], cwd=cwd,
                          env=_env(mark, **env), capture_output=True, text=True,
                          timeout=TIMEOUT)


def trained(name: str, cwd: Path, mark: str, **env: str) -> list[float]:
    """Run a snippet that must succeed; its per-epoch losses."""
    proc = run_snippet(name, cwd, mark, **env)
    assert proc.returncode == 0, _explain(proc)
    return losses_in(proc.stdout.splitlines())


def assert_same_training(losses: list[float], reference: list[float]) -> None:
    assert losses == pytest.approx(reference, **TOLERANCE), (losses, reference)


def run_two_workers(name: str, cwd: Path, mark: str,
                    monkeypatch: pytest.MonkeyPatch) -> Launcher:
    """`parallax run -np 2 --servers 2 NAME.py` in `cwd`; it must exit 0 and stop its
    servers."""
    monkeypatch.chdir(cwd)  # the launcher and its workers inherit it
    for key in [k for k in os.environ if k.startswith(("HOROVOD_", "OMPI_", "PMI_"))]:
        monkeypatch.delenv(key)
    for key in ("PARALLAX_PS_ADDRESSES", "PARALLAX_RUN_ID", "PARALLAX_MODE", "PARALLAX_SYNC",
                "TF_CONFIG"):
        monkeypatch.delenv(key, raising=False)
    launcher = Launcher("-np", "2", "--servers", "2", str(SNIPPETS / name), mark=mark)
    assert launcher.wait(TIMEOUT) == 0, launcher.output()
    start = launcher.start_line()
    addresses = start.split("(started here): ")[1].split(";")[0].split(",")
    assert len(addresses) == 2 and all(port_closed(a) for a in addresses), start
    return launcher


def rank_lines(launcher: Launcher, rank: int) -> list[str]:
    """What worker `rank` printed (horovodrun prefixes its lines with `[rank]<stdout>:`)."""
    prefix = f"[{rank}]<stdout>:"
    return [line[len(prefix):] for line in launcher.out if line.startswith(prefix)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[float]:
    """mwms_before.py: MultiWorkerMirroredStrategy, one worker (no TF_CONFIG)."""
    tag = uuid.uuid4().hex
    losses = trained("mwms_before.py", tmp_path_factory.mktemp("mwms"), tag)
    assert not wait_gone(tag), "processes left behind"
    assert len(losses) == 3 and losses[0] > losses[1] > losses[2], losses
    assert losses[-1] < 0.7 * losses[0], f"the reference barely trained: {losses}"
    return losses


# ---- the guide shows the files ---------------------------------------------------------

def test_the_guide_shows_every_snippet_file_verbatim():
    text = GUIDE.read_text()
    blocks = BLOCK.findall(text)
    assert blocks, "no <!-- file: ... --> blocks in docs/migration.md"
    shown = {}
    for path, code in blocks:
        assert (ROOT / path).read_text() == code, f"{path} differs from its block in the guide"
        shown[path] = code
    snippets = {f"examples/migration/{p.name}" for p in SNIPPETS.glob("*_before.py")} | \
        {f"examples/migration/{p.name}" for p in SNIPPETS.glob("*_after.py")}
    assert snippets and snippets <= set(shown), f"not in the guide: {snippets - set(shown)}"
    assert "examples/migration/your_model.py" in text  # the stand-ins are named


# ---- from MultiWorkerMirroredStrategy ----------------------------------------------------

def test_mwms_after_on_one_worker_trains_as_mwms(reference, tmp_path, mark):
    assert_same_training(trained("mwms_after.py", tmp_path, mark), reference)


@pytest.mark.multiprocess
def test_mwms_after_on_two_workers_trains_as_one_mwms_worker(reference, tmp_path, mark,
                                                             monkeypatch):
    """The global batch is split over 2 workers; Keras' logs are averaged over workers, so
    both print the same losses, which equal one MWMS worker's on the whole batch."""
    launcher = run_two_workers("mwms_after.py", tmp_path, mark, monkeypatch)
    losses = losses_in(rank_lines(launcher, 0))
    assert_same_training(losses, reference)
    assert losses_in(rank_lines(launcher, 1)) == losses
    assert "parallax plan (hybrid, sync, 2 worker(s), 2 server(s))" in launcher.output()


# ---- from Horovod ------------------------------------------------------------------------

def test_horovod_tape_before_on_one_process_trains_as_mwms(reference, tmp_path, mark):
    assert_same_training(trained("horovod_tape_before.py", tmp_path, mark), reference)


def test_horovod_tape_after_on_one_worker_trains_as_mwms(reference, tmp_path, mark):
    assert_same_training(trained("horovod_tape_after.py", tmp_path, mark), reference)


def test_horovod_keras_before_fails_under_keras_3(tmp_path, mark):
    """What the guide says: Horovod 0.28.1's Keras API cannot run with Keras 3."""
    proc = run_snippet("horovod_keras_before.py", tmp_path, mark)
    assert proc.returncode != 0, _explain(proc)
    assert "AttributeError: 'Variable' object has no attribute 'ref'" in proc.stderr, \
        _explain(proc)
    assert "BroadcastGlobalVariablesCallback" in proc.stderr or "callbacks.py" in proc.stderr


def test_horovod_keras_after_on_one_worker_trains_as_mwms(reference, tmp_path, mark):
    """Its chief-only ModelCheckpoint writes the file (the embedded servers have no data
    directory: the file holds the table's rows, with a warning)."""
    assert_same_training(trained("horovod_keras_after.py", tmp_path, mark), reference)
    assert (tmp_path / "checkpoint.weights.h5").stat().st_size > 0


# ---- from TF's ParameterServerStrategy ---------------------------------------------------

def test_tf_ps_before_trains_as_mwms(reference, tmp_path, mark):
    """The coordinator (the snippet, task "chief") with one TF worker and one TF ps task,
    both `tf.distribute.Server`s of one helper process that serves until killed."""
    chief, worker, ps = (f"127.0.0.1:{p}" for p in free_ports(3))
    cluster = {"chief": [chief], "worker": [worker], "ps": [ps]}
    serve = ("import json, sys, tensorflow as tf\n"
             "cluster = tf.train.ClusterSpec(json.loads(sys.argv[1]))\n"
             "servers = [tf.distribute.Server(cluster, job_name=job, task_index=0)\n"
             "           for job in ('worker', 'ps')]\n"
             "servers[0].join()\n")
    servers = subprocess.Popen([sys.executable, "-c", serve, json.dumps(cluster)],
                               env=_env(mark), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
        tf_config = json.dumps({"cluster": cluster, "task": {"type": "chief", "index": 0}})
        losses = trained("tf_ps_before.py", tmp_path, mark, TF_CONFIG=tf_config)
        assert servers.poll() is None, f"the TF servers exited with {servers.returncode}"
    finally:
        servers.kill()
        servers.wait(10)
    assert_same_training(losses, reference)


def test_tf_ps_after_uses_the_ps_tasks_of_tf_config(reference, tmp_path, mark):
    """One worker whose TF_CONFIG names a `parallax server` as its "ps" task: the table goes
    there, under a run id derived from the cluster; a second run with the same TF_CONFIG
    derives the same run id and is refused, since that table has trained."""
    with LocalCluster(1) as cluster:
        tf_config = json.dumps({"cluster": {"worker": [f"127.0.0.1:{free_ports(1)[0]}"],
                                            "ps": cluster.addresses},
                                "task": {"type": "worker", "index": 0}})
        assert_same_training(trained("tf_ps_after.py", tmp_path, mark, TF_CONFIG=tf_config),
                             reference)
        with PSClient(cluster.addresses) as client:
            tables = [t.table for reply in client.stats().values() for t in reply.tables]
        assert len(tables) == 1 and re.fullmatch(r"tf-[0-9a-f]{12}\.v\d+\.embedding_embeddings",
                                                 tables[0]), tables
        again = run_snippet("tf_ps_after.py", tmp_path, mark, TF_CONFIG=tf_config)
        assert again.returncode != 0, _explain(again)
        assert "already exists on the servers and has applied" in again.stderr, _explain(again)
    assert cluster.exit_codes == [0]


@pytest.mark.multiprocess
def test_two_horovod_workers_use_the_ps_tasks_of_tf_config(reference, tmp_path, mark):
    """`horovodrun -np 2` (no `parallax run`, so no PARALLAX_PS_ADDRESSES) with a TF_CONFIG
    whose "ps" tasks are `parallax server`s: both workers use those servers (they were
    refused as "no parameter servers were given" before) and train as the reference."""
    with LocalCluster(2) as cluster:
        tf_config = json.dumps({"cluster": {"worker": [f"127.0.0.1:{p}" for p in
                                                       free_ports(2)],
                                            "ps": cluster.addresses},
                                "task": {"type": "worker", "index": 0}})
        horovodrun = str(Path(sys.executable).parent / "horovodrun")
        proc = subprocess.run([horovodrun, "--gloo", "-np", "2", "-H", "localhost:2",
                               sys.executable, str(SNIPPETS / "tf_ps_after.py")], cwd=tmp_path,
                              env=_env(mark, TF_CONFIG=tf_config), capture_output=True,
                              text=True, timeout=TIMEOUT)
        assert proc.returncode == 0, _explain(proc)
        prefix = "[0]<stdout>:"
        assert_same_training(losses_in([line[len(prefix):] for line in proc.stdout.splitlines()
                                        if line.startswith(prefix)]), reference)
        with PSClient(cluster.addresses) as client:
            tables = {t.table for reply in client.stats().values() for t in reply.tables}
        assert tables and all(t.startswith("tf-") for t in tables), tables
    assert cluster.exit_codes == [0, 0]


@pytest.mark.multiprocess
def test_tf_ps_after_on_two_workers_trains_and_exports_a_model_that_serves_alone(
        reference, tmp_path, mark, monkeypatch):
    launcher = run_two_workers("tf_ps_after.py", tmp_path, mark, monkeypatch)
    assert_same_training(losses_in(rank_lines(launcher, 0)), reference)
    assert not losses_in(rank_lines(launcher, 1))  # only the chief prints
    exported = tmp_path / "exported_model"
    assert (exported / "saved_model.pb").exists(), launcher.output()
    proc = subprocess.run([sys.executable, "-c", SERVE_WITHOUT_PARALLAX, str(exported),
                           str(SNIPPETS)], env=_env(mark), capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert proc.returncode == 0, _explain(proc)
    [diff] = [float(line.split()[1]) for line in proc.stdout.splitlines()
              if line.startswith("DIFF ")]
    assert diff < 1e-5, f"the exported model predicts {diff} away from plain Keras"

