"""Children that end with their parent, however it died (SIGKILL, os._exit, the OOM killer).

Two mechanisms, one per kind of child:

* A parameter server (our code) watches its parent: `watch_parent` polls getppid() every
  0.2 s in a daemon thread and, once the server has been re-parented (to init or a
  subreaper), stops it as SIGTERM would. The parent passes its pid in PARALLAX_PARENT_PID
  (`child_env`), so a parent that died before the server started is noticed too. Polling
  works per process: PR_SET_PDEATHSIG fires when the parent *thread* that forked exits, and
  embedded servers may be started from any thread of a user's program; a lifeline pipe's
  write end would be inherited by every fork() of the parent (multiprocessing workers, say)
  and keep the servers alive as long as those live.
* A worker command (any program, not ours) gets PR_SET_PDEATHSIG(SIGTERM), which survives
  exec: `dying_with` starts it through a tiny fresh Python that sets it and execs the
  command (no preexec_fn, which would run Python in a fork of the threaded launcher).
  `parallax run` starts it from its main thread, which lives as long as the launcher. Linux
  only; elsewhere the launcher's own cleanup remains.
* A job's process group (`dying_with(..., reap_group=True)`): the command's own children
  (a shell's, horovodrun's) do not get that signal, and horovodrun outlives a SIGTERM. So the
  wrapper stays, as the group's leader, and runs the command as its child; when the launcher
  dies it sends SIGTERM to the whole group and every descendant (horovodrun's ranks run in
  sessions of their own), and SIGKILL after `REAP_GRACE_S` to what is left. It is the job's
  subreaper (PR_SET_CHILD_SUBREAPER): a process whose parent dies is re-parented to it, not
  to init, so it stays in the job. Without that, a process forked after a sweep by one that
  the sweep's signal then killed escaped (a rank's shell, forked by horovodrun's middleman,
  in the middleman's session). So it sweeps again and again, signalling what is new, until
  it has no child left. Otherwise it waits (reaping the job's orphans); once its command
  exited, it ends what is left of the job the same way (a worker's child that holds none
  of its output, re-parented here: a warm worker leads a session of its own, out of the
  group), and exits as its command did (a signal's death by the same signal).
"""
from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from parallax.env import PARENT_ENV

POLL_S = 0.2
REAP_GRACE_S = 3.0  # a dead launcher's job: SIGTERM, then SIGKILL this much later


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's) naming this process as the child's parent."""
    return {**(os.environ if env is None else env), PARENT_ENV: str(os.getpid())}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def watch_parent(on_gone: Callable[[int], None], environ=None) -> bool:
    """Call `on_gone(parent pid)` once this process's parent is gone (now, or later from a
    daemon thread). False, and nothing watched, without PARALLAX_PARENT_PID."""
    text = (os.environ if environ is None else environ).get(PARENT_ENV, "")
    if not text.isdigit():
        return False
    expected, parent = int(text), os.getppid()
    if parent != expected and not _alive(expected):
        on_gone(expected)  # died before we got here
        return True

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(POLL_S)
        on_gone(expected)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
    return True


# What `dying_with` runs: the child itself asks for PR_SET_PDEATHSIG, then execs the command
# (which keeps it). No preexec_fn: that runs Python in a forked copy of a threaded launcher
# (its at-fork hooks too), which the subprocess docs call unsafe; this is a fresh interpreter.
_EXEC_DYING = """
import os, signal, sys
parent, group, argv = int(sys.argv[1]), sys.argv[2] == "1", sys.argv[3:]
for name in ("SIGPIPE", "SIGXFZ", "SIGXFSZ"):  # Python ignores them; the command gets them
    if hasattr(signal, name):
        signal.signal(getattr(signal, name), signal.SIG_DFL)
if group:
    os.setpgrp()
if sys.platform.startswith("linux"):
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
if os.getppid() != parent:
    os.kill(os.getpid(), signal.SIGTERM)  # the parent died before the line above
try:
    os.execvp(argv[0], argv)
except OSError as exc:
    sys.stderr.write(f"cannot run {argv[0]!r}: {exc}; check the command\\n")
    os._exit(127)
"""


# What `dying_with(reap_group=True)` runs: the group's leader forks the command and waits.
# Signals the launcher sends reach the whole group (killpg), so the leader forwards none; the
# SIGTERM of the launcher's death (PR_SET_PDEATHSIG) it turns into the group's end. As the
# job's subreaper, it is the ancestor of every process of the job until it exits.
_REAP_GROUP = """
import os, signal, sys, time
parent, grace, argv = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]
os.setpgrp()
prctl = None
if sys.platform.startswith("linux"):
    import ctypes
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: the job's orphans come here, not to init
def processes():  # pid -> (parent pid, process group) of every live process (no zombies)
    found = {}
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue  # gone meanwhile
        if fields[0] != "Z":
            found[pid] = (int(fields[1]), int(fields[2]))
    return found
