"""Observability against real server processes: the Prometheus endpoint (`--metrics-port`),
`parallax status` (health and per-table stats, exit codes), and the examples' TensorBoard
scalars (`--tensorboard DIR`)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from parallax import SGD, PSClient, ServerError, TableSpec
from parallax.client import ClientOptions
from parallax.client.local_cluster import LocalCluster

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*"'
                    r'(?:,[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*")*)?\})? '
                    r'(-?[0-9.e+-]+|\+Inf|-Inf|NaN)$')
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
DIM = 8


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "parallax.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


def _metrics_address(cluster: LocalCluster) -> str:
    ready = next(line for line in cluster.servers[0].lines
                 if line.startswith("PARALLAX_SERVER_READY"))
    fields = dict(f.split("=", 1) for f in ready.split()[1:])
    assert fields["address"] == cluster.addresses[0]  # the old fields keep their meaning
    return fields["metrics"]


def scrape(address: str) -> dict[tuple[str, frozenset], float]:
    """GET /metrics and parse every line: comments are HELP/TYPE, the rest samples."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        assert reply.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = reply.read().decode()
    samples = {}
    for line in text.splitlines():
        if line.startswith("#"):
            assert re.match(r"^# (HELP|TYPE) [a-z_]+ \S", line), line
            continue
        match = SAMPLE.match(line)
        assert match, f"not a sample line: {line!r}"
        labels = frozenset(LABEL.findall(match[2] or ""))
        samples[(match[1], labels)] = float(match[3])
    return samples


def value(samples, name: str, **labels) -> float:
    return samples.get((name, frozenset((k, str(v)) for k, v in labels.items())), 0.0)


@pytest.fixture(scope="module")
def metered():
    with LocalCluster(1, extra_args=["--metrics-port", "0"]) as cluster:
        yield cluster, _metrics_address(cluster)


