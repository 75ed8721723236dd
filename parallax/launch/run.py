"""`parallax run`: parameter servers and N Horovod workers on this machine, in one command.

`run(LaunchConfig(...))` starts the servers (`LocalCluster`, unless external ones are given),
then the workers with a launch backend (`parallax.launch.backends`): the command itself when
there is one worker here (`single`), `horovodrun -np N -H localhost:N --gloo COMMAND`
otherwise (`horovodrun`, whose rendezvous server listens on the job's interface, loopback for
one host, not on 0.0.0.0).
Workers learn where the servers are from the environment (the contract the strategy reads):

  PARALLAX_PS_ADDRESSES  comma-separated host:port of every parameter server
  PARALLAX_RUN_ID        the job's id (table names on the servers are namespaced with it)
  PARALLAX_TLS_CA, PARALLAX_TLS_CERT, PARALLAX_TLS_KEY, PARALLAX_TOKEN_FILE
                         with --secure: the job's credentials (see parallax.protocol.security)
  PARALLAX_MODE          hybrid, ps or allreduce (only when --mode is given)
  PARALLAX_SYNC          sync or async (only when --async, or sync=... in the API, is given)
  PARALLAX_WORKER_METRICS_PORT  with --metrics-port: the workers' /metrics (0: free ports,
                         else the first port after the machine's servers', + local rank)

and their rank and size from Horovod (HOROVOD_RANK, HOROVOD_SIZE, ...; absent with one
worker). The job's exit code is the first non-zero worker exit code, else 0; a server that
dies while the job runs stops the job with exit code 1; SIGINT/SIGTERM to the launcher is
forwarded to the workers and gives 128 + signal. A server that has not answered a health
check for `health_timeout` seconds (hung, SIGSTOPped) stops the job the same way, and is
named in one line. Servers this launcher started are always
stopped. The launcher's own messages and the servers' output (`[ps i]` lines) go to stderr;
the workers' output goes to stdout and stderr as they write it, less TensorFlow's known
start-up lines (`parallax.runtime.logs.worker_noise`).

horovodrun's habits work: `-H host:N,...` (or `--hosts host:N,...`), `--hostfile FILE`
(`host slots=N` lines) and `--horovodrun-arg=ARG` for any other horovodrun flag. The
servers' start timeout is `--server-start-timeout`; `--start-timeout`, which is the workers'
in horovodrun, is refused with an error naming both (it once meant the servers' here).
"""
from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
import dataclasses
import tempfile
from dataclasses import dataclass
from pathlib import Path

from parallax.client.replicas import check_flag
from parallax.env import (ADDRESSES_ENV, COLLECTIVES, ELASTIC_ENV, HELD_BACKUPS_ENV, MODE_ENV,
                          REPLAY_ENV, REPLICAS_ENV, RESCALE_AT_START, RESCALE_FILE_ENV,
                          RESTART_COUNT_ENV, RUN_ID_ENV, RUN_MODES, SYNC_ENV, TABLES_KEPT_ENV,
                          WORKER_METRICS_HOST_ENV, WORKER_METRICS_PORT_ENV,
                          WORKER_METRICS_PREFIX, ask_rescale,
                          is_run_id, new_run_id, parse_worker_metrics_line, rescale_reason,
                          stopped_for_rescale)
from parallax.errors import ConfigError, ParallaxError
from parallax.launch.backends import WorkerBackend, choose
from parallax.launch.backends import horovodrun as horovodrun_backend
from parallax.launch.elastic import ELASTIC_TIMEOUT_S, Elastic, RescaleWatch
from parallax.launch.job_servers import (MAX_REPLACEMENTS, HealthWatch, JobServers,
                                         Replacements, ServerLosses, check_external,
                                         report_dead_server, report_silent_server)
from parallax.launch.restarts import RESTART_DELAY_S, Outcome, RestartBudget
from parallax.launch.warm import WARM_STARTS, gpu_machine, wanted, warm_process, why_cold
from parallax.runtime import lifeline, logs

_HOST = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+)$")
_PYTHON = re.compile(r"^python[0-9.]*$")
LAST_LINES = 10  # of a failed worker's output, repeated when the job ends
# a collective that lost a peer, as the other workers see it (Horovod; TF's collectives)
_PEER_GONE = ("Horovod has been shut down", "heartbeat timeout")
_RAISED = re.compile(r"^\s*[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b(:|$)")
STOP_GRACE_S = 10.0  # horovodrun gives workers 5 s after SIGTERM before it kills them
SERVER_DIED_EXIT = 1


@dataclass(frozen=True)
class LaunchConfig:
    """What `parallax run` starts, one field per flag (`parse_args` makes one from argv).

    Example (two workers and two local servers, as `parallax run -np 2 -- python train.py`):

        exit_code = run(LaunchConfig(num_workers=2, command=("python", "train.py")))

    `validate(config)` (and `run`) raise ConfigError for a bad combination before anything
    starts.
    """

    num_workers: int = 1                  # -np
    num_servers: int = 2                  # --servers; 0: use ps_addresses (external servers)
    ps_addresses: tuple[str, ...] = ()    # --ps-addresses host:port,... (servers not started)
    command: tuple[str, ...] = ()         # e.g. ("python", "train.py"); a leading .py file
                                          # is run with this interpreter
    run_id: str | None = None             # --run-id; generated when None
    server_args: tuple[str, ...] = ()     # extra args for each `parallax server`
    data_dir: str | None = None           # --data-dir of the servers (checkpoints)
    start_timeout: float = 60.0           # seconds for the servers to become ready
    secure: bool = False                  # --secure: TLS, client certificates and a token
    mode: str | None = None               # --mode hybrid|ps|allreduce -> PARALLAX_MODE
    sync: bool | None = None              # --async: False -> PARALLAX_SYNC=async
    progress_seconds: float = 30.0        # a job progress line this often (0: never)
    health_timeout: float = 30.0          # --health-timeout: a server silent this long
                                          # stops the job (0: never)
    max_restarts: int = 0                 # --max-restarts: restarts after failures
    restart_delay: float | None = None    # --restart-delay: seconds before each restart
                                          # (None: RESTART_DELAY_S after a server's failure,
                                          # 0 after a worker's: parallax.launch.restarts)
    hosts: str | None = None              # --hosts FILE, -H host:N,..., --hostfile FILE
                                          # (parallax.launch.hosts): where workers and servers
                                          # run; servers as it says unless num_servers is
                                          # 0; num_workers <= its slots
    horovodrun_args: tuple[str, ...] = ()  # --horovodrun-arg: more flags for horovodrun
    log_level: str | None = None          # --log-level (parallax.runtime.logs); None: as it is
    collectives: str = "auto"             # --collectives auto|horovod|tensorflow: the workers'
                                          # launch backend (parallax.launch.backends)
    replicas: int = 1                     # --replicas 2: a copy of each shard on the next
                                          # server; a server's death then stops nothing
    held_backups: int = 0                 # --held-backups N: one Keras backup in N on disk,
                                          # the others' tables held by the servers, kept
                                          # across a worker's failure
                                          # (parallax.tf.state.held_backups); 0: all on disk
    discovery_script: str | None = None   # --host-discovery-script: an elastic job, whose
                                          # workers run on the slots it lists
                                          # (parallax.launch.elastic)
    min_workers: int | None = None        # --min-np (default: num_workers)
    max_workers: int | None = None        # --max-np (default: num_workers)
    elastic_timeout: float = ELASTIC_TIMEOUT_S  # --elastic-timeout: seconds to wait for
                                          # --min-np slots
    metrics_port: int | None = None       # --metrics-port: each started server's and each
                                          # worker's /metrics (0: free ports; P: the i-th
                                          # server of a machine at P+i, then its workers);
                                          # None: none
    warm_starts: str = "auto"             # --warm-starts auto|on|off: fork workers from a
                                          # process with TensorFlow imported
                                          # (parallax.launch.warm); auto: with restarts
    replay_mb: int = 0                    # --replay-mb N: each worker keeps N MiB of its
                                          # pushes, and a server of ours that dies is started
                                          # again from its newest checkpoint, the pushes since
                                          # replayed to it (job_servers.Replacements); 0: off