def job(me=os.getpid()):  # this group, and every descendant (horovodrun's ranks lead sessions)
    table = processes()
    found = {pid for pid, (_, group) in table.items() if group == me}
    grown = True
    while grown:
        more = {pid for pid, (parent, _) in table.items() if parent in found | {me}} - found
        found |= more
        grown = bool(more)
    return found - {me}
def signal_all(pids, number):
    for pid in pids:
        try:
            os.kill(pid, number)
        except OSError:
            pass
def reap():  # collect ended children; False once none is left: the job has ended
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        return False
    return True
def signal_job(number, grace):  # `number` to the job; True once it has ended within `grace`
    signalled, deadline = set(), time.monotonic() + grace
    while time.monotonic() < deadline:
        found = job()  # again and again: a process may fork between a sweep and its signal
        if not found and not reap():
            return True
        signal_all(found - signalled, number)
        signalled |= found
        time.sleep(0.05)
    return False
def end_group():
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if signal_job(signal.SIGTERM, grace):  # all ended: so does their leader, as by its signal
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
    signal_job(signal.SIGKILL, grace)
    os.killpg(0, signal.SIGKILL)
def on_term(signum, frame):
    if os.getppid() != parent:
        end_group()
held = [getattr(signal, name) for name in ("SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")]
before = {number: signal.getsignal(number) for number in [signal.SIGTERM, *held]}
signal.signal(signal.SIGTERM, on_term)
for number in held:
    signal.signal(number, signal.SIG_IGN)
blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])  # on_term is not the child's
child = os.fork()
if child == 0:
    for number, handler in before.items():  # as inherited (nohup's SIGHUP stays ignored)
        signal.signal(number, signal.SIG_IGN if handler == signal.SIG_IGN else signal.SIG_DFL)
    for name in ("SIGPIPE", "SIGXFSZ"):  # Python ignores them; the command gets them
        signal.signal(getattr(signal, name), signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    if prctl is not None:
        prctl(1, signal.SIGTERM, 0, 0, 0)  # the command ends with its leader too
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        sys.stderr.write(f"cannot run {argv[0]!r}: {exc}; check the command\\n")
        os._exit(127)
signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
if prctl is not None:
    prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG: on_term hears of the launcher's end
if os.getppid() != parent:
    end_group()  # the launcher died before the line above
ended = status = 0
while ended != child:  # the job's orphans, re-parented here, are reaped meanwhile
    ended, status = os.waitpid(-1, 0)
# what the command left: its descendants' orphans, re-parented here (a warm worker's children
# too: each worker leads a session of its own, out of this group), end with it
if not signal_job(signal.SIGTERM, grace):
    signal_job(signal.SIGKILL, grace)
if os.WIFSIGNALED(status):  # end as the command did, without a core of our own
    import resource
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    number = os.WTERMSIG(status)
    try:
        signal.signal(number, signal.SIG_DFL)
    except (OSError, ValueError):
        pass  # SIGKILL and SIGSTOP cannot be caught: they are at their default already
    os.kill(os.getpid(), number)
os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)
"""


def group_alive(pgid: int) -> bool:
    """Whether a process of the group still runs; zombies (exited, waiting for whoever
    adopted them to reap them) do not count."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue  # gone meanwhile
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def dying_with(argv: list[str], parent: int, new_group: bool = False,
               reap_group: bool = False) -> list[str]:
    """`argv` run so that it gets SIGTERM when `parent` (the caller's pid, whose starting
    thread must outlive it) ends; if it already has, it ends at once. With `new_group`, it
    also leads a process group of its own; its pid stays the one the caller started. With
    `reap_group`, the pid the caller started leads a new group and runs `argv` as its child:
    when `parent` ends, every process of the group gets SIGTERM, then SIGKILL
    (`REAP_GRACE_S`); it exits as `argv` did. Signals for the command go to the group."""
    if reap_group:
        return [sys.executable, "-I", "-S", "-c", _REAP_GROUP, str(parent),
                str(REAP_GRACE_S), *argv]
    return [sys.executable, "-I", "-S", "-c", _EXEC_DYING, str(parent),
            "1" if new_group else "0", *argv]
