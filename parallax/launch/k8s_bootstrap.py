"""Worker bootstrap (`parallax k8s worker -- COMMAND`), run inside each worker pod: the
Horovod environment horovodrun would give the rank (worker 0 serves the rendezvous), the
rank of TensorFlow's collectives, or, with --max-restarts, the gang's supervision (the module
docstring of parallax.launch.k8s describes the whole)."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Mapping

from parallax.env import (ADDRESSES_ENV, ELASTIC_ENV, GANG_TIMEOUT_ENV, MAX_RESTARTS_ENV,
                          RENDEZVOUS_ENV, RENDEZVOUS_TIMEOUT_ENV, RESCALE_FILE_ENV,
                          RESTART_COUNT_ENV, RUN_ID_ENV, TABLES_KEPT_ENV, TOKEN_FILE_ENV,
                          WARM_STARTS_ENV, WORKER_RANK_ENV, WORKERS_ENV, held_backups)
from parallax.errors import ConfigError
from parallax.launch import gang
from parallax.launch.rendezvous import host_plan as _host_plan
from parallax.launch.rendezvous import horovod_env, start_rendezvous
from parallax.launch.restarts import RestartBudget
from parallax.launch.warm import gpu_machine, wanted, warm_process, why_cold_command
from parallax.protocol.security import read_token


def _wait_for(host: str, port: int, timeout: float) -> str:
    """Resolve host and wait until host:port accepts connections; returns its address."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            address = socket.gethostbyname(host)
            with socket.create_connection((address, port), timeout=2):
                return address
        except OSError as err:
            last = err
            time.sleep(1)
    raise ConfigError(f"the Horovod rendezvous at {host}:{port} (served by worker 0) did not "
                      f"answer within {timeout:.0f} s ({last}); is worker 0 running? raise "
                      f"{RENDEZVOUS_TIMEOUT_ENV} if pods start slowly")


def _rank(environ: Mapping[str, str], size: int) -> int | None:
    rank = int(environ.get("JOB_COMPLETION_INDEX", environ.get("HOROVOD_RANK", "-1")))
    if not 0 <= rank < size:
        print(f"parallax k8s worker: rank {rank} (JOB_COMPLETION_INDEX) is not in 0..{size - 1}",
              file=sys.stderr)
        return None
    return rank


def _join(environ: Mapping[str, str], rank: int, size: int, coordinator=None,
          token: str | None = None):
    """Rank 0 serves the rendezvous, the others wait for it: (server or None, the address
    to reach it at, its port). Raises OSError or ConfigError."""
    host, _, port_text = environ[RENDEZVOUS_ENV].rpartition(":")
    port = int(port_text)
    if rank == 0:
        return start_rendezvous(port, size, coordinator=coordinator,
                                horovod=size > 1 and not _tensorflow(environ), token=token), \
            "127.0.0.1", port
    timeout = float(environ.get(RENDEZVOUS_TIMEOUT_ENV, "300"))
    return None, _wait_for(host, port, timeout), port


def _stop(server) -> None:
    if server is not None:
        server.shutdown()
        server.server_close()


def worker_main(command: list[str], environ: Mapping[str, str] | None = None) -> int:
    environ = dict(os.environ if environ is None else environ)
    if not command:
        print("parallax k8s worker: no command; usage: parallax k8s worker -- COMMAND",
              file=sys.stderr)
        return 2
    bounds = _bounds(environ)
    size = bounds[1] if bounds else len(environ[WORKERS_ENV].split(",")) \
        if _tensorflow(environ) else int(environ.get("HOROVOD_SIZE", "1"))
    max_restarts = int(environ.get(MAX_RESTARTS_ENV, "0"))
    if bounds and _beyond(environ, bounds[1]):
        return 0
    rank = _rank(environ, size) if size > 1 or max_restarts or bounds else 0
    if rank is None:
        return 2
    if _tensorflow(environ):
        environ[WORKER_RANK_ENV] = str(rank)
    if max_restarts or bounds:
        return _gang_main(command, environ, rank, size, max_restarts, bounds)
    if size <= 1 or _tensorflow(environ):  # (TensorFlow's workers find each other)
        os.execvpe(command[0], command, environ)
    try:
        server, address, port = _join(environ, rank, size)
    except (OSError, ConfigError) as err:
        print(f"parallax k8s worker {rank}: {err}", file=sys.stderr)
        return 1
    environ.update(horovod_env(rank, size, address, port,
                               environ.get("HOROVOD_GLOO_IFACE", "eth0")))
    child = subprocess.Popen(command, env=environ)

    def forward(signum, _frame):
        child.send_signal(signum)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    code = child.wait()
    _stop(server)
    return code if code >= 0 else 128 - code