def _check_metrics_port(config: LaunchConfig) -> None:
    """--metrics-port: 0, or a first port that leaves room for every server and worker of
    one machine (`_per_machine`) and is clear of the host file's server ports."""
    port = config.metrics_port
    if port is None:
        return
    if config.secure:
        raise ConfigError("--metrics-port with --secure: the endpoints would need the job's "
                          "client certificate and token, which live in a temporary directory "
                          "removed at the end; scrape a --secure job's servers with "
                          "--server-arg=--metrics-port=P and credentials of your own, or "
                          "drop --secure")
    servers, workers = _per_machine(config)
    if not 0 <= port or port + servers + workers > 65536:
        raise ConfigError(f"--metrics-port {port}: give 0 (free ports) or a port in 1-"
                          f"{65536 - servers - workers} (server i of a machine listens on "
                          f"PORT+i, then its worker of local rank j on PORT+{servers}+j)")
    server_ports = _host_file_server_ports(config, servers)
    if port and server_ports and set(server_ports) & set(range(port, port + servers + workers)):
        raise ConfigError(f"--metrics-port {port}: ports {port}-{port + servers + workers - 1} "
                          f"overlap the servers' own ports {server_ports.start}-"
                          f"{server_ports.stop - 1} (the host file's server_port); pick "
                          f"another, or 0 for free ports")


def _per_machine(config: LaunchConfig) -> tuple[int, int]:
    """(servers this command starts, workers) on the busiest machine, for metrics ports."""
    if config.hosts is None:
        return config.num_servers, config.num_workers
    from parallax.launch.hosts import load_hosts
    layout = load_hosts(config.hosts)
    servers = max(h.servers for h in layout.hosts) if config.num_servers else 0
    return servers, max(h.slots for h in layout.hosts)


def _host_file_server_ports(config: LaunchConfig, servers: int) -> range | None:
    if config.hosts is None or not config.num_servers:
        return None
    from parallax.launch.hosts import load_hosts
    first = load_hosts(config.hosts).server_port
    return range(first, first + servers) if first else None


def worker_metrics_env(config: LaunchConfig) -> dict[str, str]:
    """What tells each worker to serve /metrics (`parallax.client.worker_metrics`): free
    ports with --metrics-port 0, else the first port after the servers' of a machine (the
    worker of local rank j at it + j); on several hosts every interface, since a worker
    cannot tell which of the host file's names is its own. {} without --metrics-port."""
    if config.metrics_port is None:
        return {}
    servers, _ = _per_machine(config)
    env = {WORKER_METRICS_PORT_ENV: str(config.metrics_port + servers
                                        if config.metrics_port else 0)}
    if config.hosts is not None:
        from parallax.launch.hosts import is_local, load_hosts
        if not all(is_local(h.host) for h in load_hosts(config.hosts).hosts):
            env[WORKER_METRICS_HOST_ENV] = "0.0.0.0"
    return env


class _WorkerMetrics:
    """The workers' metrics lines (`parse_worker_metrics_line`), collected from their output;
    once every worker has announced its endpoint, the launcher prints them in one line."""

    def __init__(self, workers: int, scheme: str) -> None:
        self.workers, self.scheme = workers, scheme
        self.addresses: dict[int, str] = {}

    def note(self, line: bytes) -> None:
        if WORKER_METRICS_PREFIX.encode() not in line:
            return
        found = parse_worker_metrics_line(line.decode(errors="replace"))
        if found is None or found[0] in self.addresses:
            return
        self.addresses[found[0]] = found[1]
        if len(self.addresses) == self.workers:
            _say("metrics: " + ", ".join(f"worker {rank} at {self.scheme}://{address}/metrics"
                                         for rank, address in sorted(self.addresses.items())))


def check_address(address: str, source: str = "--ps-addresses") -> str:
    host, sep, port = address.strip().rpartition(":")
    if not sep or not _HOST.match(host) or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{source}: {address!r} is not host:port with a port in 1-65535; "
                          f"give each server as e.g. 127.0.0.1:7000, comma-separated")
    return address.strip()


