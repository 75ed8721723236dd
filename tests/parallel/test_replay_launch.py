"""`parallax run --replay-mb`: a server SIGKILLed mid-job is started again on its address
with --restore-newest, the job goes on, and the table's shard there starts from its
checkpoint (tests/helpers/replay_worker.py; the workers' replay of their pushes since is
parallax.client.replay's, tested with it)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from launching import Launcher, port_closed
from launching import mark  # noqa: F401 (a fixture)

WORKER = str(Path(__file__).resolve().parents[1] / "helpers" / "replay_worker.py")


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
