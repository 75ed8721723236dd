"""The parameter-server process: gRPC server, health service, graceful shutdown.

On SIGTERM or SIGINT, or once the process that started it is gone (`parallax.runtime.lifeline`: a
launcher or a program with embedded servers killed by SIGKILL or the OOM killer), the server
reports NOT_SERVING, stops taking new RPCs, wakes every request waiting on a step or barrier
(they end with UNAVAILABLE), lets in-flight requests finish within the grace period, and
exits 0.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from parallax import native
from parallax.env import READY_PREFIX
from parallax.errors import ConfigError
from parallax.protocol import security, server_identity
from parallax.runtime import lifeline, logs
from parallax.runtime.malloc_tuning import reuse_freed_memory
from parallax_ps import instance, metrics, native_path, versions
from parallax_ps.dataplane import DataPlaneServer
from parallax_ps.service import SERVICE_NAME, ParameterServerService, add_to_server

log = logging.getLogger("parallax_ps")
MALLOC_ARENAS = 2  # freed buffers are reused across the data plane's threads (malloc_tuning)


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 0
    data_dir: Path | None = None
    max_message_mb: int = 256
    threads: int = 1024  # for RPCs that may wait (pulls, barriers, InitRows streams): a
    #                      bound, not a pool kept alive (threads are made as waits need them)
    reserved_threads: int = 8  # for the others (pushes, health, stats, control): never waits
    grace_seconds: float = 5.0
    tls_cert: Path | None = None       # with tls_key: serve TLS
    tls_key: Path | None = None
    tls_client_ca: Path | None = None  # mutual TLS: client certificates signed by this CA
    token_file: Path | None = None     # every RPC must carry this cluster token
    health_without_token: bool = False  # but grpc.health.v1 Check (a kubelet's gRPC probe)
    metrics_port: int | None = None  # Prometheus GET /metrics (0: a free port; None: off)
    metrics_host: str = "127.0.0.1"  # where /metrics listens: loopback unless asked
    memory_mb: int | None = None  # what tables may use; None: the cgroup limit, else the RAM
    data_port: int = 0  # PullMany/PushMany as frames on this port (0: any free one; -1: off)
    log_level: str | None = None  # None: PARALLAX_LOG_LEVEL, else info (parallax.runtime.logs)
    restore_newest: bool = False  # a created shard starts from its newest checkpoint, if any
    restore_newest_on_restart: str | None = None  # that, once this instance starts again

    @property
    def max_message_bytes(self) -> int:
        return self.max_message_mb * 1024 * 1024


CGROUP_SHARE = 0.75  # of a container's memory limit, when --memory-mb is not given


CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def memory_budget(memory_mb: int | None, cgroup_limits: tuple[str, ...] = CGROUP_LIMITS
                  ) -> int:
    """Bytes the server may use (`--memory-mb`): the flag, else CGROUP_SHARE of this
    process's cgroup limit (a container: the rest is headroom for what the budget does not
    see, such as gRPC's copies of requests it has not handed over yet and the allocator's
    free lists, so a server whose tables fill its budget is not OOM-killed by its first large
    step), else the machine's RAM."""
    if memory_mb is not None:
        return memory_mb << 20
    for path in cgroup_limits:
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:  # "max" or a huge number: no limit
            return int(int(text) * CGROUP_SHARE)
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def resident_bytes() -> int:
    """This process's resident memory now (VmRSS; 0 where /proc has none): at start, the
    baseline that --memory-mb holds requests in flight to beside the tables."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _restore_policy(config: ServerConfig) -> tuple[bool, frozenset[str]]:
    """(whether created shards restore their newest checkpoint, the checkpoints they never
    restore): --restore-newest, or --restore-newest-on-restart's instance marker."""
    if config.restore_newest_on_restart is None:
        return config.restore_newest, frozenset()
    start = instance.begin(config.data_dir, config.restore_newest_on_restart)
    return start.restarted, start.before


