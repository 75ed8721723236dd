"""The training examples, run as users run them (subprocesses, tiny flags): the embedded
single-worker default, and the language model on 2 workers + 2 parameter servers.

Each example prints one `RESULT {json}` line per worker; the checks read it.
"""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
RESULT = re.compile(r"RESULT (\{.*\})\s*$")
TIMEOUT = 240

LM_FLAGS = ["--max-sentences", "20000", "--eval-sentences", "500", "--epochs", "3",
            "--steps-per-epoch", "20", "--batch-size", "256"]
CTR_FLAGS = ["--train-examples", "32768", "--eval-examples", "4096", "--epochs", "2",
             "--steps-per-epoch", "15"]
DENSE_FLAGS = ["--train-examples", "16384", "--eval-examples", "2048", "--epochs", "3",
               "--steps-per-epoch", "40"]


def _env() -> dict[str, str]:
    """Our environment without any launcher's or Horovod's variables: the example must run
    as a fresh single worker (or be given them by the launcher under test)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PARALLAX_", "HOROVOD_", "OMPI_", "PMI_"))}
    env["PYTHONUNBUFFERED"] = "1"
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    return env


def _run(argv: list[str]) -> tuple[subprocess.CompletedProcess, list[dict]]:
    proc = subprocess.run(argv, cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=TIMEOUT)
    results = [json.loads(m[1]) for line in proc.stdout.splitlines()
               if (m := RESULT.search(line))]
    return proc, results


def _explain(proc: subprocess.CompletedProcess) -> str:
    return (f"exit code {proc.returncode}\n--- stdout (end) ---\n{proc.stdout[-3000:]}\n"
            f"--- stderr (end) ---\n{proc.stderr[-5000:]}")


def run_example(script: str, *flags: str) -> dict:
    proc, results = _run([sys.executable, str(EXAMPLES / script), *flags])
    assert proc.returncode == 0, _explain(proc)
    assert len(results) == 1, f"expected one RESULT line\n{_explain(proc)}"
    return results[0]


def losses(result: dict) -> list[float]:
    return [epoch["loss"] for epoch in result["epochs"]]


def assert_common(result: dict, example: str, epochs: int, steps: int) -> None:
    assert result["example"] == example
    assert (result["rank"], result["workers"]) == (0, 1)
    assert result["steps"] == epochs * steps
    assert len(result["epochs"]) == epochs
    assert all(e["examples_per_s"] > 0 and e["steps"] == steps for e in result["epochs"])
    assert result["examples_per_s"] == pytest.approx(result["epochs"][-1]["examples_per_s"])
    assert losses(result)[-1] < losses(result)[0], f"loss did not fall: {losses(result)}"


@pytest.fixture(scope="module")
def lm_one_worker() -> dict:
    return run_example("language_model.py", *LM_FLAGS)


def test_language_model_one_worker(lm_one_worker):
    result = lm_one_worker
    assert_common(result, "language_model", epochs=3, steps=20)
    assert result["vocab_size"] >= 50_000
    assert result["embedding_rows"] == result["vocab_size"]
    assert result["tables_on_servers"] == ["words/embeddings"]  # the input table is sparse
    assert "1 variable(s) on the servers" in result["plan"]
    last = result["epochs"][-1]
    assert last["perplexity"] == pytest.approx(math.exp(last["loss"]), rel=1e-6)
    assert last["pulled_mb_per_s"] > 0 and last["pushed_mb_per_s"] > 0
    assert result["eval_perplexity"] < result["epochs"][0]["perplexity"]


def test_language_model_without_wordnet(tmp_path):
    proc, results = _run([sys.executable, str(EXAMPLES / "language_model.py"),
                          "--wordnet-dir", str(tmp_path)])
    assert proc.returncode != 0 and not results
    assert "apt-get install wordnet-base" in proc.stderr, _explain(proc)


def test_ctr_model():
    result = run_example("ctr_model.py", *CTR_FLAGS)
    assert_common(result, "ctr_model", epochs=2, steps=15)
    assert result["embedding_rows"] >= 10_000_000
    assert len(result["tables_on_servers"]) == result["tables"] == 8
    assert result["epochs"][-1]["auc"] > result["epochs"][0]["auc"]
    assert result["eval_auc"] > 0.55, result
    assert 0.15 < result["positive_rate"] < 0.35


def test_ctr_model_with_dynamic_embeddings_of_raw_64_bit_keys():
    result = run_example("ctr_model.py", *CTR_FLAGS, "--dynamic", "--dynamic-rows", "20000")
    assert_common(result, "ctr_model", epochs=2, steps=15)
    assert "8 variable(s) on the servers" in result["plan"]
    assert result["eval_auc"] > 0.55


def test_dense_model_runs_as_pure_allreduce():
    result = run_example("dense_model.py", *DENSE_FLAGS)
    assert_common(result, "dense_model", epochs=3, steps=40)
    assert "no sparse variables: running as pure all-reduce" in result["plan"]
    assert result["tables_on_servers"] == []
    assert result["eval_accuracy"] > 0.5


def test_dense_model_mode_flag_reaches_the_strategy():
    result = run_example("dense_model.py", "--mode", "ps", "--epochs", "1",
                         "--steps-per-epoch", "10", "--train-examples", "4096",
                         "--eval-examples", "0")
    assert result["mode"] == "ps"
    assert result["plan"].startswith("parallax plan (ps,")
    assert len(result["tables_on_servers"]) == 6  # every weight on the servers
    assert result["pulled_mb_per_s"] > 0


def _two_worker_command(script: Path, flags: list[str]) -> list[str]:
    """`parallax run -np 2 --servers 2 ...` when the launcher is there; otherwise what it does:
    two local servers, then horovodrun with their addresses in the environment."""
    try:
        import parallax.launch.run  # noqa: F401
    except ImportError:
        code = (
            "import os, subprocess, sys\n"
            "from parallax.client.local_cluster import LocalCluster\n"
            "with LocalCluster(2) as cluster:\n"
            "    env = dict(os.environ, PARALLAX_PS_ADDRESSES=','.join(cluster.addresses),\n"
            "               PARALLAX_RUN_ID='test-examples')\n"
            "    hvd = os.path.join(os.path.dirname(sys.executable), 'horovodrun')\n"
            "    sys.exit(subprocess.call([hvd, '-np', '2', '-H', 'localhost:2', '--gloo',\n"
            "                              sys.executable, *sys.argv[1:]], env=env))\n")
        return [sys.executable, "-c", code, str(script), *flags]
    return [sys.executable, "-m", "parallax.cli", "run", "-np", "2", "--servers", "2",
            str(script), *flags]


@pytest.mark.multiprocess
@pytest.mark.timeout(600)  # 131 s on a loaded machine
def test_language_model_two_workers(lm_one_worker):
    proc, results = _run(_two_worker_command(EXAMPLES / "language_model.py", LM_FLAGS))
    assert proc.returncode == 0, _explain(proc)
    by_rank = {r["rank"]: r for r in results}
    assert sorted(by_rank) == [0, 1], _explain(proc)
    for result in by_rank.values():
        assert result["workers"] == 2
        assert result["steps"] == 3 * 20
        assert losses(result)[-1] < losses(result)[0], losses(result)
        assert "2 worker(s), 2 server(s)" in result["plan"]
    # Keras' metrics are aggregated over the workers: both report the same curve ...
    assert losses(by_rank[0]) == pytest.approx(losses(by_rank[1]), rel=1e-9)
    # ... and synchronous steps on 2 x B/2 (each worker its own half of every global
    # batch) follow the single worker's steps on B.
    assert losses(by_rank[0]) == pytest.approx(losses(lm_one_worker), rel=2e-3)


@pytest.mark.parametrize("grouped", [False, True], ids=["tables", "grouped"])
def test_the_server_handler_benchmark_runs(grouped):
    """examples/benchmarks/server_handlers.py drives the real handlers of one in-process
    service through sync steps of two workers (a step that did not close would wait for the
    pull's deadline and fail the run), with a table per table or one table group; it prints
    its figure."""
    run = subprocess.run([sys.executable, str(EXAMPLES / "benchmarks" / "server_handlers.py"),
                          "--tables", "3", "--workers", "2", "--optimizer", "adam",
                          "--steps", "5", "--rounds", "1"] + ["--grouped"] * grouped,
                         capture_output=True, text=True, timeout=TIMEOUT)
    assert run.returncode == 0, run.stderr[-3000:]
    shape = "in one table group" if grouped else "each its own table"
    assert re.search(rf"3 tables {shape}, 2 worker\(s\), adam: server handler CPU [0-9.]+ "
                     rf"ms per step", run.stdout), run.stdout


def test_the_copy_rows_benchmark_counts_rows():
    """examples/benchmarks/copy_rows.py: one worker changes exactly the rows it pushes;
    two push some rows both, which a step changes once."""
    run = subprocess.run([sys.executable, str(EXAMPLES / "benchmarks" / "copy_rows.py"),
                          "--workers", "1,2", "--steps", "2", "--workloads", "lm"],
                         capture_output=True, text=True, timeout=TIMEOUT)
    assert run.returncode == 0, run.stderr[-3000:]
    found = re.findall(r"lm (\d) workers: pushed (\d+) rows a step, changed (\d+)", run.stdout)
    assert [w for w, _, _ in found] == ["1", "2"], run.stdout
    (_, one_pushed, one_changed), (_, two_pushed, two_changed) = found
    assert one_pushed == one_changed and int(two_changed) < int(two_pushed), run.stdout


def test_the_request_floor_benchmark_runs(tmp_path):
    """examples/benchmarks/request_floor.py sends pulls and pushes of one part to a real
    server and prints, per kind and size, the server's and the client's CPU per request."""
    out = tmp_path / "floor.json"
    run = subprocess.run([sys.executable, str(EXAMPLES / "benchmarks" / "request_floor.py"),
                          "--requests", "20", "--rounds", "1", "--out", str(out)],
                         capture_output=True, text=True, timeout=TIMEOUT, env=_env())
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert sorted(report) == sorted(f"{k} {n}" for k in ("pull", "push") for n in (1, 64, 3300))
    assert all(f["wall_us"] > 0 and f["client_us"] >= 0 for f in report.values()), report
    assert re.search(r"^push 3300 +\d+ +\d+ +\d+$", run.stdout, re.M), run.stdout


def test_the_first_touch_benchmark_runs(tmp_path):
    """examples/benchmarks/first_touch.py runs sync workers against a real server on new
    rows every step and on rows already touched, and reports the server's CPU a step.
    100 steps: the server's CPU is counted in clock ticks (10 ms), and 5 steps of ~1 ms
    read as 0 once in CI."""
    out = tmp_path / "first.json"
    run = subprocess.run([sys.executable, str(EXAMPLES / "benchmarks" / "first_touch.py"),
                          "--workers", "2", "--parts", "2", "--ids", "20", "--rows", "5000",
                          "--steps", "100", "--rounds", "1", "--initializer", "truncated_normal",
                          "--out", str(out)],
                         capture_output=True, text=True, timeout=TIMEOUT, env=_env())
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert sorted(report) == ["fresh", "warm"]
    assert all(f["server_ms_per_step"] > 0 and len(f["rounds"]) == 1
               for f in report.values()), report
    assert re.search(r"^fresh: server [0-9.]+ ms a step \(median\)$", run.stdout, re.M)


def test_the_wire_dtype_benchmark_runs(tmp_path):
    """examples/benchmarks/wire_dtype.py trains the lm workload once per wire dtype and a
    float32 control on 2 local servers: narrow rows move half the bytes, the losses stay
    within its bound of float32's, and it writes every step's loss and both plots."""
    run = subprocess.run([sys.executable, str(EXAMPLES / "benchmarks" / "wire_dtype.py"),
                          "--rounds", "2", "--steps", "3", "--vocab", "2000", "--batch", "32",
                          "--window", "2", "--control", "1e-3", "--plot"],
                         capture_output=True, text=True, timeout=TIMEOUT, cwd=tmp_path,
                         env=_env())
    assert run.returncode == 0, run.stderr[-3000:]
    for name in ("bfloat16", "float16"):
        assert re.search(rf"^{name} +[0-9.]+ +0\.5\d\d ", run.stdout, re.M), run.stdout
    assert "in every window: holds" in run.stdout, run.stdout
    results = json.loads((tmp_path / "bench-results" / "wire_dtype.json").read_text())
    assert sorted(results["results"]) == ["bfloat16", "float16", "float32", "float32-lr"]
    assert all(len(r["losses"]) == 6 for r in results["results"].values())
    assert (tmp_path / "bench-results" / "wire_dtype_loss.png").stat().st_size > 0
    assert (tmp_path / "bench-results" / "wire_dtype_loss_diff.png").stat().st_size > 0
