"""Workers without Horovod: `parallax run --collectives tensorflow` starts them through its
TensorFlow supervisor, and their dense gradients go through TensorFlow's own collective ops.

Two workers must equal one process on the global batch (as with Horovod,
test_strategy_equivalence.py), the supervisor must report a failing worker as horovodrun does
(the launcher names the rank and stops the job), and what cannot work is refused up front.
"""
from __future__ import annotations

import ipaddress
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import free_ports
from parallax.errors import ConfigError
from parallax.launch.backends import BACKENDS, choose
from parallax.launch.backends.horovodrun import horovod_installed
from parallax.launch.backends.tf_supervisor import WorkerHost, remote_command
from parallax.launch.backends.tfrun import supervisor_hosts
from parallax.launch.hosts import is_local, parse_host_string
from parallax.launch.module_argv import own_module
from parallax.tf.collectives.tensorflow import collective_workers

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "helpers" / "strategy_worker.py"
PARALLAX = str(Path(sys.executable).parent / "parallax")
PLAIN = ["keras-sgd-fit", "custom-adagrad-custom", "custom-sgd-custom-allreduce",
         "shared-adagrad-custom", "keras-sgd-fit-ps"]
LAZY = ["keras-adam-fit"]  # against parallax on one worker (Adam's lazy rows)

pytestmark = pytest.mark.multiprocess


def _run(command: list[str], timeout: float = 900) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HOROVOD_", "OMPI_", "PMI_", "PARALLAX_")) and k != "TF_CONFIG"}
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=env)


def _two_workers(program: list[str], *flags: str, timeout: float = 300
                 ) -> subprocess.CompletedProcess:
    """`parallax run` of `program` on 2 workers over TensorFlow's collectives, 1 server."""
    return _run([PARALLAX, "run", "-np", "2", "--servers", "1", "--collectives", "tensorflow",
                 *flags, "--", *program], timeout=timeout)


def _ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout[-4000:]}\n" \
                                 f"{proc.stderr[-4000:]}"
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("tf-collectives")
    worker = [sys.executable, str(WORKER), "--steps", "20", "--batch", "16"]
    # both one-process references in one process (one TensorFlow start-up), plain first
    _ok(_run(worker + ["--setup", "plain", "--cases", ",".join(PLAIN), "--out",
                       str(base / "plain"), "--setup", "parallax", "--cases", ",".join(LAZY),
                       "--out", str(base / "one")]))
    two = _ok(_run([PARALLAX, "run", "-np", "2", "--servers", "2", "--collectives",
                    "tensorflow", "--", *worker, "--setup", "parallax", "--cases",
                    ",".join(PLAIN + LAZY), "--out", str(base / "two")]))
    return {"plain": base / "plain", "one": base / "one", "two": base / "two", "output": two}


def _max_difference(reference: Path, distributed: Path, case: str) -> float:
    want, got = np.load(reference / f"{case}.npz"), np.load(distributed / f"{case}.npz")
    assert len(want.files) == len(got.files)
    return max(float(np.abs(want[a] - got[b]).max() / max(1.0, np.abs(want[a]).max()))
               for a, b in zip(want.files, got.files))


@pytest.mark.parametrize("case", PLAIN)
def test_two_tensorflow_workers_equal_plain_single_process(results, case):
    assert _max_difference(results["plain"], results["two"], case) < 1e-5


@pytest.mark.parametrize("case", LAZY)
def test_two_tensorflow_workers_equal_one_worker_lazy_optimizers(results, case):
    assert _max_difference(results["one"], results["two"], case) < 1e-5


def test_the_workers_really_used_tensorflows_collectives(results):
    """Every case ran on two workers over TensorFlowWorkers (no Horovod in the workers),
    and the supervisor marked their output with ranks as horovodrun does."""
    summaries = [json.loads(line.split("CASE ", 1)[1]) for line in
                 results["output"].splitlines() if "CASE " in line]
    assert sorted(s["case"] for s in summaries) == sorted(PLAIN + LAZY)
    assert {(s["workers"], s["collectives"]) for s in summaries} == {(2, "TensorFlowWorkers")}
    assert any(line.startswith("[1]<stdout>:") for line in results["output"].splitlines())


