"""The parameter servers of one `parallax run` job across its attempts (`JobServers`): started
for the first attempt, kept for the next where a worker failed or the workers stopped for a
new count (the run's tables dropped from them), started again after a server's failure; and
what the launcher watches them for while an attempt runs: deaths (`ServerLosses`, which
with --replicas 2 tells the deaths the job goes on without, and with --replay-mb starts the
dead server again: `Replacements`) and silence (`HealthWatch`)."""
from __future__ import annotations

import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Callable

from parallax.client.replicas import survives
from parallax.errors import ParallaxError
from parallax.launch.restarts import Outcome

if TYPE_CHECKING:
    from parallax.launch.run import LaunchConfig


MAX_REPLACEMENTS = 3  # starts of one server per attempt with --replay-mb; then the job ends
RESTORE_NEWEST = "--restore-newest"  # (parallax_ps.server): the replacement's own shards


class Replacements:
    """With --replay-mb: each of our servers that dies is started again on its address with
    --restore-newest, its shards then restored from their newest checkpoint as the workers
    create them there, and the workers replay their pushes since
    (`parallax.client.replay`), so the job goes on, no step redone. At most
    MAX_REPLACEMENTS starts of a server per attempt: a server that keeps dying ends the job
    as a death without --replay-mb does (--max-restarts acts on it)."""

    def __init__(self, cluster, say: Callable[[str], None], health=None,
                 limit: int = MAX_REPLACEMENTS) -> None:
        self.cluster, self.say, self.health, self.limit = cluster, say, health, limit
        self.starts: dict[int, int] = {}  # this attempt's, per server index

    def replace(self, server) -> bool:
        """Start `server` (dead) again; False when it may not (its starts are spent) or
        its replacement did not start (said, with its output): the job ends then."""
        done = self.starts.get(server.index, 0)
        code = server.proc.returncode
        if done >= self.limit:
            self.say(f"parameter server {server.index} ({server.address}) exited with code "
                     f"{code}, after {done} start(s) again in this attempt (--replay-mb "
                     f"starts a server at most {self.limit} times an attempt)")
            return False
        self.starts[server.index] = done + 1
        try:
            new = self.cluster.replace(server.index, [RESTORE_NEWEST])
        except ParallaxError as err:
            self.say(f"parameter server {server.index} ({server.address}) exited with code "
                     f"{code}, and could not be started again (--replay-mb): {err}")
            return False
        if self.health is not None:
            self.health.restart_clock(new.address)  # (its silence counts from now)
        self.say(f"parameter server {server.index} ({server.address}) exited with code {code}; "
                 f"started again there (--replay-mb, start {done + 1} of {self.limit} this "
                 f"attempt, pid {new.proc.pid}): its tables restore from their newest "
                 f"checkpoint, and the workers replay their pushes since")
        return True


class ServerLosses:
    """The servers of ours that died; with --replicas 2, those the job goes on without (every
    shard still has a live copy: `parallax.client.replicas.survives`); with --replay-mb,
    those started again (`replacements`), which the job goes on with."""

    def __init__(self, cluster, replicas: int, say: Callable[[str], None],
                 on_loss: Callable | None = None,
                 replacements: Replacements | None = None) -> None:
        self.cluster, self.replicas, self.say = cluster, replicas, say
        self.on_loss = on_loss  # called with each server the job goes on without
        self.replacements = replacements
        self.lost: set[int] = set()
        self.addresses: set[str] = set()  # of the servers lost and gone on without

    def fatal(self):
        """The first newly dead server the job cannot go on without, or None."""
        for server in (list(self.cluster.servers) if self.cluster is not None else ()):
            if server.index in self.lost or server.proc.poll() is None:
                continue
            if self.replacements is not None:
                if self.replacements.replace(server):
                    continue
                return self.cluster.servers[server.index]  # (its replacement, if it failed)
            if not survives(self.lost | {server.index}, len(self.cluster.servers),
                            self.replicas):
                return server
            self.lost.add(server.index)
            self.addresses.add(server.address)
            self.say(f"parameter server {server.index} ({server.address}) exited with code "
                     f"{server.proc.returncode}; with --replicas {self.replicas} its shards go on "
                     f"on their copies (server {(server.index + 1) % len(self.cluster.servers)}) "
                     f"and the job continues; the death of a neighbour of it would end the job")
            if self.on_loss is not None:
                self.on_loss(server)
        return None

    def outlives(self, silent: tuple[int, str, float], servers: int) -> bool:
        """With --replicas 2, whether the job goes on without a server silent past
        --health-timeout: one of ours is killed (its workers' requests then fail over to its
        copies) and judged by `fatal` as it exits; one started elsewhere is left out, if
        every shard keeps a copy (a hung one fails its workers' requests at their deadline).
        With --replay-mb, one of ours is killed too, and `fatal` starts it again."""
        index, address, age = silent
        if self.replacements is not None:
            return self._killed(index, address, age, "with --replay-mb it is stopped (SIGKILL) "
                                                     "and started again")
        if self.replicas == 1 or not survives(self.lost | {index}, servers, self.replicas):
            return False
        if self._killed(index, address, age, f"with --replicas {self.replicas} it is stopped "
                                             f"(SIGKILL) and its copies take over"):
            return True
        self.lost.add(index)
        self.addresses.add(address)
        self.say(f"parameter server {index} ({address}) has not answered a health check for "
                 f"{age:.0f}s (--health-timeout); with --replicas {self.replicas} the job goes on "
                 f"with its copies")
        return True

    def _killed(self, index: int, address: str, age: float, then: str) -> bool:
        """Kill our silent server at `address` (SIGKILL), saying `then` (what follows: `fatal`
        judges it as it exits); False for a server that is not ours."""
        ours = [s for s in getattr(self.cluster, "servers", ()) if s.address == address]
        if not ours:
            return False
        if ours[0].proc.poll() is None:
            self.say(f"parameter server {index} ({address}) has not answered a health check "
                     f"for {age:.0f}s (--health-timeout); {then}")
            ours[0].proc.kill()
        return True


