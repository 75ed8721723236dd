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
* A worker command (any program, not ours) gets PR_SET_PDEATHSIG(SIGTERM) between fork and
  exec (`dies_with`, a preexec_fn): `parallax run` starts it from its main thread, which
  lives as long as the launcher. Linux only; elsewhere the launcher's own cleanup remains.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from typing import Callable

PARENT_ENV = "PARALLAX_PARENT_PID"
POLL_S = 0.2
PR_SET_PDEATHSIG = 1
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


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


def dies_with(parent: int, new_group: bool = False) -> Callable[[], None]:
    """A preexec_fn: the child gets SIGTERM when `parent` (the caller's pid, whose forking
    thread must outlive the child) ends; if it already has, the child ends at once. With
    `new_group`, the child also leads a process group of its own."""
    def preexec() -> None:
        if new_group:
            os.setpgrp()
        if _PRCTL is not None:
            _PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGTERM)
    return preexec