@contextlib.contextmanager
def _warm(command: list[str], environ: Mapping[str, str]):
    """`command`, forked from a warm process of this pod for each attempt where
    PARALLAX_WARM_STARTS (`parallax k8s --warm-starts`) allows it (`parallax.launch.warm`);
    else as it is. A warm process that ends lets the next attempts start cold."""
    setting = environ.get(WARM_STARTS_ENV, "auto")
    why = why_cold_command(command, environ.get("PATH", os.defpath))
    if why is not None and setting == "on":
        _say(f"--warm-starts on: the command starts cold ({why})")
    enabled = why is None and wanted(setting, True, gpu_machine())
    with warm_process(enabled, dict(environ), _say) as warm:
        if warm is None:
            yield command
            return
        warm.ensure()
        yield warm.wrap(command)


def _bounds(environ: Mapping[str, str]) -> tuple[int, int] | None:
    """An elastic worker Job's (--min-np, --max-np), from PARALLAX_MIN_WORKERS and
    PARALLAX_MAX_WORKERS; None when the Job's count is fixed."""
    if not environ.get(gang.MAX_WORKERS_ENV):
        return None
    most = int(environ[gang.MAX_WORKERS_ENV])
    return int(environ.get(gang.MIN_WORKERS_ENV, most)), most


def _beyond(environ: Mapping[str, str], most: int) -> bool:
    """Whether this pod's index is --max-np or more (the Job scaled above it): it says so and
    the pod ends with 0, not training (a failed pod would fail the Job)."""
    index = environ.get("JOB_COMPLETION_INDEX", "")
    if not index.isdecimal() or int(index) < most:
        return False
    print(f"parallax k8s worker {index}: index {index} is beyond the job's --max-np {most} "
          f"(the Job was scaled above it): this pod does not train; scale the Job to "
          f"{most} or fewer", flush=True)
    return True


def _tensorflow(environ: Mapping[str, str]) -> bool:
    """Whether the manifests gave this job TensorFlow's collectives (--collectives)."""
    return bool(environ.get(WORKERS_ENV))


def _say(text: str) -> None:
    print(f"parallax k8s worker 0: {text}", flush=True)


def _fresh_start(environ: Mapping[str, str], server, size: int | gang.Gang, timeout: float):
    """Worker 0, before each attempt: a new rendezvous (a fresh gloo context), and none of
    this run's tables left on the servers, as if they had restarted (the checkpoints on
    their data volume stay; the workers' scripts restore from them). With held backups
    (PARALLAX_HELD_BACKUPS) every attempt keeps them, a recreated gang's first one too (its
    pods replaced after a node's loss, their disks with them): the chief rolls them back to
    the servers' newest held backup, or drops them when it resumes from none
    (`binding.drop_kept_tables`), unless an elastic gang's count changed: a held backup is
    of the count that took it, so the tables are dropped and restored from the backup on
    disk. Returns whether the servers kept the tables. `size`: every attempt's rank count,
    or the gang whose `members` are each attempt's."""
    sizes: list[int] = []  # each attempt's, in order

    def start(attempt: int) -> bool:
        ranks = len(size.members) if isinstance(size, gang.Gang) else size
        sizes.append(ranks)
        if ranks > 1 and not _tensorflow(environ):
            server.init(_host_plan(ranks))
        addresses = environ.get(ADDRESSES_ENV)
        if not addresses:
            return False
        if held_backups(environ) and (len(sizes) == 1 or sizes[-2] == ranks):
            _say(f"attempt {attempt}: the servers keep run {environ[RUN_ID_ENV]}'s tables; the "
                 f"workers roll them back to their newest held backup, if they hold one")
            return True
        from parallax.client.connection import client_options_from_env
        from parallax.client.ps_client import PSClient
        with PSClient(addresses.split(","), client_options_from_env(environ=environ)) as client:
            client.wait_ready(timeout)
            dropped = client.delete_tables(f"{environ[RUN_ID_ENV]}.")
        if dropped:
            _say(f"attempt {attempt}: dropped {len(dropped)} table(s) of run "
                 f"{environ[RUN_ID_ENV]} from the servers; the workers restore them from "
                 f"their last checkpoint")
        return False
    return start


