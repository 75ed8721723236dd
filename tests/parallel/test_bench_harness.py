"""The benchmark harness end to end (`parallax bench` with the short configuration, real
processes in real namespaces) and its arithmetic."""
from __future__ import annotations

import io
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from parallax.bench import cgroups, harness, measure, netns, roles, workloads
from parallax.bench.command import config_from, parser
from parallax.errors import ConfigError
from launching import MARK, marked_processes

ROOT = Path(__file__).resolve().parents[2]


def _prefix() -> str:
    return "pxh" + secrets.token_hex(2)


def _bench(tmp_path: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`parallax bench` with a unique mark in its environment, which every process it
    starts inherits (see test_launch.marked_processes)."""
    out = tmp_path / "out"
    return subprocess.run([sys.executable, "-m", "parallax.cli", "bench", "--size", "short",
                           "--out", str(out), "--windows", "2", "--window-seconds", "0.5",
                           "--warmup-steps", "2", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", MARK: tmp_path.name})


def _groups(prefix: str) -> list[str]:
    return sorted(str(p) for p in cgroups.CPU_ROOT.glob(f"{prefix}-*"))


def _namespaces(prefix: str) -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in listed.splitlines() if line.startswith(prefix)]


def test_short_comparison_in_namespaces_measures_every_system(tmp_path):
    reason = netns.available()
    assert reason is None, f"the benchmark's namespaces need root, ip and tc: {reason}"
    prefix = _prefix()
    done = _bench(tmp_path, "--workloads", "lm", "--workers", "2", "--networks", "unlimited",
                  "--systems", "hybrid,horovod,mwms,tf_ps,hybrid_tf", "--rounds", "1",
                  "--prefix", prefix, "--placement", "dedicated")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = tmp_path / "out"
    results = json.loads((out / "results.json").read_text())
    runs = {r["system"]: r for r in results["runs"]}
    assert set(runs) == {"hybrid", "horovod", "mwms", "tf_ps", "hybrid_tf"}
    for system, run in runs.items():
        assert run["status"] == "ok", f"{system}: {run['error']}"
        assert run["samples_per_s"] > 0 and run["cpu_seconds_per_sample"] > 0
        assert len(run["windows"]) == 2
        assert run["network"]["name"] == "unlimited:dedicated"
        assert run["network"]["placement"] == run["placement"] == "dedicated"
    # A host per process: workers, servers, TF's coordinator; shared cores: no core count.
    assert {s: (r["hosts"], r["cores"]) for s, r in runs.items()} == {
        "hybrid": (4, None), "hybrid_tf": (4, None), "horovod": (2, None), "mwms": (2, None),
        "tf_ps": (5, None)}
    spec = workloads.get("lm", "short")
    hybrid = runs["hybrid"]
    measured = hybrid["worker_bytes_per_step"]
    minimum = hybrid["analytic"]
    # Bytes are counted on the namespaces' interfaces: the rows and gradients a worker
    # moves, plus gRPC/TCP framing; the traffic model counts payload only. The floor allows
    # for a window's edges: its bytes and its steps are read at slightly different moments,
    # which on a loaded machine left a short run at 0.89x (2 of 6 runs at the former 0.9).
    for way in ("sent", "received"):
        assert 0.8 * minimum[way] <= measured[way] <= 1.3 * minimum[way], (way, measured,
                                                                             minimum)
    # The servers' hosts carried the workers' pulls and pushes; nothing else did.
    window = hybrid["windows"][0]
    assert window["bytes_received"]["ps0"] > 0 and window["bytes_received"]["ps1"] > 0
    assert window["bytes_sent"]["chief"] == 0
    # Horovod all-gathers the sparse gradients: at this tiny size its model predicts about
    # the servers' bytes (it measured 0.90x-1.19x hybrid's here), so it is held to its own
    # traffic model, as hybrid is, not to hybrid's measurement.
    horovod = runs["horovod"]
    for way in ("sent", "received"):
        ratio = horovod["worker_bytes_per_step"][way] / horovod["analytic"][way]
        assert 0.75 <= ratio <= 1.33, (way, ratio)
    # hybrid over TensorFlow's collectives (across the namespaces) moves what hybrid over
    # Horovod moves: the same pulls and pushes, and a ring all-reduce of the dense part.
    for way in ("sent", "received"):
        ratio = runs["hybrid_tf"]["worker_bytes_per_step"][way] / measured[way]
        assert 0.75 <= ratio <= 1.33, (way, ratio)
    assert hybrid["global_batch"] == 2 * spec.batch_per_worker
    report = (out / "report.md").read_text()
    assert "lm on unlimited:dedicated" in report and "| hybrid | 4 | shared |" in report
    assert (out / "throughput_lm_unlimited-dedicated.png").stat().st_size > 1000
    assert _namespaces(prefix) == []
    assert marked_processes(tmp_path.name) == {}


def test_tf_ps_runs_colocated_with_three_jobs_on_one_host(tmp_path):
    """Equal hardware for TF's ParameterServerStrategy: its ps tasks and its coordinator
    inside the workers' hosts (each job on its own port there), 2 hosts in all."""
    prefix = _prefix()
    done = _bench(tmp_path, "--workloads", "lm", "--workers", "2", "--networks", "unlimited",
                  "--systems", "tf_ps", "--rounds", "1", "--prefix", prefix)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [run] = json.loads((tmp_path / "out" / "results.json").read_text())["runs"]
    assert run["status"] == "ok", run["error"]
    assert (run["placement"], run["hosts"], run["cores"]) == ("colocated", 2, None)
    assert set(run["per_process"]) == {"worker", "server", "chief"}
    assert all(set(w["bytes_sent"]) == {"worker0", "worker1"} for w in run["windows"])
    logs = sorted(p.name for p in (tmp_path / "out" / "logs").glob("*/*.log"))
    assert logs == ["chief-chief.log", "ps0-ps.log", "ps1-ps.log", "worker0-worker.log",
                    "worker1-worker.log"]
    assert "[2 hosts]" in done.stdout
    assert _namespaces(prefix) == [] and marked_processes(tmp_path.name) == {}


def test_failed_run_is_recorded_and_everything_is_cleaned_up(tmp_path):
    prefix = _prefix()
    done = _bench(tmp_path, "--workloads", "dense", "--workers", "2", "--networks",
                  "unlimited", "--systems", "hybrid", "--rounds", "1", "--prefix", prefix,
                  "--run-timeout", "3")
    assert done.returncode == 0, done.stderr[-3000:]
    run = json.loads((tmp_path / "out" / "results.json").read_text())["runs"][0]
    assert run["status"] == "failed"
    assert "timed out after 3 s" in run["error"]
    assert "FAILED" in done.stdout
    assert _namespaces(prefix) == []
    assert marked_processes(tmp_path.name) == {}


def _host(pid: int, prefix: str) -> tuple[str, str]:
    """(namespace, CPU group) process pid runs in, read from /proc/<pid>/ns/net (matched
    against /run/netns) and /proc/<pid>/cgroup (the cpu controller's line)."""
    inode = os.stat(f"/proc/{pid}/ns/net").st_ino
    namespace = next((ns for ns in _namespaces(prefix)
                      if os.stat(f"/run/netns/{ns}").st_ino == inode), "root")
    lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    group = next(line.rpartition(":")[2] for line in lines
                 if "cpu" in line.split(":")[1].split(","))
    return namespace, group


def _python_processes(mark: str, module: str) -> list[int]:
    """The marked processes that are `python -m module` by now (not the `sh` or `ip netns
    exec` in front of them, whose command lines name the module too)."""
    return [pid for pid, cmd in marked_processes(mark).items()
            if cmd.startswith(sys.executable) and f"-m {module} " in cmd]


def _hosts_once_started(mark: str, prefix: str, bench: subprocess.Popen) -> dict[str, tuple]:
    """Process name (from the log its stdout goes to: logs/<run>/<name>-<role>.log) ->
    (namespace, CPU group), once both workers have started."""
    deadline = time.monotonic() + 120
    while len(_python_processes(mark, "parallax.bench.worker")) < 2:
        assert time.monotonic() < deadline and bench.poll() is None, "no workers started"
        time.sleep(0.5)
    pids = _python_processes(mark, "parallax_ps") + _python_processes(mark,
                                                                      "parallax.bench.worker")
    return {Path(os.readlink(f"/proc/{pid}/fd/1")).name.split("-")[0]: _host(pid, prefix)
            for pid in pids}


def test_sigterm_stops_every_process_and_deletes_the_namespaces(tmp_path):
    """Also: colocated (the default), each server runs inside a worker's host (server i in
    worker i's namespace and CPU group), and there are no other hosts."""
    prefix = _prefix()
    out = tmp_path / "out"
    bench = subprocess.Popen(
        [sys.executable, "-m", "parallax.cli", "bench", "--size", "short", "--out", str(out),
         "--workloads", "lm", "--workers", "2", "--networks", "unlimited", "--systems",
         "hybrid", "--prefix", prefix, "--window-seconds", "30", "--cpu-share", "0.5"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", MARK: tmp_path.name})
    try:
        hosts = _hosts_once_started(tmp_path.name, prefix, bench)
        assert hosts == {f"{name}{i}": (f"{prefix}-worker{i}", f"/{prefix}-worker{i}")
                         for name in ("ps", "worker") for i in range(2)}
        assert sorted(_namespaces(prefix)) == [f"{prefix}-worker0", f"{prefix}-worker1"]
        assert _groups(prefix) == [f"{cgroups.CPU_ROOT}/{prefix}-{h}"
                                   for h in ("worker0", "worker1")]
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(60) == 128 + signal.SIGTERM
    finally:
        if bench.poll() is None:
            bench.kill()
        left_namespaces, left_processes = _namespaces(prefix), marked_processes(tmp_path.name)
        left_groups = _groups(prefix)
        netns.sweep(prefix)  # whatever the outcome, leave nothing to the next test
        cgroups.sweep(prefix)
    assert left_namespaces == []
    assert left_groups == []
    assert left_processes == {}


def test_cpu_isolated_runs_hold_each_process_to_its_share(tmp_path):
    """`--cpu-share off,0.25`: a shared-core and an isolated setting in one results file;
    the isolated one's links at 100 Mbit/s x 0.25, no host (a worker and its co-located
    server: colocated is the default) above its quarter core, hosts and cores on every run,
    CPU per step per role recorded, the step-time model fitted, nothing left."""
    assert cgroups.available() is None, cgroups.available()
    prefix = _prefix()
    done = _bench(tmp_path, "--workloads", "lm", "--workers", "1,2", "--networks", "100mbit",
                  "--systems", "hybrid", "--rounds", "1", "--prefix", prefix,
                  "--cpu-share", "off,0.25")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    runs = results["runs"]
    assert [(r["network"]["name"], r["workers"], r["status"], r["hosts"], r["cores"])
            for r in runs] == [
        ("100mbit:colocated", 1, "ok", 1, None), ("100mbit:colocated", 2, "ok", 2, None),
        ("100mbit@0.25cpu:colocated", 1, "ok", 1, 0.25),
        ("100mbit@0.25cpu:colocated", 2, "ok", 2, 0.5)]
    isolated = runs[3]
    assert {k: isolated["network"][k] for k in ("rate_mbit", "cpu_share", "cpu_quota_us",
                                               "nominal_rate_mbit")} == {
        "rate_mbit": 25.0, "cpu_share": 0.25, "cpu_quota_us": 25000, "nominal_rate_mbit": 100.0}
    assert "cpu_share" not in runs[1]["network"] and runs[1]["network"]["rate_mbit"] == 100.0
    for window in isolated["windows"]:
        rates = {h: c / window["seconds"] for h, c in window["cpu_seconds_by_host"].items()}
        assert set(rates) == {"worker0", "worker1", "ps0", "ps1"}  # CPU: per process
        hosts = [rates[f"worker{i}"] + rates[f"ps{i}"] for i in range(2)]
        assert max(hosts) <= 0.3, rates
        assert set(window["bytes_sent"]) == {"worker0", "worker1"}  # bytes: per host link
    per_process = isolated["per_process"]
    assert (per_process["worker"]["processes"], per_process["server"]["processes"]) == (2, 2)
    assert per_process["worker"]["cpu_seconds"] > 0 and per_process["server"]["cpu_seconds"] > 0
    assert per_process["server"]["bytes_sent"] is None  # no link of its own
    assert isolated["traffic_workload"]["workers"] == 2
    assert any(n.startswith("100mbit@0.25cpu: each host in its own CPU group of 0.25 core")
               for n in results["meta"]["notes"])
    assert any(n.startswith("Horovod's cycle time: ") for n in results["meta"]["notes"])
    report = (tmp_path / "out" / "report.md").read_text()
    assert "### lm on 100mbit:colocated (" in report
    assert "### lm on 100mbit@0.25cpu:colocated (25 Mbit/s" in report
    assert "| hybrid | 2 | 0.5 | " in report  # hosts, cores at 2 workers
    assert "### lm, fitted on 100mbit@0.25cpu:colocated" in report and "| hybrid | " in report
    assert (tmp_path / "out" / "projection_lm.png").stat().st_size > 1000
    # Start-up ran unthrottled: each isolated run's hosts were throttled at its gate.
    gates = sorted(p.parent.name for p in (tmp_path / "out" / "logs").glob("*/throttled"))
    assert gates == ["100mbit@0.25cpu:colocated-lm-w1-r0-hybrid",
                     "100mbit@0.25cpu:colocated-lm-w2-r0-hybrid"], gates
    assert _groups(prefix) == [] and _namespaces(prefix) == []
    assert marked_processes(tmp_path.name) == {}


def test_loopback_runs_without_namespaces_and_counts_no_bytes(tmp_path):
    done = _bench(tmp_path, "--workloads", "dense", "--workers", "1", "--networks",
                  "loopback", "--systems", "allreduce,horovod", "--rounds", "2",
                  "--data-batches", "20")
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    runs = results["runs"]
    assert harness.DATA_NOTE.format(batches=20) in results["meta"]["notes"]
    # Rounds alternate systems: A B A B.
    assert [(r["system"], r["round"]) for r in runs] == [
        ("allreduce", 0), ("horovod", 0), ("allreduce", 1), ("horovod", 1)]
    assert all(r["status"] == "ok" and r["worker_bytes_per_step"] is None for r in runs)
    # every worker imported this checkout's parallax (an A/B of two checkouts shows two)
    assert {r["code"] for r in runs} == {str(ROOT)}


def test_the_commit_says_when_tracked_files_differ_from_it(tmp_path):
    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
                       cwd=tmp_path, check=True, capture_output=True)
    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("commit", "-q", "-m", "a")
    clean = harness._git_commit(tmp_path)
    assert len(clean) >= 7 and not clean.endswith("+dirty")
    (tmp_path / "new.txt").write_text("untracked files are not what ran\n")
    assert harness._git_commit(tmp_path) == clean
    (tmp_path / "a.py").write_text("x = 2\n")
    assert harness._git_commit(tmp_path) == clean + "+dirty"
    assert harness._git_commit(tmp_path / "nowhere") == "unknown"


def test_row_cache_and_numpy_path_systems_run_in_the_same_rounds_and_train_as_hybrid(tmp_path):
    done = _bench(tmp_path, "--workloads", "ctr", "--workers", "1", "--networks", "loopback",
                  "--systems", "hybrid,hybrid_py", "--cache-staleness", "0,4", "--rounds", "1",
                  "--cache-mb", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    runs = {r["system"]: r for r in
            json.loads((tmp_path / "out" / "results.json").read_text())["runs"]}
    assert list(runs) == ["hybrid", "hybrid_py", "hybrid_cache0", "hybrid_cache4"]
    assert all(r["status"] == "ok" for r in runs.values())
    plain, numpy_path, exact, stale = runs.values()
    # hybrid_py: hybrid's processes on the numpy data path, the same losses bit for bit.
    assert plain["data_path"].startswith("native") and numpy_path["data_path"] == \
        "python (selected)"
    n = min(len(plain["losses"]), len(numpy_path["losses"]))
    assert n > 5 and plain["losses"][:n] == numpy_path["losses"][:n]
    assert plain["counters"]["server_pull_rows"] > 0 and "cache_hits" not in plain["counters"]
    assert exact["cache"] == {"staleness": 0, "mb": 1} and stale["counters"]["cache_hits"] > 0
    n = min(len(plain["losses"]), len(exact["losses"]))
    assert n > 5 and plain["losses"][:n] == exact["losses"][:n]  # staleness 0: bit for bit
    report = (tmp_path / "out" / "report.md").read_text()
    assert "## Row cache" in report and "| hybrid_cache4 |" in report
    assert (tmp_path / "out" / "cache_ctr_loopback-colocated_w1.png").stat().st_size > 1000


def test_row_cache_options_make_systems_and_bad_ones_are_refused():
    config = config_from(parser().parse_args(["--systems", "hybrid", "--cache-staleness",
                                              "0,16,4", "--cache-mb", "8"]))
    assert config.runs == ("hybrid", "hybrid_cache0", "hybrid_cache16", "hybrid_cache4")
    assert config.cache_mb == 8 and harness.base_system("hybrid_cache16") == "hybrid"
    assert harness.base_system("hybrid_py") == "hybrid" and "hybrid_py" not in harness.BenchConfig().runs
    assert harness.hosts_per_run(harness.BenchConfig(systems=(), workers=(2,),
                                                     cache_staleness=(1,))) == 2
    assert harness.hosts_per_run(harness.BenchConfig(systems=(), workers=(2,),
                                                     cache_staleness=(1,),
                                                     placements=("dedicated",))) == 4
    with pytest.raises(ConfigError, match=r"--cache-mb 0 must be >= 1.*--cache-mb 64"):
        config_from(parser().parse_args(["--cache-mb", "0"]))
    with pytest.raises(ConfigError, match=r"--cache-staleness values must be integers >= 0"):
        harness.BenchConfig(cache_staleness=(-1,))
    with pytest.raises(SystemExit):
        parser().parse_args(["--cache-staleness", "four"])
    from parallax.bench.worker import _parser
    args = _parser().parse_args(["--system", "hybrid", "--workload", "ctr",
                                 "--cache-staleness", "4", "--cache-mb", "2"])
    assert (args.cache_staleness, args.cache_mb) == (4, 2)


def test_window_arithmetic():
    windows = [{"seconds": 2.0, "steps": 10, "samples": 100, "samples_per_s": 50.0,
                "cpu_seconds": 4.0, "bytes_sent": {"worker0": 1000.0, "worker1": 3000.0,
                                                   "ps0": 9e9},
                "bytes_received": {"worker0": 500.0, "worker1": 500.0, "ps0": 0.0}},
               {"seconds": 1.0, "steps": 10, "samples": 100, "samples_per_s": 100.0,
                "cpu_seconds": 1.0, "bytes_sent": {"worker0": 2000.0, "worker1": 2000.0},
                "bytes_received": {"worker0": 100.0, "worker1": 300.0}},
               {"seconds": 1.0, "steps": 5, "samples": 50, "samples_per_s": 50.0,
                "cpu_seconds": 3.0, "bytes_sent": {"worker0": 0.0, "worker1": 0.0},
                "bytes_received": {"worker0": 0.0, "worker1": 0.0}}]
    summary = harness.summarize_windows(windows, ["worker0", "worker1"])
    assert summary["samples_per_s"] == 50.0
    assert summary["cpu_seconds_per_sample"] == pytest.approx(0.04)   # median of .04 .01 .06
    assert summary["worker_bytes_per_step"] == {"sent": 200.0, "received": 20.0}
    assert summary["per_process"] is None  # no per-host CPU: an older harness's windows


def test_per_process_figures_per_role():
    """Per role: the mean over the run's processes (hosts with CPU), per step, then the
    median over windows; an idle host of the cluster (chief, worker2) is not averaged in."""
    def window(steps, cpu, sent):
        return {"steps": steps, "cpu_seconds_by_host": cpu,
                "bytes_sent": {"worker0": sent, "worker1": 3 * sent, "ps0": 10 * sent,
                               "chief": 0.0, "worker2": 0.0},
                "bytes_received": {"worker0": sent, "worker1": sent, "ps0": sent,
                                   "chief": 0.0, "worker2": 0.0}}
    windows = [window(10, {"worker0": 1.0, "worker1": 3.0, "ps0": 5.0}, 100.0),
               window(20, {"worker0": 2.0, "worker1": 2.0, "ps0": 4.0}, 100.0),
               window(10, {"worker0": 4.0, "worker1": 4.0, "ps0": 9.0}, 1000.0)]
    assert roles.per_process_per_step(windows) == {
        "worker": {"processes": 2, "cpu_seconds": 0.2, "bytes_sent": 20.0,
                   "bytes_received": 10.0},
        "server": {"processes": 1, "cpu_seconds": 0.5, "bytes_sent": 100.0,
                   "bytes_received": 10.0}}
    loopback = [{"steps": 4, "cpu_seconds_by_host": {"worker0": 2.0, "chief": 1.0},
                 "bytes_sent": None, "bytes_received": None}]
    assert roles.per_process_per_step(loopback) == {
        "worker": {"processes": 1, "cpu_seconds": 0.5, "bytes_sent": None,
                   "bytes_received": None},
        "chief": {"processes": 1, "cpu_seconds": 0.25, "bytes_sent": None,
                  "bytes_received": None}}
    assert [roles.role_of(h) for h in ("worker3", "ps0", "chief", "other")] == [
        "worker", "server", "chief", None]


def test_calibration_stops_when_the_slowest_worker_says_so():
    steps, agreed = [], []

    def agree_max(value):  # another worker reports a much longer round
        agreed.append(value)
        return value + 100.0

    def step():
        steps.append(1)
        assert len(steps) < 10_000, "calibration did not stop when the others said so"

    trainer = measure.Trainer(step=step, rank=0, workers=2,
                              global_batch=8, agree_max=agree_max)
    config = measure.WindowConfig(warmup_steps=2, calibration_steps=3, windows=2,
                                  window_seconds=200.0, min_window_steps=4)
    windows = measure.run_windows(trainer, config)
    # One calibration round (this worker alone would have doubled it many times), then
    # windows of ceil(200 / ((elapsed + 100) / 3)) steps, the same on every worker.
    assert len(agreed) == 2  # the round's elapsed time, then the window's step count
    per_window = windows[0].steps
    assert per_window == int(agreed[1] + 100.0) and per_window >= config.min_window_steps
    assert len(steps) == 2 + 3 + 2 * per_window


def test_the_gate_comes_after_the_first_warmup_step():
    """The harness throttles CPU once every process has taken its first step (its tracing is
    start-up): the gate runs after exactly one step, and the rest of the warm-up after it."""
    steps, gated = [], []
    trainer = measure.Trainer(step=lambda: steps.append(1), rank=0, workers=1, global_batch=8)
    config = measure.WindowConfig(warmup_steps=3, calibration_steps=1, windows=1,
                                  window_seconds=0.0, min_window_steps=1)
    measure.run_windows(trainer, config, gate=lambda: gated.append(len(steps)))
    assert gated == [1] and len(steps) == 3 + 1 + 1


def test_isolated_hosts_size_tensorflow_pools_for_their_core_and_gate_start_up(tmp_path,
                                                                           monkeypatch):
    """Every process of a CPU-isolated run gets TF pools for the one core its host stands
    for (a setting from the environment wins) and the gate's path; shared cores get neither."""
    spec = workloads.get("lm", "short")
    window = measure.WindowConfig()
    cpu = cgroups.CpuGroups(0.25, deferred=True)
    monkeypatch.setenv("TF_NUM_INTRAOP_THREADS", "3")
    run = harness.Run("horovod", spec, 2, 0, harness.Placement(None, cpu), window,
                      tmp_path / "a")
    assert (run.env["TF_NUM_INTEROP_THREADS"], run.env["TF_NUM_INTRAOP_THREADS"]) == ("1", "3")
    assert run.env[measure.GATE_ENV] == str(tmp_path / "a" / "throttled")
    tf_ps = harness.Run("tf_ps", spec, 2, 2, harness.Placement(None, cpu), window,
                        tmp_path / "c")  # TF's PS deadlocks on one inter-op thread
    assert (tf_ps.env["TF_NUM_INTEROP_THREADS"], tf_ps.env["TF_NUM_INTRAOP_THREADS"]) == ("2", "3")
    shared = harness.Run("horovod", spec, 2, 0, harness.Placement(None), window, tmp_path / "b")
    assert shared.env == {} and shared.gate is None


def test_wait_for_gate_says_started_then_waits_for_the_file(tmp_path):
    gate, out = tmp_path / "throttled", io.StringIO()
    threading.Timer(0.3, gate.touch).start()
    t0 = time.monotonic()
    measure.wait_for_gate(str(gate), timeout=30, out=out)
    assert time.monotonic() - t0 >= 0.25
    assert out.getvalue() == measure.READY_LINE + "\n"
    with pytest.raises(TimeoutError, match="did not create .*missing"):
        measure.wait_for_gate(str(tmp_path / "missing"), timeout=0.1, out=out)
    measure.wait_for_gate(None, out=out)  # no harness gate: returns at once, prints nothing
    assert out.getvalue().count(measure.READY_LINE) == 2


def test_window_config_round_trips_through_worker_flags():
    from parallax.bench.worker import _parser
    config = measure.WindowConfig(4, 2, 5, 1.5, 3)
    args = _parser().parse_args(["--system", "hybrid", "--workload", "lm", *config.args()])
    assert measure.WindowConfig(args.warmup_steps, args.calibration_steps, args.windows,
                                args.window_seconds, args.min_window_steps) == config


def test_data_batches_reach_every_worker_and_its_dataset():
    from parallax.bench.worker import _parser
    config = config_from(parser().parse_args(["--data-batches", "40"]))
    assert config.data_batches == 40 and harness.BenchConfig().data_batches == 16
    spec = replace(workloads.get("ctr", "short"), data_batches=40)
    assert len(workloads.batch_pool(spec, 0)) == 40
    assert workloads.batch_pool(spec, 0)[39]["ids"].tolist() == \
        workloads.local_batch(spec, 0, 39)["ids"].tolist()
    args = _parser().parse_args(["--system", "hybrid", "--workload", "lm",
                                 "--data-batches", "40"])
    assert args.data_batches == 40
    with pytest.raises(ConfigError, match="--data-batches 0 must be >= 1"):
        config_from(parser().parse_args(["--data-batches", "0"]))


def test_bad_configurations_are_refused_with_the_value():
    with pytest.raises(ConfigError, match="unknown system 'horovd'"):
        config_from(parser().parse_args(["--systems", "hybrid,horovd"]))
    with pytest.raises(ConfigError, match="unknown workload 'bert'"):
        config_from(parser().parse_args(["--workloads", "bert"]))
    with pytest.raises(ConfigError, match="worker counts must be >= 1"):
        config_from(parser().parse_args(["--workers", "0,2"]))
    with pytest.raises(SystemExit):
        parser().parse_args(["--workers", "two"])
    config = harness.BenchConfig(workers=(1, 4), servers=2)
    assert harness.cluster_hosts(config, "dedicated") == [
        "chief", "worker0", "worker1", "worker2", "worker3", "ps0", "ps1"]
    assert harness.cluster_hosts(config, "colocated") == [
        "worker0", "worker1", "worker2", "worker3"]
    with pytest.raises(ConfigError, match="placement 'nearby' is not known: choose colocated"):
        config_from(parser().parse_args(["--placement", "colocated,nearby"]))


def test_result_lines_are_found_among_other_output():
    assert measure.parse_result("noise") is None
    assert measure.parse_result('[1] BENCH_RESULT {"windows": []}\n') == {"windows": []}


def test_the_bench_command_line_does_not_import_tensorflow():
    """`parallax bench --help` answers at once and without TensorFlow's start-up noise: the
    command line and the harness read the workloads' sizes, not their models."""
    code = ("import sys, parallax.bench.command, parallax.bench.harness; "
            "print('tensorflow' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_colocated_topology_places_server_i_on_host_i_mod_w():
    """Equal hardware: every system on W hosts; dedicated: a host per process."""
    from parallax.bench import topology
    placed = topology.processes("tf_ps", 2, 3, "colocated")
    assert [(p.name, p.role, p.host) for p in placed] == [
        ("ps0", "ps", "worker0"), ("ps1", "ps", "worker1"), ("ps2", "ps", "worker0"),
        ("worker0", "worker", "worker0"), ("worker1", "worker", "worker1"),
        ("chief", "chief", "worker0")]
    hosts = {(s, p): topology.hosts(s, 4, 2, p) for s in ("hybrid", "horovod", "tf_ps", "mwms")
             for p in topology.PLACEMENTS}
    assert {k: len(v) for k, v in hosts.items()} == {
        ("hybrid", "colocated"): 4, ("hybrid", "dedicated"): 6,
        ("horovod", "colocated"): 4, ("horovod", "dedicated"): 4,
        ("tf_ps", "colocated"): 4, ("tf_ps", "dedicated"): 7,
        ("mwms", "colocated"): 4, ("mwms", "dedicated"): 4}
    assert topology.cores(6, 0.25) == 1.5 and topology.cores(4, None) is None
    # at 0.125 core, 8 colocated hosts take 1 core in all; dedicated ones 1.375 (tf_ps)
    eight = dict(workers=(8,), systems=("hybrid", "horovod", "tf_ps"))
    assert harness.BenchConfig(**eight, cpu_shares=(0.125,)).placements == ("colocated",)
    with pytest.raises(ConfigError, match=r"0.125 for 11 hosts \(CPU groups\) is 1.375 "):
        cgroups.check_total(0.125, harness.hosts_per_run(
            harness.BenchConfig(**eight, placements=("dedicated",))), cores=1)
    assert harness.TF_PORT_OFFSET == {"worker": 0, "ps": 1, "chief": 2}  # one host, 3 jobs


def test_servers_default_to_one_per_worker_host_when_colocated():
    """As `parallax run -H` places them (and the Parallax paper ran them): one server on each
    worker host, so no host carries more of the servers' traffic and work than another;
    dedicated servers stay 2 hosts of their own; --servers N is N everywhere."""
    default = harness.BenchConfig()
    assert default.servers is None
    assert [harness.servers_for(default, w, "colocated") for w in (1, 2, 4, 8)] == [1, 2, 4, 8]
    assert harness.servers_for(default, 8, "dedicated") == harness.DEDICATED_SERVERS == 2
    given = harness.BenchConfig(servers=3)
    assert {harness.servers_for(given, 8, p) for p in ("colocated", "dedicated")} == {3}
    assert harness.hosts_per_run(harness.BenchConfig(workers=(2, 4), systems=("tf_ps",),
                                                     placements=("dedicated",))) == 7
    assert config_from(parser().parse_args([])).servers is None


def test_link_profiles_name_a_network_and_say_why():
    from parallax.bench import link_profiles
    paper = link_profiles.get("paper")
    assert paper.network == "167mbit"  # 100 Gbit/s / 6 GPUs / (a GPU ~ 100 cores)
    assert link_profiles.PAPER_MBIT_PER_CORE == round(100_000 / 6 / 100)
    config = config_from(parser().parse_args(["--link-profile", "core,paper"]))
    assert config.networks == ("1gbit", "167mbit")
    assert "Gbit/s per 6 GPUs" in link_profiles.note(paper)
    with pytest.raises(ConfigError, match="link profile 'gpu' is not known: choose from "
                                          "core, paper"):
        config_from(parser().parse_args(["--link-profile", "gpu"]))
    with pytest.raises(SystemExit):  # one or the other
        parser().parse_args(["--link-profile", "paper", "--networks", "1gbit"])
    assert parser().parse_args(["--colocate"]).placement == ("colocated",)