def validate(config: LaunchConfig) -> list[str]:
    """Check every field; returns the program's argv as each worker will run it."""
    for name in ("command", "ps_addresses", "server_args"):
        if isinstance(getattr(config, name), str):
            raise ConfigError(f"{name} must be a tuple of strings, not the string "
                              f"{getattr(config, name)!r}")
    if config.num_workers < 1:
        raise ConfigError(f"-np {config.num_workers}: the number of workers must be at least 1")
    if config.num_servers < 0:
        raise ConfigError(f"--servers {config.num_servers} must be >= 0 (0: use "
                          f"--ps-addresses of servers started elsewhere)")
    if config.num_servers > 0 and config.ps_addresses:
        raise ConfigError(f"--servers {config.num_servers} and --ps-addresses both given: "
                          f"use --servers 0 with --ps-addresses, or drop --ps-addresses")
    if config.num_servers == 0:
        if not config.ps_addresses:
            raise ConfigError("--servers 0 needs --ps-addresses host:port,... of running "
                              "parameter servers (or give --servers N to start N here)")
        for address in config.ps_addresses:
            check_address(address)
        if config.server_args or config.data_dir is not None:
            raise ConfigError("--server-arg and --data-dir apply to servers this command "
                              "starts; with --ps-addresses, give them to those servers")
    if config.secure and config.num_servers == 0:
        raise ConfigError("--secure makes credentials for the servers this command starts; "
                          "for --ps-addresses servers, set PARALLAX_TLS_CA (and "
                          "PARALLAX_TLS_CERT/KEY, PARALLAX_TOKEN_FILE) instead")
    for arg in config.server_args:
        if config.secure and arg.split("=", 1)[0] in ("--tls-cert", "--tls-key",
                                                      "--tls-client-ca", "--token-file"):
            raise ConfigError(f"--server-arg {arg!r}: --secure sets the servers' credentials; "
                              f"drop one of them")
        if config.metrics_port is not None and arg.split("=", 1)[0] in ("--metrics-port",
                                                                          "--metrics-host"):
            raise ConfigError(f"--server-arg {arg!r}: --metrics-port sets the servers' "
                              f"metrics ports; drop one of them")
        if arg.split("=", 1)[0] in ("--port", "--data-dir"):
            raise ConfigError(f"--server-arg {arg!r}: ports are picked by the launcher and "
                              f"the data directory is --data-dir; drop it")
    _check_metrics_port(config)
    _check_replicas(config)
    _check_replay(config)
    _check_elastic(config)
    if config.held_backups < 0:
        raise ConfigError(f"--held-backups {config.held_backups} must be >= 0 (N: one backup "
                          f"in N on disk, the others held by the servers; 0: all on disk)")
    if config.run_id is not None and not is_run_id(config.run_id):
        raise ConfigError(f"--run-id {config.run_id!r} must be 1-48 letters, digits, "
                          f"'_' or '-'")
    if config.health_timeout < 0:
        raise ConfigError(f"--health-timeout {config.health_timeout} must be >= 0 seconds "
                          f"(0: no health checks)")
    if config.start_timeout <= 0:
        raise ConfigError(f"--server-start-timeout {config.start_timeout} must be > 0 seconds")
    horovodrun_backend.check_args(config.horovodrun_args)
    if config.collectives not in COLLECTIVES:
        raise ConfigError(f"--collectives {config.collectives!r} must be one of "
                          f"{', '.join(COLLECTIVES)}")
    if config.warm_starts not in WARM_STARTS:
        raise ConfigError(f"--warm-starts {config.warm_starts!r} must be one of "
                          f"{', '.join(WARM_STARTS)}")
    if config.mode is not None and config.mode not in RUN_MODES:
        raise ConfigError(f"--mode {config.mode!r} must be one of {', '.join(RUN_MODES)}")
    if config.sync is not None and not isinstance(config.sync, bool):
        raise ConfigError(f"sync must be True, False or None, not {config.sync!r}")
    if config.hosts is not None:
        from parallax.launch.hosts import load_hosts
        layout = load_hosts(config.hosts)
        if config.num_workers > layout.num_slots:
            raise ConfigError(f"-np {config.num_workers}: {config.hosts} has only "
                              f"{layout.num_slots} slot(s); lower -np or add slots")
        if config.num_servers > 0 and layout.num_servers == 0:
            raise ConfigError(f"{config.hosts} places no servers (servers: 0 on every host); "
                              f"give a host servers >= 1, or use --ps-addresses")
        _check_restart_storage(config, layout)
    return program_argv(config.command)


def _check_elastic(config: LaunchConfig) -> None:
    if config.discovery_script is None:
        given = [flag for flag, value in (("--min-np", config.min_workers),
                                          ("--max-np", config.max_workers)) if value is not None]
        if given:
            raise ConfigError(f"{' and '.join(given)} without --host-discovery-script: the "
                              f"worker count changes with the hosts a discovery script lists "
                              f"(Horovod Elastic's flags); give one, or drop {given[0]}")
        return
    if config.hosts is not None:
        raise ConfigError(f"--host-discovery-script and --hosts/-H/--hostfile "
                          f"{config.hosts} both given: an elastic job's hosts are the ones its "
                          f"script lists; give one of them")
    _elastic(config)  # its bounds


def _check_replicas(config: LaunchConfig) -> None:
    if config.replicas == 1:
        return
    servers = config.num_servers or len(config.ps_addresses)
    if config.hosts is not None and config.num_servers:
        from parallax.launch.hosts import load_hosts
        servers = load_hosts(config.hosts).num_servers
    check_flag(config.replicas, servers, config.sync is not False)


def _check_replay(config: LaunchConfig) -> None:
    """--replay-mb N: the launcher starts its own dead servers again, and the workers'
    replay rebuilds their shards exactly only where sync steps sum the workers' pushes in a
    fixed order."""
    n = config.replay_mb
    if n < 0:
        raise ConfigError(f"--replay-mb {n} must be >= 0 (MiB of pushes each worker keeps to "
                          f"replay to a server started again; 0: off)")
    if n == 0:
        return
    if config.replicas > 1:
        raise ConfigError(f"--replay-mb {n} with --replicas {config.replicas}: give one (copies "
                          f"of each shard, or a lost server started again from its checkpoint "
                          f"and the pushes since replayed to it)")
    if config.sync is False:
        raise ConfigError(f"--replay-mb {n} with --async: a replay rebuilds a shard exactly "
                          f"only from sync steps (the workers' pushes summed in a fixed "
                          f"order); drop one of them")
    external = ("--ps-addresses" if config.num_servers == 0 else
                "--hosts/-H/--hostfile" if config.hosts is not None else None)
    if external is not None:
        raise ConfigError(f"--replay-mb {n} with {external}: those servers are not ours to "
                          f"start again (--replay-mb starts a lost server anew on this "
                          f"machine, from the checkpoints in its data directory); use "
                          f"--servers N, or drop --replay-mb")


def _check_restart_storage(config: LaunchConfig, layout) -> None:
    """Refuse restarts that would keep the checkpoints of servers on other hosts in a
    directory of the launcher's (what `_restart_data_dir` makes without --data-dir): each
    host would get one of its own, never removed."""
    if not _makes_data_dir(config):
        return
    from parallax.launch.hosts import is_local
    remote = [h.host for h in layout.hosts if h.servers and not is_local(h.host)]
    if remote:
        raise ConfigError(f"--max-restarts {config.max_restarts} without --data-dir, and servers "
                          f"run on {', '.join(remote)}: give --data-dir on storage that every "
                          f"server host shares (the same path on each), or run every server on "
                          f"this machine")


def program_argv(command: tuple[str, ...] | list[str]) -> list[str]:
    argv = list(command)
    if not argv or not argv[0]:
        raise ConfigError("no command to run: give the program after the options, e.g. "
                          "`parallax run -np 2 -- python train.py`")
    if argv[0].endswith(".py"):
        _check_script(argv[0])
        return [sys.executable, *argv]
    if shutil.which(argv[0], path=worker_path()) is None:
        raise ConfigError(f"command {argv[0]!r} is neither an executable file nor on PATH; "
                          f"check its spelling, or give a .py file to run it with "
                          f"{sys.executable}")
    if _PYTHON.match(Path(argv[0]).name) and len(argv) > 1 and argv[1].endswith(".py"):
        _check_script(argv[1])
    return argv


def _check_script(path: str) -> None:
    if not Path(path).is_file():
        raise ConfigError(f"script {path!r} not found (relative to {os.getcwd()}); check the "
                          f"path")


def worker_path() -> str:
    """PATH for the workers: in a virtual environment, its bin directory first (as if it were
    activated), so that `python train.py` runs with the launcher's interpreter."""
    path = os.environ.get("PATH", os.defpath)
    if sys.prefix == sys.base_prefix:
        return path
    bin_dir = str(Path(sys.executable).parent)
    return os.pathsep.join([bin_dir, *(p for p in path.split(os.pathsep) if p != bin_dir)])