class RunningServer:
    """A started server; `address` is host:port with the real port when 0 was asked."""

    def __init__(self, config: ServerConfig) -> None:
        if config.data_dir is not None:
            config.data_dir.mkdir(parents=True, exist_ok=True)
            for stale in versions.sweep_stale(config.data_dir):
                log.info("removed %s, left by a save that can no longer commit", stale)
        self.config = config
        limit = config.max_message_bytes
        token = security.read_token(config.token_file) if config.token_file else None
        credentials = security.server_credentials(
            config.tls_cert, config.tls_key, config.tls_client_ca) if config.tls_cert else None
        self.wait_pool = futures.ThreadPoolExecutor(max_workers=config.threads,
                                                    thread_name_prefix="ps-wait")
        restore, skip = _restore_policy(config)
        self.service = ParameterServerService(config.data_dir, limit,
                                              memory_budget(config.memory_mb), config.threads,
                                              resident_bytes(), restore, skip)
        checks = [security.TokenInterceptor(token, [security.HEALTH_CHECK] if
                                            config.health_without_token else [])] \
            if token else []
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=config.reserved_threads,
                                       thread_name_prefix="ps"),
            options=[("grpc.max_receive_message_length", limit),
                     ("grpc.max_send_message_length", limit),
                     ("grpc.so_reuseport", 0)],
            interceptors=[*checks, server_identity.IdentityInterceptor(self.service.server_id)])
        add_to_server(self.service, self.server, self.wait_pool)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        try:
            bind = f"{config.host}:{config.port}"
            port = (self.server.add_secure_port(bind, credentials) if credentials
                    else self.server.add_insecure_port(bind))
        except RuntimeError:  # grpc reports a failed bind by raising or by returning 0
            port = 0
        if port == 0 and credentials is not None:
            raise OSError(f"cannot serve TLS on {bind}: gRPC refused --tls-cert "
                          f"{config.tls_cert} with --tls-key {config.tls_key} (a key that is "
                          f"not the certificate's, or malformed PEM: gRPC's reason is logged "
                          f"above), or the address is in use or not local")
        if port == 0:
            raise OSError(f"cannot listen on {config.host}:{config.port} (address in use or "
                          f"not local); pick another --port or --host")
        host = f"[{config.host}]" if ":" in config.host else config.host
        self.address = f"{host}:{port}"
        self.metrics = None if config.metrics_port is None else metrics.MetricsServer(
            config.metrics_host, config.metrics_port, lambda: metrics.render(self.service),
            token, metrics.tls_context(config.tls_cert, config.tls_key, config.tls_client_ca)
            if config.tls_cert else None)
        self.metrics_address = self.metrics.address if self.metrics is not None else None
        self.data_plane = None if config.data_port < 0 else DataPlaneServer(
            self.service, config.host, config.data_port, limit, token,
            metrics.tls_context(config.tls_cert, config.tls_key, config.tls_client_ca)
            if config.tls_cert else None)
        if self.data_plane is not None:
            self.service.data_port = self.data_plane.port
            self.service.data_idle_timeout_s = int(self.data_plane.idle_timeout_s)
        self.server.start()
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    def stop(self, grace: float | None = None) -> None:
        if self.metrics is not None:
            self.metrics.stop()
        self.health.enter_graceful_shutdown()
        if self.data_plane is not None:
            self.data_plane.stop_listening()  # requests in flight finish within the grace
        done = self.server.stop(self.config.grace_seconds if grace is None else grace)
        self.service.close()
        done.wait()
        if self.data_plane is not None:  # its requests in flight get the same grace
            self.data_plane.wait_idle(self.config.grace_seconds if grace is None else grace)
            self.data_plane.stop()
        self.wait_pool.shutdown(wait=False)


