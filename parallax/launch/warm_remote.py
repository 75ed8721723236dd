"""The warm process of another host (`parallax.launch.warm`), started over ssh.

The launch backend gives every host's workers one command line, so each host's warm process
listens at the same path as this machine's (`warm_stub.host_socket`: one socket per network
namespace), in a directory that it makes private (0700) or refuses: the stubs send it their
environment, tokens included. It runs under the `serve` wrapper of `parallax.launch.hosts`,
as a remote parameter server does, which ends it (and so its workers) when ssh's standard
input closes: when the launcher stops it, or dies. It gets what the workers there get of
the compared variables (PYTHON*, `warm_fork.START_ENV`, `warm_fork.IMPORT_TIME_ENV`): the
values the backend forwards (horovodrun: nearly all), and that host's own for the rest.
"""
from __future__ import annotations

import json
import subprocess
import sys
import threading

from parallax.launch.hosts import HostSpec, ssh_command
from parallax.launch.module_argv import own_module
from parallax.launch.warm_fork import IMPORT_TIME_ENV, LISTENING, START_ENV

READY_WAIT_S = 30.0  # the most a launch waits for another host's warm process to listen
TAIL_LINES = 10  # of its output, kept to say why it did not start


def compared(env: dict[str, str]) -> dict[str, str]:
    """The variables of `env` that a stub and the warm process must agree on."""
    return {k: v for k, v in env.items()
            if k.startswith("PYTHON") or k in START_ENV or k in IMPORT_TIME_ENV}


class RemoteWarm:
    """`ssh HOST env NAME=VALUE... python -m parallax.launch.hosts serve python -m
    parallax.launch.warm_fork SOCKET ROOM`, its output read for the line that says it
    listens (`warm_fork.LISTENING`)."""

    def __init__(self, host: HostSpec, socket: str, env: dict[str, str], room: int) -> None:
        self.host = host
        warm = [sys.executable, "-m", "parallax.launch.warm_fork", socket, "-" * room]
        argv = ssh_command(host, ["env", *(f"{k}={v}" for k, v in sorted(env.items())),
                                  *own_module("parallax.launch.hosts"), "serve", *warm])
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, errors="replace")
        self.said: dict | None = None  # the LISTENING line's fields, once read
        self.lines: list[str] = []
        self._heard = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith(LISTENING) and self.said is None:
                self.said = json.loads(line[len(LISTENING):])
                self._heard.set()
            else:
                self.lines = [*self.lines[-TAIL_LINES + 1:], line.rstrip("\n")]
        self._heard.set()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def refusal(self, stub: str, gpus_ok: bool, timeout: float = READY_WAIT_S) -> str | None:
        """Why this host's workers cannot start warm (its warm process did not start or
        does not fit), or None once it listens."""
        if not self._heard.wait(timeout):
            return f"its warm process did not answer over ssh within {timeout:.0f} s"
        if self.said is None:
            self.proc.wait()
            tail = " / ".join(line for line in self.lines if line.strip())[-500:]
            return f"its warm process did not start (ssh exit {self.proc.returncode}: " \
                   f"{tail or 'no output'})"
        if self.said["stub"] != stub:
            return f"its parallax is at {self.said['stub']}, not {stub}: install it at the " \
                   f"same path on every host"
        if self.said["gpus"] and not gpus_ok:
            return "it has NVIDIA GPUs (a fork after TensorFlow's import is untested with " \
                   "CUDA; --warm-starts on forks there anyway)"
        return None

    def close(self) -> None:
        """Close ssh's stdin: the wrapper there ends the warm process and its workers."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass

    def wait(self, grace: float) -> None:
        """Wait for ssh to end after `close`; kill it after `grace` seconds."""
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