def test_a_failing_worker_is_named_and_the_job_stops(tmp_path):
    """Worker 1 exits 3 while worker 0 would sleep: the supervisor reports it in horovodrun's
    words, stops worker 0, and `parallax run` exits with its code, naming rank 1."""
    script = tmp_path / "fail.py"
    script.write_text("import os, sys, time\n"
                      "rank = int(os.environ['PARALLAX_WORKER_RANK'])\n"
                      "print('WORKERS', os.environ['PARALLAX_WORKERS'], flush=True)\n"
                      "sys.exit(3) if rank == 1 else time.sleep(120)\n")
    proc = _two_workers([sys.executable, str(script)], timeout=120)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 3, output
    assert "Process 1 exit with status code 3." in output
    assert "worker rank 1 exited with code 3" in output
    workers = [line.split("WORKERS ", 1)[1] for line in output.splitlines() if "WORKERS " in line]
    assert workers and len(workers[0].split(",")) == 2


def test_local_aggregation_with_tensorflows_collectives_is_refused_up_front(tmp_path):
    proc = _two_workers([sys.executable, str(WORKER), "--setup", "parallax", "--cases",
                         "keras-adagrad-fit-localagg", "--out", str(tmp_path)])
    assert proc.returncode == 1
    assert "local aggregation gathers each step's sparse gradients" in proc.stdout + proc.stderr


# ---- choosing, and reading the workers (no process) -----------------------------------------
def test_the_backend_follows_collectives():
    two_here = parse_host_string("localhost:2")
    assert choose(two_here, 2, "tensorflow") is BACKENDS["tensorflow"]
    assert choose(two_here, 2, "horovod") is BACKENDS["horovodrun"]
    assert choose(two_here, 2) is BACKENDS["horovodrun" if horovod_installed() else "tensorflow"]
    assert choose(two_here, 1, "tensorflow") is BACKENDS["single"]
    assert supervisor_hosts(two_here, 2) == [{"host": "127.0.0.1", "workers": 2}]
    elsewhere = parse_host_string("localhost:1,carol@192.0.2.1:2")
    assert choose(elsewhere, 3, "tensorflow") is BACKENDS["tensorflow"]
    here, there = supervisor_hosts(elsewhere, 2)
    # this machine by the address 192.0.2.1 reaches it at, not loopback: its workers'
    # addresses go to the other host's workers too
    assert here["workers"] == 1 and is_local(here["host"])
    assert not ipaddress.ip_address(here["host"]).is_loopback, here
    assert there == {"host": "192.0.2.1", "workers": 1, "ssh_target": "carol@192.0.2.1"}


def test_a_remote_worker_runs_here_in_this_directory_with_the_exportable_environment():
    host = WorkerHost("192.0.2.1", 1, "carol@192.0.2.1", 2222)
    argv = remote_command(host, ["python", "train.py", "--name", "a b"],
                          {"PARALLAX_RUN_ID": "r1", "PARALLAX_PARENT_PID": "42",
                           "HOME": "/root", "SSH_AUTH_SOCK": "/x", "BASH_FUNC_f%%": "()",
                           "ODD": "it's"})
    assert argv[:-1] == [argv[0], "-o", "BatchMode=yes", "-p", "2222", "carol@192.0.2.1"]
    words = shlex.split(argv[-1])
    assert words[:2] == ["sh", "-c"]
    script = shlex.split(words[2])
    assert script[:4] == ["cd", os.getcwd(), "&&", "exec"]
    assert script[4:7] == ["env", "ODD=it's", "PARALLAX_RUN_ID=r1"]
    assert script[7:] == [*own_module("parallax.launch.hosts"), "serve", "python",
                          "train.py", "--name", "a b"]