def parse_args(argv: list[str] | None = None) -> ServerConfig:
    parser = argparse.ArgumentParser(prog="parallax server",
                                     description="Run a parallax parameter server.")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default loopback; 0.0.0.0 for every interface)")
    parser.add_argument("--port", type=int, default=0, help="port (0: any free port)")
    logs.add_argument(parser)
    parser.add_argument("--data-dir", type=Path, default=None,
                        help="directory for checkpoints (save/restore are refused without it)")
    parser.add_argument("--max-message-mb", type=int, default=256,
                        help="largest request or response in MiB (default 256)")
    parser.add_argument("--threads", type=int, default=ServerConfig.threads,
                        help="most threads for RPCs that may wait: pulls (a sync pull waits "
                             "for its step), barriers and InitRows streams (default "
                             f"{ServerConfig.threads}; made only as waits need them). A sync "
                             "table is refused when its workers x the sync shards held here "
                             "exceed it")
    parser.add_argument("--reserved-threads", type=int, default=8,
                        help="threads for RPCs that never wait (pushes, health checks, stats, "
                             "table and checkpoint control): waiting pulls cannot take them "
                             "(default 8)")
    parser.add_argument("--grace-seconds", type=float, default=5.0,
                        help="how long in-flight requests may finish on shutdown")
    parser.add_argument("--tls-cert", type=Path, default=None,
                        help="PEM certificate of this server: serve TLS (needs --tls-key)")
    parser.add_argument("--tls-key", type=Path, default=None,
                        help="PEM private key of --tls-cert")
    parser.add_argument("--tls-client-ca", type=Path, default=None,
                        help="PEM CA: require client certificates signed by it (mutual TLS)")
    parser.add_argument("--token-file", type=Path, default=None,
                        help="file holding the cluster token that every RPC must carry "
                             "(authorization: Bearer <token>)")
    parser.add_argument("--health-without-token", action="store_true",
                        help="with --token-file: answer grpc.health.v1 Check (SERVING or "
                             "not, nothing else) without the token, for probes that cannot "
                             "send it (a kubelet's gRPC probe; parallax k8s sets it)")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="serve Prometheus metrics at http(s)://METRICS_HOST:PORT/metrics "
                             "(0: any free port; default: no metrics endpoint); with "
                             "--token-file a scrape needs the token, with --tls-cert it is "
                             "HTTPS")
    parser.add_argument("--metrics-host", default="127.0.0.1",
                        help="address the metrics endpoint binds (default loopback, whatever "
                             "--host is; 0.0.0.0 for every interface)")
    parser.add_argument("--memory-mb", type=int, default=None,
                        help="memory of this server: its tables (rows, slots, buffered "
                             "pushes and InitRows streams) may use this much, reported to "
                             "clients, which refuse a plan that does not fit; requests in "
                             "flight are held to it with the tables and the process's own "
                             "baseline (the interpreter, numpy and gRPC, ~62 MB, measured at "
                             "start and counted when it is at most half the limit): "
                             "one that does not fit waits for room until its deadline or is "
                             "refused RESOURCE_EXHAUSTED (default: 3/4 of the cgroup limit, "
                             "leaving headroom in a container, else RAM)")
    parser.add_argument("--data-port", type=int, default=0,
                        help="port of the data plane: PullMany/PushMany (a training step's "
                             "traffic) as frames on plain TCP, or TLS with --tls-cert, with "
                             "the same token; about 30x less CPU per request than gRPC "
                             "(default 0: any free port, announced over gRPC; -1: none, "
                             "clients use gRPC)")
    parser.add_argument("--restore-newest", action="store_true",
                        help="this server replaces one that was lost (parallax run "
                             "--replay-mb starts it so): every table shard created on it "
                             "starts from the newest complete checkpoint of its table under "
                             "--data-dir (any checkpoint path), at that checkpoint's step, "
                             "and the workers replay their pushes since (CreateTable "
                             "answers the checkpoint's name in restored_from); a table with "
                             "no complete checkpoint there is created fresh at step 0, as "
                             "without the flag (needs --data-dir)")
    parser.add_argument("--restore-newest-on-restart", metavar="INSTANCE", default=None,
                        help="--restore-newest, but only when this instance starts again "
                             "(parallax k8s --replay-mb gives the pod's uid: the same for "
                             "its container's restarts): the first start of INSTANCE notes "
                             "it in --data-dir (.instance-*.json, with the checkpoints there "
                             "then) and creates shards fresh; a start again restores each "
                             "from its newest checkpoint saved since that first start, "
                             "never from an older one (another run's)")
    args = parser.parse_args(argv)
    _check_restore_flags(parser, args)
    if not -1 <= args.data_port < 65536:
        parser.error(f"--data-port {args.data_port} is not a TCP port (0-65535), or -1")
    if args.memory_mb is not None and args.memory_mb < 1:
        parser.error(f"--memory-mb {args.memory_mb} must be >= 1")
    if not 0 <= args.port < 65536:
        parser.error(f"--port {args.port} is not a TCP port (0-65535)")
    if args.max_message_mb < 1:
        parser.error(f"--max-message-mb {args.max_message_mb} must be >= 1")
    for flag, value in (("--threads", args.threads),
                        ("--reserved-threads", args.reserved_threads)):
        if value < 1:
            parser.error(f"{flag} {value} must be >= 1")
    if (args.tls_cert is None) != (args.tls_key is None):
        given, missing = (("--tls-cert", "--tls-key") if args.tls_key is None
                          else ("--tls-key", "--tls-cert"))
        parser.error(f"{given} needs {missing} too (the certificate and its private key)")
    if args.tls_client_ca is not None and args.tls_cert is None:
        parser.error("--tls-client-ca needs --tls-cert and --tls-key (mutual TLS is TLS)")
    if args.health_without_token and args.token_file is None:
        parser.error("--health-without-token exempts health checks from --token-file: give "
                     "--token-file too, or drop it (without a token every RPC is open)")
    if args.metrics_port is not None and not 0 <= args.metrics_port < 65536:
        parser.error(f"--metrics-port {args.metrics_port} is not a TCP port (0-65535)")
    return ServerConfig(tls_cert=args.tls_cert, tls_key=args.tls_key,
                        tls_client_ca=args.tls_client_ca, token_file=args.token_file,
                        health_without_token=args.health_without_token,
                        host=args.host, port=args.port, data_dir=args.data_dir,
                        max_message_mb=args.max_message_mb, threads=args.threads,
                        reserved_threads=args.reserved_threads,
                        grace_seconds=args.grace_seconds, metrics_port=args.metrics_port,
                        metrics_host=args.metrics_host,
                        memory_mb=args.memory_mb, log_level=args.log_level,
                        data_port=args.data_port, restore_newest=args.restore_newest,
                        restore_newest_on_restart=args.restore_newest_on_restart)