def report_dead_server(server, say: Callable[[str], None]) -> None:
    reader = getattr(server, "_reader", None)
    if reader is not None:
        reader.join(1.0)  # the last lines it printed
    say(f"parameter server {server.index} ({server.address}) exited with code "
       f"{server.proc.returncode} while the job was running; stopping the workers. "
        f"Its last output:\n{server.tail(10)}")


class HealthWatch:
    """Health checks of every server from a daemon thread; `silent()` gives the server that
    has not answered SERVING for longer than `timeout` seconds, if any (0: no checks)."""

    def __init__(self, addresses: list[str], timeout: float, options) -> None:
        from parallax.client.connection import ServerConnection
        self.timeout = timeout
        self.servers = len(addresses)
        self._servers = [ServerConnection(a, options) for a in addresses] if timeout else []
        self._answered = [time.monotonic()] * len(self._servers)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="parallax-health", daemon=True)

    def start(self) -> "HealthWatch":
        if self._servers:
            self._thread.start()
        return self

    def _loop(self) -> None:
        check = min(2.0, self.timeout / 3)  # one silent server delays the others this much
        while not self._stop.wait(min(1.0, self.timeout / 4)):
            for index, server in enumerate(self._servers):
                try:
                    if server.healthy(timeout=check):
                        self._answered[index] = time.monotonic()
                except ParallaxError:
                    pass  # refused credentials: not an answer

    def restart_clock(self, address: str) -> None:
        """Count the silence of the server at `address` from now: one started again there
        (--replay-mb) was silent while it was dead and starting, not hung."""
        for index, server in enumerate(self._servers):
            if server.address == address:
                self._answered[index] = time.monotonic()

    def silent(self, lost: set[str] = frozenset()) -> tuple[int, str, float] | None:
        """(index, address, seconds) of the server silent the longest, past the timeout,
        but for those `lost` that the job goes on without."""
        ages = [(time.monotonic() - t, i) for i, t in enumerate(self._answered)
                if self._servers[i].address not in lost]
        if not ages:
            return None
        age, index = max(ages)
        return (index, self._servers[index].address, age) if age > self.timeout else None

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        for server in self._servers:
            server.close()


def report_silent_server(silent: tuple[int, str, float], cluster,
                         say: Callable[[str], None]) -> None:
    """Say which server stopped answering; resume it if it is ours and SIGSTOPped, so that
    the cleanup can stop it gracefully."""
    index, address, age = silent
    say(f"parameter server {index} ({address}) has not answered a health check for "
       f"{age:.0f}s (hung, stopped or overloaded; --health-timeout); stopping the workers")
    for server in getattr(cluster, "servers", ()):
        if server.address == address and server.proc.poll() is None:
            server.proc.send_signal(signal.SIGCONT)


DROP_TIMEOUT_S = 10.0  # the most dropping a run's tables from kept servers may take