def worker_env(addresses: list[str], run_id: str, mode: str | None = None,
               sync: bool | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = worker_path()
    env[ADDRESSES_ENV] = ",".join(addresses)
    env[RUN_ID_ENV] = run_id
    if mode is not None:
        env[MODE_ENV] = mode
    if sync is not None:
        env[SYNC_ENV] = "sync" if sync else "async"
    env.setdefault("PYTHONUNBUFFERED", "1")  # live output through pipes (horovodrun's too)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's start-up notices, per worker
    return env


def _say(message: str) -> None:
    print(f"parallax run: {message}", file=sys.stderr, flush=True)


class _Job:
    """The workers' process (the command, or horovodrun) in its own process group, so that
    signals reach it once, from the launcher, and leftovers in the group can be killed."""

    def __init__(self, argv: list[str], env: dict[str, str], backend: WorkerBackend,
                 metrics: _WorkerMetrics | None = None) -> None:
        # the wrapper leads the job's group and ends all of it if the launcher dies: the
        # command's children (a shell's, horovodrun's) are no orphans either
        argv = lifeline.dying_with(argv, os.getpid(), reap_group=True)
        group = {"process_group": 0} if sys.version_info >= (3, 11) else {}  # before exec
        self.backend = backend
        self.metrics = metrics  # collects the workers' metrics lines (--metrics-port)
        self.first_failure: tuple[int, int] | None = None  # (rank, code) from the backend
        self.last_lines: dict[int, deque] = {}  # rank -> its last lines, for the report
        # stderr always goes through the launcher (TensorFlow's start-up noise is dropped);
        # stdout only when the backend says so (a single worker keeps its terminal)
        piped = subprocess.PIPE if backend.pipes_stdout else None
        self.proc = subprocess.Popen(argv, env=env, stdout=piped,
                                     stderr=subprocess.PIPE, **group)
        self._pumps = [threading.Thread(target=self._forward, args=(stream, out), daemon=True)
                       for stream, out in ((self.proc.stdout, sys.stdout),
                                           (self.proc.stderr, sys.stderr)) if stream]
        for pump in self._pumps:
            pump.start()

    def _forward(self, stream, out) -> None:
        """Copy one of the workers' streams as it comes (partial lines too) less TensorFlow's
        known start-up lines, keeping each rank's last lines (a traceback goes to stderr)
        and noting the backend's report of failures."""
        fd, line, noise = stream.fileno(), b"", logs.NoiseFilter()
        while raw := os.read(fd, 65536):
            chunk = noise.feed(raw)
            _write(out, chunk)
            line += chunk
            *complete, line = line.split(b"\n")
            for text in complete:
                if self.metrics is not None:
                    self.metrics.note(text)
                failure = self.backend.failure(text)
                if failure is not None and self.first_failure is None:
                    self.first_failure = failure  # (the other stream's pump never unsets it)
                ranked = self.backend.rank_line(text)
                if ranked and ranked[1].strip():
                    lines = self.last_lines.setdefault(ranked[0], deque(maxlen=LAST_LINES))
                    lines.append(ranked[1].decode(errors="replace"))
        _write(out, noise.flush())

    def tail(self, rank: int) -> str:
        return "\n".join(f"  [{rank}] {line}" for line in self.last_lines.get(rank, ()))

    def signal(self, signum: int) -> None:
        try:
            os.killpg(self.proc.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, grace: float = STOP_GRACE_S) -> None:
        """SIGTERM the group, wait, SIGKILL what is left (also after the leader exited)."""
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.proc.wait()
        self._reap_group(grace)
        for pump in self._pumps:
            pump.join(2.0)

    def _reap_group(self, grace: float) -> None:
        """Processes left in the job's group (e.g. the multiprocessing resource tracker of
        horovodrun, which ignores SIGTERM and leaves when its last user has gone)."""
        self.signal(signal.SIGTERM)
        deadline, killed = time.monotonic() + grace, False
        while lifeline.group_alive(self.proc.pid):
            if time.monotonic() > deadline:
                if killed:
                    _say(f"processes of group {self.proc.pid} survived SIGKILL; giving up")
                    return
                self.signal(signal.SIGKILL)
                deadline, killed = time.monotonic() + 2.0, True
            time.sleep(0.05)

    def exit_code(self) -> int:
        code = self.proc.returncode
        if code is not None and code < 0:
            return 128 - code  # killed by a signal: the shell's convention
        if code and self.first_failure is not None:  # e.g. horovodrun itself exits 1
            return self.first_failure[1]
        return code or 0


def _write(out, data: bytes) -> None:
    out.flush()
    out.buffer.write(data)
    out.buffer.flush()


class _Interrupted(BaseException):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _Signals:
    """SIGINT/SIGTERM while the launcher runs: before the job starts, abort the start; once
    it runs, forward the signal to the job (a second one kills it)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.job: _Job | None = None
        self.abortable = True  # False from just before the job's Popen
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "_Signals":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame) -> None:
        first = self.signum is None
        self.signum = self.signum or signum
        if self.job is None:
            if self.abortable:
                raise _Interrupted(signum)
            return  # attach() forwards it
        self.job.signal(signum if first else signal.SIGKILL)

    def attach(self, job: _Job) -> None:
        self.job = job
        if self.signum is not None:  # arrived while the job was being started
            job.signal(self.signum)


def _supervise(job: _Job, losses: ServerLosses, signals: _Signals,
               health: HealthWatch, stops: Path | None = None) -> Outcome:
    while True:
        try:
            job.proc.wait(0.2)
        except subprocess.TimeoutExpired:
            pass
        if signals.signum is not None:  # already forwarded to the job: give it time
            name = signal.Signals(signals.signum).name
            _say(f"got {name}: stopping the workers and servers")
            try:
                job.proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
            job.stop(grace=2.0)
            return Outcome(128 + signals.signum, f"got {name}")
        dead = losses.fatal()
        if dead is not None:
            report_dead_server(dead, _say)
            job.stop()
            return Outcome.failed(SERVER_DIED_EXIT, f"parameter server {dead.index} "
                                  f"({dead.address}) exited with code {dead.proc.returncode}",
                                  server_failed=True)
        silent = health.silent(losses.addresses) if job.proc.returncode is None else None
        if silent is not None and losses.outlives(silent, health.servers):
            continue
        if silent is not None:
            report_silent_server(silent, losses.cluster, _say)
            job.stop()
            return Outcome.failed(SERVER_DIED_EXIT, f"parameter server {silent[0]} "
                                  f"({silent[1]}) answered no health check for "
                                  f"{silent[2]:.0f}s", server_failed=True)
        if job.proc.returncode is not None:
            job.stop()  # leftovers in its process group
            return _job_outcome(job, stops is not None
                                and stopped_for_rescale(stops, clear=False) is not None)


def _job_outcome(job: _Job, rescale: bool = False) -> Outcome:
    """How the job ended when its workers did; `rescale`: they stopped for a new worker
    count (`_rescaled`), no failure to report."""
    code = job.exit_code()
    if not code:
        return Outcome(0)
    if job.first_failure is None or rescale:
        return Outcome.failed(code, f"{job.backend.who} exited with code {code}")
    rank, failed = job.first_failure
    _say(f"worker rank {rank} exited with code {failed} first; the job exits with "
         f"{code}. Its last output:\n{job.tail(rank) or '  (none)'}")
    if _lost_a_peer(job.tail(rank)):
        _say(_peer_failure(job, rank))
    return Outcome.failed(code, f"worker rank {rank} exited with code {failed}")


def _lost_a_peer(output: str) -> bool:
    return any(sign in output for sign in _PEER_GONE)


def _peer_failure(job: _Job, rank: int) -> str:
    """What ended the collective under worker `rank`: another worker's exception (that
    worker often exits after the failure it caused in the others), or a worker that had
    finished its script."""
    for other, lines in sorted(job.last_lines.items()):
        raised = [line for line in lines if _RAISED.match(line)]
        if other != rank and raised and not _lost_a_peer(job.tail(other)):
            return (f"worker rank {rank} failed because a collective lost a peer after "
                    f"worker rank {other} raised {raised[-1].strip()[:300]!r}, the cause. "
                    f"Its last output:\n{job.tail(other)}")
    return (f"worker rank {rank} failed because a collective lost a peer: another worker "
            f"failed, or had already finished its script while this one still ran a "
            f"collective (fit, evaluate, predict and reading a metric: every worker must run "
            f"them)")


@contextlib.contextmanager
def _credentials(config: LaunchConfig):
    """With --secure: the job's credentials in a private temporary directory, for this
    machine's names and every host of --hosts, copied to the same path on the other hosts;
    removed everywhere at the end. Without: None."""
    if not config.secure:
        yield None
        return
    from parallax.protocol.security import temporary_job_credentials
    names = ["127.0.0.1", "localhost", socket.gethostname()]
    layout = None
    if config.hosts is not None:
        from parallax.launch.hosts import load_hosts
        layout = load_hosts(config.hosts)
        names += [host.host.strip("[]") for host in layout.hosts]
    with temporary_job_credentials(tuple(dict.fromkeys(names))) as credentials:
        copied = []
        try:
            if layout is not None:
                from parallax.launch.hosts import copy_directory_to_hosts
                copied = copy_directory_to_hosts(layout, credentials.ca_cert.parent)
            yield credentials
        finally:
            if copied:
                from parallax.launch.hosts import remove_directory_from_hosts
                remove_directory_from_hosts(copied, credentials.ca_cert.parent)


def _metrics_url(address: str | None, config: LaunchConfig) -> str:
    """Where a server's metrics are scraped (HTTPS with --secure, as its gRPC port)."""
    return f"{'https' if config.secure else 'http'}://{address}/metrics"