def test_workers_come_from_parallax_run_or_tf_config():
    a, b = (f"127.0.0.1:{p}" for p in free_ports(2))
    assert collective_workers({"PARALLAX_WORKERS": f"{a},{b}",
                               "PARALLAX_WORKER_RANK": "1"}) == ([a, b], 1)
    assert collective_workers({"PARALLAX_WORKERS": a, "PARALLAX_WORKER_RANK": "0"}) is None
    with pytest.raises(ConfigError, match="PARALLAX_WORKER_RANK='2'"):
        collective_workers({"PARALLAX_WORKERS": f"{a},{b}", "PARALLAX_WORKER_RANK": "2"})
    tf_config = {"cluster": {"chief": [a], "worker": [b], "ps": ["h:1"]},
                 "task": {"type": "worker", "index": 0}}
    assert collective_workers({"TF_CONFIG": json.dumps(tf_config)}) == ([a, b], 1)
    tf_config["cluster"] = {"worker": [a], "ps": ["h:1"]}
    assert collective_workers({"TF_CONFIG": json.dumps(tf_config)}) is None
    assert collective_workers({}) is None


def test_signal_deaths_and_unended_lines_are_reported_as_horovodrun_does(tmp_path):
    """Worker 1 prints a progress line with no newline, then is SIGKILLed: the supervisor
    still reports it on a line of its own, with horovodrun's code 128 + 9, and `parallax run`
    names rank 1 and exits 137."""
    script = tmp_path / "killed.py"
    script.write_text("import os, signal, sys, time\n"
                      "if os.environ['PARALLAX_WORKER_RANK'] == '1':\n"
                      "    sys.stdout.write('5/100 [=>....] - loss: 0.69'); sys.stdout.flush()\n"
                      "    os.kill(os.getpid(), signal.SIGKILL)\n"
                      "time.sleep(120)\n")
    proc = _two_workers([sys.executable, str(script)], timeout=120)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 137, output
    assert "\nProcess 1 exit with status code 137." in output
    assert "worker rank 1 exited with code 137" in output


def test_small_integer_and_bool_tensors_are_summed_and_broadcast_exactly(tmp_path):
    """dtypes CollectiveReduceV2 does not take (bool, int8, uint8, int16) travel as int64."""
    script = tmp_path / "dtypes.py"
    script.write_text(
        "import tensorflow as tf\n"
        "from parallax.tf.collectives import make_collectives\n"
        "w = make_collectives('tensorflow')\n"
        "r = w.info.rank\n"
        "flag = tf.Variable(r == 0)\n"
        "small = tf.Variable(tf.constant([r + 1, 100], tf.int8))\n"
        "w.broadcast_variables([flag, small])\n"
        "sums = w.allreduce_sum([tf.constant([r], tf.uint8), tf.constant([r + 1], tf.int16),\n"
        "                        tf.constant(1.5)])\n"
        "print('RESULT', r, bool(flag.numpy()), small.numpy().tolist(),\n"
        "      [s.numpy().tolist() for s in sums], [s.dtype.name for s in sums], flush=True)\n")
    output = _ok(_two_workers([sys.executable, str(script)]))
    results = sorted(line.split("RESULT ", 1)[1] for line in output.splitlines()
                     if "RESULT " in line)
    expected = "True [1, 100] [[1], [3], 3.0] ['uint8', 'int16', 'float32']"
    assert results == [f"0 {expected}", f"1 {expected}"], output