def _check_restore_flags(parser: argparse.ArgumentParser, args) -> None:
    if args.restore_newest and args.data_dir is None:
        parser.error("--restore-newest restores each table from the checkpoints in "
                     "--data-dir: give --data-dir (the lost server's), or drop it")
    again = args.restore_newest_on_restart
    if again is None:
        return
    if args.restore_newest:
        parser.error("--restore-newest restores on every start, --restore-newest-on-restart "
                     "on a start again of its instance only: give one of them")
    if not again.strip():
        parser.error("--restore-newest-on-restart needs an instance name that is the same "
                     "on every start of this server and only on those (e.g. a pod's uid)")
    if args.data_dir is None:
        parser.error("--restore-newest-on-restart keeps its marker and restores from the "
                     "checkpoints in --data-dir: give --data-dir, or drop it")


def _orphaned(parent: int, stop: threading.Event) -> None:
    log.warning("parent process %d is gone (it started this server and did not stop it); "
                "shutting down", parent)
    stop.set()


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    logs.configure(config.log_level, server=True)
    reuse_freed_memory(arenas=MALLOC_ARENAS)
    try:
        native_path.kernels()  # PARALLAX_NATIVE=1 without the build stops here, named
        log.info("data path: %s", native.describe())
        server = RunningServer(config)
    except (OSError, ConfigError) as exc:
        print(f"parallax server: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    lifeline.watch_parent(lambda parent: _orphaned(parent, stop))
    extra = f" metrics={server.metrics_address}" if server.metrics_address else ""
    print(f"{READY_PREFIX} address={server.address} pid={os.getpid()}{extra}", flush=True)
    while not stop.wait(0.5):
        pass
    log.info("shutting down %s", server.address)
    server.stop()
    return 0