def _secured(credentials, env: dict[str, str]) -> dict[str, str]:
    return {**env, **credentials.worker_env()} if credentials is not None else env


def _monitor_options(env: dict):
    """Client options for the launcher's own calls (progress, health): the job's
    credentials, short timeouts, no retries."""
    from parallax.client import ClientOptions
    from parallax.client.connection import client_options_from_env
    return client_options_from_env(ClientOptions(timeout=5, retries=0), environ=env)


def _progress(config: LaunchConfig, addresses: list[str], run_id: str, env: dict):
    from parallax.launch.progress import ProgressReporter
    return ProgressReporter(addresses, run_id, config.progress_seconds, _say,
                            _monitor_options(env)).start()


def run(config: LaunchConfig) -> int:
    """Run the job, restarting it after a failure up to `config.max_restarts` times (and,
    elastic, with a new worker count whenever its workers stopped for one); returns its exit
    code. Raises ConfigError before starting anything."""
    if config.log_level is not None:
        logs.configure(config.log_level)
    program = validate(config)
    elastic = _elastic(config)
    run_id = config.run_id or new_run_id()
    budget = RestartBudget(config.max_restarts, config.restart_delay, _say)
    warm = wanted(config.warm_starts,
                  bool(config.max_restarts or elastic or _rereplicates(config)), gpu_machine())
    with _credentials(config) as credentials, _Signals() as signals, \
            _restart_data_dir(config, run_id) as config, \
            _rescale_file(config, elastic) as rescale, \
            warm_process(warm, worker_env([], run_id, config.mode, config.sync), _say) as warm:
        servers = JobServers(config, credentials, run_id, _say)
        try:
            attempt = 0
            while True:
                outcome = _attempt(config, program, run_id, attempt, signals,
                                   _Context(elastic, rescale, warm), servers)
                if signals.signum is None and (
                        _rescaling(signals) if outcome.rescale
                        else _restarting(budget, outcome, signals)):
                    attempt += 1
                    continue
                return outcome.code if signals.signum is None else 128 + signals.signum
        finally:
            signals.abortable = False  # a signal now must not interrupt the cleanup
            servers.stop()


def _elastic(config: LaunchConfig) -> Elastic | None:
    if config.discovery_script is None:
        return None
    bounds = [config.num_workers if value is None else value  # (0 is a value, refused)
              for value in (config.min_workers, config.max_workers)]
    return Elastic(config.discovery_script, *bounds, config.elastic_timeout, _say)


def _rereplicates(config: LaunchConfig) -> bool:
    """Whether the launcher starts a lost server again (at the workers' next checkpoint):
    its servers, on this machine, keep copies of their shards."""
    return config.replicas > 1 and config.num_servers > 0 and config.hosts is None


@contextlib.contextmanager
def _rescale_file(config: LaunchConfig, elastic: Elastic | None):
    """Where the launcher asks the workers to stop at their next checkpoint: an elastic
    job's, for a new count; one whose servers (started here) keep copies of their shards,
    to start a lost one again. None for any other job."""
    if elastic is None and not _rereplicates(config):
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="parallax-stops-") as directory:
        path = Path(directory) / "rescale.json"
        if elastic is not None:
            elastic.request = path
        yield path


@dataclasses.dataclass(frozen=True)
class _Context:
    """What every attempt of a job starts its workers with."""
    elastic: Elastic | None  # the hosts' discovery of an elastic job
    stops: Path | None  # where the launcher asks the workers to stop at a checkpoint
    warm: object  # the warm process (`parallax.launch.warm`), or None: workers start cold


def _workers_of(config: LaunchConfig, program: list[str], context: _Context) -> tuple:
    """(config with this attempt's worker count, the workers' argv, the backend, the
    watch of an elastic job's hosts, to start once the workers run)."""
    stops, warm = context.stops, context.warm
    for stale in (stops, Path(f"{stops}.stopped")) if stops is not None else ():
        stale.unlink(missing_ok=True)
    if context.elastic is None:
        return (config, *workers_argv(config, program, warm=warm), None)
    layout, count = context.elastic.wait()
    config = dataclasses.replace(config, num_workers=count)
    return (config, *workers_argv(config, program, layout, warm),
            RescaleWatch(context.elastic, layout, count, stops))


def _rescaling(signals: _Signals) -> bool:
    """Whether to start the attempt with the new worker count: yes, unless a signal came
    as the last one ended. From now on a signal aborts its start (the wait for --min-np
    slots included), as for a restart: there is no job to forward it to."""
    signals.job, signals.abortable = None, True
    return signals.signum is None