def test_metrics_count_requests_rows_bytes_and_latency(metered):
    cluster, address = metered
    spec = TableSpec(name="obs", vocabulary_size=1000, dim=DIM, num_workers=1,
                     optimizer=SGD(0.1))
    with PSClient(cluster.addresses) as client:
        table = client.create_table(spec)
        before = scrape(address)
        table.pull(np.arange(10))
        table.push(np.arange(4), np.ones((4, DIM), np.float32), step=0)
        table.pull(np.arange(5), min_step=1)
    after = scrape(address)

    def moved(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("parallax_requests_total", method="Pull", code="OK") == 2
    assert moved("parallax_requests_total", method="Push", code="OK") == 1
    assert moved("parallax_rows_total", method="Pull", run_id="", table="obs") == 15
    assert moved("parallax_rows_total", method="Push", run_id="", table="obs") == 4
    assert moved("parallax_bytes_total", method="Pull", direction="out") == 15 * DIM * 4
    assert moved("parallax_bytes_total", method="Push", direction="in") == 4 * DIM * 4
    assert moved("parallax_request_seconds_count", method="Pull") == 2
    assert moved("parallax_request_seconds_bucket", method="Pull", le="+Inf") == 2
    assert moved("parallax_request_seconds_sum", method="Pull") > 0
    buckets = sorted((float(dict(k[1])["le"]), v) for k, v in after.items()
                     if k[0] == "parallax_request_seconds_bucket"
                     and dict(k[1])["method"] == "Pull")
    assert buckets[0][0] == 0.0001 and buckets[-2][0] == 10.0
    assert [v for _, v in buckets] == sorted(v for _, v in buckets)  # cumulative
    assert value(after, "parallax_table_step", run_id="", table="obs", shard=0) == 1
    # the open step's one worker has not pushed it: 1 pending
    assert value(after, "parallax_table_step_pending_workers", run_id="", table="obs",
                 shard=0) == 1
    assert value(after, "parallax_table_shards") >= 1 and value(after, "parallax_up") == 1
    from parallax.version import PROTOCOL_VERSION, __version__
    assert value(after, "parallax_build_info", version=__version__,
                 protocol=f"parallax.ps.v{PROTOCOL_VERSION}") == 1


def test_a_planned_tables_run_id_is_a_label_of_its_own(metered):
    """A plan names its server tables RUN.v<i>.<variable>: the run id is its own label, so
    the series of one table carry over from job to job (one series per table, not per run)."""
    cluster, address = metered
    with PSClient(cluster.addresses) as client:
        table = client.create_table(TableSpec(name="job-7.v3.embedding", vocabulary_size=100,
                                              dim=DIM, num_workers=1, optimizer=SGD(0.1)))
        table.pull(np.arange(6))
    after = scrape(address)
    assert value(after, "parallax_rows_total", method="Pull", run_id="job-7",
                 table="v3.embedding") == 6
    assert value(after, "parallax_table_rows", run_id="job-7", table="v3.embedding",
                 shard=0) == 100


def test_bad_request_counts_its_code(metered):
    cluster, address = metered
    before = scrape(address)
    with PSClient(cluster.addresses, ClientOptions(retries=0)) as client:
        missing = client.table(TableSpec(name="no_such_table", vocabulary_size=10, dim=DIM))
        with pytest.raises(ServerError, match="NOT_FOUND"):
            missing.pull(np.arange(3))
    after = scrape(address)
    key = dict(method="Pull", code="NOT_FOUND")
    assert value(after, "parallax_requests_total", **key) == \
        value(before, "parallax_requests_total", **key) + 1
    assert value(after, "parallax_rows_total", method="Pull", run_id="",
                 table="no_such_table") == 0


def test_metrics_endpoint_answers_404_elsewhere_and_is_off_by_default(metered):
    _, address = metered
    with pytest.raises(urllib.error.HTTPError, match="404"):
        urllib.request.urlopen(f"http://{address}/other", timeout=10)
    proc = _cli("server", "--metrics-port", "70000")
    assert proc.returncode == 2 and "--metrics-port 70000" in proc.stderr


def test_metrics_add_the_process_and_speak_openmetrics_when_asked(metered):
    _, address = metered
    samples = scrape(address)  # no Accept header: text format 0.0.4 (checked by scrape)
    assert value(samples, "process_cpu_seconds_total") > 0
    assert value(samples, "process_resident_memory_bytes") > 0
    assert any(name == "python_info" for name, _ in samples)
    assert any(name == "python_gc_collections_total" for name, _ in samples)
    request = urllib.request.Request(f"http://{address}/metrics", headers={
        "Accept": "application/openmetrics-text; version=1.0.0,text/plain;q=0.5"})
    with urllib.request.urlopen(request, timeout=10) as reply:
        kind, text = reply.headers["Content-Type"], reply.read().decode()
    assert kind.startswith("application/openmetrics-text;"), kind
    assert text.endswith("# EOF\n")
    assert "# TYPE parallax_requests counter" in text and "parallax_up 1.0" in text
    bad = urllib.request.Request(f"http://{address}/metrics", headers={
        "Accept": "application/openmetrics-text; version=x"})  # the library may not parse it
    with urllib.request.urlopen(bad, timeout=10) as reply:
        assert reply.status == 200 and "parallax_up 1.0" in reply.read().decode()


def test_metrics_servers_in_one_process_keep_their_own_registries():
    """Each endpoint has a registry of its own: two in one process show their own families
    (and both the process's), and nothing lands in prometheus_client's default registry."""
    from prometheus_client import REGISTRY
    from prometheus_client.metrics_core import GaugeMetricFamily

    from parallax_ps.metrics import MetricsServer
    servers = [MetricsServer("127.0.0.1", 0, lambda n=n: [GaugeMetricFamily(
        f"parallax_test_{n}", "A test gauge.", value=1)]) for n in ("a", "b")]
    try:
        a, b = [scrape(server.address) for server in servers]
    finally:
        for server in servers:
            server.stop()
    assert value(a, "parallax_test_a") == 1 and ("parallax_test_b", frozenset()) not in a
    assert value(b, "parallax_test_b") == 1 and ("parallax_test_a", frozenset()) not in b
    assert value(a, "process_cpu_seconds_total") > 0 and value(b, "process_cpu_seconds_total")
    assert not [m for m in REGISTRY.collect() if m.name.startswith("parallax_")]


def test_a_workers_endpoint_needs_the_token_as_the_servers_do(tmp_path, monkeypatch):
    """A worker given PARALLAX_TOKEN_FILE (a --secure job's, or the user's own) answers a
    scrape without `Authorization: Bearer <token>` with 401, as a server does; it announces
    its address in the line `parallax run` collects."""
    from parallax.client import worker_metrics
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    monkeypatch.setenv("PARALLAX_TOKEN_FILE", str(token))
    server = worker_metrics.serve(0, rank=0, local_rank=0, size=1)
    try:
        url = f"http://{server.address}/metrics"
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(url, timeout=10)
        assert refused.value.code == 401
        asked = urllib.request.Request(url, headers={"Authorization": "Bearer s3cret"})
        with urllib.request.urlopen(asked, timeout=10) as reply:
            text = reply.read().decode()
        assert "# TYPE parallax_worker_steps_total counter" in text, text
        assert "parallax_worker_rank 0.0" in text and "process_cpu_seconds_total" in text
    finally:
        worker_metrics.stop()


def test_a_worker_that_cannot_bind_its_port_names_the_fix():
    import socket

    from parallax.client import worker_metrics
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=rf"cannot serve metrics on 127.0.0.1:{port} "
                                          rf"\(Address already in use\); worker 0: give another "
                                          rf"first port .* or 0 for free ports"):
            worker_metrics.serve(port, rank=0, local_rank=0, size=1)
    worker_metrics.stop()  # (nothing was started)


