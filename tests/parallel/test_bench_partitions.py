"""`parallax bench partitions`: a tiny sweep plus tuned run end to end (real processes in real
namespaces), the report's arithmetic from a synthetic results file, and bad arguments."""
from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from parallax.bench import partitions, partitions_report
from parallax.bench.command import main as bench_main, partitions_config, partitions_parser
from parallax.errors import ConfigError
from launching import MARK, marked_processes

ROOT = Path(__file__).resolve().parents[2]


def _namespaces(prefix: str) -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in listed.splitlines() if line.startswith(prefix)]


def test_tiny_sweep_and_tuned_run_in_namespaces(tmp_path):
    out, prefix = tmp_path / "out", "pxq" + secrets.token_hex(2)
    done = subprocess.run(
        [sys.executable, "-m", "parallax.cli", "bench", "partitions", "--size", "short",
         "--workloads", "lm", "--topologies", "2x2", "--shards", "1,2", "--network",
         "unlimited", "--windows", "2", "--window-seconds", "0.3", "--warmup-steps", "1",
         "--search-steps-per-sample", "3", "--search-warmup-steps", "1",
         "--search-max-shards", "4", "--out", str(out), "--prefix", prefix],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", MARK: tmp_path.name})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    runs = json.loads((out / "partitions.json").read_text())["runs"]
    assert [(r["shards"], r["tuned"]) for r in runs] == [(1, False), (2, False), (None, True)]
    for run in runs:
        assert run["status"] == "ok", run["error"]
        assert run["samples_per_s"] > 0 and len(run["windows"]) == 2
        assert (run["workers"], run["servers"]) == (2, 2)
        assert run["worker_bytes_per_step"]["sent"] > 0  # counted on the namespaces' links
    # The sweep's plans have the shard counts asked for; the tuned run measured its choice.
    assert set(runs[0]["plan"]["shards"].values()) == {1}
    assert set(runs[1]["plan"]["shards"].values()) == {2}
    tuning = runs[2]["tuning"]
    assert tuning["chosen"] == runs[2]["plan"]["shards"]
    assert tuning["samples"] and tuning["fitted_curve"] and not tuning["from_cache"]
    assert all(1 <= n <= 4 for n in tuning["chosen"].values())
    report = (out / "report.md").read_text()
    assert "| lm | 2x2 |" in report and "| tuned |" in report
    png = out / "partitions_lm_2x2_unlimited.png"
    assert png.stat().st_size > 1000 and png.name in report
    assert _namespaces(prefix) == []
    assert marked_processes(tmp_path.name) == {}


def _run(shards, sps, *, status="ok", error=None, tuning=None, workload="ctr", workers=2):
    return {"system": "hybrid", "workload": workload, "size": "full", "workers": workers,
            "servers": 2, "network": {"name": "1gbit", "rate_mbit": 1000.0,
                                      "latency_ms": 0.0, "latency_emulated": True},
            "round": 0, "batch_per_worker": 50, "global_batch": 50 * workers,
            "status": status, "error": error, "windows": [], "samples_per_s": sps,
            "cpu_seconds_per_sample": None, "worker_bytes_per_step": None, "analytic": None,
            "shards": shards, "tuned": shards is None, "tuning": tuning, "plan": None}


def _synthetic(path: Path) -> Path:
    tuning = {"samples": [{"counts": {"a": 1, "b": 1}, "step_seconds": 0.2, "steps": 10},
                          {"counts": {"a": 2, "b": 2}, "step_seconds": 0.1, "steps": 10},
                          {"counts": {"a": 2, "b": 4}, "step_seconds": 0.125, "steps": 10}],
              "chosen": {"a": 2, "b": 2}, "servers": {"a": [0, 1], "b": [1, 0]},
              "search_steps": 40, "search_seconds": 6.0, "overhead_seconds": 5.0,
              "final_reshard_seconds": 0.5, "fitted_curve": [[1, 0.2], [2, 0.1], [4, 0.125]],
              "decided_at_step": 41, "from_cache": False}
    runs = [_run(1, 500.0), _run(2, 1000.0), _run(4, 800.0),
            _run(8, None, status="failed", error="timed out after 240 s; worker0 still"),
            _run(None, 960.0, tuning=tuning),
            _run(1, 100.0, workload="lm"),
            _run(None, None, status="failed", error="worker0 (worker) exited 1:\nboom",
                 workload="lm")]
    path.write_text(json.dumps({"meta": {"date": "d", "commit": "c", "command": "x",
                                         "machine": "m", "notes": []}, "runs": runs}))
    return path


def test_report_from_synthetic_results(tmp_path):
    written = partitions.write_report(_synthetic(tmp_path / "partitions.json"), tmp_path)
    ctr, lm = partitions_report.summarize(partitions_report.load(tmp_path / "partitions.json"))
    assert ctr.best == (2, 1000.0)
    assert ctr.ratio == pytest.approx(0.96) and ctr.choice_ratio == 1.0
    # 5 s of overhead over 1000 steps at 100 samples/step / 1000 samples/s = 0.1 s a step.
    assert ctr.overhead == pytest.approx(0.05)
    assert ctr.curve() == [(1.0, 500.0), (2.0, 1000.0), (4.0, 800.0)]
    assert ctr.sampled()[2] == (4.0, 800.0, False)   # a per-table sample, at its largest
    assert lm.ratio is None and lm.overhead is None
    report = written["report.md"].read_text()
    assert "| ctr | 2x2 | 1,000 @ 2 | 960 | 0.960 (met) | 1.000 | 5.0% (met) | 2 (all 2 " \
           "tables) |" in report
    assert "| 8 | failed | n/a | 1/1 timed out: timed out after 240 s" in report
    assert "final resharding 0.50 s" in report
    assert "| lm | 2x2 | 100 @ 1 | n/a | n/a | n/a | n/a (not measured) | n/a |" in report
    assert "1/1 failed: worker0 (worker) exited 1:" in report
    summary = json.loads(written["summary.json"].read_text())
    assert summary[0]["targets"] == {"ratio": "met", "overhead": "met"}
    assert summary[1]["targets"] == {"ratio": "not measured", "overhead": "not measured"}
    for name in ("partitions_ctr_2x2_1gbit.png", "partitions_lm_2x2_1gbit.png"):
        assert written[name].stat().st_size > 1000 and name in report


def test_malformed_results_are_refused(tmp_path):
    path = _synthetic(tmp_path / "partitions.json")
    raw = json.loads(path.read_text())
    raw["runs"][0]["tuned"] = True  # shards 1 and tuned: contradictory
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"runs\[0\]: shards must be an int for a sweep"):
        partitions_report.load(path)
    del raw["runs"][0]["status"]
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"runs\[0\]\.status is missing"):
        partitions_report.load(path)


