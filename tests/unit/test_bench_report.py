"""The benchmark report: medians over rounds, speed-ups, traffic ratios, targets and plots,
from a small synthetic results file whose every number is known."""
from __future__ import annotations

import copy
import re
import json
import statistics
import struct

import pytest
from matplotlib.image import imread

from parallax.bench import report
from parallax.errors import ConfigError
from parallax.placement.traffic_model import StepTraffic, Workload

NETWORKS = {"1gbit": {"name": "1gbit", "rate_mbit": 1000, "latency_ms": 0.1,
                      "latency_emulated": False},
            "loopback": {"name": "loopback", "rate_mbit": None, "latency_ms": None,
                         "latency_emulated": False}}
# lm: one 100 x 4 table, 10 unique rows per worker-step (240 B each way) and 1000 dense bytes;
# dense: 1000 dense bytes only.
MODELS = {"lm": dict(dense_bytes=1000, table_rows=(100,), table_dims=(4,), unique_rows=(10,)),
          "dense": dict(dense_bytes=1000)}


def _run(system, workload, workers, network, rnd, sps, *, cpu=0.002, sent=None, received=None,
         error=None):
    analytic = report.analytic_traffic(system, Workload(workers=workers, **MODELS[workload]))
    return {"system": system, "workload": workload, "size": "small", "workers": workers,
            "servers": 2, "network": dict(NETWORKS[network]), "round": rnd, "batch_per_worker": 32,
            "global_batch": 32 * workers, "status": "failed" if error else "ok", "error": error,
            "windows": [] if error else [{"seconds": 1.0, "steps": 10, "samples": 320}],
            "samples_per_s": None if error else sps,
            "cpu_seconds_per_sample": None if error else cpu,
            "worker_bytes_per_step": None if sent is None else {"sent": sent,
                                                                  "received": received},
            "analytic": None if analytic is None else {"sent": analytic.sent,
                                                       "received": analytic.received}}


def _results() -> dict:
    runs = []
    for w in (1, 2, 4):
        for rnd, (k, cpu, sent) in enumerate([(1.0, 0.002, 2000), (0.9, 0.001, 1900),
                                              (1.4, 0.006, 2600)]):  # medians, not means
            runs.append(_run("hybrid", "lm", w, "1gbit", rnd, k * 1000 * w, cpu=cpu, sent=sent,
                             received=sent - 100))
            runs.append(_run("ps", "lm", w, "1gbit", rnd, (k - 0.5) * 1000 * w, cpu=0.004,
                             sent=1500, received=1300))
            dense_sps = 800 * w if w < 4 else [None, 1600, 1700][rnd]
            runs.append(_run("horovod_dense", "lm", w, "1gbit", rnd, dense_sps, sent=5000,
                             received=5000, error=None if dense_sps else "out of memory"))
            runs.append(_run("mwms", "lm", w, "1gbit", rnd, 300 * w,
                             error="timeout after 600 s" if w == 4 else None))
    for w in (1, 4):
        for rnd in range(3):
            runs.append(_run("hybrid", "lm", w, "loopback", rnd, 2000 * w))
            runs.append(_run("ps", "lm", w, "loopback", rnd, 2250 * w))
    for w in (2, 4):
        for rnd, hybrid in enumerate([3900, 3800, 4000]):
            runs.append(_run("horovod", "dense", w, "1gbit", rnd, 4000))
            runs.append(_run("hybrid", "dense", w, "1gbit", rnd, hybrid if w == 4 else 2000))
    return {"meta": {"date": "2026-11-29T22:30:00Z", "commit": "abc1234",
                     "command": "parallax bench --quick", "machine": "2 cores",
                     "notes": ["synthetic"]},
            "runs": runs}


@pytest.fixture
def results_file(tmp_path):
    path = tmp_path / "results.json"
    path.write_text(json.dumps(_results()))
    return path


def _write(tmp_path, raw) -> report.Results:
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(raw))
    return report.load(path)


# --- the analytic model per system -------------------------------------------------------

@pytest.mark.parametrize("system, expected", [
    ("hybrid", 240 + 1500.0),          # rows pulled/pushed + 2 (W-1)/W x dense
    ("ps", 240 + 1000.0),              # dense pulled and pushed whole
    ("tf_ps", 240 + 1000.0),           # approximated by ps
    ("allreduce", 3 * 240 + 1500.0),   # the other 3 workers' rows
    ("horovod", 3 * 240 + 1500.0),
    ("horovod_dense", 1.5 * 2600),     # table (1600 B) densified and all-reduced with dense
    ("mwms", 3 * 240 + 1500.0),        # TF all-gathers IndexedSlices too
])
def test_analytic_traffic_per_system(system, expected):
    workload = Workload(workers=4, **MODELS["lm"])
    assert report.analytic_traffic(system, workload) == StepTraffic(expected, expected)