WORKER = str(ROOT / "tests" / "helpers" / "chaos_worker.py")


class _Job:
    """`parallax run` in the background, its stderr read line by line as it comes."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "parallax.cli", "run", *args],
                                     cwd=ROOT, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        self.err: list[str] = []
        self._reader = threading.Thread(target=lambda: self.err.extend(self.proc.stderr),
                                        daemon=True)
        self._reader.start()

    def line(self, prefix: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            found = next((line for line in list(self.err) if line.startswith(prefix)), None)
            if found:
                return found
            time.sleep(0.2)
        raise AssertionError(f"no line {prefix!r}:\n" + "".join(self.err[-40:]))


def _scraped_while(job: _Job, address: str, timeout: float = 120) -> dict:
    """The worker's metrics once it has counted two steps (the job still running): a sync
    push's time is known when its answers are read, by the next step's pull."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        samples = scrape(address)
        if value(samples, "parallax_worker_steps_total") >= 2:
            return samples
        assert job.proc.poll() is None, "".join(job.err[-40:])
        time.sleep(0.5)
    raise AssertionError(f"worker at {address} counted under 2 steps in {timeout} s")


@pytest.mark.timeout(600)
def test_each_worker_of_a_job_serves_its_metrics_while_it_trains(tmp_path):
    """`parallax run -np 2 --metrics-port 0`: each worker serves its own /metrics at a free
    port, which the launcher prints once both serve; scraped while they train (a paced
    Keras fit with a row cache), each counts steps, times its fused pulls and pushes, and
    counts its rows by run id and table and its cache's hits and misses."""
    job = _Job("-np", "2", "--servers", "1", "--metrics-port", "0", "--run-id", "wm1",
               "--progress-seconds", "0", "--data-dir", str(tmp_path / "data"),  # its saves
               "--", sys.executable, WORKER, "--epochs", "3",
               "--interval", "4", "--step-delay", "1.5", "--cache-staleness", "2",
               "--backup", str(tmp_path / "backup"), "--out", str(tmp_path / "out.npz"))
    try:
        line = job.line("parallax run: metrics: worker", timeout=240)
        addresses = re.findall(r"worker (\d) at http://(127\.0\.0\.1:\d+)/metrics", line)
        assert [rank for rank, _ in addresses] == ["0", "1"], line
        for rank, address in addresses:
            samples = _scraped_while(job, address)
            assert value(samples, "parallax_worker_rank") == int(rank)
            assert value(samples, "parallax_worker_size") == 2
            for name in ("step", "pull", "push"):
                assert value(samples, f"parallax_worker_{name}_seconds_count") > 0, name
                assert value(samples, f"parallax_worker_{name}_seconds_bucket", le="+Inf") > 0
            rows = {dict(labels)["table"]: v for (name, labels), v in samples.items()
                    if name == "parallax_worker_rows_total" and
                    dict(labels).get("direction") == "in" and dict(labels)["run_id"] == "wm1"}
            assert rows and all(v > 0 for v in rows.values()), samples
            assert value(samples, "parallax_worker_bytes_total", direction="out",
                         run_id="wm1", table=next(iter(rows))) > 0
            assert ("parallax_worker_row_cache_hits_total", frozenset()) in samples
            assert value(samples, "parallax_worker_row_cache_misses_total") > 0
        assert job.proc.wait(240) == 0, "".join(job.err[-40:])
    finally:
        if job.proc.poll() is None:
            job.proc.terminate()
            job.proc.wait(30)


