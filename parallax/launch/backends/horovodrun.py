"""The `horovodrun` launch backend: N workers, here and over ssh, through Horovod's launcher.

`horovodrun -np N -H host:slots,... --gloo [-p PORT] [--network-interfaces NIC] [ARGS]
PROGRAM`, run through `horovodrun_bound.py` (beside this file) so that its rendezvous server
listens on the job's interface (loopback for one host), not on 0.0.0.0, and with an
interpreter that imports Horovod. horovodrun prefixes each worker's output line with
`[rank]<stdout>:` and reports each worker that exits non-zero, the first failure first; it
exits 1 itself. Its workers get their rank and size as HOROVOD_RANK, HOROVOD_SIZE, ...
"""
from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from parallax.errors import ConfigError
from parallax.launch.backends.base import WorkerBackend
from parallax.launch.hosts import ClusterLayout, is_local, worker_hosts

_NP, _HOSTS = "give parallax run -np N", "give parallax run -H host:N,... or --hostfile FILE"
_OWN_FLAGS = {"-np": _NP, "--num-proc": _NP, "-H": _HOSTS, "--hosts": _HOSTS,
              "--hostfile": _HOSTS, "--gloo": "drop it (gloo is always used)",
              "--mpi": "drop it (parallax runs horovodrun with gloo)"}
# horovodrun prints this for each worker that exits non-zero, the first failure first
_HVD_EXIT = re.compile(rb"^Process (\d+) exit with status code (-?\d+)\.")
_RANK_LINE = re.compile(rb"^\[(\d+)\]<std(?:out|err)>:(.*)")  # horovodrun's prefixes
# what horovodrun does not forward to a remote worker (Horovod 0.28's env_util.IGNORE_REGEXES,
# matched as it does, from a name's start)
_NOT_FORWARDED = re.compile(r"BASH_FUNC_.*|OLDPWD|.*CUDA_VISIBLE_DEVICES|HOROVOD_SECRET_KEY")


class Horovodrun(WorkerBackend):
    name = "horovodrun"
    who = "the workers (horovodrun)"

    def accepts(self, layout: ClusterLayout, num_workers: int, collectives: str = "auto"
                ) -> bool:
        return collectives != "tensorflow"

    def forwarded(self, env: dict[str, str]) -> dict[str, str]:
        return {k: v for k, v in env.items() if not _NOT_FORWARDED.match(k)}

    def argv(self, layout: ClusterLayout, num_workers: int, program: list[str],
             extra_args: tuple[str, ...] = ()) -> list[str]:
        return bound_horovodrun(horovodrun_argv(layout, num_workers, program,
                                                find_horovodrun(), extra_args))

    def rank_line(self, line: bytes) -> tuple[int, bytes] | None:
        ranked = _RANK_LINE.match(line)
        return (int(ranked[1]), ranked[2]) if ranked else None

    def failure(self, line: bytes) -> tuple[int, int] | None:
        match = _HVD_EXIT.match(line)
        return (int(match[1]), int(match[2])) if match else None


def check_args(args: tuple[str, ...]) -> None:
    """Refuse --horovodrun-arg's that parallax run sets itself."""
    if isinstance(args, str):
        raise ConfigError(f"horovodrun_args must be a tuple of strings, not the string {args!r}")
    for arg in args:
        flag = arg.split("=", 1)[0]
        if flag in _OWN_FLAGS:
            raise ConfigError(f"--horovodrun-arg {arg!r}: parallax run sets {flag} itself; "
                              f"{_OWN_FLAGS[flag]}")


def find_horovodrun() -> str:
    beside = Path(sys.executable).parent / "horovodrun"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("horovodrun")
    if found is None:
        raise ConfigError(f"these workers need horovodrun (Horovod's launcher), which is "
                          f"neither next to {sys.executable} nor on PATH: install Horovod with "
                          f"gloo (`make demo` does), run them on this machine with "
                          f"--collectives tensorflow, or run with -np 1")
    return found


BOUND_HOROVODRUN = Path(__file__).with_name("horovodrun_bound.py")


def horovod_installed() -> bool:
    """Whether this interpreter can import Horovod."""
    return importlib.util.find_spec("horovod") is not None


def _interpreter_of(script: str) -> str:
    """The Python to run horovodrun's code with: this one when it has Horovod, else the one
    `script` (horovodrun) runs with, checked to be a Python that imports Horovod."""
    if horovod_installed():
        return sys.executable
    python = _script_python(script)
    if python is None or not _imports_horovod(python):
        named = python or "an interpreter its first lines do not name"
        raise ConfigError(f"horovodrun {script} runs with {named}, which cannot import "
                          f"Horovod, and neither can {sys.executable}: install Horovod with "
                          f"gloo into {sys.executable}'s environment (`make demo` does), or "
                          f"put the horovodrun of a Python with Horovod first on PATH")
    return python


def _script_python(script: str) -> str | None:
    """The interpreter a console script names: its #! line (`#!/usr/bin/env NAME` through
    PATH) or, under `#!/bin/sh`, the one pip's wrapper execs (pip writes one when the
    environment's path is long or has spaces: `'''exec' "/venv/bin/python" "$0" "$@"`)."""
    with open(script, "rb") as file:
        lines = file.read(4096).decode(errors="replace").splitlines()
    if not lines or not lines[0].startswith("#!"):
        return None
    words = lines[0][2:].split()
    if words and Path(words[0]).name == "env":
        words = [shutil.which(words[1]) or ""] if len(words) > 1 else []
    if words and Path(words[0]).name == "sh":
        words = _pip_wrapped(lines[1] if len(lines) > 1 else "")
    return words[0] if words and Path(words[0]).is_file() else None


def _pip_wrapped(line: str) -> list[str]:
    """[the Python] that pip's /bin/sh wrapper line execs, else []."""
    try:
        words = shlex.split(line)
    except ValueError:
        return []
    return words[1:2] if words[:1] == ["exec"] else []


def _imports_horovod(python: str) -> bool:
    """Whether `python` runs and imports Horovod's launcher."""
    try:
        return subprocess.run([python, "-c", "import horovod.runner.launch"],
                              capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def bound_horovodrun(argv: list[str]) -> list[str]:
    """horovodrun's argv (argv[0] is horovodrun) run through BOUND_HOROVODRUN, with
    horovodrun's own interpreter."""
    return [_interpreter_of(argv[0]), str(BOUND_HOROVODRUN), *argv[1:]]


def horovodrun_argv(layout: ClusterLayout, num_workers: int, program: list[str],
                    horovodrun: str, extra_args: tuple[str, ...] = ()) -> list[str]:
    """`horovodrun -np N -H host:slots,... --gloo [-p PORT] [EXTRA_ARGS] PROGRAM` for a
    layout (Horovod runs the remote workers over ssh, with the launcher's environment and
    working directory)."""
    hosts = worker_hosts(layout, num_workers)
    parts = [f"{name}:{take}" for _, name, take in hosts]
    ports = {h.ssh_port for h, _, _ in hosts if not is_local(h.host)}
    if len(ports) > 1:
        raise ConfigError(f"the worker hosts use different ssh ports "
                          f"{sorted(p or 22 for p in ports)}; horovodrun takes one (-p): use "
                          f"one port, or set them per host in ~/.ssh/config")
    port = ports.pop() if ports else None
    nic = layout.network_interface
    return [horovodrun, "-np", str(num_workers), "-H", ",".join(parts), "--gloo",
            *(["-p", str(port)] if port is not None else []),
            *(["--network-interfaces", nic] if nic else []), *extra_args, *program]
