"""`parallax bench`: train the same model under every system, side by side, and measure.

For each workload and network, rounds alternate the systems (A B C A B C ...) so that drift
of this shared machine hits them all alike. One run = one system with W workers: its
processes start (each in its own network namespace on an emulated cluster, or all on
loopback), rank 0 reports its measurement windows (`measure`), and the harness turns each
window into samples/s, CPU seconds per sample (all of the run's processes, from /proc) and
bytes sent and received per worker per step (each namespace's interface counters), sampled
from outside the processes by `sampler.ResourceSampler`. Results are appended to a JSON file
after every run, so a crash keeps what was measured; `report` renders it.

CPU isolation (`cpu_shares`, `--cpu-share 0.25`): every process of a run gets its own
cgroup v1 CPU group holding it to that many cores (`cgroups`), and every link is scaled by
the same factor, so each process is "one core with a 1 Gbit/s NIC, scaled by the share".
Such a run's network is keyed "1gbit@0.25cpu" in the results, beside a shared-core "1gbit"
run of the same file; CPU seconds and bytes per step are also kept per process role
(`roles`), for the step-time model.

Row cache (`cache_staleness`, `--cache-staleness 0,1,4`): one more system per staleness,
"hybrid_cache<S>", run in the same alternating rounds: hybrid with every worker's
`parallax.RowCache(cache_mb << 20, S)`. Each parallax run's record also keeps rank 0's loss
at every step (`losses`) and, over the timed windows, the servers' pull counters and its
cache's counts (`counters`).

Topologies (processes; "127.0.0.1" on loopback):
  hybrid, ps       workers worker0..W-1 (Horovod gloo ranks) + parallax servers ps0..S-1
                   (hybrid_py: hybrid's, with PARALLAX_NATIVE=0 in every process: the numpy
                   data path beside the compiled one; hybrid_r2: with PARALLAX_REPLICAS=2, a
                   copy of every shard on the next server; hybrid_replay: with
                   PARALLAX_REPLAY_MB, each worker keeping its pushes to replay them to a
                   server started again; all on request)
  allreduce        workers only (the plan puts nothing on servers)
  horovod[_dense]  workers only (Horovod gloo ranks)
  mwms             workers only (TF_CONFIG, ring collectives)
  tf_ps            coordinator `chief` + TF servers worker0..W-1 and ps0..S-1

Placement (`placements`, `--placement colocated,dedicated`; `topology`): which host (a
namespace, a CPU group, a link) each process runs on. `colocated`, the default, gives every
system the same W hosts (server i inside worker i mod W's host, TF's coordinator inside
worker 0's), with one server per worker host unless --servers says otherwise (where
`parallax run -H` puts them: no host carries more of the servers' traffic and work than
another); `dedicated` gives every process a host of its own (2 servers by default). Each setting's network is
keyed with its placement ("1gbit@0.25cpu:colocated"), and every run records `hosts` (the
emulated machines it used) and `cores` (the cores they were held to in all; None on shared
cores). Per-process CPU stays keyed by process name (`cpu_seconds_by_host`: worker0, ps0,
chief), bytes by host link.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Sequence

from parallax.launch import k8s
from parallax.bench import cgroups, measure, summary, topology, workloads
from parallax.bench.workloads import POOL_BATCHES
from parallax.bench.metrics import (analytic, summarize_windows,  # noqa: F401 (API)
                                    traffic_record, window_metrics)
from parallax.bench.cgroups import CpuGroups
from parallax.bench.netns import EmulatedCluster, LinkSpec
from parallax.bench.sampler import ResourceSampler
from parallax.env import (ADDRESSES_ENV, HOROVOD_CYCLE_TIME_ENV, NATIVE_ENV, REPLAY_ENV,
                          REPLICAS_ENV, RUN_ID_ENV, TF_THREAD_ENVS, WORKER_CYCLE_TIME_MS, WORKER_RANK_ENV, WORKERS_ENV)
from parallax.errors import ConfigError, ParallaxError
from parallax.runtime.cpu_quota import MIN_INTER_OP
from parallax.client.local_cluster import ready_address

SYSTEMS = summary.SYSTEMS
CACHED, cache_system, cache_staleness = summary.CACHED, summary.cache_system, \
    summary.cache_staleness
DEFAULT_SYSTEMS = tuple(s for s in SYSTEMS if s not in summary.ON_REQUEST)
REPLAY_MB = 256  # hybrid_replay's --replay-mb: MiB of its pushes each worker keeps
# A variant runs its base system's processes with more environment in every process.
VARIANTS = {"hybrid_py": ("hybrid", {NATIVE_ENV: "0"}),
            "hybrid_r2": ("hybrid", {REPLICAS_ENV: "2"}),
            "hybrid_replay": ("hybrid", {REPLAY_ENV: str(REPLAY_MB)})}
SERVED = topology.SERVED  # systems with parameter servers
LOOPBACK = "loopback"
TF_PORT = 23400          # TF servers and MWMS workers inside namespaces
# A TF job's port inside a namespace: a colocated host holds a worker, a ps and the chief.
TF_PORT_OFFSET = {"worker": 0, "ps": 1, "chief": 2}
PS_PORT = 7000           # parallax servers inside namespaces
RENDEZVOUS_PORT = 23399  # Horovod's rendezvous, served by the harness in the root namespace
DEFAULT_CACHE_MB = 64  # MiB of row cache per worker
DEDICATED_SERVERS = 2  # servers on hosts of their own, unless --servers says otherwise


def base_system(system: str) -> str:
    """The system whose processes a run starts (a cache system runs hybrid's, a variant its
    base's)."""
    if system in VARIANTS:
        return VARIANTS[system][0]
    return "hybrid" if cache_staleness(system) is not None else system


@dataclass(frozen=True)
class BenchConfig:
    workloads: tuple[str, ...] = workloads.WORKLOADS
    systems: tuple[str, ...] = DEFAULT_SYSTEMS  # hybrid_tf, hybrid_py: on request
    workers: tuple[int, ...] = (1, 2, 4)
    networks: tuple[str, ...] = ("1gbit+0.1ms",)
    servers: int | None = None  # None: `servers_for`'s default (one per worker host colocated)
    rounds: int = 2
    size: str = "full"
    window: measure.WindowConfig = field(default_factory=measure.WindowConfig)
    run_timeout: float = 900.0
    out_dir: str = "bench-results"
    prefix: str = "pxb"
    cpu_shares: tuple[float | None, ...] = (None,)  # cores per process; None: shared cores
    cgroup_root: str = str(cgroups.CPU_ROOT)
    cpu_period_us: int = cgroups.PERIOD_US
    cache_staleness: tuple[int, ...] = ()  # one hybrid_cache<S> system each
    cache_mb: int = DEFAULT_CACHE_MB
    placements: tuple[str, ...] = (topology.COLOCATED,)  # equal hardware first
    data_batches: int = POOL_BATCHES  # per worker, made before timing and cycled

    @property
    def runs(self) -> tuple[str, ...]:
        """Every system a round runs, in order: `systems`, then the cache systems."""
        return self.systems + tuple(cache_system(s) for s in self.cache_staleness
                                    if cache_system(s) not in self.systems)

    def __post_init__(self) -> None:
        for system in self.systems:
            if system not in SYSTEMS and cache_staleness(system) is None:
                raise ConfigError(f"unknown system {system!r}: choose from {', '.join(SYSTEMS)}"
                                  f" or {CACHED}<staleness> (e.g. {cache_system(4)})")
        if any(s < 0 for s in self.cache_staleness):
            raise ConfigError(f"--cache-staleness values must be integers >= 0 (steps a cached "
                              f"row may lag), got {self.cache_staleness}")
        if self.cache_mb < 1:
            raise ConfigError(f"--cache-mb {self.cache_mb} must be >= 1 (MiB of row cache per "
                              f"worker), e.g. --cache-mb 64")
        for name in self.workloads:
            workloads.get(name, self.size)  # raises ConfigError for a bad name or size
        if not self.workers or min(self.workers) < 1:
            raise ConfigError(f"worker counts must be >= 1, got {self.workers}")
        if self.servers is not None and self.servers < 1:
            raise ConfigError(f"servers must be >= 1, got {self.servers}")
        if self.rounds < 1:
            raise ConfigError(f"rounds must be >= 1, got {self.rounds}")
        if self.data_batches < 1:
            raise ConfigError(f"--data-batches {self.data_batches} must be >= 1 (batches "
                              f"each worker makes before timing and cycles)")
        if not self.cpu_shares:
            raise ConfigError("cpu_shares must name at least one setting, e.g. (None,)")
        if not self.placements:
            raise ConfigError(f"placements must name at least one of {topology.PLACEMENTS}")
        for placement in self.placements:
            topology.check_placement(placement)
        if not 1000 <= self.cpu_period_us <= 1_000_000:
            raise ConfigError(f"--cpu-period-us {self.cpu_period_us} must be in [1000, 1000000]")
        for share in self.cpu_shares:
            if share is not None:
                cgroups.check_total(share, hosts_per_run(self))


def servers_for(config: BenchConfig, workers: int, placement: str) -> int:
    """Parameter servers of a run: `config.servers` when given; else one per worker host when
    colocated (where `parallax run -H` puts them, as the Parallax paper ran them: the traffic
    and the work are spread over every host), and DEDICATED_SERVERS hosts of their own."""
    if config.servers is not None:
        return config.servers
    return workers if placement == topology.COLOCATED else DEDICATED_SERVERS


def hosts_per_run(config: BenchConfig) -> int:
    """The most hosts (CPU groups) one run of the matrix uses at once, over its placements."""
    most = max(config.workers)
    return max((len(topology.hosts(base_system(s), most, servers_for(config, most, p), p))
                for s in config.runs for p in config.placements), default=most)


@dataclass
class Proc:
    name: str  # worker<i>, ps<i>, chief: whose CPU the sampler charges
    host: str  # the host it runs on (its namespace and CPU group)
    role: str
    popen: subprocess.Popen
    log: Path

    def tail(self, n: int = 12) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


class Placement:
    """Where the processes of a run live: hosts that are namespaces of an emulated cluster,
    or loopback; each host in its own CPU group when `cpu` is given (groups made at spawn,
    removed by release() after every run). `placement` (`topology`) maps a process to its
    host: dedicated (a host per process) or colocated (servers inside worker hosts)."""

    def __init__(self, cluster: EmulatedCluster | None, cpu: CpuGroups | None = None,
                 placement: str = topology.DEDICATED) -> None:
        self.cluster = cluster
        self.cpu = cpu
        self.placement = topology.check_placement(placement)

    def host_of(self, name: str, workers: int) -> str:
        return topology.host_of(name, workers, self.placement)

    def address(self, host: str) -> str:
        return self.cluster.address(host) if self.cluster else "127.0.0.1"

    def port(self, fixed: int) -> int:
        return fixed if self.cluster else _free_port()

    def prefix(self, host: str) -> list[str]:
        """The CPU group's prefix goes first: `ip netns exec` hides /sys/fs/cgroup."""
        return ((self.cpu.exec_prefix(host) if self.cpu else [])
                + (self.cluster.exec_prefix(host) if self.cluster else []))

    def release(self) -> None:
        if self.cpu is not None:
            self.cpu.remove_all()

    @property
    def gateway(self) -> str:
        return self.cluster.gateway if self.cluster else "127.0.0.1"

    @property
    def iface(self) -> str:
        return "eth0" if self.cluster else "lo"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cluster_hosts(config: BenchConfig, placement: str = topology.DEDICATED) -> list[str]:
    """Every namespace any run of a placement may need (`topology.cluster_hosts`)."""
    most = max(config.workers)
    return topology.cluster_hosts(most, servers_for(config, most, placement), placement)


class Run:
    """The processes of one system's run, started and stopped as one."""

    def __init__(self, system: str, spec: workloads.WorkloadSpec, workers: int,
                 servers: int, placement: Placement, window: measure.WindowConfig,
                 log_dir: Path, worker_args: Sequence[str] = (),
                 env: dict[str, str] | None = None) -> None:
        self.system, self.spec, self.workers, self.servers = system, spec, workers, servers
        self.env = dict(env or {})  # for every process (a variant's, e.g. hybrid_py's)
        self.place, self.window, self.log_dir = placement, window, log_dir
        self.worker_args = list(worker_args)  # more worker.py flags, e.g. --shards 8
        self.procs: list[Proc] = []
        self.rendezvous = None
        log_dir.mkdir(parents=True, exist_ok=True)
        if placement.cpu is not None:  # TensorFlow sizes its pools by the visible cores
            threads = {name: str(HOST_CORES) for name in TF_THREAD_ENVS}
            threads.update(FEWEST_THREADS.get(self.system, {}))
            for name, count in threads.items():
                self.env.setdefault(name, os.environ.get(name, count))
        self.gate = None  # with deferred CPU groups: created once every host is throttled
        if placement.cpu is not None and placement.cpu.deferred:
            self.gate = log_dir / "throttled"
            self.gate.unlink(missing_ok=True)
            self.env[measure.GATE_ENV] = str(self.gate)

    def pids(self) -> list[int]:
        return [p.popen.pid for p in self.procs]

    def pid_hosts(self) -> dict[int, str]:
        """pid -> process name (worker0, ps0, chief), the label its CPU is charged to."""
        return {p.popen.pid: p.name for p in self.procs}

    def _worker_argv(self, role: str = "worker") -> list[str]:
        return [sys.executable, "-u", "-m", "parallax.bench.worker", "--system", self.system,
                "--workload", self.spec.name, "--size", self.spec.size, "--role", role,
                *self.window.args(), *self.worker_args]

    def _address(self, name: str) -> str:
        return self.place.address(self.place.host_of(name, self.workers))

    def _tf_address(self, name: str, job: str) -> str:
        return f"{self._address(name)}:{self.place.port(TF_PORT + TF_PORT_OFFSET[job])}"

    def _spawn(self, name: str, role: str, argv: list[str], env: dict[str, str]) -> Proc:
        """Start process `name` on its host (`Placement.host_of`); log NAME-ROLE.log."""
        host = self.place.host_of(name, self.workers)
        log = self.log_dir / f"{name}-{role}.log"
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "TF_CPP_MIN_LOG_LEVEL": "2",
                    **self.env, **env}
        with open(log, "w") as out:
            popen = subprocess.Popen(self.place.prefix(host) + argv, stdout=out,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=full_env, start_new_session=True)
        proc = Proc(name, host, role, popen, log)
        self.procs.append(proc)
        return proc

    def start(self) -> list[Proc]:
        """Start everything; returns the processes whose exit ends the run."""
        if self.system == "tf_ps":
            return self._start_tf_ps()
        if self.system == "mwms":
            return self._start_mwms()
        env: dict[str, str] = {}
        if self.system in SERVED:
            env.update({ADDRESSES_ENV: ",".join(self._start_parallax_servers()),
                        RUN_ID_ENV: f"bench-{self.system}-{int(time.time())}"})
        if self.system == "hybrid_tf":
            return self._start_tf_collectives(env)
        if self.workers > 1:
            port = self.place.port(RENDEZVOUS_PORT)
            # On the bridge's address only, so benchmarks of other prefixes can run at once.
            self.rendezvous = k8s.start_rendezvous(port, self.workers, self.place.gateway)
        workers = []
        for rank in range(self.workers):
            rank_env = dict(env)
            if self.workers > 1:
                rank_env.update(k8s.horovod_env(rank, self.workers, self.place.gateway, port,
                                                self.place.iface))
            workers.append(self._spawn(f"worker{rank}", "worker", self._worker_argv(),
                                       rank_env))
        return workers

    def _start_parallax_servers(self, timeout: float = 120.0) -> list[str]:
        procs = []
        for i in range(self.servers):
            argv = [sys.executable, "-u", "-m", "parallax_ps", "--host",
                    self._address(f"ps{i}"), "--port", "0"]
            procs.append(self._spawn(f"ps{i}", "server", argv, {}))
        return [_wait_ready(proc, timeout) for proc in procs]

    def _start_tf_collectives(self, env: dict[str, str]) -> list[Proc]:
        """parallax's workers on TensorFlow's collectives, as its TensorFlow launch backend
        starts them (PARALLAX_WORKERS, PARALLAX_WORKER_RANK)."""
        addresses = ",".join(self._tf_address(f"worker{i}", "worker")
                             for i in range(self.workers))
        return [self._spawn(f"worker{i}", "worker", self._worker_argv(),
                            {**env, WORKERS_ENV: addresses, WORKER_RANK_ENV: str(i)}
                            if self.workers > 1 else env)
                for i in range(self.workers)]

    def _tf_config(self, cluster: dict[str, list[str]], task: str, index: int) -> dict:
        return {"TF_CONFIG": json.dumps({"cluster": cluster,
                                         "task": {"type": task, "index": index}})}

    def _start_mwms(self) -> list[Proc]:
        addresses = [self._tf_address(f"worker{i}", "worker") for i in range(self.workers)]
        cluster = {"worker": addresses}
        return [self._spawn(f"worker{i}", "worker", self._worker_argv(),
                            self._tf_config(cluster, "worker", i))
                for i in range(self.workers)]

    def _start_tf_ps(self) -> list[Proc]:
        def addresses(names: list[str], job: str) -> list[str]:
            return [self._tf_address(n, job) for n in names]
        workers = [f"worker{i}" for i in range(self.workers)]
        servers = [f"ps{i}" for i in range(self.servers)]
        cluster = {"chief": addresses(["chief"], "chief"),
                   "worker": addresses(workers, "worker"), "ps": addresses(servers, "ps")}
        for job, names in (("ps", servers), ("worker", workers)):
            for i, name in enumerate(names):
                self._spawn(name, job, self._worker_argv(job), self._tf_config(cluster, job, i))
        return [self._spawn("chief", "chief", self._worker_argv("chief"),
                            self._tf_config(cluster, "chief", 0))]

    def wait(self, waited: list[Proc], timeout: float) -> tuple[dict | None, str | None]:
        """Wait for the processes that end the run; (rank 0's record, error)."""
        deadline = time.monotonic() + timeout
        pending = list(waited)
        while pending:
            for proc in list(pending):
                code = proc.popen.poll()
                if code is None:
                    continue
                pending.remove(proc)
                if code != 0:
                    return None, f"{proc.name} ({proc.role}) exited {code}:\n{proc.tail()}"
            self._throttle_once_started(waited)
            for proc in self.procs:  # a server or TF server that dies ends the run too
                if proc not in waited and proc.popen.poll() is not None:
                    return None, (f"{proc.name} ({proc.role}) died with exit code "
                                  f"{proc.popen.returncode}:\n{proc.tail()}")
            if time.monotonic() > deadline:
                return None, (f"timed out after {timeout:.0f} s; {pending[0].name} still "
                              f"running:\n{pending[0].tail()}")
            time.sleep(0.2)
        for line in waited[0].log.read_text(errors="replace").splitlines():
            record = measure.parse_result(line)
            if record is not None:
                return record, None
        return None, f"{waited[0].name} printed no {measure.RESULT_PREFIX.strip()} line"

    def _throttle_once_started(self, waited: list[Proc]) -> None:
        """Once every process that steps has taken its first step (start-up done: imports,
        tables, tracing), hold every host to its quota and let them go on."""
        if self.gate is None or self.gate.exists():
            return
        if all(measure.READY_LINE in p.log.read_text(errors="replace") for p in waited):
            self.place.cpu.throttle()
            self.gate.touch()

    def stop(self, grace: float = 10.0) -> None:
        """TERM, then KILL after `grace`, to each process's whole session (they were started
        in their own), so nothing they started outlives the run, on loopback too."""
        for proc in self.procs:
            if proc.popen.poll() is None:
                _signal_session(proc.popen, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in self.procs:
            try:
                proc.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_session(proc.popen, signal.SIGKILL)
                proc.popen.wait()
        if self.rendezvous is not None:
            self.rendezvous.shutdown()
            self.rendezvous.server_close()
            self.rendezvous = None


def _signal_session(popen: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(popen.pid, sig)
    except ProcessLookupError:
        pass


def _wait_ready(proc: Proc, timeout: float) -> str:
    """A parallax server's address, from the READY line it prints once listening."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in proc.log.read_text(errors="replace").splitlines():
            address = ready_address(line)
            if address is not None:
                return address
        if proc.popen.poll() is not None:
            break
        time.sleep(0.1)
    raise ParallaxError(f"parameter server {proc.name} on {proc.host} did not become ready "
                        f"within {timeout:.0f} s (exit code {proc.popen.poll()}):\n{proc.tail()}")


def run_one(system: str, spec: workloads.WorkloadSpec, workers: int, config: BenchConfig,
            placement: Placement, log_dir: Path, worker_args: Sequence[str] = ()) -> dict:
    """One run, as a results record (status "failed" with the reason instead of raising).
    worker_args: more flags for every worker process (parallax.bench.worker's); a cache
    system (`cache_system`) runs hybrid's processes with its cache's flags."""
    if spec.data_batches != POOL_BATCHES:
        worker_args = [*worker_args, "--data-batches", str(spec.data_batches)]
    staleness = cache_staleness(system)
    if staleness is not None:
        worker_args = [*worker_args, "--cache-staleness", str(staleness),
                       "--cache-mb", str(config.cache_mb)]
    servers = servers_for(config, workers, placement.placement)
    run = Run(base_system(system), spec, workers, servers, placement, config.window,
              log_dir, worker_args, VARIANTS.get(system, (system, {}))[1])
    worker_hosts = [f"worker{i}" for i in range(workers)]
    counters = placement.cluster.counters if placement.cluster else None
    record, error = None, None
    try:
        with ResourceSampler(counters, run.pids, labels=run.pid_hosts) as sampler:
            try:
                waited = run.start()
                record, error = run.wait(waited, config.run_timeout)
            except ParallaxError as err:
                error = str(err)
            finally:
                try:
                    run.stop()
                finally:
                    placement.release()
    except Exception as err:  # noqa: BLE001 - one failed run must not end the benchmark
        error = f"{type(err).__name__}: {err}"
    hosts = len(topology.hosts(base_system(system), workers, servers,
                               placement.placement))
    if placement.cluster is None and placement.cpu is None:
        hosts = 1  # loopback on shared cores: one machine
    result = {"system": system, "workload": spec.name, "size": spec.size, "workers": workers,
              "servers": servers if base_system(system) in SERVED else 0,
              "placement": placement.placement, "hosts": hosts,
              "cores": topology.cores(hosts, placement.cpu.share if placement.cpu else None),
              "batch_per_worker": spec.batch_per_worker,
              "global_batch": spec.batch_per_worker * workers,
              "status": "failed" if record is None else "ok", "error": error, "windows": [],
              "samples_per_s": None, "cpu_seconds_per_sample": None,
              "worker_bytes_per_step": None, "per_process": None, "loss": None,
              "analytic": analytic(base_system(system), spec, workers),
              "traffic_workload": traffic_record(spec, workers)}
    if record is not None:
        try:
            result["windows"] = window_metrics(record, sampler)
        except ParallaxError as err:  # e.g. the sampler lost its counters mid-run
            result.update(status="failed", error=f"measurement windows: {err}")
            return result
        result.update(summarize_windows(result["windows"], worker_hosts))
        result["loss"] = record.get("loss")
        result["losses"] = record.get("losses", [])
        result["counters"] = record.get("counters", {})
        result["data_path"] = record.get("data_path")
        result["code"] = record.get("code")
    if staleness is not None:
        result["cache"] = {"staleness": staleness, "mb": config.cache_mb}
    return result


def _network_record(name: str, cluster: EmulatedCluster | None,
                    cpu: CpuGroups | None = None, placement: str | None = None) -> dict:
    """The results' network: its key (name, with "@<share>cpu" when isolated and
    ":<placement>" when one is given), the links' effective rate and latency, the placement,
    and the CPU share with the link as asked for (nominal)."""
    share = cpu.share if cpu else None
    nominal = LinkSpec() if cluster is None else LinkSpec.parse(name)
    key = cgroups.network_key(LOOPBACK if cluster is None else nominal.name, share)
    record = {"name": key if placement is None else f"{key}:{placement}",
              "rate_mbit": None, "latency_ms": 0.0, "latency_emulated": False}
    if placement is not None:
        record["placement"] = placement
    if cluster is not None:
        link = cluster.link
        record.update(rate_mbit=link.rate_mbit, latency_ms=link.latency_ms,
                      latency_emulated=cluster.latency_emulated,
                      latency_note=cluster.latency_note)
    if cpu is not None:
        record.update(cpu_share=share, cpu_period_us=cpu.period_us, cpu_quota_us=cpu.quota_us,
                      nominal_rate_mbit=nominal.rate_mbit,
                      nominal_latency_ms=nominal.latency_ms)
    return record


def _git_commit(root: Path = Path(measure.CODE_ROOT)) -> str:
    """The checkout's commit, "+dirty" when its tracked files differ from it (what ran is
    then not that commit)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True,
                              cwd=root).stdout.strip()
    try:
        commit = git("rev-parse", "--short", "HEAD")
        return commit + ("+dirty" if git("status", "--porcelain", "--untracked-files=no")
                         else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _cycle_time_note(environ) -> str:
    """Which Horovod cycle time each system ran with (it changes a waiting worker's CPU)."""
    given = environ.get(HOROVOD_CYCLE_TIME_ENV)
    if given is not None:
        return f"Horovod's cycle time: {HOROVOD_CYCLE_TIME_ENV}={given} for every system"
    return (f"Horovod's cycle time: parallax's workers (hybrid, ps, allreduce) "
            f"{WORKER_CYCLE_TIME_MS} ms, Horovod's peers its own default (1 ms); set "
            f"{HOROVOD_CYCLE_TIME_ENV} to give every system one")


DATA_NOTE = ("data: each worker makes {batches} batches before timing and cycles them "
             "(--data-batches), so the servers meet rows never touched before only in a "
             "run's first {batches} steps")


def run_benchmark(config: BenchConfig, command: str = "", echo=sys.stdout,
                  notes: Sequence[str] = ()) -> Path:
    """Every run of the matrix; returns the results JSON path (rewritten after every run).
    notes: more lines for the results' meta.notes (e.g. which link profile ran)."""
    out = Path(config.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "results.json"
    results = {"meta": {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                        "commit": _git_commit(), "command": command,
                        "machine": f"{os.cpu_count()} cores, {_memory_gib():.0f} GiB RAM",
                        "notes": list(notes)},
               "runs": []}
    if "tf_ps" in config.systems:
        results["meta"]["notes"].append(
            "tf_ps trains asynchronously, as TensorFlow's ParameterServerStrategy does: each "
            "worker applies its own batch's gradient, so a global step is W updates and its "
            "loss is not comparable with the synchronous systems' (throughput and bytes are)")
    results["meta"]["notes"].append(_cycle_time_note(os.environ))
    results["meta"]["notes"].append(DATA_NOTE.format(batches=config.data_batches))
    _prepare_cpu_groups(config, results["meta"]["notes"], echo)
    for network in config.networks:
        for share in config.cpu_shares:
            for placement in config.placements:
                _run_setting(config, network, share, placement, results, results_path,
                             echo)
    return results_path


# The cores one CPU-isolated host stands for: its processes' TensorFlow thread pools get as
# many threads (TF_NUM_INTEROP_THREADS, TF_NUM_INTRAOP_THREADS) as on such a machine, not
# one per core of the machine that emulates it; threads beyond a host's cores spin and
# switch inside its quota (hybrid ctr, one worker at 0.5 core: 105 context switches and
# 19.3 ms of worker CPU per step with 2 + 2 threads, 8 and 13.5 ms with 1 + 1).
HOST_CORES = 1
# Where a system cannot run on one thread: TF's ParameterServerStrategy deadlocked with one
# inter-op thread (cpu_quota.MIN_INTER_OP, which the strategy keeps to as well); the systems
# on TensorFlow's own collectives share its runtime and were not run on one.
FEWEST_THREADS = {system: {TF_THREAD_ENVS[0]: str(MIN_INTER_OP)}
                  for system in ("tf_ps", "mwms", "hybrid_tf")}
ISOLATION_NOTE = ("{key}: each host in its own CPU group of {share:g} core (cgroup v1 "
                  "quota {quota} us per {period} us), links scaled by the same factor "
                  "(rate x {share:g}, latency / {share:g}): each host stands for one core "
                  "with a {link} link, slowed {slow:g}x; the quotas apply from each run's "
                  "second warm-up step on (start-up, the first step's tracing included, runs "
                  "unthrottled: it is not measured); every process's TensorFlow thread "
                  "pools sized for the one core a host stands for")


def _prepare_cpu_groups(config: BenchConfig, notes: list[str], echo) -> None:
    """Refuse CPU isolation where cgroup v1 cpu is missing; remove a killed run's groups."""
    if all(share is None for share in config.cpu_shares):
        return
    reason = cgroups.available(config.cgroup_root)
    if reason:
        raise ConfigError(f"--cpu-share needs cgroup v1 CPU groups: {reason}")
    removed = cgroups.sweep(config.prefix, config.cgroup_root)
    if removed:
        print(f"removed CPU groups left by an earlier run: {', '.join(removed)}", file=echo)


def _run_setting(config: BenchConfig, network: str, share: float | None, placement: str,
                 results: dict, results_path: Path, echo) -> None:
    """Every run of one network at one CPU share and placement: the cluster (links scaled by
    the share) up, the runs, the cluster and the CPU groups down, whatever happens."""
    cluster, key = None, cgroups.network_key(network, share)
    cpu = None if share is None else CpuGroups(share, config.prefix, config.cgroup_root,
                                               config.cpu_period_us, deferred=True)
    notes = results["meta"]["notes"]
    try:
        if network != LOOPBACK:
            link = cgroups.scaled_link(LinkSpec.parse(network), share)
            cluster = EmulatedCluster(cluster_hosts(config, placement), link,
                                      prefix=config.prefix).up()
            if not cluster.latency_emulated and cluster.link.latency_ms > 0:
                _note(notes, f"{key}: latency not emulated ({cluster.latency_note})")
        if cpu is not None:
            _note(notes, ISOLATION_NOTE.format(key=key, share=share, quota=cpu.quota_us,
                                               period=cpu.period_us, link=network,
                                               slow=1 / share))
        _note(notes, PLACEMENT_NOTES[placement])
        _run_network(config, network, Placement(cluster, cpu, placement), results,
                     results_path, Path(config.out_dir), echo)
    finally:
        if cluster is not None:
            cluster.down()
        if cpu is not None:
            cpu.remove_all()


PLACEMENT_NOTES = {
    topology.COLOCATED: (":colocated: equal hardware: every system runs on W hosts (one per "
                         "worker); parameter servers run inside worker hosts (server i on "
                         "host i mod W) and TF's coordinator inside worker 0's; a host's "
                         "bytes are its worker's and its server's together"),
    topology.DEDICATED: (":dedicated: every process is a host of its own (namespace, CPU "
                         "group, link): systems with servers or a coordinator use more "
                         "hosts and cores than Horovod (see each row's hosts and cores)")}


def _note(notes: list[str], text: str) -> None:
    if text not in notes:
        notes.append(text)


def _run_network(config, network, placement, results, results_path, out, echo) -> None:
    for name in config.workloads:
        spec = replace(workloads.get(name, config.size), data_batches=config.data_batches)
        for workers in config.workers:
            for rnd in range(config.rounds):
                for system in config.runs:
                    record = _network_record(network, placement.cluster, placement.cpu,
                                             placement.placement)
                    log_dir = (out / "logs" /
                               f"{record['name']}-{name}-w{workers}-r{rnd}-{system}")
                    started = time.monotonic()
                    result = run_one(system, spec, workers, config, placement, log_dir)
                    result["network"] = record
                    result["round"] = rnd
                    results["runs"].append(result)
                    results_path.write_text(json.dumps(results, indent=1))
                    _echo_run(result, time.monotonic() - started, echo)


def echo_failure(head: str, result: dict, elapsed: float, echo) -> bool:
    """Print a failed run's line (the first line of its error); True if it failed."""
    if result["status"] == "ok":
        return False
    first = (result["error"] or "").splitlines()[0] if result["error"] else ""
    print(f"{head} FAILED ({elapsed:.0f} s): {first}", file=echo, flush=True)
    return True


def _echo_run(result: dict, elapsed: float, echo) -> None:
    cores = "" if result["cores"] is None else f" {result['cores']:g} cores"
    head = (f"{result['network']['name']:>13} {result['workload']:<5} W={result['workers']} "
            f"r{result['round']} {result['system']:<13} [{result['hosts']} hosts{cores}]")
    if echo_failure(head, result, elapsed, echo):
        return
    traffic = result["worker_bytes_per_step"]
    moved = (f"  {traffic['sent'] / 1e3:9.1f} KB sent/worker/step" if traffic else "")
    print(f"{head} {result['samples_per_s']:10.1f} samples/s{moved}  ({elapsed:.0f} s)",
          file=echo, flush=True)
    if result.get("code") not in (None, measure.CODE_ROOT):
        print(f"{head} ran parallax from {result['code']}, not from this harness's "
              f"checkout {measure.CODE_ROOT} (results.json's commit is this one's)", file=echo,
              flush=True)


def _memory_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30
    except (ValueError, OSError):
        return 0.0