def _restarting(budget: RestartBudget, outcome: Outcome, signals: _Signals) -> bool:
    """Whether to start another attempt. A signal during the restart delay interrupts it
    and says no (there is no job to forward it to); during the next start it aborts that
    start, as for the first."""
    signals.job, signals.abortable = None, True
    restart = False
    try:
        restart = budget.should_restart(outcome)
    except _Interrupted as exc:
        _say(f"got {exc} during the restart delay: not restarting")
    finally:
        signals.abortable = restart
    return restart


def workers_argv(config: LaunchConfig, program: list[str], layout=None,
                 warm=None) -> tuple[list[str], WorkerBackend]:
    """The workers' command on `layout` (default: --hosts, else this machine), and the
    launch backend that made it (`parallax.launch.backends.choose`); forked from `warm`
    (a `parallax.launch.warm.WarmProcess`) where they can be."""
    from parallax.launch.hosts import load_hosts, parse_host_string, with_devices
    if layout is None:
        layout = (load_hosts(config.hosts) if config.hosts is not None
                  else parse_host_string(f"localhost:{config.num_workers}"))
    backend = choose(layout, config.num_workers, config.collectives)
    if config.secure and backend.name == "tensorflow":
        raise ConfigError("--secure with TensorFlow's collectives: each worker's TensorFlow "
                          "server listens, unauthenticated, on every interface (TensorFlow has "
                          "no bind address or credentials for it); use --collectives horovod "
                          "for a secure job")
    if warm is not None:
        program = _warm(warm, config, program, layout, backend)
    program = with_devices(layout, config.num_workers, program)
    return backend.argv(layout, config.num_workers, program, config.horovodrun_args), backend


def _warm(warm, config: LaunchConfig, program: list[str], layout,
          backend: WorkerBackend) -> list[str]:
    """`program` through the warm processes' stub (this machine's and, over ssh, each other
    host's), or as it is (said when --warm-starts on asked for it, or a warm process could
    not start)."""
    from parallax.launch.hosts import is_local, worker_hosts
    why = why_cold(program, layout, config.num_workers, worker_path())
    if why is not None:
        if config.warm_starts == "on":
            _say(f"--warm-starts on: the workers start cold ({why})")
        return program
    others = [h for h, _, _ in worker_hosts(layout, config.num_workers) if not is_local(h.host)]
    if warm.ensure() is not None or (others and warm.ensure_hosts(
            others, backend.forwarded, config.warm_starts == "on") is not None):
        return program
    return warm.wrap(program)


def _makes_data_dir(config: LaunchConfig) -> bool:
    """Whether the launcher makes the servers' data directory: restarts are on (of the job,
    or, --replay-mb, of a server, which restores from its checkpoints there), it starts the
    servers, and no --data-dir was given."""
    return bool(config.max_restarts or config.discovery_script or config.replay_mb) \
        and config.data_dir is None and config.num_servers > 0


@contextlib.contextmanager
def _restart_data_dir(config: LaunchConfig, run_id: str):
    """The config, with a data directory for the servers' checkpoints that outlives every
    attempt when restarts are on and none was given (removed at the end)."""
    if not _makes_data_dir(config):
        yield config
        return
    with tempfile.TemporaryDirectory(prefix=f"parallax-{run_id}-") as data_dir:
        given = " and ".join(flag for flag, on in (
            ("--max-restarts", config.max_restarts),
            ("--host-discovery-script", config.discovery_script),
            ("--replay-mb", config.replay_mb)) if on)
        users = "a server started again" if given == "--replay-mb" else "the next attempts"
        _say(f"{given} without --data-dir: the servers keep their checkpoints in {data_dir} "
             f"for {users} (removed at the end)")
        yield dataclasses.replace(config, data_dir=data_dir)


def _attempt(config: LaunchConfig, program: list[str], run_id: str, attempt: int,
             signals: _Signals, context: _Context, servers: JobServers) -> Outcome:
    """One run of every worker, on the servers `servers` keeps or starts; how it ended."""
    outcome = watch = None
    credentials = servers.credentials
    try:
        config, argv, backend, watch = _workers_of(config, program, context)
        cluster = servers.for_attempt(config, attempt)
        if cluster is not None:
            addresses, where = cluster.addresses, "started here"
        else:
            addresses, where = [a.strip() for a in config.ps_addresses], "external"
            from parallax.client.connection import client_options_from_env
            check_external(addresses, config.start_timeout, client_options_from_env())
        _say(f"{config.num_workers} worker(s); {len(addresses)} parameter server(s) "
             f"({where}): {','.join(addresses)}; run id {run_id}"
             + (f"; restart {attempt}" if attempt else ""))
        if cluster is not None and config.metrics_port is not None:
            _say("metrics: " + ", ".join(f"server {s.index} at {_metrics_url(s.metrics, config)}"
                                         for s in cluster.servers))
        signals.abortable = False
        env = _secured(credentials, worker_env(addresses, run_id, config.mode, config.sync))
        env[RESTART_COUNT_ENV] = str(attempt)
        stops = context.stops
        if stops is not None:
            env[RESCALE_FILE_ENV] = str(stops)
        if watch is not None:
            env[ELASTIC_ENV] = "1"
        if config.replicas > 1:
            env[REPLICAS_ENV] = str(config.replicas)
        if config.held_backups:
            env[HELD_BACKUPS_ENV] = str(config.held_backups)
        if config.replay_mb:
            env[REPLAY_ENV] = str(config.replay_mb)
        if servers.kept:
            env[TABLES_KEPT_ENV] = "1"
        env.update(worker_metrics_env(config))
        job = _Job(argv, env, backend, _WorkerMetrics(config.num_workers, "http")
                   if config.metrics_port is not None else None)
        signals.attach(job)
        progress = _progress(config, addresses, run_id, env)
        health = HealthWatch(addresses, config.health_timeout, _monitor_options(env)).start()
        if watch is not None:
            watch.start()
        losses = ServerLosses(cluster, config.replicas, _say, _rereplication(
            stops, config.num_workers, watch) if cluster else None,
            Replacements(cluster, _say, health) if cluster and config.replay_mb else None)
        try:
            outcome = _supervise(job, losses, signals, health, stops)
        finally:
            health.stop()
            progress.stop()
        if losses.lost and outcome.restartable:  # (with --replicas 2: one already gone)
            outcome = dataclasses.replace(outcome, server_failed=True)
        if signals.signum is not None:
            return outcome  # the job ends: it does not go on from the stop it may have made
        return _rescaled(outcome, stops, config.num_workers, watch)
    except _Interrupted as exc:
        _say(f"got {exc}: stopped before the job started")
        return Outcome(128 + exc.signum, f"got {exc}")
    finally:
        signals.abortable = False  # a signal now must not interrupt the cleanup
        if watch is not None:
            watch.stop()
        servers.after(outcome)


