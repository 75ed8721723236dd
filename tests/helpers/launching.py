"""`parallax run` as a child process, and the orphan check, for the tests that launch jobs
(tests/parallel/test_launch.py and the tests of other tiers that import it from here).

Every launcher started with the `mark` fixture runs with a unique LAUNCH_TEST_MARK in its
environment, which all its descendants inherit (servers, horovodrun and its helpers,
workers); after the test no running process may carry it: that is the orphan check.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

PARALLAX = str(Path(sys.executable).parent / "parallax")
PROBE = str(Path(__file__).resolve().parent / "launch_probe.py")
RENDEZVOUS_PROBE = str(Path(__file__).resolve().parent / "rendezvous_probe.py")
MARK = "LAUNCH_TEST_MARK"


def marked_processes(mark: str) -> dict[int, str]:
    """pid -> command line of every live (non-zombie) process whose environment has the mark."""
    found = {}
    needle = f"{MARK}={mark}".encode()
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            if (entry / "stat").read_text().rpartition(")")[2].split()[0] == "Z":
                continue
            found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue  # gone, or not ours to read
    return found


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, exited and not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(mark: str, timeout: float = 10.0) -> dict[int, str]:
    deadline = time.monotonic() + timeout
    while (left := marked_processes(mark)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def port_closed(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
        return False
    except OSError:
        return True


class Launcher:
    """`parallax run ARGS` as a child process; its output is collected line by line."""

    def __init__(self, *args: str, mark: str, start_new_session: bool = False) -> None:
        self.proc = subprocess.Popen(
            [PARALLAX, "run", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env={**os.environ, MARK: mark, "TF_CPP_MIN_LOG_LEVEL": "2"},
            start_new_session=start_new_session)  # its own group: a terminal's, for killpg
        self.out: list[str] = []
        self.err: list[str] = []
        self._readers = [threading.Thread(target=self._read, args=(s, lines), daemon=True)
                         for s, lines in ((self.proc.stdout, self.out),
                                          (self.proc.stderr, self.err))]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _read(stream, lines: list[str]) -> None:
        for line in stream:
            lines.append(line.rstrip("\n"))

    def wait(self, timeout: float = 60.0) -> int:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        for reader in self._readers:
            reader.join(5)
        return code

    def probes(self) -> list[dict]:
        return [json.loads(line[line.index("{"):]) for line in self.out if '{"probe"' in line]

    def wait_for_probes(self, count: int, timeout: float = 60.0) -> list[dict]:
        deadline = time.monotonic() + timeout
        while len(self.probes()) < count:
            assert self.proc.poll() is None, f"launcher exited early:\n{self.output()}"
            assert time.monotonic() < deadline, f"no {count} probes:\n{self.output()}"
            time.sleep(0.05)
        return self.probes()

    def start_line(self) -> str:
        return next(line for line in self.err if line.startswith("parallax run: "))

    def output(self) -> str:
        return "\n".join(["--- stdout", *self.out, "--- stderr", *self.err])


@pytest.fixture
def mark():
    mark = uuid.uuid4().hex
    yield mark
    left = wait_gone(mark)
    for pid in left:  # clean up after a failure, then fail
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes left behind: {left}"
