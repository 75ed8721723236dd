"""What a worker left behind holding its output pipes, ended once the worker has exited.

A backend relays each worker's output until the pipe's end of file, which comes only when
every process holding the pipe's write end has closed it: the worker's own children inherit
it (a `subprocess.Popen` without `stdout=`, a shell's background job). One of them still
running after the worker exited held the relay, and the backend with it, for as long as it
ran: a worker that failed with a child left running hung horovodrun and the TensorFlow
supervisor, and the failure was never reported (`parallax run` waited until it was killed).
Neither horovodrun nor torchrun ends them; mpirun ends the whole job.

So, once the worker has exited, `end_holders` finds the processes that still hold the pipes
(by the pipes' inodes in /proc/PID/fd: a warm worker's children are not in the rank's
session or process group, and a worker may have started a new session), waits
`SETTLE_S` for them to close them on their own (a log shipper finishing its last line), then
sends SIGTERM, and SIGKILL `GRACE_S` later to what is left; it names each on stderr. The
job ends anyway when a worker fails, and `parallax run` ends every process of the job when
it exits; this only brings that end to where it is waited for.

Standard library only: horovodrun's middlemen load it from its file
(`launch/backends/horovodrun_bound.py`), in horovodrun's interpreter, which need not import
parallax. Linux only (/proc); elsewhere, nothing.
"""
from __future__ import annotations

import os
import signal
import sys
import time

SETTLE_S = 1.0  # after the worker's exit: how long its leftovers may take to close the pipes
GRACE_S = 2.0  # SIGTERM, then SIGKILL this much later
POLL_S = 0.05


def pipe_names(fds) -> set[str]:
    """"pipe:[INODE]" of each of `fds` that is a pipe (others are left out)."""
    names = set()
    for fd in fds:
        try:
            name = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if name.startswith("pipe:"):
            names.add(name)
    return names


def holders(names: set[str], exclude: set[int]) -> dict[int, str]:
    """pid -> command line of every process but `exclude` holding the write end of one of
    the pipes `names` (the readers, the backend itself, keep no pipe open)."""
    found: dict[int, str] = {}
    if not names:
        return found
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in exclude:
            continue
        try:
            fds = os.listdir(f"/proc/{entry}/fd")
        except OSError:
            continue  # gone meanwhile, or not ours to read
        for fd in fds:
            try:
                if os.readlink(f"/proc/{entry}/fd/{fd}") in names and _writes(entry, fd):
                    found[int(entry)] = _command(int(entry))
                    break
            except OSError:
                continue
    return found


def _writes(pid: str, fd: str) -> bool:
    """Whether descriptor `fd` of process `pid` was opened for writing (/proc's fdinfo)."""
    try:
        with open(f"/proc/{pid}/fdinfo/{fd}") as file:
            flags = next((line.split()[1] for line in file if line.startswith("flags:")), "0")
    except OSError:
        return False
    return int(flags, 8) & os.O_ACCMODE != os.O_RDONLY


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            text = file.read().replace(b"\0", b" ").strip().decode(errors="replace")
    except OSError:
        return "?"
    return text[:120] or "?"


def _ancestors() -> set[int]:
    """This process and its ancestors, up to and with pid 1: a shell that ssh ran the caller
    from may hold the same pipe, and so may a container's first process (tini, a shell), or
    the caller may be that process; none is a leftover of the worker's."""
    found, pid = set(), os.getpid()
    while pid > 0 and pid not in found:
        found.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as stat:
                pid = int(stat.read().rpartition(")")[2].split()[1])
        except (OSError, IndexError, ValueError):
            break
    return found


def _signal(pids, number: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, number)
        except OSError:
            pass  # ended meanwhile


def _wait(names: set[str], exclude: set[int], seconds: float) -> dict[int, str]:
    """The holders left after up to `seconds` (fewer if none is left sooner)."""
    deadline = time.monotonic() + seconds
    left = holders(names, exclude)
    while left and time.monotonic() < deadline:
        time.sleep(POLL_S)
        left = holders(names, exclude)
    return left


def end_holders(fds, who: str, exclude: set[int] = frozenset(), settle: float = SETTLE_S,
                grace: float = GRACE_S) -> list[int]:
    """End what still holds the pipes among `fds` once `who` (a worker, named in the
    message) has exited; this process, its ancestors and `exclude` are spared. Returns the
    pids ended."""
    if not os.path.isdir("/proc/self/fd"):
        return []
    names, spared = pipe_names(fds), {*_ancestors(), *exclude}
    left = _wait(names, spared, settle)
    if not left:
        return []
    for pid, command in sorted(left.items()):
        sys.stderr.write(f"parallax: {who} exited, but its process {pid} ({command}) still "
                         f"held its output: stopping it (SIGTERM, SIGKILL after {grace:g} s); "
                         f"wait for a worker's children before it exits, or start them with "
                         f"their own stdout and stderr\n")
    sys.stderr.flush()
    _signal(left, signal.SIGTERM)
    stubborn = _wait(names, spared, grace)
    _signal(stubborn, signal.SIGKILL)
    return sorted(left)