def _config(*args: str) -> partitions.PartitionConfig:
    return partitions_config(partitions_parser().parse_args(list(args)))


def test_bad_arguments_are_refused_clearly(capsys):
    with pytest.raises(ConfigError, match="'dense' has no sparse tables"):
        _config("--workloads", "lm,dense")
    with pytest.raises(ConfigError, match="unknown workload 'bert'"):
        _config("--workloads", "bert")
    with pytest.raises(ConfigError, match=r"shard counts must be >= 1, got \(0, 2\)"):
        _config("--shards", "0,2")
    with pytest.raises(ConfigError, match="topologies need >= 1 worker and >= 1 server"):
        _config("--topologies", "2x0")
    with pytest.raises(ConfigError, match="nothing to run"):
        _config("--shards", "", "--no-tuned")
    with pytest.raises(ConfigError, match="--search-steps-per-sample must be >= 1"):
        _config("--search-steps-per-sample", "0")
    with pytest.raises(ConfigError, match="link spec 'fast' is not understood"):
        _config("--network", "fast")
    for bad in (["--topologies", "2by2"], ["--shards", "one"]):
        with pytest.raises(SystemExit):
            partitions_parser().parse_args(bad)
    assert "WORKERSxSERVERS" in capsys.readouterr().err
    assert bench_main(["partitions", "--workloads", "dense", "--out", "/nonexistent"]) == 2
    assert "has no sparse tables" in capsys.readouterr().err


def test_defaults_are_the_issue_matrix():
    config = _config()
    assert config.workloads == ("lm", "ctr") and config.size == "full"
    assert config.topologies == ((2, 2), (4, 4)) and config.tuned
    assert config.shards == (1, 2, 4, 8, 16, 32, 64) and config.search.max_shards == 64
    assert config.search.cache_dir == "" and config.rounds == 1
    assert config.hosts() == ["worker0", "worker1", "worker2", "worker3",
                              "ps0", "ps1", "ps2", "ps3"]
    assert config.search.args() == ["--search-partitions", "--search-max-steps", "2000",
                                    "--search-max-shards", "64", "--search-cache-dir", ""]
    bench = config.bench_config(4, 3)
    assert (bench.servers, bench.workers, bench.systems) == (3, (4,), ("hybrid",))


def test_worker_flags(monkeypatch):
    import parallax
    from parallax.bench import worker
    args = worker._parser().parse_args(["--system", "hybrid", "--workload", "lm",
                                        "--search-partitions", "--search-max-shards", "8",
                                        "--search-cache-dir", ""])
    search = worker.partition_search(args)
    assert (search.max_shards, search.cache_dir) == (8, "")
    assert search.steps_per_sample == parallax.PartitionSearch().steps_per_sample
    with pytest.raises(SystemExit):
        worker._parser().parse_args(["--system", "hybrid", "--workload", "lm", "--shards", "0"])
    with pytest.raises(SystemExit, match="apply to hybrid, ps, allreduce.*, not horovod"):
        worker.main(["--system", "horovod", "--workload", "lm", "--shards", "2"])
    monkeypatch.setattr(parallax, "PartitionSearch", None)  # a parallax without the tuner
    with pytest.raises(SystemExit, match="needs parallax.PartitionSearch"):
        worker.partition_search(args)