def _rescaled(outcome: Outcome, stops: Path | None, workers: int,
              watch: RescaleWatch | None) -> Outcome:
    """Workers that stopped at a checkpoint as the launcher asked (in `stops`), for a new
    count or to start a lost server again: a rescale (using none of --max-restarts),
    whatever their exit codes said."""
    at = stopped_for_rescale(stops, clear=True) if stops is not None and outcome.code else None
    if at is None:
        return outcome
    if at == RESCALE_AT_START:
        _say(f"the {workers} worker(s) stopped before their first step: they cannot "
             f"split the global batch evenly; the job goes on with a count that does")
        return Outcome(outcome.code, "stopped for a new worker count", rescale=True)
    why = rescale_reason(stops)
    _say(f"the {workers} worker(s) stopped after their checkpoint, as asked; the job goes on "
         f"{_goes_on(why, watch.asked if watch is not None else None)}")
    return Outcome(outcome.code, f"stopped for {why or 'a new worker count'}", rescale=True)


def _goes_on(why: str, asked: int | None) -> str:
    """Where the job goes on after its workers' stop, in words (`why`: the launcher's own
    reason; `asked`: the worker count asked, None when it was withdrawn or never asked)."""
    if why:  # (an elastic job may also have asked for another count)
        return f"from it with {why}" + (f", and {asked} worker(s)" if asked is not None else "")
    return f"with {asked} from it" if asked is not None else "from it with the count listed now"


def _rereplication(stops: Path | None, workers: int, watch: RescaleWatch | None = None):
    """What the launcher does when the job goes on without a lost server of its own (the
    copies of its shards serve): ask the workers to stop at their next checkpoint, so that
    the job goes on from it on every server again (`JobServers` starts them afresh, and the
    workers' restore fills every copy); in an elastic job through its `watch`, which writes
    the same file (its withdrawal of a count must leave this request). None without a
    request file."""
    if stops is None:
        return None
    lost: list[int] = []  # this attempt's, in order: a second loss must not hide the first

    def ask(server) -> None:
        lost.append(server.index)
        named = (f"parameter server {lost[0]}" if len(lost) == 1 else
                 "parameter servers " + ", ".join(map(str, lost[:-1])) + f" and {lost[-1]}")
        why = (f"every server again ({named} started anew, the copies of "
               f"{'its' if len(lost) == 1 else 'their'} shards restored)")
        if watch is not None:
            watch.stop_anyway(why)
        else:
            ask_rescale(stops, workers, why)
        _say(f"asking the {workers} worker(s) to stop at their next checkpoint, to go on "
             f"from it with parameter server {server.index} started again and the copies of "
             f"its shards restored (until then the job has one copy of them)")
    return ask


