"""Run a command as a child subreaper and report what became of every process under it.

    orphan_reaper.py READY_FILE [--kill] -- COMMAND ...

Starts COMMAND, waits for it to create READY_FILE, SIGKILLs it with --kill (else waits for it
to exit), then reaps every process left under this one (orphans are re-parented here, not to
init, because this process is a subreaper) for up to DEADLINE_S seconds. Survivors are
SIGKILLed and reaped too, so nothing outlives the test. Prints one JSON object:
{"command": exit status, "children": [{"pid", "cmd", "status" (None: survived), "seconds"}]}
with statuses as subprocess reports them (negative: killed by that signal).
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

PR_SET_CHILD_SUBREAPER = 36
DEADLINE_S = 10.0


def _children() -> dict[int, str]:
    """pid -> command line of this process's children (zombies too)."""
    me, found = os.getpid(), {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
            cmd = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if int(fields[1]) == me:
            found[int(stat.parent.name)] = cmd.strip()
    return found


def _status(raw: int) -> int:
    return -os.WTERMSIG(raw) if os.WIFSIGNALED(raw) else os.WEXITSTATUS(raw)


def _reap(start: float) -> list[dict]:
    """Wait for every child until the deadline; kill and record the survivors."""
    report: dict[int, dict] = {}
    while True:
        for pid, cmd in _children().items():
            report.setdefault(pid, {"pid": pid, "cmd": cmd, "status": None, "seconds": None})
        pending = [r for r in report.values() if r["seconds"] is None]
        if not pending:
            return list(report.values())
        for entry in pending:
            done, raw = os.waitpid(entry["pid"], os.WNOHANG)
            if done:
                entry.update(status=_status(raw), seconds=round(time.monotonic() - start, 2))
        if time.monotonic() - start > DEADLINE_S:
            break
        time.sleep(0.05)
    for entry in report.values():
        if entry["seconds"] is None:
            os.kill(entry["pid"], signal.SIGKILL)
            os.waitpid(entry["pid"], 0)
            entry["seconds"] = "survived"
    return list(report.values())


def main(argv: list[str]) -> int:
    ready, kill = Path(argv[0]), argv[1] == "--kill"
    command = argv[argv.index("--") + 1:]
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    proc = subprocess.Popen(command)
    deadline = time.monotonic() + 120
    while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if kill:
        proc.kill()
    code = proc.wait(60)
    report = {"ready": ready.exists(), "command": code, "children": _reap(time.monotonic())}
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