def test_analytic_minimum_is_hybrid_and_unknown_systems_have_no_model():
    workload = Workload(workers=4, **MODELS["lm"])
    assert report.minimum_traffic(workload) == StepTraffic(1740.0, 1740.0)
    assert report.analytic_traffic("gossip", workload) is None


# --- loading -----------------------------------------------------------------------------

def test_load_gives_typed_runs(results_file):
    results = report.load(results_file)
    assert results.meta.commit == "abc1234" and results.meta.notes == ("synthetic",)
    first = results.runs[0]
    assert (first.system, first.workers, first.network.name, first.network.rate_mbit) == \
        ("hybrid", 1, "1gbit", 1000.0)
    assert first.worker_bytes_per_step == StepTraffic(2000.0, 1900.0)
    failed = [r for r in results.runs if not r.ok]
    assert len(failed) == 4 and {r.error for r in failed} == {"out of memory",
                                                              "timeout after 600 s"}


def _drop(key):
    return lambda raw: raw["runs"][1].pop(key)


def _set(*path_and_value):
    *path, value = path_and_value

    def edit(raw):
        obj = raw
        for key in path[:-1]:
            obj = obj[key]
        obj[path[-1]] = value
    return edit


@pytest.mark.parametrize("edit, words", [
    (_drop("workers"), "runs[1].workers is missing"),
    (_set("runs", 0, "workers", True), "runs[0].workers must be int, got True"),
    (_set("runs", 2, "network", "rate_mbit", "fast"),
     "runs[2].network.rate_mbit must be int or float or null, got 'fast'"),
    (_set("runs", 0, "status", "maybe"), "runs[0].status must be 'ok' or 'failed'"),
    (_set("runs", 0, "samples_per_s", None), "runs[0].samples_per_s is null but"),
    (_set("runs", 3, "worker_bytes_per_step", {"sent": 1}),
     "runs[3].worker_bytes_per_step.received is missing"),
    (_set("runs", 1, "windows", 0, 7), "runs[1].windows[0] must be an object"),
    (_set("meta", "notes", "one"), "meta.notes must be list"),
    (lambda raw: raw.pop("meta"), "meta is missing"),
])
def test_malformed_results_name_the_file_and_field(tmp_path, edit, words):
    raw = _results()
    edit(raw)
    with pytest.raises(ConfigError) as info:
        _write(tmp_path, raw)
    assert "edited.json" in str(info.value) and words in str(info.value)


def test_unreadable_results_are_config_errors(tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="bad.json"):
        report.load(tmp_path / "bad.json")
    with pytest.raises(ConfigError, match="missing.json"):
        report.load(tmp_path / "missing.json")


# --- aggregation -------------------------------------------------------------------------

def _row(rows, workload, network, workers, system):
    [row] = [r for r in rows if (r.workload, r.network, r.workers, r.system) ==
             (workload, network, workers, system)]
    return row


def test_summarize_medians_over_ok_rounds(results_file):
    rows = report.summarize(report.load(results_file))
    assert len(rows) == 12 + 4 + 4
    hybrid = _row(rows, "lm", "1gbit", 4, "hybrid")
    assert (hybrid.rounds_ok, hybrid.rounds_total) == (3, 3)
    assert hybrid.samples_per_s == 4000 and hybrid.cpu_seconds_per_sample == 0.002
    assert hybrid.measured == StepTraffic(2000, 1900)
    assert hybrid.analytic == hybrid.minimum == StepTraffic(1740, 1740)
    assert hybrid.vs_analytic == pytest.approx(3900 / 3480)
    dense = _row(rows, "lm", "1gbit", 4, "horovod_dense")
    assert (dense.rounds_ok, dense.rounds_total, dense.samples_per_s) == (2, 3, 1650)
    assert dense.vs_minimum == pytest.approx(10000 / 3480)
    mwms = _row(rows, "lm", "1gbit", 4, "mwms")
    assert (mwms.rounds_ok, mwms.samples_per_s, mwms.measured) == (0, None, None)
    loop = _row(rows, "lm", "loopback", 4, "hybrid")
    assert (loop.samples_per_s, loop.measured, loop.vs_analytic) == (8000, None, None)
    # ordering: workload, network as first seen, workers, then the canonical system order
    assert [r.system for r in rows[:4]] == ["hybrid", "ps", "mwms", "horovod_dense"]
    assert [(r.workload, r.network) for r in rows][-1] == ("dense", "1gbit")


