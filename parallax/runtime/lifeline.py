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
"""
from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable

from parallax.env import PARENT_ENV

POLL_S = 0.2


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


def dying_with(argv: list[str], parent: int, new_group: bool = False) -> list[str]:
    """`argv` run so that it gets SIGTERM when `parent` (the caller's pid, whose starting
    thread must outlive it) ends; if it already has, it ends at once. With `new_group`, it
    also leads a process group of its own. Its pid stays the one the caller started."""
    return [sys.executable, "-I", "-S", "-c", _EXEC_DYING, str(parent),
            "1" if new_group else "0", *argv]