@pytest.mark.horovod
def test_horovods_broadcast_of_variables_is_bit_exact_as_an_object_and_through_horovod(
        tmp_path):
    """HorovodWorkers.broadcast_variables: up to OBJECT_BROADCAST_BYTES as one pickled object
    (no tf.function traced), more through Horovod's own; either way every worker ends with
    rank 0's bits (-0.0 and a NaN's payload included) and dtypes."""
    script = tmp_path / "broadcast.py"
    script.write_text(
        "import sys\n"
        "import numpy as np, tensorflow as tf\n"
        "from parallax.tf.collectives import horovod, make_collectives\n"
        "horovod.OBJECT_BROADCAST_BYTES = int(sys.argv[1])\n"
        "w = make_collectives('horovod')\n"
        "r = w.info.rank\n"
        "bits = np.array([0x80000000, 0x7fc00123, 0x3f800000 + r], np.uint32)\n"
        "variables = [tf.Variable(bits.view(np.float32)), tf.Variable(r == 0),\n"
        "             tf.Variable(tf.constant([r + 1, 100], tf.int8))]\n"
        "w.broadcast_variables(variables)\n"
        "print('RESULT', r, variables[0].numpy().view(np.uint32).tolist(),\n"
        "      [v.numpy().tolist() for v in variables[1:]], [v.dtype.name for v in variables],\n"
        "      flush=True)\n")
    expected = "[2147483648, 2143289635, 1065353216] [True, [1, 100]] ['float32', 'bool', 'int8']"
    for limit in ("1024", "0"):  # as an object; through Horovod's broadcast_variables
        output = _ok(_run([PARALLAX, "run", "-np", "2", "--servers", "1", "--collectives",
                           "horovod", "--", sys.executable, str(script), limit], timeout=300))
        results = sorted(line.split("RESULT ", 1)[1] for line in output.splitlines()
                         if "RESULT " in line)
        assert results == [f"0 {expected}", f"1 {expected}"], (limit, output)


def test_a_secure_job_or_horovodrun_flags_are_refused_with_tensorflows_collectives(tmp_path):
    for extra in (["--secure"], ["--horovodrun-arg=--verbose"]):
        proc = _two_workers([sys.executable, "-c", "pass"], *extra, timeout=120)
        output = proc.stdout + proc.stderr
        assert proc.returncode != 0, (extra, output)
        assert ("listens, unauthenticated" if extra == ["--secure"] else
                "--horovodrun-arg --verbose: the workers start without horovodrun") in output


def test_a_strategy_asking_for_other_collectives_than_its_launcher_is_refused():
    """Else every worker would train alone, as rank 0 of 1."""
    from parallax.tf.collectives import make_collectives
    with pytest.raises(ConfigError, match="horovodrun \\(or mpirun\\) started this worker"):
        make_collectives("tensorflow", {"HOROVOD_RANK": "0", "HOROVOD_SIZE": "2"})
    a, b = (f"127.0.0.1:{p}" for p in free_ports(2))
    with pytest.raises(ConfigError, match="started this worker, one of 2, without Horovod"):
        make_collectives("horovod", {"PARALLAX_WORKERS": f"{a},{b}",
                                     "PARALLAX_WORKER_RANK": "0"})


@pytest.mark.parametrize("tf_config, message", [
    ({"cluster": {"worker": ["h:1", "h:2"]}}, 'no "task"'),
    ({"cluster": {"worker": ["h:1", "h:2"]}, "task": {"type": "worker", "index": 2}},
     "task index 2 is not one of the 2 worker tasks"),
    ({"cluster": {"worker": ["h:1", "h:2"]}, "task": {"type": "worker", "index": -1}},
     "task index -1"),
    ({"cluster": {"worker": "h:1,h:2"}, "task": {"type": "worker", "index": 0}},
     "must be lists"),
    ({"cluster": {"worker": ["h:1", "h"]}, "task": {"type": "worker", "index": 0}},
     "'h' is not host:port"),
])
def test_a_tf_config_that_cannot_name_this_worker_is_refused(tf_config, message):
    with pytest.raises(ConfigError, match=message):
        collective_workers({"TF_CONFIG": json.dumps(tf_config)})
    assert collective_workers({"TF_CONFIG": json.dumps(
        {"cluster": {"worker": ["h:1", "h:2"], "ps": ["p:1"]},
         "task": {"type": "ps", "index": 0}})}) is None  # a ps task takes no part


PAUSED = """
import os, pathlib, signal, sys, time
import tensorflow as tf
from parallax.tf.collectives import make_collectives
w = make_collectives("tensorflow")
r = w.info.rank
pidfile = pathlib.Path(sys.argv[1])
w.allreduce_sum([tf.constant(1.0)])  # both are up
if r == 1:  # a long pause (GC, a debugger, SIGSTOP): no heartbeat
    pidfile.with_suffix(".tmp").write_text(str(os.getpid()))
    pidfile.with_suffix(".tmp").rename(pidfile)
    os.kill(os.getpid(), signal.SIGSTOP)
else:
    while not pidfile.exists():
        time.sleep(0.1)
    time.sleep(float(sys.argv[2]))
    os.kill(int(pidfile.read_text()), signal.SIGCONT)
(total,) = w.allreduce_sum([tf.constant(float(r + 1))])
print("RESULT", r, float(total.numpy()), flush=True)
"""


