"""Warm starts: workers forked from a process that has TensorFlow imported already.

A worker spends ~3.5 s of CPU importing TensorFlow, Keras and parallax before its first
line runs; a restart after a worker's death pays that for every worker at once (4 workers
on 2 cores: 7-9 s before training again). With warm starts, `parallax run` keeps one
process (`warm_fork`) that imported them once and forks each worker from it, through a
stub (`warm_stub`, ~20 ms, standard library only) that the launch backend starts in the
worker's place: horovodrun, the TensorFlow supervisor and the launcher's signals, lifelines
and exit codes see the stub, which passes its environment, arguments, working directory and
standard streams to the fork and then stands in for it (signals forwarded, exit status
mirrored, its death killing the fork).

`--warm-starts auto` (the default) keeps the warm process where restarts are expected
(--max-restarts, --host-discovery-script, --replicas 2); `on` always, `off` never. Only for
commands it can become (`python SCRIPT ...` or `python -m MODULE ...` with the launcher's
interpreter), on this machine and on each other host of --hosts, where the launcher keeps
one more over ssh (`parallax.launch.warm_remote`: the same interpreter and parallax paths
there; a host whose warm process cannot start sends the job's workers cold, said once; a
Kubernetes worker pod keeps its own: `parallax k8s --warm-starts`, `k8s_bootstrap`), and
not where the hosts name GPU slots, nor by default on a machine with NVIDIA GPUs (a fork
must not inherit a CUDA context: untested there). A worker
that the warm process refuses (another namespace, cgroup, user, rlimit, PYTHON* variable,
a variable TensorFlow or Keras reads at import, sys.path, or a script that sets such a
variable or sets up logging before its `import tensorflow`) starts cold, as it would have
without it; so does every worker when the warm process is gone.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from parallax.launch.warm_stub import host_socket, private_refusal
from parallax.runtime import lifeline

WARM_STARTS = ("auto", "on", "off")
STUB = Path(__file__).with_name("warm_stub.py")
STOP_GRACE_S = 5.0
BIND_WAIT_S = 5.0  # the most a launch waits for the warm process to listen
TITLE_ROOM_BYTES = 4096  # of the warm process's command line, which each worker overwrites


class WarmProcess:
    """The warm process of one launcher, listening on a socket in a private directory."""

    def __init__(self, env: dict[str, str], say) -> None:
        self._env, self._say = env, say
        self._dir = tempfile.mkdtemp(prefix="parallax-warm-")  # 0700: this user's only
        self.base = str(Path(self._dir) / "fork.sock")  # the stubs' argument, on every host
        self.socket = host_socket(self.base)  # this machine's
        self._proc: subprocess.Popen | None = None
        self._starts = 0
        self._remotes: dict = {}  # ssh target -> its `warm_remote.RemoteWarm`
        self._said: set[str] = set()

    def ensure(self) -> str | None:
        """Start the warm process, or again if it has ended (its next workers are then
        forked from the new one; any that asked in between started cold); why the workers
        start cold (its directory is not private: said once), or None."""
        Path(self._dir).mkdir(mode=0o700, exist_ok=True)  # (a warm process ended removes it)
        why = private_refusal(self._dir)
        if why is not None:
            return self._once(f"this machine: {why}")
        if self._proc is not None and self._proc.poll() is None:
            return None
        if self._proc is not None:
            self._say(f"the warm process ended ({self._proc.returncode}); starting another")
            self._signal(signal.SIGKILL)  # what is left in its group (its leader ended the rest)
        Path(self.socket).unlink(missing_ok=True)
        argv = [sys.executable, "-m", "parallax.launch.warm_fork", self.base,
                "-" * TITLE_ROOM_BYTES]
        # as the job is: in a group of its own, whose leader ends all of it (the workers'
        # children too: they are re-parented to it) when the launcher dies; and out of the
        # terminal's group, so that its Ctrl-C reaches the launcher only, not the workers
        group = {"process_group": 0} if sys.version_info >= (3, 11) else {}  # before exec
        # started in its private directory, which `-m` puts first on its sys.path: not in
        # the launcher's, whose modules (a checkout's parallax/, say) a worker would not see
        self._proc = subprocess.Popen(lifeline.dying_with(argv, os.getpid(), reap_group=True),
                                      env=self._env, cwd=self._dir, stdin=subprocess.DEVNULL,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      **group)
        self._starts += 1
        self._listening()
        return None

    def _listening(self) -> None:
        """Wait (up to BIND_WAIT_S) until the new warm process listens: a stub that came
        before would start cold (it binds before its imports, ~0.3 s after its start)."""
        deadline = time.monotonic() + BIND_WAIT_S
        while not Path(self.socket).exists() and self._proc.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.01)

    def wrap(self, program: list[str]) -> list[str]:
        """`program` started through the stub."""
        return [sys.executable, "-I", "-S", str(STUB), self.base, "--", *program]

    def ensure_hosts(self, hosts, forwarded, gpus_ok: bool) -> str | None:
        """Start the warm process of each of `hosts` (other machines' HostSpecs) that has
        none (again where one ended), with the compared variables of `forwarded(env)`
        (what the backend gives the workers there); why the workers must start cold (one
        of them has none: said once), or None. `gpus_ok`: fork on a host with GPUs."""
        from parallax.launch.warm_remote import RemoteWarm, compared
        env = compared(forwarded(self._env))
        for host in hosts:
            old = self._remotes.get(host.ssh_target)
            if old is None or (old.said is not None and not old.alive()):
                if old is not None:
                    self._say(f"the warm process on {host.ssh_target} ended; starting another")
                self._remotes[host.ssh_target] = RemoteWarm(
                    host, self.base, env, TITLE_ROOM_BYTES)
        for host in hosts:
            why = self._remotes[host.ssh_target].refusal(str(STUB), gpus_ok)
            if why is not None:
                return self._once(f"{host.ssh_target}: {why}")
        return None

    def _once(self, why: str) -> str:
        if why not in self._said:
            self._said.add(why)
            self._say(f"warm starts: the workers start cold ({why})")
        return why

    def stop(self) -> None:
        """SIGTERM the warm process's group (its leader waits for the warm process, whose
        workers die with it; a worker's children that outlived it were re-parented to the
        leader, which ends them before it exits: each worker leads a session of its own, out
        of the group), then SIGKILL what is left after STOP_GRACE_S."""
        for remote in self._remotes.values():
            remote.close()  # (the wrapper there ends it and its workers: waited for below)
        if self._proc is not None:
            self._signal(signal.SIGTERM)
            deadline = time.monotonic() + STOP_GRACE_S
            while lifeline.group_alive(self._proc.pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            self._signal(signal.SIGKILL)
            self._proc.wait()
        for remote in self._remotes.values():
            remote.wait(STOP_GRACE_S + 10)  # (the wrapper there waits 10 s for its SIGTERM)
        shutil.rmtree(self._dir, ignore_errors=True)

    def _signal(self, signum: int) -> None:
        try:
            os.killpg(self._proc.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


def wanted(setting: str, restarts: bool, gpus: bool = False) -> bool:
    """Whether --warm-starts SETTING asks for a warm process (`restarts`: the job restarts
    or rescales its workers; `gpus`: this machine has NVIDIA GPUs, where auto says no: a
    fork after TensorFlow's import is untested with CUDA)."""
    return setting == "on" or (setting == "auto" and restarts and not gpus)


def gpu_machine() -> bool:
    """Whether this machine has NVIDIA GPUs (their device files)."""
    return any(Path("/dev").glob("nvidia[0-9]*"))


def why_cold(program: list[str], layout, num_workers: int, path: str) -> str | None:
    """Why this job's workers cannot start warm, or None (`path`: the workers' PATH)."""
    from parallax.launch.hosts import worker_hosts
    hosts = worker_hosts(layout, num_workers)
    if any(host.gpus for host, _, _ in hosts):
        return "GPU slots named"
    return why_cold_command(program, path)


def why_cold_command(program: list[str], path: str) -> str | None:
    """Why `program` cannot be forked from the warm process, or None (`path`: its PATH)."""
    if not _same_python(program[0], path):
        return f"{program[0]} is not {sys.executable}"
    rest = program[1:]
    if rest[:1] == ["-m"] and len(rest) > 1 and not rest[1].startswith("-"):
        return None
    if rest and not rest[0].startswith("-"):
        return None
    return "not `python SCRIPT` or `python -m MODULE`"


def _same_python(command: str, path: str) -> bool:
    """Whether `command` runs this interpreter: found on the workers' PATH in the same
    directory as sys.executable (a virtual environment's bin, not the Python it links to),
    spelled alike (Python derives sys.executable, sys.prefix and so every module's path
    from the path it was started by: through a symlinked directory, a cold worker's
    differ from the warm process's), and the same file."""
    found = shutil.which(command, path=path)
    if found is None:
        return False
    found, mine = os.path.abspath(found), os.path.abspath(sys.executable)
    return (os.path.dirname(found) == os.path.dirname(mine)
            and os.path.realpath(found) == os.path.realpath(mine))


@contextlib.contextmanager
def warm_process(enabled: bool, env: dict[str, str], say):
    """A WarmProcess for the life of the launcher (None when not `enabled`)."""
    if not enabled:
        yield None
        return
    warm = WarmProcess(env, say)
    try:
        yield warm
    finally:
        warm.stop()
