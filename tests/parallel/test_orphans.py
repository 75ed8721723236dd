"""No orphans (issue 13, defect 4): when a job's launcher, or a process with embedded servers,
dies without cleaning up (SIGKILL, os._exit, the OOM killer), its servers and workers notice
and exit within seconds.

Each case runs under `orphan_reaper.py`, a child subreaper: the orphans are re-parented to it
rather than to init, so it can collect every exit code, and it kills whatever survives. A
job's own orphans go to its lifeline wrapper (a subreaper too), which ends only once they
have: its prompt exit is theirs.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

HELPERS = Path(__file__).resolve().parents[1] / "helpers"
PROMPT_S = 5.0  # what "promptly" means here: the servers poll their parent every 0.2 s

WORKER = """
import os, sys, time
open(sys.argv[1] + ".tmp", "w").write(os.environ["PARALLAX_PS_ADDRESSES"])
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(600)
"""

EMBEDDED = """
import os, signal, sys, time
from parallax.client.cluster import resolve_cluster
spec = resolve_cluster(environ={})
assert len(spec.ps_addresses) == 2 and spec.embedded, spec
open(sys.argv[1], "w").write(",".join(spec.ps_addresses))
if sys.argv[2] == "exit":
    os._exit(3)
time.sleep(600)
"""


def _reaped(tmp_path: Path, kill: bool, *command: str) -> dict:
    ready = tmp_path / "ready"
    proc = subprocess.run([sys.executable, str(HELPERS / "orphan_reaper.py"), str(ready),
                           "--kill" if kill else "--wait", "--", *command],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["ready"], proc.stderr[-3000:]
    return report


def _servers(report: dict) -> list[dict]:
    return [c for c in report["children"] if "parallax_ps" in c["cmd"]]


def _assert_prompt_exits(report: dict) -> None:
    late = [c for c in report["children"]
            if c["seconds"] == "survived" or c["seconds"] > PROMPT_S]
    assert not late, f"outlived their parent by more than {PROMPT_S}s: {late}"


def test_servers_and_worker_end_when_parallax_run_is_sigkilled(tmp_path):
    report = _reaped(tmp_path, True, sys.executable, "-m", "parallax.cli", "run",
                     "--servers", "2", "--progress-seconds", "0", "--",
                     sys.executable, "-c", WORKER, str(tmp_path / "ready"))
    assert report["command"] == -9
    servers = _servers(report)
    workers = [c for c in report["children"] if c not in servers]
    # the job group's leader (the lifeline wrapper) and the command, if it outlived it
    assert len(servers) == 2 and 1 <= len(workers) <= 2, report
    _assert_prompt_exits(report)
    assert [s["status"] for s in servers] == [0, 0], servers  # a graceful stop
    assert {w["status"] for w in workers} == {-15}, workers  # the launcher's death signal


def _job_killed(tmp_path: Path, *run_args: str) -> list[dict]:
    """SIGKILL a `parallax run` whose worker command is a shell that starts WORKER as its
    child (a wrapper script, as users write them), and return what was left to reap."""
    shell = f"{sys.executable} -c '{WORKER}' {tmp_path / 'ready'}; echo after"
    report = _reaped(tmp_path, True, sys.executable, "-m", "parallax.cli", "run",
                     "--servers", "2", "--progress-seconds", "0", "--health-timeout", "0",
                     *run_args, "--", "/bin/sh", "-c", shell)
    assert report["command"] == -9
    _assert_prompt_exits(report)  # nothing survived, nothing lingered past PROMPT_S
    return [c for c in report["children"] if c not in _servers(report)]


def test_a_shell_commands_children_end_when_parallax_run_is_sigkilled(tmp_path):
    # defect: the shell got SIGTERM and died; the program it started lived on (PPID 1)
    left = _job_killed(tmp_path)
    assert left and all(w["status"] is not None for w in left), left


@pytest.mark.horovod
def test_horovodrun_and_its_ranks_end_when_parallax_run_is_sigkilled(tmp_path):
    # defect: horovodrun (re-parented, handling SIGTERM) and both ranks kept running
    left = _job_killed(tmp_path, "-np", "2")
    assert left and all(w["status"] is not None for w in left), left


# horovodrun's middleman (in a session of its own), SIGTERMed just after it forked a rank's
# shell, dies and leaves that shell to whoever adopts orphans, unseen by the lifeline's sweep
STARTS_AS_IT_DIES = """
import os, signal, sys, time
os.setsid()
def on_term(*_):
    if os.fork() == 0:
        os.execvp("sleep", ["sleep", "600"])
    os._exit(0)
signal.signal(signal.SIGTERM, on_term)
open(sys.argv[1], "w").close()
time.sleep(600)
"""


def test_a_process_started_as_the_job_is_ended_ends_too(tmp_path):
    # defect: `sleep` outlived everything (re-parented to the reaper, in no group of the job)
    report = _reaped(tmp_path, True, sys.executable, "-m", "parallax.cli", "run",
                     "--servers", "2", "--progress-seconds", "0", "--health-timeout", "0",
                     "--", sys.executable, "-c", STARTS_AS_IT_DIES, str(tmp_path / "ready"))
    assert report["command"] == -9
    _assert_prompt_exits(report)


@pytest.mark.parametrize("death", ["exit", "sigkill"])
def test_embedded_servers_end_with_their_process(tmp_path, death):
    report = _reaped(tmp_path, death == "sigkill", sys.executable, "-c", EMBEDDED,
                     str(tmp_path / "ready"), death)
    assert report["command"] == (3 if death == "exit" else -9)
    servers = _servers(report)
    assert len(servers) == 2 and len(report["children"]) == 2, report
    _assert_prompt_exits(report)
    assert [s["status"] for s in servers] == [0, 0], servers