def test_a_worker_paused_past_tensorflows_heartbeat_default_does_not_fail_the_job(tmp_path):
    """Issue 29, item 14: TensorFlow's coordination service failed every worker's
    collectives once one was silent for 10 s (its default heartbeat timeout). The timeout is
    PARALLAX_TF_HEARTBEAT_S, 60 s by default: a worker paused 15 s carries on."""
    script = tmp_path / "paused.py"
    script.write_text(PAUSED)
    output = _ok(_two_workers([sys.executable, str(script), str(tmp_path / "pid"), "15"]))
    assert sorted(line.split("RESULT ", 1)[1] for line in output.splitlines()
                  if "RESULT " in line) == ["0 3.0", "1 3.0"], output


@pytest.mark.parametrize("value", ["0", "-5", "soon", "1e9", "nan"])
def test_a_bad_heartbeat_setting_names_the_variable(value):
    from parallax.env import TF_HEARTBEAT_ENV, tf_heartbeat_seconds
    with pytest.raises(ConfigError, match=f"{TF_HEARTBEAT_ENV}=.*1-86400"):
        tf_heartbeat_seconds({TF_HEARTBEAT_ENV: value})
    assert tf_heartbeat_seconds({TF_HEARTBEAT_ENV: "120"}) == 120.0
    assert tf_heartbeat_seconds({}) == 60.0


QUIET_FIT = """
import json, os, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras, numpy as np, tensorflow as tf
import parallax

strategy = parallax.ParallaxStrategy(log_plan=False)
rows = 70  # 4 full global batches of 16, and a partial one of 6
ids = np.arange(rows, dtype="int64").reshape(-1, 1) % 50
labels = np.ones((rows, 1), "float32")
with strategy.scope():
    model = keras.Sequential([keras.Input((1,), dtype="int64"), keras.layers.Embedding(50, 4),
                              keras.layers.Flatten(), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.1), loss="mse")

class Steps(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.batches = 0

    def on_train_batch_end(self, batch, logs=None):
        self.batches += 1

    def on_epoch_end(self, epoch, logs=None):
        print(json.dumps({"rank": strategy.worker.rank, "steps": self.batches}), flush=True)

model.fit(ids, labels, batch_size=16, epochs=2, verbose=0, callbacks=[Steps()])
data = tf.data.Dataset.from_tensor_slices((ids, labels)).batch(16)  # of known length, 5
model.fit(data, epochs=2, verbose=0, shuffle=False, callbacks=[Steps()])
"""


def test_a_fit_that_drops_a_partial_batch_prints_nothing_of_tensorflows_or_keras(tmp_path):
    """Two workers over TensorFlow's collectives fit arrays, then a dataset of known length,
    whose last global batch is partial: each epoch runs the 4 full ones, and the job's
    output has neither TensorFlow's start-up lines (the workers' servers and coordination
    agents, absl's preamble), nor tf.data's note that parallax turned auto-sharding off,
    nor Keras' "Your input ran out of data" (the dropped batch is parallax's doing)."""
    script = tmp_path / "quiet_fit.py"
    script.write_text(QUIET_FIT)
    output = _ok(_two_workers([sys.executable, str(script)], "--progress-seconds", "0"))
    steps = sorted((r["rank"], r["steps"]) for r in map(json.loads, (
        line.split(":", 1)[1] for line in output.splitlines() if '"steps"' in line)))
    assert steps == [(rank, 4) for rank in (0, 1) for _ in range(4)], output
    for words in ("ran out of data", "auto_shard_policy", "Started server with target",
                  "Coordination agent", "absl::InitializeLog", "WARNING"):
        assert words not in output, output