# --- the markdown ------------------------------------------------------------------------

def test_throughput_table_cells(results_file):
    text = report.markdown(report.load(results_file))
    assert "\n".join([
        "| system | 1 worker | 2 workers | 4 workers | hybrid / this (4 workers) |",
        "|---|---:|---:|---:|---:|",
        "| hybrid | 1,000 | 2,000 | 4,000 | 1.00x |",
        "| ps | 500 | 1,000 | 2,000 | 2.00x |",
        "| mwms | 300 | 600 | failed | n/a |",
        "| horovod_dense | 800 | 1,600 | 1,650 (2/3 ok) | 2.42x |",
    ]) in text
    assert ("### lm on 1gbit (1000 Mbit/s, 0.1 ms latency, not emulated; processes share "
            "the machine's cores)") in text
    assert "### lm on loopback (unshaped)" in text
    assert "| ps | 2,250 | 9,000 | 0.89x |" in text


def test_traffic_table_cells(results_file):
    text = report.markdown(report.load(results_file))
    assert "\n".join([
        "| system | sent | received | analytic sent | analytic received | measured / analytic "
        "| measured / minimum |",
        "|---|---:|---:|---:|---:|---:|---:|",
        "| hybrid | 2 KB | 1.9 KB | 1.74 KB | 1.74 KB | 1.12x | 1.12x (target ≤ 1.2x: met) |",
        "| ps | 1.5 KB | 1.3 KB | 1.24 KB | 1.24 KB | 1.13x | 0.80x |",
        "| mwms | not measured | not measured | 2.22 KB | 2.22 KB | not measured | not measured |",
        "| horovod_dense | 5 KB | 5 KB | 3.9 KB | 3.9 KB | 1.28x | 2.87x |",
    ]) in text
    assert "| hybrid | not measured | not measured | 1.74 KB | 1.74 KB | not measured " \
           "| not measured |" in text  # loopback: no byte counters


def test_cpu_table_cells(results_file):
    text = report.markdown(report.load(results_file))
    assert "\n".join(["| system | 1 worker | 2 workers | 4 workers |",
                      "|---|---:|---:|---:|",
                      "| hybrid | 0.002 | 0.002 | 0.002 |",
                      "| ps | 0.004 | 0.004 | 0.004 |",
                      "| mwms | 0.002 | 0.002 | failed |",
                      "| horovod_dense | 0.002 | 0.002 | 0.002 |"]) in text


def test_targets_section(results_file):
    text = report.markdown(report.load(results_file))
    section = text[text.index("## Targets"):].strip().splitlines()
    assert section[2:] == [
        "- lm on 1gbit, 4 workers: hybrid faster than every peer: **met** "
        "(ps 2.00x, horovod_dense 2.42x; no ok rounds: mwms)",
        "- lm on 1gbit, 4 workers: hybrid bytes within 1.2x of the analytic minimum: **met** "
        "(1.12x: 3.9 KB vs 3.48 KB per worker per step)",
        "- lm on loopback, 4 workers: hybrid faster than every peer: **missed** (ps 0.89x)",
        "- lm on loopback, 4 workers: hybrid bytes within 1.2x of the analytic minimum: "
        "**not measured** (no measured bytes or no analytic model for hybrid)",
        "- dense on 1gbit, 4 workers: hybrid within 5% of horovod: **met** (-2.5% vs horovod)",
        "- dense on 1gbit, 4 workers: hybrid bytes within 1.2x of the analytic minimum: "
        "**not measured** (no measured bytes or no analytic model for hybrid)",
    ]


def test_targets_missed(tmp_path):
    raw = copy.deepcopy(_results())
    for run in raw["runs"]:
        if (run["system"], run["workload"], run["workers"]) == ("hybrid", "lm", 4):
            run["worker_bytes_per_step"] = {"sent": 2500.0, "received": 2500.0}
        if (run["system"], run["workload"], run["workers"]) == ("horovod", "dense", 4):
            run["samples_per_s"] = 4200.0
    found = {(t.workload, t.network, t.goal[:12]): (t.verdict, t.detail)
             for t in report.targets(_write(tmp_path, raw))}
    assert found[("lm", "1gbit", "hybrid bytes")] == \
        ("missed", "1.44x: 5 KB vs 3.48 KB per worker per step")
    assert found[("dense", "1gbit", "hybrid withi")] == ("missed", "-7.1% vs horovod")


def test_no_peer_measured_is_not_guessed(tmp_path):
    raw = _results()
    raw["runs"] = [r for r in raw["runs"] if r["system"] == "hybrid" or r["workers"] < 4]
    found = [t for t in report.targets(_write(tmp_path, raw)) if t.goal.startswith("hybrid f")]
    assert {(t.verdict, t.detail) for t in found} == \
        {("not measured", "no ok rounds of hybrid and a peer")}


