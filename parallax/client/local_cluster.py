"""Parameter servers as child processes on loopback: for the embedded default, tests, demos.

Each server is started with `--port 0`; its address is read from the READY line it prints,
so there is no race for free ports. Output is forwarded with a `[ps i]` prefix. `stop()`
sends SIGTERM, waits, kills stragglers, and reports every exit code. A server whose parent
dies without stopping it (SIGKILL, os._exit) stops by itself (`parallax.runtime.lifeline`).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

from parallax.env import READY_PREFIX
from parallax.errors import ParallaxError
from parallax.runtime import lifeline


# -m would put the working directory first on the server's sys.path (a numpy/ there broke
# it); Python 3.11's -P leaves it out (3.10 has no -P). A flag, not PYTHONSAFEPATH: the
# environment reaches whatever a `command` of the user's runs (a wrapper script, a remote
# server's ssh and its ProxyCommand), whose scripts would lose their own directory
SERVER_COMMAND = (sys.executable, "-u", *(("-P",) if sys.version_info >= (3, 11) else ()),
                  "-m", "parallax_ps")
SERVER_ENV = {"PYTHONUNBUFFERED": "1"}


_EXIT_AFTER_OUTPUT_S = 5.0  # a server whose output ended is given this long to exit


def ready_fields(line: str) -> dict[str, str] | None:
    """The fields a server's READY line announces (`PARALLAX_SERVER_READY address=H:P
    pid=N [metrics=H:P]`); None for any other line."""
    if not line.startswith(READY_PREFIX):
        return None
    return dict(f.split("=", 1) for f in line.split()[1:] if "=" in f)


def ready_address(line: str) -> str | None:
    """The address a server's READY line announces; None for any other line."""
    return (ready_fields(line) or {}).get("address")


def metrics_args(port: int | None, index: int) -> list[str]:
    """A server's --metrics-port: none (None), a free port (0), or `port + index` for the
    index-th server on one machine (so several servers there never ask for the same)."""
    if port is None:
        return []
    return ["--metrics-port", str(port + index if port else 0)]


class ServerProcess:
    def __init__(self, index: int, command: list[str], echo: IO[str] | None,
                 stdin: int | None = None) -> None:
        self.index = index
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            command, stdin=stdin, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, bufsize=1,
            env=lifeline.child_env({**os.environ, **SERVER_ENV}))
        self.address: str | None = None
        self.metrics: str | None = None  # host:port of its /metrics, when it serves them
        self._ready = threading.Event()
        self._echo = echo
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            self.lines.append(line)
            if line.startswith(READY_PREFIX) and self.address is None:
                fields = ready_fields(line) or {}
                self.address, self.metrics = fields.get("address"), fields.get("metrics")
                self._ready.set()
            elif self._echo is not None:
                print(f"[ps {self.index}] {line}", file=self._echo, flush=True)
        self._ready.set()

    def wait_ready(self, timeout: float) -> str:
        if not self._ready.wait(timeout) or self.address is None:
            tail = "\n".join(self.lines[-10:])
            code = self._exit_code(ended=self._ready.is_set())
            what = (f"did not start within {timeout:.0f}s" if code is None else
                    f"exited with code {code} before it was ready")
            raise ParallaxError(f"parameter server {self.index} {what}; its output:\n{tail}")
        return self.address

    def _exit_code(self, ended: bool) -> int | None:
        """The exit code; when its output `ended`, the moment the process takes to exit."""
        try:
            return self.proc.wait(_EXIT_AFTER_OUTPUT_S) if ended else self.proc.poll()
        except subprocess.TimeoutExpired:
            return None

    def request_stop(self) -> None:
        """Ask the server to shut down gracefully (SIGTERM); `stop_servers` waits."""
        self.proc.send_signal(signal.SIGTERM)

    def tail(self, n: int = 10) -> str:
        return "\n".join(self.lines[-n:])


def stop_servers(servers: list[ServerProcess], timeout: float) -> list[int | None]:
    """Ask every server to stop, wait up to `timeout` in all, kill stragglers; the exit
    codes (None: did not stop in time)."""
    for server in servers:
        if server.proc.poll() is None:
            server.request_stop()
    deadline = time.monotonic() + timeout
    codes = []
    for server in servers:
        try:
            codes.append(server.proc.wait(max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait()
            codes.append(None)
    return codes


class LocalCluster:
    """`with LocalCluster(2) as cluster: PSClient(cluster.addresses)`.

    `command` starts one server (the `--host/--port/--data-dir` flags are appended); the
    default runs the server module with this interpreter.
    """

    def __init__(self, num_servers: int = 2, *, data_dir: str | Path | None = None,
                 host: str = "127.0.0.1", extra_args: list[str] | None = None,
                 echo: IO[str] | None = None, start_timeout: float = 60.0,
                 command: tuple[str, ...] = SERVER_COMMAND,
                 metrics_port: int | None = None) -> None:
        if num_servers < 1:
            raise ParallaxError(f"LocalCluster needs at least 1 server, got {num_servers}")
        self.num_servers = num_servers
        self.data_dir = Path(data_dir) if data_dir is not None else None
        self.host = host
        self.extra_args = list(extra_args or [])
        self.echo = echo
        self.start_timeout = start_timeout
        self.command = list(command)
        self.metrics_port = metrics_port  # `metrics_args`: None, 0 or the first server's
        self.servers: list[ServerProcess] = []
        self.exit_codes: list[int | None] = []

    @property
    def addresses(self) -> list[str]:
        return [s.address for s in self.servers if s.address]

    def _args(self, port: int | str = 0) -> list[str]:
        """Every server's flags but its metrics port."""
        args = ["--host", self.host, "--port", str(port), *self.extra_args]
        if self.data_dir is not None:
            args += ["--data-dir", str(self.data_dir)]
        return args

    def start(self) -> "LocalCluster":
        args = self._args()
        try:
            self.servers = [ServerProcess(i, self.command + args +
                                          metrics_args(self.metrics_port, i), self.echo)
                            for i in range(self.num_servers)]
            for server in self.servers:
                server.wait_ready(self.start_timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def replace(self, index: int, extra_args: list[str] = ()) -> ServerProcess:
        """Start server `index`, which has exited, again with the same flags plus
        `extra_args`, on the port it had: the clients find it at the address they know (its
        data plane may get another port: they ask it again). Raises ParallaxError, with its
        output, when it does not start (it is killed then); `stop` stops it like the others."""
        old = self.servers[index]
        port = old.address.rsplit(":", 1)[1]
        server = ServerProcess(index, self.command + self._args(port) + list(extra_args)
                               + metrics_args(self.metrics_port, index), self.echo)
        self.servers[index] = server
        try:
            server.wait_ready(self.start_timeout)
        except ParallaxError:
            if server.proc.poll() is None:
                server.proc.kill()
                server.proc.wait()
            server.address = server.address or old.address  # (what it was to listen on)
            raise
        return server

    def stop(self, timeout: float = 15.0) -> list[int | None]:
        self.exit_codes = stop_servers(self.servers, timeout)
        return self.exit_codes

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