class JobServers:
    """The job's servers across its attempts. The launcher's own are started for the first
    attempt and kept for the next while every one still runs and the attempt did not end
    for a server's failure (a worker failed, or the workers stopped for a new count): the
    run's tables are then dropped from them, so the workers restore them from their
    checkpoint as onto fresh servers, without the servers' start. External servers
    (--ps-addresses) get the same drop before every attempt but the first. With
    --held-backups and as many workers as the attempt before, the tables are kept instead:
    the workers roll them back to their newest held backup (`parallax.tf.state.held_backups`),
    or restore them from disk over what the attempt before left."""

    def __init__(self, config: LaunchConfig, credentials, run_id: str,
                 say: Callable[[str], None]) -> None:
        self.config, self.credentials, self.run_id, self.say = config, credentials, run_id, say
        self.cluster = None
        self.kept = False  # this attempt's servers kept the run's tables (TABLES_KEPT_ENV)
        self._workers = 0  # the attempt before's worker count

    def for_attempt(self, config: LaunchConfig, attempt: int):
        """This attempt's servers (None: external ones, at config.ps_addresses)."""
        keep = bool(config.held_backups) and self._workers == config.num_workers
        self._workers, self.kept = config.num_workers, False
        if config.num_servers == 0:
            if attempt and not (keep and self._keep()):
                self._drop([a.strip() for a in config.ps_addresses])
            return None
        if self.cluster is not None and self._running() and \
                (keep and self._keep() or self._drop(self.cluster.addresses)):
            return self.cluster
        self.stop()
        self.cluster = start_servers(config, self.credentials)
        return self.cluster

    def _keep(self) -> bool:
        self.say(f"the servers keep running with run {self.run_id}'s tables: the workers "
                 f"roll them back to their newest held backup (--held-backups)")
        self.kept = True
        return True

    def _running(self) -> bool:
        return all(server.proc.poll() is None for server in self.cluster.servers)

    def _drop(self, addresses: list[str]) -> bool:
        """Drop the run's tables from `addresses`; whether it worked."""
        from parallax.client.connection import ClientOptions, client_options_from_env
        from parallax.client.ps_client import PSClient
        environ = self.credentials.worker_env() if self.credentials is not None else None
        options = client_options_from_env(ClientOptions(timeout=DROP_TIMEOUT_S),
                                          environ=environ)
        try:
            with PSClient(addresses, options) as client:
                dropped = client.delete_tables(f"{self.run_id}.")
        except ParallaxError as err:
            self.say(f"could not drop run {self.run_id}'s tables from the servers ({err}); "
                     f"{'starting them again' if self.cluster is not None else 'going on'}")
            return False
        if dropped:
            self.say(f"the servers keep running; dropped {len(dropped)} table(s) of run "
                     f"{self.run_id} from them: the workers restore them from their checkpoint")
        return True

    def after(self, outcome: Outcome | None) -> None:
        """Stop the servers unless the next attempt may keep them."""
        if outcome is None or outcome.server_failed or not (outcome.restartable
                                                            or outcome.rescale):
            self.stop()

    def stop(self) -> None:
        if self.cluster is not None:
            cluster, self.cluster = self.cluster, None
            cluster.stop()


def start_servers(config: LaunchConfig, credentials=None):
    if config.hosts is not None:
        from parallax.launch.hosts import HostCluster, load_hosts
        return HostCluster(load_hosts(config.hosts), data_dir=config.data_dir,
                           extra_args=[*config.server_args, *(credentials.server_args()
                                                              if credentials else [])],
                           echo=sys.stderr, start_timeout=config.start_timeout,
                           metrics_port=config.metrics_port).start()
    from parallax.client.connection import client_options_from_env
    from parallax.client.local_cluster import LocalCluster
    cluster = LocalCluster(config.num_servers, data_dir=config.data_dir,
                           extra_args=[*config.server_args, *(credentials.server_args()
                                                              if credentials else [])],
                           echo=sys.stderr, start_timeout=config.start_timeout,
                           metrics_port=config.metrics_port)
    cluster.start()
    if credentials is not None:  # they serve what the workers will present
        try:
            check_external(cluster.addresses, config.start_timeout,
                            client_options_from_env(environ=credentials.worker_env()))
        except BaseException:
            cluster.stop()
            raise
    return cluster


def check_external(addresses: list[str], timeout: float, options=None) -> None:
    from parallax.client import PSClient
    with PSClient(addresses, options) as client:
        client.wait_ready(timeout)