# --- files -------------------------------------------------------------------------------

def _png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_write_report_and_pngs(results_file, tmp_path):
    out = tmp_path / "out"
    written = report.write_report(results_file, out)
    pngs = ["throughput_lm_1gbit.png", "bytes_lm_1gbit.png", "throughput_lm_loopback.png",
            "throughput_dense_1gbit.png"]  # no bytes plot where no bytes were measured
    assert sorted(written) == sorted(pngs + ["report.md", "summary.json"])
    assert sorted(p.name for p in out.iterdir()) == sorted(written)
    for name in pngs:
        assert _png_size(out / name) == (640, 420)
        image = imread(out / name)
        assert image.shape[:2] == (420, 640) and image.std() > 0.01  # not blank
    text = (out / "report.md").read_text()
    assert text == report.markdown(report.load(results_file), pngs)
    assert "![bytes_lm_1gbit](bytes_lm_1gbit.png)" in text
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["rows"]) == 20 and len(summary["targets"]) == 6
    assert summary["rows"][0]["measured"] == {"sent": 2000, "received": 1900}


def test_main(results_file, tmp_path, capsys):
    assert report.main([str(results_file), "--out", str(tmp_path / "cli")]) == 0
    assert (tmp_path / "cli" / "report.md").exists()
    (tmp_path / "bad.json").write_text(json.dumps({"meta": {}, "runs": []}))
    assert report.main([str(tmp_path / "bad.json"), "--out", str(tmp_path / "x")]) == 2
    assert "meta.date is missing" in capsys.readouterr().err


# --- CPU isolation and the projection past this machine ---------------------------------

from parallax.bench import projection  # noqa: E402
from parallax.placement.traffic_model import StepModel, expected_traffic  # noqa: E402

ISOLATED = {"name": "1gbit@0.25cpu", "rate_mbit": 250.0, "latency_ms": 0.0,
            "latency_emulated": False, "cpu_share": 0.25, "cpu_period_us": 100000,
            "cpu_quota_us": 25000, "nominal_rate_mbit": 1000.0, "nominal_latency_ms": 0.0}
# One 1M x 64 table, 2000 unique rows per worker-step, 400 KB of dense variables.
TRAFFIC = {"dense_bytes": 400_000, "table_rows": [1_000_000], "table_dims": [64],
           "unique_rows": [2000], "itemsize": 4}
TRUTH = {  # the model each system's synthetic measurements come from
    "hybrid": StepModel("max", 1.0, 0.004, 0.001, server_cpu_per_worker=0.005,
                        bytes_ratio=1.1, server_bytes_per_worker=3e5),
    "tf_ps": StepModel("max", 1.2, 0.003, 0.0005, server_cpu_per_worker=0.002,
                       chief_cpu_per_worker=0.004, bytes_ratio=1.0,
                       server_bytes_per_worker=5e5),
    "horovod": StepModel("sum", 1.0, 0.002, 0.003, bytes_ratio=1.05)}
MODEL_OF = {"hybrid": "hybrid", "tf_ps": "ps", "horovod": "allreduce"}
SERVERS = {"hybrid": 2, "tf_ps": 2, "horovod": 0}


def _analytic_bytes(system, workers):
    traffic = expected_traffic(MODEL_OF[system], Workload(workers=workers, **{
        k: tuple(v) if isinstance(v, list) else v for k, v in TRAFFIC.items()}))
    return max(traffic.sent, traffic.received)


def _role(processes, cpu, link_bytes):
    return {"processes": processes, "cpu_seconds": cpu, "bytes_sent": link_bytes,
            "bytes_received": 0.9 * link_bytes}


def _isolated_run(system, workers, rnd, factor=1.0):
    """A run whose figures the system's true model makes (step time x factor)."""
    m, servers = TRUTH[system], SERVERS[system]
    analytic = _analytic_bytes(system, workers)
    step = m.step_seconds(workers, servers, 0.25, 250e6 / 8, analytic) * factor
    run = _run(system, "lm", workers, "1gbit", rnd, workers * 32 / step)
    run.update(network=dict(ISOLATED), servers=servers,
               traffic_workload={"workers": workers, **TRAFFIC})
    roles = {"worker": _role(workers, m.worker_cpu_base + m.worker_cpu_slope * workers,
                             m.bytes_ratio * analytic)}
    if servers:
        roles["server"] = _role(servers, m.server_cpu_per_worker * workers / servers,
                                m.server_bytes_per_worker * workers / servers)
    if m.chief_cpu_per_worker:
        roles["chief"] = _role(1, m.chief_cpu_per_worker * workers, 1000.0)
    run["per_process"] = roles
    return run


