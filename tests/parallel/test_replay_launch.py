"""`parallax run --replay-mb`: a server SIGKILLed mid-job is started again on its address
with --restore-newest, the job goes on, and the table's shard there starts from its
checkpoint (tests/helpers/replay_worker.py; the workers' replay of their pushes since is
parallax.client.replay's, tested with it); a hung one is killed and started again; a server
that keeps dying ends the job after its starts."""
from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from launching import PROBE, Launcher, marked_processes, port_closed
from parallax.launch.job_servers import MAX_REPLACEMENTS
from launching import mark  # noqa: F401 (a fixture)

WORKER = str(Path(__file__).resolve().parents[1] / "helpers" / "replay_worker.py")
STARTED = re.compile(r"started again there \(--replay-mb, start \d+ of \d+ this attempt, "
                     r"pid (\d+)\)")


@pytest.mark.multiprocess
def test_a_killed_server_answers_again_at_its_address_with_its_checkpoint(mark):
    launcher = Launcher("--replay-mb", "64", "-np", "1", "--servers", "2",
                        "--health-timeout", "10", "--progress-seconds", "0", "--",
                        sys.executable, WORKER, mark=mark)
    assert launcher.wait(120) == 0, launcher.output()
    [line] = [x for x in launcher.out if '{"replay"' in x]
    report = json.loads(line[line.index("{"):])
    assert report["new_pid"] != report["old_pid"], launcher.output()
    assert report["steps"] == [4, 3] and report["restored"], launcher.output()
    address = report["addresses"][1]
    said = [x for x in launcher.err if "started again there" in x]
    assert said == [f"parallax run: parameter server 1 ({address}) exited with code -9; "
                    f"started again there (--replay-mb, start 1 of 3 this attempt, pid "
                    f"{report['new_pid']}): its tables restore from their newest checkpoint, "
                    f"and the workers replay their pushes since"], launcher.output()
    assert any("--replay-mb without --data-dir" in x for x in launcher.err)
    assert all(port_closed(a) for a in report["addresses"])


def _started_again(launcher: Launcher, count: int, timeout: float = 60.0) -> list[int]:
    """The pids of the first `count` servers started again, once the launcher said so."""
    deadline = time.monotonic() + timeout
    while True:
        pids = [int(m.group(1)) for m in map(STARTED.search, launcher.err) if m]
        if len(pids) >= count:
            return pids
        assert launcher.proc.poll() is None, launcher.output()
        assert time.monotonic() < deadline, launcher.output()
        time.sleep(0.1)


@pytest.mark.multiprocess
def test_a_hung_server_is_started_again_and_one_that_keeps_dying_ends_the_job(mark):
    """A SIGSTOPped server is killed after --health-timeout and started again; its
    replacements' deaths are too, 3 starts in all; the next death ends the job as a server's
    death without --replay-mb does."""
    launcher = Launcher("--replay-mb", "8", "-np", "1", "--servers", "2", "--health-timeout",
                        "2", "--progress-seconds", "0", PROBE, "--sleep", "120", mark=mark)
    launcher.wait_for_probes(1)
    servers = sorted(pid for pid, cmd in marked_processes(mark).items() if "parallax_ps" in cmd)
    os.kill(servers[1], signal.SIGSTOP)
    pids = _started_again(launcher, 1)
    assert any("with --replay-mb it is stopped (SIGKILL) and started again" in line
               for line in launcher.err), launcher.output()
    for start in (2, 3):
        os.kill(pids[-1], signal.SIGKILL)
        pids = _started_again(launcher, start)
    assert MAX_REPLACEMENTS == 3 and len(pids) == 3
    os.kill(pids[-1], signal.SIGKILL)
    assert launcher.wait(30) == 1, launcher.output()
    message = "\n".join(launcher.err)
    assert "after 3 start(s) again in this attempt" in message, launcher.output()
    assert "exited with code -9 while the job was running; stopping the workers" in message
