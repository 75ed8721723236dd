"""Chaos: a 2-worker, 2-server Keras `fit` job (tests/chaos_worker.py, `BackupAndRestore`
every epoch of INTERVAL steps) under `parallax run --max-restarts 3` loses a parameter
server to SIGKILL mid-epoch, is restarted, then loses worker rank 1 to SIGKILL mid-epoch,
and is restarted again. It must exit 0 with the same final weights (the whole embedding
table, pulled from the servers, and the dense layer) as an uninterrupted run of the same
script, within 1e-6.

The kills are timed by the steps the workers print, and the victims are found among the
launcher's descendants (test_launch's LAUNCH_TEST_MARK). Measured and printed per failure
(run with -s to see it): the steps redone after the restart (the last step the killed
attempt printed minus the step the next one resumed at; at most one checkpoint interval),
the seconds from the kill to the restarted workers resuming, and to their first step.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from test_launch import Launcher, mark, marked_processes, wait_gone  # noqa: F401 (fixture)

WORKER = str(Path(__file__).parent / "chaos_worker.py")
INTERVAL, EPOCHS = 4, 8                  # a checkpoint every 4 steps; 32 steps in all
SERVER_KILL_STEP, WORKER_KILL_STEP = 6, 18  # both two steps into an epoch
STEP_DELAY = 0.3                         # seconds per step in the chaos run

pytestmark = pytest.mark.multiprocess


def _start(tmp: Path, name: str, mark: str, delay: float) -> Launcher:
    return Launcher("-np", "2", "--servers", "2", "--max-restarts", "3", "--restart-delay",
                    "0", "--", sys.executable, WORKER, "--interval", str(INTERVAL),
                    "--epochs", str(EPOCHS), "--step-delay", str(delay),
                    "--backup", str(tmp / name / "backup"), "--out", str(tmp / f"{name}.npz"),
                    mark=mark)


def _events(launcher: Launcher) -> list[dict]:
    return [json.loads(line[line.index('{"chaos"'):])
            for line in list(launcher.out) if '{"chaos"' in line]


def _wait_for(launcher: Launcher, what: str, match, timeout: float = 90.0) -> dict:
    """The first event `match` accepts, once the workers printed it."""
    deadline = time.monotonic() + timeout
    while True:
        found = next((e for e in _events(launcher) if match(e)), None)
        if found is not None:
            return found
        assert launcher.proc.poll() is None, f"job ended before {what}:\n{launcher.output()}"
        assert time.monotonic() < deadline, f"no {what} in {timeout}s:\n{launcher.output()}"
        time.sleep(0.02)


def _kill(pid: int) -> float:
    os.kill(pid, signal.SIGKILL)
    return time.time()


def _kill_a_server(launcher: Launcher, mark: str) -> float:
    _wait_for(launcher, f"step {SERVER_KILL_STEP}",
              lambda e: e["attempt"] == 0 and e["step"] >= SERVER_KILL_STEP)
    servers = sorted(pid for pid, cmd in marked_processes(mark).items() if "parallax_ps" in cmd)
    assert len(servers) == 2, marked_processes(mark)
    return _kill(servers[1])


def _kill_worker_1(launcher: Launcher, mark: str) -> float:
    start = _wait_for(launcher, "worker 1 restarted",
                      lambda e: e["chaos"] == "start" and e["attempt"] == 1 and e["rank"] == 1)
    _wait_for(launcher, f"step {WORKER_KILL_STEP}",
              lambda e: e["attempt"] == 1 and e["step"] >= WORKER_KILL_STEP)
    processes = marked_processes(mark)
    assert "chaos_worker.py" in processes.get(start["pid"], ""), (start, processes)
    return _kill(start["pid"])


def _run_to_end(launcher: Launcher, mark: str, timeout: float = 150.0) -> None:
    try:
        code = launcher.wait(timeout)
    finally:
        if launcher.proc.poll() is None:
            launcher.proc.kill()  # its servers and workers follow it (lifeline)
    assert code == 0, launcher.output()
    assert not wait_gone(mark), f"left behind: {marked_processes(mark)}"


def _failures(events: list[dict], kill_times: list[float]) -> list[dict]:
    """Per failure k: steps redone and seconds to recover, from attempt k's last step and
    attempt k+1's start and first step."""
    measured = []
    for attempt, killed_at in enumerate(kill_times):
        done = max(e["step"] for e in events if e["attempt"] == attempt)
        later = [e for e in events if e["attempt"] == attempt + 1]
        start = min(e["step"] for e in later if e["chaos"] == "start")
        measured.append({
            "last_step": done, "resumed_at": start, "steps_lost": done - start,
            "to_resume_s": max(e["time"] for e in later if e["chaos"] == "start") - killed_at,
            "to_first_step_s": min(e["time"] for e in later if e["chaos"] == "step")
            - killed_at})
    return measured


def _restart_causes(launcher: Launcher) -> list[str]:
    return [line for line in launcher.err if line.startswith("parallax run: restart ")]


@pytest.mark.timeout(900)  # two training runs, one with 2 restarts (251 s on a loaded machine)
def test_killed_server_then_killed_worker_end_with_the_uninterrupted_weights(tmp_path, mark):
    chaos = _start(tmp_path, "chaos", mark, STEP_DELAY)
    try:
        kill_times = [_kill_a_server(chaos, mark), _kill_worker_1(chaos, mark)]
    finally:
        _run_to_end(chaos, mark)
    causes = _restart_causes(chaos)
    assert len(causes) == 2, chaos.output()
    assert "parameter server" in causes[0] and "-9" in causes[0], causes
    assert "worker rank 1" in causes[1], causes

    full = _start(tmp_path, "full", mark, 0.0)
    _run_to_end(full, mark)
    assert not _restart_causes(full), full.output()

    events = _events(chaos)
    assert max(e["step"] for e in events if e["attempt"] == 2) == INTERVAL * EPOCHS
    failures = _failures(events, kill_times)
    for kind, failure in zip(["server killed", "worker killed"], failures):
        print(f"\nchaos: {kind}: {json.dumps(failure)}")
        assert failure["resumed_at"] % INTERVAL == 0, failure
        assert 0 <= failure["steps_lost"] <= INTERVAL, failure

    with np.load(tmp_path / "chaos.npz") as got, np.load(tmp_path / "full.npz") as want:
        assert sorted(got.files) == sorted(want.files)
        assert any(got[k].shape == (300, 4) for k in got.files), got.files  # the table
        for key in want.files:
            np.testing.assert_allclose(got[key], want[key], rtol=0, atol=1e-6, err_msg=key)