def _isolated_results(worker_counts=(1, 2, 4)) -> dict:
    """The shared-core synthetic runs, plus the same workload isolated at 0.25 core: two
    rounds per point, 10% apart around the truth, so the medians are the truth."""
    raw = _results()
    for w in worker_counts:
        for rnd, factor in enumerate((0.95, 1.05, 1.0)):
            raw["runs"] += [_isolated_run(s, w, rnd, factor) for s in TRUTH]
    return raw


def test_shared_and_isolated_runs_have_their_own_tables(tmp_path):
    text = report.markdown(_write(tmp_path, _isolated_results()))
    assert "### lm on 1gbit (1000 Mbit/s, 0.1 ms latency, not emulated; processes share " \
           "the machine's cores)" in text
    assert "### lm on 1gbit@0.25cpu (250 Mbit/s = 1000 Mbit/s x 0.25, 0 ms latency, not " \
           "emulated; 0.25 core per host)" in text
    rows = report.summarize(_write(tmp_path, _isolated_results()))
    assert {r.network for r in rows if r.workload == "lm"} == {"1gbit", "loopback",
                                                               "1gbit@0.25cpu"}


def test_the_fit_recovers_each_systems_model_from_a_results_file(tmp_path):
    found = projection.projections(_write(tmp_path, _isolated_results()))
    assert [(p.system, p.network, p.workload) for p in found] == [
        ("hybrid", "1gbit@0.25cpu", "lm"), ("horovod", "1gbit@0.25cpu", "lm"),
        ("tf_ps", "1gbit@0.25cpu", "lm")]
    for p in found:
        true, fitted = TRUTH[p.system], p.fit.model
        assert fitted.form == true.form, p.system
        for name in ("scale", "worker_cpu_base", "worker_cpu_slope", "server_cpu_per_worker",
                     "chief_cpu_per_worker", "bytes_ratio", "server_bytes_per_worker"):
            assert getattr(fitted, name) == pytest.approx(getattr(true, name), rel=1e-9,
                                                          abs=1e-12), (p.system, name)
        assert p.fit.mean_error < 1e-9 and p.fit.max_error < 1e-9
        assert p.workers_per_server == (2.0 if SERVERS[p.system] else None)


def test_the_projection_is_what_the_true_model_says(tmp_path):
    found = projection.projections(_write(tmp_path, _isolated_results()))
    for p in found:
        assert [(q.workers, q.link_gbit) for q in p.projections] == [
            (w, g) for g in (10.0, 25.0) for w in (8, 16, 32, 64)]
        for q in p.projections:
            servers = q.workers // 2 if SERVERS[p.system] else 0
            step = TRUTH[p.system].step_seconds(q.workers, servers, 1.0, q.link_gbit * 1e9 / 8,
                                                _analytic_bytes(p.system, q.workers))
            assert q.servers == servers
            assert q.samples_per_s == pytest.approx(q.workers * 32 / step, rel=1e-9)


def test_the_report_shows_the_projection_and_its_plot(tmp_path):
    path = tmp_path / "results.json"
    path.write_text(json.dumps(_isolated_results()))
    out = tmp_path / "out"
    written = report.write_report(path, out)
    assert "projection_lm.png" in written
    assert _png_size(out / "projection_lm.png") == (640, 420)
    assert imread(out / "projection_lm.png").std() > 0.01
    text = (out / "report.md").read_text()
    section = text[text.index("## Projection past this machine"):text.index("## Targets")]
    assert "### lm, fitted on 1gbit@0.25cpu (250 Mbit/s = 1000 Mbit/s x 0.25" in section
    assert "| hybrid | max | 1 | 1,2,4 | 0.0% | 0.0% |" in section
    assert "| horovod | sum | 1 | 1,2,4 | 0.0% | 0.0% |" in section
    assert "![projection_lm](projection_lm.png)" in section
    assert "(workers per server: 2; never fewer servers than measured)" in section
    # hybrid at 64 workers on 10 Gbit/s: 32 servers; worker CPU 68 ms bounds the step.
    hybrid_64 = 64 * 32 / TRUTH["hybrid"].step_seconds(64, 32, 1.0, 1.25e9,
                                                       _analytic_bytes("hybrid", 64))
    assert f"{hybrid_64:,.0f} (worker CPU, S=32) |" in section
    assert "## Plots" in text and "projection_lm.png" not in text[text.index("## Plots"):]
    summary = json.loads((out / "summary.json").read_text())
    assert [p["system"] for p in summary["projections"]] == ["hybrid", "horovod", "tf_ps"]