def test_status_reports_tables_and_exit_codes():
    with LocalCluster(2) as cluster, PSClient(cluster.addresses) as client:
        spec = TableSpec(name="stat", vocabulary_size=100, dim=DIM, shard_count=2,
                         num_workers=1, optimizer=SGD(0.1))
        table = client.create_table(spec)
        table.push(np.arange(6), np.ones((6, DIM), np.float32), step=0)
        table.pull(np.arange(6), min_step=1)
        joined = ",".join(cluster.addresses)

        proc = _cli("status", env={"PARALLAX_PS_ADDRESSES": joined})
        assert proc.returncode == 0, proc.stderr
        for address in cluster.addresses:
            assert f"{address}  SERVING" in proc.stdout
        assert len(re.findall(r"^  stat +\d +50 +8 .* 1 +", proc.stdout, re.M)) == 2, proc.stdout

        proc = _cli("status", "--json", "--ps-addresses", joined)
        servers = json.loads(proc.stdout)["servers"]
        assert proc.returncode == 0 and [s["health"] for s in servers] == ["SERVING"] * 2
        shards = [t for s in servers for t in s["tables"]]
        assert sorted(t["shard"] for t in shards) == [0, 1]
        assert all(t["step"] == 1 and t["pushes"] == 1 and t["pulls"] == 1 for t in shards)
        assert sum(t["rows_pushed"] for t in shards) == 6

        dead = "127.0.0.1:1"
        proc = _cli("status", "--ps-addresses", f"{cluster.addresses[0]},{dead}")
        assert proc.returncode == 1
        assert f"{dead}  UNREACHABLE" in proc.stdout and dead in proc.stderr

    proc = _cli("status", "--ps-addresses", "nonsense", env={"PARALLAX_PS_ADDRESSES": ""})
    assert proc.returncode == 2 and "'nonsense' is not host:port" in proc.stderr


def test_example_writes_tensorboard_scalars(tmp_path):
    logs = tmp_path / "tb"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PARALLAX_", "HOROVOD_", "OMPI_", "PMI_"))}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "dense_model.py"), "--epochs", "2",
         "--steps-per-epoch", "3", "--train-examples", "2048", "--eval-examples", "512",
         "--hidden", "16", "--tensorboard", str(logs)],
        cwd=ROOT, env={**env, "TF_CPP_MIN_LOG_LEVEL": "2"}, capture_output=True, text=True,
        timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = list(logs.rglob("events.out.tfevents.*"))
    assert len(events) == 1, list(logs.rglob("*"))
    data = events[0].read_bytes()
    for tag in (b"epoch/loss", b"epoch/accuracy", b"epoch/examples_per_s",
                b"epoch/pulled_mb_per_s"):
        assert data.count(tag) == 2, tag  # one scalar per epoch