def parse_args(argv: list[str]) -> LaunchConfig:
    import argparse
    parser = argparse.ArgumentParser(
        prog="parallax run", allow_abbrev=False,
        description="Start parameter servers and N workers (Horovod's, or TensorFlow "
                    "collectives') on this machine; the "
                    "workers find the servers in PARALLAX_PS_ADDRESSES and the job id in "
                    "PARALLAX_RUN_ID.",
        usage="parallax run [-np N] [--servers S | --ps-addresses HOST:PORT,...] "
              "[--run-id ID] [--server-arg=ARG ...] [--data-dir DIR] "
              "[--server-start-timeout S] [--health-timeout S] [--max-restarts N] "
              "[--restart-delay S] [--secure] [--mode hybrid|ps|allreduce] [--async] "
              "[--replicas 1|2] [--replay-mb N] [--held-backups N] "
              "[-H HOST:N,... | --hosts FILE | --hostfile FILE | --host-discovery-script SCRIPT "
              "[--min-np N] [--max-np N] [--elastic-timeout S]] [--horovodrun-arg=ARG ...] "
              "[--collectives auto|horovod|tensorflow] [--warm-starts auto|on|off] "
              "[--log-level LEVEL] [--] COMMAND "
              "[ARGS ...]")
    parser.add_argument("-np", "--num-workers", dest="num_workers", type=int, default=None,
                        help="number of workers (default 1, or every slot of --hosts; more "
                             "than 1 uses horovodrun, or the TensorFlow backend: "
                             "--collectives)")
    parser.add_argument("-H", "--hosts", default=None, metavar="HOSTS",
                        help="horovodrun's host:N,host2:M (N workers and one server on each "
                             "host), or a host file (horovodrun's `host slots=N` lines, or YAML "
                             "with hosts/slots/servers/gpus): servers and workers there, over "
                             "ssh for other hosts")
    parser.add_argument("--hostfile", default=None, metavar="FILE",
                        help="horovodrun's host file (`host slots=N` lines; parallax's YAML "
                             "works too); like --hosts FILE")
    parser.add_argument("--host-discovery-script", default=None, metavar="SCRIPT",
                        help="an elastic job (Horovod Elastic's flag): SCRIPT prints the hosts "
                             "workers may run on now (`host:N` lines; this machine's for now); "
                             "each attempt runs min(slots, --max-np) workers, and when the "
                             "count it allows changes, the workers stop at their next "
                             "checkpoint and go on with the new count from it")
    parser.add_argument("--min-np", dest="min_workers", type=int, default=None, metavar="N",
                        help="with --host-discovery-script: the fewest workers to run with "
                             "(default -np)")
    parser.add_argument("--max-np", dest="max_workers", type=int, default=None, metavar="N",
                        help="with --host-discovery-script: the most workers (default -np)")
    parser.add_argument("--elastic-timeout", type=float, default=ELASTIC_TIMEOUT_S,
                        metavar="S", help="with --host-discovery-script: seconds to wait for "
                        f"--min-np slots before the job fails (default {ELASTIC_TIMEOUT_S:g})")
    parser.add_argument("--horovodrun-arg", action="append", default=[], metavar="ARG",
                        help="extra argument(s) for horovodrun, e.g. "
                             "--horovodrun-arg=--start-timeout=120 (repeatable)")
    parser.add_argument("--collectives", choices=COLLECTIVES, default="auto",
                        help="what sums the workers' dense gradients: horovod (horovodrun "
                             "starts the workers), tensorflow (TensorFlow's collective ops, no "
                             "Horovod; here and over ssh) or auto (default): horovod "
                             "where Horovod is installed, else tensorflow")
    parser.add_argument("--warm-starts", choices=WARM_STARTS, default="auto",
                        help="fork the workers on this machine from one process that imported "
                             "TensorFlow, Keras, Horovod and parallax once (each worker "
                             "otherwise spends ~3.5 s of CPU on them, at every restart): on, "
                             "off, or auto (default): when the job restarts or rescales its "
                             "workers (--max-restarts, --host-discovery-script, --replicas 2)")
    parser.add_argument("--servers", type=int, default=None,
                        help="parameter servers to start (default 2; 0 with --ps-addresses)")
    parser.add_argument("--ps-addresses", default=None,
                        help="comma-separated host:port of running servers (none started)")
    parser.add_argument("--run-id", default=None, help="job id (default: generated)")
    parser.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                        help="extra argument(s) for each server, e.g. --server-arg=--threads=128")
    parser.add_argument("--data-dir", default=None, help="the servers' checkpoint directory")
    parser.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                        help="each server this command starts and each worker serve "
                             "Prometheus metrics (GET /metrics): 0 for free ports, or PORT for "
                             "the first server of each machine, PORT+i for its i-th, then its "
                             "workers by local rank; the addresses are printed when the "
                             "servers are up and when every worker serves (default: none)")
    parser.add_argument("--server-start-timeout", type=float, default=None, metavar="S",
                        help="seconds to wait for the servers to start (default 60)")
    parser.add_argument("--start-timeout", type=float, default=None, metavar="S",
                        help="refused, naming the flag meant: --server-start-timeout for the "
                             "servers, --horovodrun-arg=--start-timeout=S for horovodrun")
    parser.add_argument("--progress-seconds", type=float, default=30.0,
                        help="print the job's progress (tables, steps, rows moved, read from "
                             "the servers) this often; 0: never (default 30)")
    parser.add_argument("--health-timeout", type=float, default=30.0,
                        help="stop the job (exit 1), naming the server, when a parameter "
                             "server has not answered a health check for this many seconds "
                             "(hung, SIGSTOPped); 0: no checks (default 30)")
    parser.add_argument("--max-restarts", type=int, default=0, metavar="N",
                        help="after a failure (a worker exits non-zero or is killed, a server "
                             "dies or misses health checks) stop everything and start every "
                             "server and worker again, at most N times; workers get "
                             f"{RESTART_COUNT_ENV} and resume from their last checkpoint "
                             "(default 0: the job ends)")
    parser.add_argument("--restart-delay", type=float, default=None, metavar="S",
                        help=f"seconds before each restart (default: {RESTART_DELAY_S:g} after "
                             f"a server's failure, 0 after a worker's, whose servers keep "
                             f"running)")
    parser.add_argument("--secure", action="store_true",
                        help="TLS with client certificates and a cluster token: credentials "
                             "made for this job (removed at the end), passed to the workers "
                             "in PARALLAX_TLS_CA/CERT/KEY and PARALLAX_TOKEN_FILE")
    parser.add_argument("--mode", choices=RUN_MODES, default=None,
                        help="the strategy's mode for the workers (PARALLAX_MODE; default: "
                             "the strategy's own default)")
    parser.add_argument("--replicas", type=int, default=1, metavar="N",
                        help="copies of each table shard: 2 keeps one on the next server too, "
                             "so that the death of a server loses no step and stops nothing "
                             "(sync mode, at least 2 servers; default 1)")
    parser.add_argument("--replay-mb", type=int, default=0, metavar="N",
                        help="when a parameter server started here dies, start it again on "
                             "its address from its newest checkpoint (--restore-newest), and "
                             "the workers, each keeping up to N MiB of its pushes "
                             f"({REPLAY_ENV}), replay those since: the job goes on, no step "
                             f"redone (sync mode, servers started here; at most "
                             f"{MAX_REPLACEMENTS} starts of a server an attempt, then the job "
                             "ends as for a server's death; default 0: off)")
    parser.add_argument("--held-backups", type=int, default=0, metavar="N",
                        help="Keras BackupAndRestore: one backup in N on disk, the tables of "
                             "the others held in the servers' memory (a backup every step "
                             "then costs the step's rows, not the tables); the servers keep "
                             "them across a worker's failure (default 0: all on disk)")
    parser.add_argument("--async", dest="sync", action="store_false", default=None,
                        help="asynchronous parameter-server updates (PARALLAX_SYNC=async)")
    logs.add_argument(parser)
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="the program: a .py file (run with this Python) or a command")
    args = parser.parse_args(argv)
    hosts = _hosts_arg(args.hosts, args.hostfile)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    addresses = tuple(a.strip() for a in (args.ps_addresses or "").split(",") if a.strip())
    if args.ps_addresses is not None and not addresses:
        raise ConfigError("--ps-addresses is empty; give host:port of each parameter server, "
                          "comma-separated (e.g. 127.0.0.1:7000,127.0.0.1:7001)")
    servers = args.servers if args.servers is not None else (0 if addresses else 2)
    workers = args.num_workers if args.num_workers is not None else 1
    if args.host_discovery_script is not None and args.num_workers is None:
        if args.max_workers is None:
            raise ConfigError("--host-discovery-script needs -np N or --max-np N: the most "
                              "workers the job runs with when its hosts allow")
        workers = args.max_workers
        if workers < 1:
            raise ConfigError(f"--max-np {workers} must be at least 1 (the most workers the "
                              f"job runs with)")
    if hosts is not None:
        from parallax.launch.hosts import load_hosts
        layout = load_hosts(hosts)
        if args.servers not in (None, 0):
            raise ConfigError(f"--servers {args.servers} with --hosts/-H/--hostfile {hosts}: "
                              f"one server runs on each host; for more, give `servers` per "
                              f"host in a YAML host file")
        servers = 0 if addresses else layout.num_servers
        workers = args.num_workers if args.num_workers is not None else layout.num_slots
    return LaunchConfig(
        secure=args.secure,
        num_workers=workers, num_servers=servers, ps_addresses=addresses, hosts=hosts,
        command=tuple(command), run_id=args.run_id,
        server_args=_split_each(args.server_arg),
        data_dir=args.data_dir, mode=args.mode,
        start_timeout=_server_start_timeout(args.server_start_timeout, args.start_timeout),
        progress_seconds=args.progress_seconds, health_timeout=args.health_timeout,
        max_restarts=args.max_restarts, restart_delay=args.restart_delay,
        sync=args.sync, horovodrun_args=_split_each(args.horovodrun_arg),
        log_level=args.log_level, collectives=args.collectives,
        metrics_port=args.metrics_port, replicas=args.replicas,
        held_backups=args.held_backups, replay_mb=args.replay_mb,
        discovery_script=args.host_discovery_script, min_workers=args.min_workers,
        max_workers=args.max_workers, elastic_timeout=args.elastic_timeout,
        warm_starts=args.warm_starts)


def _split_each(values: list[str]) -> tuple[str, ...]:
    """Repeatable pass-through options: each value split like a shell would."""
    return tuple(a for value in values for a in shlex.split(value))


def _hosts_arg(hosts: str | None, hostfile: str | None) -> str | None:
    if hosts is not None and hostfile is not None:
        raise ConfigError(f"--hosts/-H {hosts} and --hostfile {hostfile} both given; give one")
    return hosts if hosts is not None else hostfile


def _server_start_timeout(timeout: float | None, horovodruns: float | None) -> float:
    """--server-start-timeout (default 60). --start-timeout is refused: it is horovodrun's
    flag (the workers' timeout), once taken here for the servers'."""
    if horovodruns is not None:
        raise ConfigError(f"--start-timeout {horovodruns:g}: for the servers' start, give "
                          f"--server-start-timeout {horovodruns:g}; for horovodrun's (the "
                          f"workers'), --horovodrun-arg=--start-timeout={horovodruns:g}")
    return 60.0 if timeout is None else timeout


def main(argv: list[str]) -> int:
    try:
        config = parse_args(argv)
        logs.configure(config.log_level)
        return run(config)
    except ConfigError as exc:
        _say(f"error: {exc}")
        return 2
    except ParallaxError as exc:
        _say(f"error: {exc}")
        return 1