def test_no_projection_without_two_worker_counts_says_why(tmp_path):
    results = _write(tmp_path, _isolated_results(worker_counts=(4,)))
    assert projection.projections(results) == []
    text = report.markdown(results)
    assert "Not available: the step-time model needs CPU-isolated runs" in text


def test_per_process_fields_are_checked(tmp_path):
    raw = _isolated_results()
    raw["runs"][-1]["per_process"]["worker"]["cpu_seconds"] = "fast"
    with pytest.raises(ConfigError, match=r"per_process.worker.cpu_seconds must be int or "
                                          r"float or null, got 'fast'"):
        _write(tmp_path, raw)
    raw = _isolated_results()
    raw["runs"][-1]["traffic_workload"]["table_rows"] = ["many"]
    with pytest.raises(ConfigError, match=r"traffic_workload.table_rows must be a list of "
                                          r"integers"):
        _write(tmp_path, raw)


def test_shared_and_isolated_side_by_side(tmp_path):
    text = report.markdown(_write(tmp_path, _isolated_results()))
    section = text[text.index("## Shared cores against CPU isolation"):
                   text.index("## Projection past this machine")]
    hybrid = 4 * 32 / TRUTH["hybrid"].step_seconds(4, 2, 0.25, 250e6 / 8,
                                                   _analytic_bytes("hybrid", 4))
    assert "### lm: 1gbit against 1gbit@0.25cpu, 4 workers" in section
    assert "| hybrid | 4,000 | " + f"{hybrid:,.0f} | {hybrid * 4:,.0f} | 0.002 | 0.002 |" \
        in section
    assert "## Shared cores against CPU isolation" not in report.markdown(
        _write(tmp_path, _results()))


def test_results_say_which_horovod_cycle_time_each_system_ran_with():
    from parallax.bench.harness import _cycle_time_note
    assert _cycle_time_note({"HOROVOD_CYCLE_TIME": "2"}).endswith(
        "HOROVOD_CYCLE_TIME=2 for every system")
    note = _cycle_time_note({})
    assert "(hybrid, ps, allreduce) 5.0 ms" in note and "default (1 ms)" in note


def _cache_run(system, rnd, sps, pull_bytes, loss, hits=0):
    """ctr at 4 workers: 10 steps a run, so per worker per step = counter / 40."""
    MODELS.setdefault("ctr", MODELS["lm"])
    run = _run(system, "ctr", 4, "1gbit", rnd, sps, sent=9000, received=8000)
    run["losses"] = [loss + 1.0] * 60 + [loss] * 50
    run["counters"] = {"server_pull_rows": pull_bytes / 16, "server_pull_bytes": pull_bytes,
                       "server_pull_requests": 80}
    if system != "hybrid":
        run["counters"].update(cache_hits=hits, cache_misses=100 - hits, cache_stale=0)
    return run


def _cache_results() -> dict:
    runs = []
    for rnd in range(2):
        runs += [_cache_run("hybrid", rnd, 1000 + rnd, 40_000, 0.5),
                 _cache_run("hybrid_cache16", rnd, 1600, 8_000, 0.52, hits=80),
                 _cache_run("hybrid_cache4", rnd, 1400, 16_000, 0.502, hits=60),
                 _cache_run("hybrid_cache0", rnd, 900, 40_000, 0.5)]
    raw = _results()
    raw["runs"] = runs
    return raw


def test_the_row_cache_section_compares_each_staleness_with_hybrid(tmp_path):
    (tmp_path / "results.json").write_text(json.dumps(_cache_results()))
    written = report.write_report(tmp_path / "results.json", tmp_path / "out")
    text = written["report.md"].read_text()
    section = text[text.index("## Row cache"):text.index("## Targets")]
    rows = [line for line in section.splitlines() if line.startswith("| hybrid")]
    assert [r.split(" | ")[0] for r in rows] == [  # by staleness, not by name
        "| hybrid", "| hybrid_cache0", "| hybrid_cache4", "| hybrid_cache16"]
    cells = dict((r.split(" | ")[0][2:], r.split(" | ")) for r in rows)
    # samples/s, vs hybrid (median 1000.5), rows and bytes pulled per worker-step, cut
    assert cells["hybrid_cache4"][1:7] == ["1,400, 1,400", "1,400", "1.40x", "25", "400", "60%"]
    assert cells["hybrid_cache4"][9:12] == ["60.0%", "0.5020", "+0.400% |"]
    assert "Final losses over steps 63-110." in section
    assert cells["hybrid"][3] == "-" and cells["hybrid"][7] == "2.0"  # 80 requests / 40
    assert ("hybrid_cache4: bytes cut 60% (target >= 50%): met; throughput 1.40x (target >= "
            "1.3x): met; final loss +0.400% (target within 1%): met") in section
    assert "hybrid_cache0: bytes cut 0% (target >= 50%): missed" in section
    assert "hybrid_cache16" not in section.split("### Row cache targets")[1]  # > 4: no target
    png = tmp_path / "out" / "cache_ctr_1gbit_w4.png"
    assert "![cache_ctr_1gbit_w4](cache_ctr_1gbit_w4.png)" in section
    assert imread(png).shape[:2] == (420, 1280)
    assert "cache_ctr" not in text[text.index("## Targets"):]  # shown inline, not again