def _elastic_env(request: Path) -> dict[str, str]:
    """An elastic job's command: where worker 0 asks its chief to stop at the next checkpoint
    (every rank gets a path, the chief reads it and broadcasts), and PARALLAX_ELASTIC=1 (the
    chief notes the global batch there, which each count must split)."""
    return {RESCALE_FILE_ENV: str(request), ELASTIC_ENV: "1"}


def _gang_token(environ: Mapping[str, str], rank: int) -> str | None:
    """The job's token (the file PARALLAX_TOKEN_FILE names, mounted from its Secret), which
    every gang request carries; None, with a warning, for a job rendered --insecure."""
    if environ.get(TOKEN_FILE_ENV):
        return read_token(environ[TOKEN_FILE_ENV])
    if rank == 0:
        _say(f"no {TOKEN_FILE_ENV}: the gang at the rendezvous port accepts requests from "
             f"any pod (rendered with --insecure)")
    return None


def _gang_main(command: list[str], environ: dict[str, str], rank: int, size: int,
               max_restarts: int, bounds: tuple[int, int] | None = None) -> int:
    """Run `command` under the gang's supervision (parallax.launch.gang): every rank's command
    restarts together after any failure, at most `max_restarts` times; with `bounds` (an
    elastic Job) each attempt runs the pods there, and stops at a checkpoint when the Job
    is scaled."""
    timeout = float(environ.get(GANG_TIMEOUT_ENV, gang.GANG_TIMEOUT_S))
    try:
        token = _gang_token(environ, rank)
    except ConfigError as err:
        print(f"parallax k8s worker {rank}: {err}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="parallax-rescale-") as directory:
        request = Path(directory) / "rescale.json"  # (read by the chief only: worker 0's)
        return _supervise(command, environ, rank, size, max_restarts, timeout, token,
                          _scaling(environ, bounds, request) if bounds else None)


def _scaling(environ: Mapping[str, str], bounds: tuple[int, int], request: Path):
    """The gang's elastic bounds, with worker 0's rescale file and --elastic-timeout."""
    return gang.Scaling(bounds[0], request, float(environ.get(gang.ELASTIC_TIMEOUT_ENV,
                                                              gang.ELASTIC_TIMEOUT_S)))


def _supervise(command: list[str], environ: dict[str, str], rank: int, size: int,
               max_restarts: int, timeout: float, token: str | None,
               scaling: gang.Scaling | None) -> int:
    """_gang_main's body: worker 0 serves the gang, every rank runs its supervisor."""
    coordinator = None
    if rank == 0:
        coordinator = gang.Gang(size, RestartBudget(max_restarts, say=_say), lambda _: None,
                                timeout, say=_say, scaling=scaling)
    try:
        server, address, port = _join(environ, rank, size, coordinator, token)
    except (OSError, ConfigError) as err:  # worker 0 not there: the Job may recreate pods
        print(f"parallax k8s worker {rank}: {err}", file=sys.stderr)
        return 1 if rank == 0 else gang.LOST_GANG_EXIT
    stop = threading.Event()
    if coordinator is not None:
        coordinator.on_start = _fresh_start(environ, server, coordinator, timeout)
        gang.run_steps(coordinator, stop)

    def child_env(status: dict) -> dict[str, str]:
        env = dict(environ, **{RESTART_COUNT_ENV: str(status["attempt"])})
        if status.get("kept", held_backups(environ) and environ.get(ADDRESSES_ENV)):
            env[TABLES_KEPT_ENV] = "1"  # (worker 0's `_fresh_start` kept them)
        if scaling is not None:
            env.update(_elastic_env(scaling.request))
        ranks = status.get("size", size)
        if ranks > 1 and not _tensorflow(environ):
            env.update(horovod_env(status.get("rank", rank), ranks, address, port,
                                   environ.get("HOROVOD_GLOO_IFACE", "eth0")))
        elif scaling is not None:  # one rank: no Horovod job (the template's size is stale)
            env = {k: v for k, v in env.items() if not k.startswith("HOROVOD_")}
        return env
    leave = None  # worker 0 never leaves: no scale-down deletes index 0 (completions >= 1)
    if scaling is not None and rank != 0:
        leave = float(environ.get(gang.LEAVE_GRACE_ENV, gang.LEAVE_GRACE_S))
    with _warm(command, environ) as command:
        code = gang.Supervisor(f"http://{address}:{port}", rank, command, child_env,
                               timeout, token, leave).run()
    if coordinator is not None:  # let the others read the final state before leaving
        deadline = time.monotonic() + timeout
        while not coordinator.everyone_told() and time.monotonic() < deadline:
            time.sleep(gang.POLL_S)
    stop.set()
    _stop(server)
    return code