def test_the_final_loss_is_taken_over_the_steps_every_run_ran(tmp_path):
    from parallax.bench.cache_report import LOSS_TAIL, cache_slices, final_loss
    long = [1.0] * 100 + [9.0] * 100
    assert final_loss(long, 100) == 1.0 and final_loss(long[:50], 100) is None
    ramp = [float(i) for i in range(LOSS_TAIL * 2)]
    assert final_loss(ramp, len(ramp)) == sum(ramp[LOSS_TAIL:]) / LOSS_TAIL
    raw = _cache_results()
    raw["runs"][1]["losses"] = raw["runs"][1]["losses"][:80]  # one short run: all at 80
    raw["runs"][0]["losses"][79] = 2.0  # hybrid round 0 at step 80 only
    (tmp_path / "r.json").write_text(json.dumps(raw))
    rows = {r.system: r for r in cache_slices(report.load(tmp_path / "r.json"))[0].rows}
    mine = (28 * 1.502 + 20 * 0.502) / 48  # steps 33-80: 28 before the drop, 20 after
    theirs = [(28 * 1.5 + 19 * 0.5 + 2.0) / 48, (28 * 1.5 + 20 * 0.5) / 48]
    assert rows["hybrid_cache4"].loss_change == pytest.approx(
        statistics.median([mine / t - 1 for t in theirs]))


# --- equal hardware: placements, hosts and cores; the held-out projection -----------------

def _placed_run(system, placement, rnd, sps, hosts, sent):
    """4 workers at 0.25 core a host, on the colocated (a server in each worker host) or the
    dedicated setting (2 servers)."""
    run = _run(system, "lm", 4, "1gbit", rnd, sps, sent=sent, received=sent)
    run["network"] = {**ISOLATED, "name": f"1gbit@0.25cpu:{placement}", "placement": placement}
    run.update(placement=placement, hosts=hosts, cores=hosts * 0.25,
               servers=4 if placement == "colocated" else 2,
               traffic_workload={"workers": 4, "itemsize": 4, "dense_bytes": 1000,
                                 "table_rows": [100], "table_dims": [4], "unique_rows": [10]})
    return run


def _placed_results() -> dict:
    raw = _results()
    raw["runs"] = [run for rnd in range(2) for run in (
        _placed_run("hybrid", "colocated", rnd, 4000, 4, 1900),
        _placed_run("horovod", "colocated", rnd, 3000, 4, 4000),
        _placed_run("hybrid", "dedicated", rnd, 4500, 6, 1800),
        _placed_run("horovod", "dedicated", rnd, 3000, 4, 4000))]
    shared = _placed_run("hybrid", "colocated", 0, 5000, 4, 1500)
    shared.update(cores=None)
    shared["network"] = {**NETWORKS["1gbit"], "name": "1gbit:colocated",
                         "placement": "colocated"}
    raw["runs"].append(shared)
    return raw


def test_rows_carry_hosts_and_cores_and_the_report_gives_samples_per_core(tmp_path):
    (tmp_path / "results.json").write_text(json.dumps(_placed_results()))
    written = report.write_report(tmp_path / "results.json", tmp_path / "out")
    text = written["report.md"].read_text()
    colocated = text[text.index("### lm on 1gbit@0.25cpu:colocated"):
                     text.index("### lm on 1gbit@0.25cpu:dedicated")]
    dedicated = text[text.index("### lm on 1gbit@0.25cpu:dedicated"):]
    assert "0.25 core per host; servers inside worker hosts (equal hardware))" in colocated
    # system, hosts, cores, samples/s, samples/s per core, hybrid / this per core
    assert "| hybrid | 4 | 1 | 4,000 | 4,000 | 1.00x |" in colocated
    assert "| horovod | 4 | 1 | 3,000 | 3,000 | 1.33x |" in colocated
    # a host's link carries its worker's traffic and its server's: per direction 1500 B of
    # ring all-reduce and 2 (W-1)/W x 240 B of rows (10 rows of 16 B, 8 B ids), not 240 B
    assert "Bytes per worker host link (its co-located server's bytes included" in colocated
    assert "| hybrid | 1.9 KB | 1.9 KB | 1.86 KB | 1.86 KB | 1.02x | 1.02x (target ≤ 1.2x: " \
        "met) |" in colocated
    assert "| horovod | 4 KB | 4 KB |" in colocated  # (no servers: a worker's own traffic)
    assert "(target ≤ 1.2x: met)" in dedicated
    assert "a host per process (servers on hosts of their own))" in dedicated
    assert "| hybrid | 6 | 1.5 | 4,500 | 3,000 | 1.00x |" in dedicated
    assert "| horovod | 4 | 1 | 3,000 | 3,000 | 1.00x |" in dedicated
    # the shared-core table pairs with the isolated one of the same placement only
    assert "### lm: 1gbit:colocated against 1gbit@0.25cpu:colocated, 4 workers" in text
    assert "against 1gbit@0.25cpu:dedicated" not in text
    assert ("1gbit@0.25cpu:colocated, 4 workers: hybrid bytes within 1.2x of the analytic "
            "minimum: **met** (1.02x: 3.8 KB vs 3.72 KB per step over a worker host's link, "
            "its server's bytes included") in text
    assert ("1gbit@0.25cpu:dedicated, 4 workers: hybrid bytes within 1.2x of the analytic "
            "minimum: **met** (1.03x") in text  # a worker's own link: checked as before
    rows = json.loads(written["summary.json"].read_text())["rows"]
    placed = {(r["network"], r["system"]): r for r in rows}
    assert {k: placed[("1gbit@0.25cpu:dedicated", "hybrid")][k]
            for k in ("hosts", "cores", "samples_per_s_per_core")} == {
        "hosts": 6, "cores": 1.5, "samples_per_s_per_core": 3000.0}
    assert placed[("1gbit:colocated", "hybrid")]["cores"] is None
    assert placed[("1gbit:colocated", "hybrid")]["samples_per_s_per_core"] is None
    assert all("hosts" in r and "cores" in r for r in rows)  # older runs: None


@pytest.mark.parametrize("key, value, words", [
    ("hosts", 0, "runs[0].hosts must be >= 1"), ("cores", -1, "runs[0].cores must be > 0"),
    ("hosts", 1.5, "runs[0].hosts must be int or null")])
def test_hosts_and_cores_are_checked(tmp_path, key, value, words):
    raw = _placed_results()
    raw["runs"][0][key] = value
    with pytest.raises(ConfigError, match=re.escape(words)):
        _write(tmp_path, raw)
    raw = _placed_results()
    raw["runs"][0]["network"]["placement"] = "nearby"
    with pytest.raises(ConfigError, match="placement must be 'colocated' or 'dedicated'"):
        _write(tmp_path, raw)


def test_the_model_fitted_on_1_to_4_workers_reports_its_error_at_8_held_out(tmp_path):
    raw = _isolated_results(worker_counts=(1, 2, 4, 8))
    for run in raw["runs"]:  # the measured 8 is 25% slower than the model says
        if run["workers"] == 8 and "per_process" in run:
            run["samples_per_s"] /= 1.25
    (tmp_path / "results.json").write_text(json.dumps(raw))
    results = report.load(tmp_path / "results.json")
    held = projection.projections(results)
    assert [(p.fit.workers, p.held_out, p.fit_max_workers) for p in held] == [
        ((1, 2, 4), ((8, pytest.approx(0.2)),), 4)] * 3  # |1 - 1.25| / 1.25
    for p in held:  # fitted on 1-4 only: the truth, exactly
        assert p.fit.mean_error < 1e-9 and p.fit.model.scale == pytest.approx(
            TRUTH[p.system].scale)
    everything = projection.projections(results, fit_max_workers=None)
    assert all(p.fit.workers == (1, 2, 4, 8) and p.held_out == () for p in everything)
    assert all(p.fit.mean_error > 0.01 for p in everything)
    written = report.write_report(tmp_path / "results.json", tmp_path / "out")
    summary = json.loads(written["summary.json"].read_text())["projections"]
    assert [(s["workers_fitted"], s["held_out_errors"], s["fit_max_workers"])
            for s in summary] == [([1, 2, 4], {"8": pytest.approx(0.2)}, 4)] * 3
    assert "| 20.0% at 8 |" in written["report.md"].read_text()
    with pytest.raises(ConfigError, match="fit_max_workers 0 must be >= 1"):
        projection.projections(results, fit_max_workers=0)
