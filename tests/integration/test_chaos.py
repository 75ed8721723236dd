"""Chaos: a 2-worker, 2-server Keras `fit` job (tests/helpers/chaos_worker.py, `BackupAndRestore`
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

import contextlib
import ctypes
import json
import os
import random
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from launching import MARK, Launcher, mark, marked_processes, wait_gone  # noqa: F401 (fixture)

WORKER = str(Path(__file__).resolve().parents[1] / "helpers" / "chaos_worker.py")
INTERVAL, EPOCHS = 4, 8                  # a checkpoint every 4 steps; 32 steps in all
SERVER_KILL_STEP, WORKER_KILL_STEP = 6, 18  # both two steps into an epoch
SAVE_KILL_STEP = 8                       # kills during the save at the end of step 8
STEP_DELAY = 0.3                         # seconds per step in the chaos run

pytestmark = pytest.mark.multiprocess


def _start(tmp: Path, name: str, mark: str, delay: float, *settings: str,
           paced: int = EPOCHS, launch: tuple[str, ...] = ()) -> Launcher:
    """The job under `parallax run --max-restarts 3` (and `launch`), its servers' data
    directory TMP/NAME/data, run id NAME; `settings`: more chaos_worker.py arguments; steps
    take `delay` s in the first `paced` attempts (those with kills), no longer after."""
    return Launcher("-np", "2", "--servers", "2", "--max-restarts", "3", "--restart-delay",
                    "0", *launch, "--data-dir", str(tmp / name / "data"), "--run-id", name, "--",
                    sys.executable, WORKER, "--interval", str(INTERVAL),
                    "--epochs", str(EPOCHS), "--step-delay", str(delay),
                    "--paced-attempts", str(paced),
                    "--backup", str(tmp / name / "backup"), "--out", str(tmp / f"{name}.npz"),
                    *settings, mark=mark)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The final weights (.npz) of an uninterrupted run with the given chaos_worker.py
    settings, run once per module and settings."""
    runs: dict[tuple, Path] = {}

    def weights(*settings: str) -> Path:
        if settings not in runs:
            tmp, mark = tmp_path_factory.mktemp("full"), uuid.uuid4().hex
            full = _start(tmp, "full", mark, 0.0, *settings)
            _run_to_end(full, mark)
            assert not _restart_causes(full), full.output()
            runs[settings] = tmp / "full.npz"
        return runs[settings]
    return weights


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
def test_killed_server_then_killed_worker_end_with_the_uninterrupted_weights(tmp_path, mark,
                                                                            uninterrupted):
    chaos = _start(tmp_path, "chaos", mark, STEP_DELAY, paced=2)
    try:
        kill_times = [_kill_a_server(chaos, mark), _kill_worker_1(chaos, mark)]
    finally:
        _run_to_end(chaos, mark)
    causes = _restart_causes(chaos)
    assert len(causes) == 2, chaos.output()
    assert "parameter server" in causes[0] and "-9" in causes[0], causes
    assert "worker rank 1" in causes[1], causes

    events = _events(chaos)
    assert max(e["step"] for e in events if e["attempt"] == 2) == INTERVAL * EPOCHS
    failures = _failures(events, kill_times)
    for kind, failure in zip(["server killed", "worker killed"], failures):
        print(f"\nchaos: {kind}: {json.dumps(failure)}")
        assert failure["resumed_at"] % INTERVAL == 0, failure
        assert 0 <= failure["steps_lost"] <= INTERVAL, failure

    _assert_same_weights(tmp_path / "chaos.npz", uninterrupted())


@pytest.mark.timeout(600)
def test_killed_servers_with_replicas_lose_no_step_and_their_copies_come_back(tmp_path, mark,
                                                                            uninterrupted):
    """`--replicas 2`: the job goes on through a server's SIGKILL with no step redone; at
    its next checkpoint the workers stop, as the launcher asks, and the job goes on from it
    on every server again, the lost one's copies restored (no --max-restarts used). So it
    also goes on through the death of the other server, which held the only copies of the
    first one's shards before that. It ends with the uninterrupted run's weights (which ran
    without copies). Printed: the longest pause between two steps after each kill, and the
    pause of each stop."""
    # paced: the two attempts with a kill (the third, after the second stop, runs at speed)
    chaos = _start(tmp_path, "copies", mark, STEP_DELAY, paced=2, launch=("--replicas", "2"))
    kills = []
    try:
        kills.append(_kill_a_server(chaos, mark))
        _wait_for(chaos, "the job going on after the stop", lambda e: e["attempt"] == 1
                  and e["chaos"] == "step" and e["step"] % INTERVAL == 2)
        kills.append(_kill(_server_pids(mark)[0]))  # the copies' server of the first kill
    finally:
        _run_to_end(chaos, mark)
    assert not _restart_causes(chaos), chaos.output()
    assert chaos.output().count("with --replicas 2 its shards go on on their copies") == 2
    assert chaos.output().count("the job goes on from it with every server again") == 2
    events = _events(chaos)
    assert {e["attempt"] for e in events} == {0, 1, 2}, events
    starts = dict(sorted({(e["attempt"], e["step"]) for e in events if e["chaos"] == "start"}))
    assert starts[0] == 0 and starts[1] in (8, 12), starts  # the next checkpoint (or the one
    assert starts[2] > starts[1] and starts[2] % INTERVAL == 0, starts  # after: the ask
    # comes while the workers fail over, in the same epoch or the next)
    for rank in (0, 1):
        steps = [e["step"] for e in events if e["chaos"] == "step" and e["rank"] == rank]
        assert steps == list(range(1, INTERVAL * EPOCHS + 1)), (rank, steps)  # none redone
    times = sorted(e["time"] for e in events if e["chaos"] == "step" and e["rank"] == 0)
    for n, killed_at in enumerate(kills):
        stop = min(e["time"] for e in events if e["chaos"] == "step" and e["rank"] == 0
                   and e["attempt"] == n + 1)
        after = [t for t in times if killed_at < t < stop]
        pause = max(b - a for a, b in zip([killed_at] + after, after))
        print(f"\nchaos: server killed with --replicas 2: longest pause after the kill "
              f"{pause:.2f}s (steps take {STEP_DELAY}s); the stop to start it again "
              f"{stop - after[-1]:.2f}s")
    _assert_same_weights(tmp_path / "copies.npz", uninterrupted())


@pytest.mark.timeout(600)
def test_killed_servers_started_again_are_rebuilt_from_the_workers_pushes(tmp_path, mark,
                                                                        uninterrupted):
    """`--replay-mb 64`: server 1 is SIGKILLed two steps after a checkpoint, and server 0
    as a later step that ends an epoch is seen, so during or right after the chief's
    backup; the launcher starts each again on its address from its newest complete
    checkpoint, and the workers send it their pushes since (`parallax.client.replay`; the
    other worker's watch does so while it waits for the chief in a collective). The job
    goes on in its one attempt, no step redone, no worker restarted, no copy of any shard
    kept, and ends with the uninterrupted run's weights. Printed: the second kill's step,
    and the pauses after each kill."""
    chaos = _start(tmp_path, "replayed", mark, STEP_DELAY, launch=("--replay-mb", "64"))
    second = random.Random().choice([s for s in range(SERVER_KILL_STEP + 4, INTERVAL * EPOCHS)
                                     if s % INTERVAL == 0])
    kills = []
    try:
        kills.append(_kill_a_server(chaos, mark))
        _wait_for(chaos, f"step {second}", lambda e: e["step"] >= second)
        kills.append(_kill(_server_pids(mark)[0]))  # server 0 (server 1's pid is newer now)
    finally:
        _run_to_end(chaos, mark)
    assert not _restart_causes(chaos), chaos.output()
    assert chaos.output().count("started again there (--replay-mb") == 2, chaos.output()
    events = _events(chaos)
    assert {e["attempt"] for e in events} == {0}, events
    for rank in (0, 1):
        steps = [e["step"] for e in events if e["chaos"] == "step" and e["rank"] == rank]
        assert steps == list(range(1, INTERVAL * EPOCHS + 1)), (rank, steps)  # none redone
    times = sorted(e["time"] for e in events if e["chaos"] == "step" and e["rank"] == 0)
    for what, killed_at in zip((f"at step {SERVER_KILL_STEP}", f"at step {second}"), kills):
        after = [t for t in times if t > killed_at]
        print(f"\nchaos: server killed {what} with --replay-mb: first step after the kill "
              f"{after[0] - killed_at:.2f}s, longest pause between steps after it "
              f"{max(b - a for a, b in zip([killed_at] + after, after)):.2f}s "
              f"(steps take {STEP_DELAY}s)")
    _assert_same_weights(tmp_path / "replayed.npz", uninterrupted())


@pytest.mark.timeout(600)
def test_a_worker_killed_during_a_servers_takeover_resumes_with_every_server(tmp_path, mark,
                                                                             uninterrupted):
    """`--replicas 2`: server 1 SIGKILLed at a random step, and worker rank 1 right after,
    while the workers fail over to the copies: the worker's death restarts the job (one of
    --max-restarts) from its last checkpoint on every server, started again, and it ends
    with the uninterrupted run's weights. Printed: the steps and the failure's cost."""
    step = random.Random().randint(SERVER_KILL_STEP - 1, SERVER_KILL_STEP + 1)
    chaos = _start(tmp_path, "takeover", mark, STEP_DELAY, paced=1,  # kills: attempt 0 only
                   launch=("--replicas", "2"))
    try:
        _wait_for(chaos, f"step {step}", lambda e: e["attempt"] == 0 and e["step"] >= step)
        _kill(_server_pids(mark)[1])
        killed_at = _kill(_start_of(chaos, 0, 1)["pid"])
    finally:
        _run_to_end(chaos, mark)
    causes = _restart_causes(chaos)
    assert len(causes) == 1 and "worker rank 1" in causes[0], chaos.output()
    failure, = _failures(_events(chaos), [killed_at])
    print(f"\nchaos: server then worker killed at step {step}, during the takeover: "
          f"{json.dumps(failure)}")
    assert failure["resumed_at"] % INTERVAL == 0 and 0 <= failure["steps_lost"] <= INTERVAL
    _assert_same_weights(tmp_path / "takeover.npz", uninterrupted())


@pytest.mark.timeout(600)
def test_a_killed_worker_with_a_backup_every_step_redoes_at_most_one(tmp_path, mark,
                                                                    uninterrupted):
    """`BackupAndRestore(save_freq=1)`: worker rank 1 SIGKILLed inside an epoch; the
    restarted workers resume mid-epoch, after the last step backed up, so at most one step
    is redone, and the weights are the uninterrupted run's. Printed: steps redone and the
    seconds from the kill to the first step again."""
    chaos = _start(tmp_path, "steps", mark, STEP_DELAY, "--save-freq", "1", paced=1)
    try:
        _wait_for(chaos, "step 10", lambda e: e["attempt"] == 0 and e["step"] >= 10)
        killed_at = _kill(_start_of(chaos, 0, 1)["pid"])
    finally:
        _run_to_end(chaos, mark)
    assert len(_restart_causes(chaos)) == 1, chaos.output()
    events = _events(chaos)
    failure, = _failures(events, [killed_at])
    print(f"\nchaos: worker killed, a backup every step: {json.dumps(failure)}")
    assert 0 <= failure["steps_lost"] <= 1, failure
    assert failure["resumed_at"] % INTERVAL, failure  # mid-epoch
    assert {e["step"] for e in events if e["chaos"] == "start" and e["attempt"] == 1} == \
        {failure["resumed_at"]}  # both workers, at the chief's batch
    _assert_same_weights(tmp_path / "steps.npz", uninterrupted())


HELD_FILE = "held.npz"  # (parallax.tf.state.held_backups.HELD_FILE, in each worker's backup)
HELD_EVERY = 3  # --held-backups: one backup in 3 on disk (each attempt's first, then every 3rd)


@pytest.mark.timeout(600)
def test_held_backups_through_a_killed_worker_and_a_killed_server(tmp_path, mark,
                                                                  uninterrupted):
    """`--held-backups 3` with a backup every step: worker rank 1 SIGKILLed at a random
    step resumes from the held backup (the servers kept the run's tables and roll them back),
    at most one step redone; then a server SIGKILLed: every server starts anew, the held
    marks are gone, and the job resumes from the newest backup on disk (at most 3 steps
    redone). The weights are the uninterrupted run's."""
    chaos = _start(tmp_path, "held", mark, STEP_DELAY, "--save-freq", "1", paced=2,
                   launch=("--held-backups", str(HELD_EVERY)))
    kill_step, kill_times = _a_worker_then_a_server_killed(chaos, mark)
    events = _events(chaos)
    failures = _failures(events, kill_times)
    print(f"\nchaos: held backups (kill at step {kill_step}): {json.dumps(failures)}")
    assert 0 <= failures[0]["steps_lost"] <= 1, failures
    assert 0 <= failures[1]["steps_lost"] <= HELD_EVERY, failures
    err = "\n".join(chaos.err)
    assert "the servers keep running with run held's tables" in err, chaos.output()
    if (failures[0]["resumed_at"] - 1) % HELD_EVERY:  # that step's backup was a held one
        assert "resuming from the held backup" in err, chaos.output()
    _assert_same_weights(tmp_path / "held.npz", uninterrupted())


def _a_worker_then_a_server_killed(chaos, mark: str) -> tuple[int, list[float]]:
    """SIGKILL worker rank 1 at a random step of the first attempt, then a server 5 steps
    into the second; run the job to its end. (The step chosen, the kills' times.)"""
    kill_step = random.randint(6, 14)
    try:
        _wait_for(chaos, f"step {kill_step}",
                  lambda e: e["attempt"] == 0 and e["step"] >= kill_step)
        kill_times = [_kill(_start_of(chaos, 0, 1)["pid"])]
        resumed = _start_of(chaos, 1, 0)["step"]
        _wait_for(chaos, f"step {resumed + 5}",
                  lambda e: e["attempt"] == 1 and e["step"] >= resumed + 5)
        kill_times.append(_kill(_server_pids(mark)[1]))
    finally:
        _run_to_end(chaos, mark)
    causes = _restart_causes(chaos)
    assert len(causes) == 2 and "worker rank 1" in causes[0] and "parameter server" in \
        causes[1], chaos.output()
    return kill_step, kill_times


@pytest.mark.timeout(900)  # two training runs
def test_held_checkpoints_of_a_custom_loop_through_a_killed_worker_and_a_killed_server(
        tmp_path, mark, uninterrupted):
    """The same with a custom loop (`tf.train.CheckpointManager`, max_to_keep=2, a save every
    step, `parallax.tf.state.held_checkpoints`): worker rank 1 SIGKILLed at a random step,
    every worker resumes from the chief's held checkpoint (at most one step redone); then a
    server, and the job resumes from the newest checkpoint on disk, which max_to_keep kept
    (at most 3 steps redone). The weights are the uninterrupted custom loop's."""
    chaos = _start(tmp_path, "loop", mark, STEP_DELAY, "--save-freq", "1", "--loop", "custom",
                   paced=2, launch=("--held-backups", str(HELD_EVERY)))
    kill_step, kill_times = _a_worker_then_a_server_killed(chaos, mark)
    failures = _failures(_events(chaos), kill_times)
    print(f"\nchaos: held checkpoints, custom loop (kill at step {kill_step}): "
          f"{json.dumps(failures)}")
    assert 0 <= failures[0]["steps_lost"] <= 1, failures
    assert 0 <= failures[1]["steps_lost"] <= HELD_EVERY, failures
    err = "\n".join(chaos.err)
    if (failures[0]["resumed_at"] - 1) % HELD_EVERY:  # that step's checkpoint was held
        assert "resuming from held checkpoint" in err, chaos.output()
    _assert_same_weights(tmp_path / "loop.npz", uninterrupted("--loop", "custom"))


@pytest.mark.timeout(600)
def test_held_backups_with_replicas_through_a_killed_server_then_a_killed_worker(
        tmp_path, mark, uninterrupted):
    """(helper-55's) `--replicas 2 --held-backups 3`, a backup every step: server 1
    SIGKILLed (the job goes on with the copies, then stops after a backup on disk for the
    server to come back: held marks die with the servers), then the chief (worker rank 0)
    in the next attempt, every worker's held.npz deleted (hosts without their backup
    directories): the chief resumes from the servers' copy of the held backup (a piece on
    each server, and on the other), at most one step redone, and rank 1 from the chief's
    position and variables. The uninterrupted run's weights."""
    chaos = _start(tmp_path, "repl", mark, STEP_DELAY, "--save-freq", "1", paced=3,
                   launch=("--replicas", "2", "--held-backups", str(HELD_EVERY)))
    try:
        _wait_for(chaos, "step 6", lambda e: e["attempt"] == 0 and e["step"] >= 6)
        _kill(_server_pids(mark)[1])
        start = _start_of(chaos, 1, 0)
        _wait_for(chaos, "attempt 1 steps",  # (its backups: disk, held, held, disk, ...; a
                  lambda e: e["attempt"] == 1 and e["rank"] == 0  # step printed: backed up)
                  and e["step"] >= start["step"] + 2)
        _kill(start["pid"])
        for rank in (0, 1):  # (rank 1, blocked without the chief, writes no newer one)
            (tmp_path / "repl" / "backup" / f"worker-{rank}" / HELD_FILE).unlink(
                missing_ok=True)
    finally:
        _run_to_end(chaos, mark)
    output = chaos.output()
    assert "resuming from the held backup" in output, output
    assert "(the servers' copy of held checkpoint ckpt-" in output, output
    events = _events(chaos)
    done = max(e["step"] for e in events if e["attempt"] == 1)
    resumed = min(e["step"] for e in events if e["attempt"] == 2 and e["chaos"] == "start")
    print(f"\nchaos: chief killed, every held.npz deleted: resumed at step {resumed} from "
          f"the servers' copy, {done - resumed} step(s) redone")
    assert 0 <= done - resumed <= 1, (done, resumed)
    _assert_same_weights(tmp_path / "repl.npz", uninterrupted())


@pytest.mark.timeout(600)
def test_held_backups_of_async_tables_go_on_disk(tmp_path, mark):
    """(helper-55's) `--async --held-backups 3`: the servers refuse to hold async tables,
    so every backup goes on disk, said once, and a killed worker resumes from it."""
    chaos = _start(tmp_path, "async", mark, STEP_DELAY, "--save-freq", "1", paced=1,
                   launch=("--async", "--held-backups", str(HELD_EVERY)))
    try:
        _wait_for(chaos, "step 9", lambda e: e["attempt"] == 0 and e["step"] >= 9)
        _kill(_start_of(chaos, 0, 1)["pid"])
    finally:
        _run_to_end(chaos, mark)
    assert len(_restart_causes(chaos)) == 1, chaos.output()
    assert chaos.output().count("every backup is saved on disk") == 2, chaos.output()


@pytest.mark.timeout(600)
def test_a_recreated_kubernetes_gang_resumes_from_the_servers_held_backup(tmp_path, mark,
                                                                          uninterrupted):
    """`parallax k8s --max-restarts 1 --held-backups 3`, a backup every step: both worker
    pods lost with their node at a random step, once the chief's held backup of it is whole
    (SIGKILL of every process of theirs, their backup directories gone with their disks),
    the servers kept. The recreated pods' first attempt keeps the run's tables, and the
    chief resumes from the servers' copy of the held backup (the dense part it sent them
    with each held save): at most one step redone, the uninterrupted run's weights. The
    kill comes right after a backup on disk (the 1st, 4th, 7th...), the hardest step: it
    is held too (until 2026-12-06 the chief dropped the held marks after a disk backup,
    and a node lost then restarted the job from the beginning); held ones alone are
    covered by the replicas test above."""
    from parallax.client.local_cluster import LocalCluster
    kill_step = random.choice((7, 10, 13))
    with LocalCluster(2, data_dir=tmp_path / "data") as cluster:
        first = _gang(tmp_path, cluster, mark, "node-a", paced=True)
        try:
            _wait_for(first, f"the chief's step {kill_step}",  # (after its backup)
                      lambda e: e["attempt"] == 0 and e["rank"] == 0 and e["step"] >= kill_step)
        finally:
            for pid in marked_processes(mark):  # the node is lost: every process of both pods
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            first.wait(30)
        killed_at = time.time()
        assert not wait_gone(mark), marked_processes(mark)
        shutil.rmtree(tmp_path / "node-a")  # the pods' disks
        second = _gang(tmp_path, cluster, mark, "node-b", paced=False)
        assert second.wait(150) == 0, second.output()
    events = [dict(e, attempt=1) for e in _events(second)] + _events(first)
    failure, = _failures(events, [killed_at])
    print(f"\nchaos: recreated gang (kill at step {kill_step}): {json.dumps(failure)}")
    assert 0 <= failure["steps_lost"] <= 1, (failure, second.output())
    out = second.output()
    assert "attempt 0: the servers keep run lost's tables" in out, out
    assert "the servers' copy of held checkpoint" in out, out
    _assert_same_weights(tmp_path / "lost.npz", uninterrupted())


class _Gang:
    """The two worker pods of a `parallax k8s` job (rendered, run on loopback against
    `cluster`): their output collected line by line, as `Launcher`'s."""

    def __init__(self, pods: list[subprocess.Popen]) -> None:
        self.pods, self.out, self.err, self._readers = [], [], [], []
        for pod in pods:
            self.add(pod)

    def add(self, pod: subprocess.Popen) -> None:
        """One more pod (an elastic Job scaled up)."""
        self.pods.append(pod)
        self._readers.append(threading.Thread(target=self._read, args=(pod.stdout,),
                                              daemon=True))
        self._readers[-1].start()

    def _read(self, stream) -> None:
        for line in stream:
            self.out.append(line.rstrip("\n"))

    @property
    def proc(self):  # (`_wait_for` asks whether the job still runs: pod 0's supervisor)
        return self.pods[0]

    def wait(self, timeout: float) -> int:
        codes = [p.wait(timeout) for p in self.pods]
        for reader in self._readers:
            reader.join(5)
        return max(codes)

    def output(self) -> str:
        return "\n".join(self.out)


def _gang(tmp: Path, cluster, mark: str, node: str, paced: bool) -> _Gang:
    """Worker pods 0 and 1 of job `lost` (2 workers, --max-restarts 1, --held-backups 3),
    their BackupAndRestore directories under TMP/NODE (the node's disk)."""
    from parallax.launch.k8s import K8sConfig
    command = (sys.executable, WORKER, "--interval", str(INTERVAL), "--epochs", str(EPOCHS),
               "--step-delay", str(STEP_DELAY if paced else 0.0), "--save-freq", "1",
               "--backup", str(tmp / node / "backup"), "--out", str(tmp / "lost.npz"))
    config = K8sConfig(name="lost", image="x", workers=2, servers=2, max_restarts=1,
                       held_backups=HELD_EVERY, command=command)
    pod = _pods(tmp, cluster, mark, config)
    return _Gang([pod(i) for i in (0, 1)])


def _pods(tmp: Path, cluster, mark: str, config, **extra: str):
    """A function starting the worker pod of an index of `config`'s rendered Job, on
    loopback against `cluster` (its environment as rendered, `extra` over it), as the Job
    controller would."""
    from parallax.env import ADDRESSES_ENV, RENDEZVOUS_ENV, TOKEN_FILE_ENV
    from parallax.launch.k8s import render
    (job,) = [o for o in render(config) if o["kind"] == "Job"]
    (container,) = job["spec"]["template"]["spec"]["containers"]
    (tmp / "token").write_text("the-jobs-token\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, **{e["name"]: e["value"] for e in container["env"]},
           ADDRESSES_ENV: ",".join(cluster.addresses), RENDEZVOUS_ENV: f"localhost:{port}",
           TOKEN_FILE_ENV: str(tmp / "token"), MARK: mark, **extra}
    argv = [str(Path(sys.executable).parent / "parallax"), *container["command"][1:]]

    def pod(index: int) -> subprocess.Popen:
        return subprocess.Popen(argv, env={**env, "JOB_COMPLETION_INDEX": str(index)},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return pod


NO_BACKUP = """
import os, sys
import keras, numpy as np, parallax
strategy = parallax.ParallaxStrategy()
with strategy.scope():
    inputs = keras.Input((2,), dtype="int64")
    out = keras.layers.Dense(1)(keras.layers.Flatten()(keras.layers.Embedding(50, 2)(inputs)))
    model = keras.Model(inputs, out)
    model.compile(keras.optimizers.Adagrad(0.1), loss="mse")
ids = np.arange(32, dtype="int64").reshape(16, 2) % 50
model.fit(ids, np.ones((16, 1), "float32"), batch_size=8, epochs=2, verbose=0)
sys.exit(3 if os.environ["PARALLAX_RESTART_COUNT"] == "0" else 0)
"""


@pytest.mark.timeout(300)
def test_held_backups_restart_a_job_without_backups_on_fresh_tables(tmp_path, mark):
    """--held-backups keeps the run's tables for the next attempt, but one that resumes from
    no held backup (here: none at all) drops them first and starts as on fresh servers
    (else: "already exists on the servers and has applied 4 steps")."""
    script = tmp_path / "no_backup.py"
    script.write_text(NO_BACKUP)
    job = Launcher("-np", "1", "--servers", "1", "--max-restarts", "1", "--restart-delay",
                   "0", "--held-backups", "2", "--", sys.executable, str(script), mark=mark)
    _run_to_end(job, mark, timeout=120)
    err = "\n".join(job.err)
    assert "the servers keep running with run" in err, job.output()
    assert "dropped 1 table(s) the attempt before left on the servers" in err, job.output()


@pytest.mark.timeout(600)
def test_an_elastic_job_goes_2_1_2_workers_at_a_fixed_global_batch(tmp_path, mark,
                                                                  uninterrupted):
    """`--host-discovery-script` with `--min-np 1`: rank 1's host leaves (it is SIGKILLed and
    the script lists one slot), the job restarts with 1 worker from its checkpoint; the host
    comes back, the launcher asks the worker to stop at its next checkpoint and the job
    goes on with 2 from it, redoing nothing. Each step consumed the same global batch
    throughout: the weights are the uninterrupted 2-worker run's."""
    hosts, script = tmp_path / "hosts", tmp_path / "discover.sh"
    hosts.write_text("localhost:2\n")
    script.write_text(f"#!/bin/sh\ncat {hosts}\n")
    script.chmod(0o755)
    chaos = _start(tmp_path, "elastic", mark, STEP_DELAY,
                   launch=("--min-np", "1", "--host-discovery-script", str(script)))
    try:
        _wait_for(chaos, f"step {SERVER_KILL_STEP}",
                  lambda e: e["attempt"] == 0 and e["step"] >= SERVER_KILL_STEP)
        hosts.write_text("localhost:1\n")
        killed_at = _kill(_start_of(chaos, 0, 1)["pid"])
        alone = _wait_for(chaos, "the restart with 1 worker",
                          lambda e: e["chaos"] == "start" and e["attempt"] == 1)
        _wait_for(chaos, "a step with 1 worker",
                  lambda e: e["attempt"] == 1 and e["step"] > alone["step"] + 1)
        hosts.write_text("localhost:2\n")
    finally:
        _run_to_end(chaos, mark)
    causes = _restart_causes(chaos)
    assert len(causes) == 1 and "worker rank 1" in causes[0], chaos.output()
    assert "stopped after their checkpoint, as asked; the job goes on with 2" in \
        chaos.output()
    events = _events(chaos)
    starts = {(e["attempt"], e["rank"]): e for e in events if e["chaos"] == "start"}
    assert sorted(starts) == [(0, 0), (0, 1), (1, 0), (2, 0), (2, 1)], sorted(starts)
    assert starts[1, 0]["workers"] == "SingleWorker", starts
    assert starts[2, 0]["workers"] == starts[0, 0]["workers"] != "SingleWorker", starts
    failure, = _failures(events, [killed_at])
    assert 0 <= failure["steps_lost"] <= INTERVAL, failure
    alone_done = max(e["step"] for e in events if e["attempt"] == 1)
    assert starts[2, 0]["step"] == starts[2, 1]["step"] == alone_done, (starts, alone_done)
    assert alone_done % INTERVAL == 0 and alone_done < INTERVAL * EPOCHS
    rescaled = min(e["time"] for e in events if e["attempt"] == 2 and e["chaos"] == "step")
    print(f"\nchaos: elastic 2 -> 1 -> 2: worker killed: {json.dumps(failure)}; "
          f"stopped for 2 workers at step {alone_done} (none redone), first step again "
          f"{rescaled - max(e['time'] for e in events if e['attempt'] == 1):.1f}s later")
    _assert_same_weights(tmp_path / "elastic.npz", uninterrupted())


@pytest.mark.timeout(600)
def test_an_elastic_kubernetes_job_goes_1_2_1_workers_at_a_fixed_global_batch(tmp_path, mark,
                                                                              uninterrupted):
    """`parallax k8s -np 1 --min-np 1 --max-np 2` (no --max-restarts), its pods run on loopback:
    pod 0 trains alone; the pod of index 1 starts mid-run (the Job scaled up to 2), and the
    gang stops at the next checkpoint and goes on with 2; then pod 1 gets SIGTERM (scaled
    down to 1), tells worker 0, and the gang stops at the next checkpoint again and goes on
    with pod 0. Each change redoes no step, uses no restart, and the job ends with 0 and
    the uninterrupted 2-worker run's weights (each step consumed the same global batch)."""
    from parallax.client.local_cluster import LocalCluster
    from parallax.launch.k8s import K8sConfig
    command = (sys.executable, WORKER, "--interval", str(INTERVAL), "--epochs", str(EPOCHS),
               "--step-delay", str(STEP_DELAY), "--paced-attempts", "2",  # (the last: fast)
               "--backup", str(tmp_path / "backup"), "--out", str(tmp_path / "ela.npz"))
    config = K8sConfig(name="ela", image="x", workers=1, min_workers=1, max_workers=2,
                       servers=2, command=command)
    with LocalCluster(2, data_dir=tmp_path / "data") as cluster:
        pod = _pods(tmp_path, cluster, mark, config, HOROVOD_GLOO_IFACE="lo")
        job = _Gang([pod(0)])
        try:
            _wait_for(job, "a step of pod 0 alone", lambda e: e["chaos"] == "step")
            job.add(pod(1))  # kubectl patch job ela-worker: completions = parallelism = 2
            two = _wait_for(job, "the attempt with 2 workers",
                            lambda e: e["chaos"] == "start" and e["rank"] == 1)
            _wait_for(job, "a step of 2 workers", lambda e: e["attempt"] == two["attempt"]
                      and e["chaos"] == "step" and e["step"] > two["step"] + 1)
            job.pods[1].send_signal(signal.SIGTERM)  # scaled down to 1: the pod is deleted
            assert job.wait(150) == 0, job.output()
        finally:
            for proc in job.pods:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
    events, out = _events(job), job.output()
    starts = {(e["attempt"], e["rank"]): e for e in events if e["chaos"] == "start"}
    assert sorted(starts) == [(0, 0), (1, 0), (1, 1), (2, 0)], (sorted(starts), out)
    assert starts[0, 0]["workers"] == starts[2, 0]["workers"] == "SingleWorker", starts
    assert starts[1, 0]["workers"] != "SingleWorker", starts
    pauses = []
    for attempt in (1, 2):
        done = max(e["step"] for e in events if e["attempt"] == attempt - 1)
        assert starts[attempt, 0]["step"] == done and done % INTERVAL == 0, (starts, done)
        first = min(e["time"] for e in events if e["attempt"] == attempt and e["chaos"] == "step")
        pauses.append(first - max(e["time"] for e in events if e["attempt"] == attempt - 1))
    assert starts[1, 1]["step"] == starts[1, 0]["step"], starts
    assert out.count("using none of the restarts") == 2, out
    assert "worker 1's pod is leaving" in out, out
    print(f"\nchaos: elastic Kubernetes job 1 -> 2 -> 1 workers: stopped at steps "
          f"{starts[1, 0]['step']} and {starts[2, 0]['step']} (none redone), first step "
          f"again {pauses[0]:.1f}s and {pauses[1]:.1f}s later")
    _assert_same_weights(tmp_path / "ela.npz", uninterrupted())


def _assert_same_weights(chaos: Path, full: Path) -> None:
    """The whole table and the dense layer of both runs, within 1e-6."""
    with np.load(chaos) as got, np.load(full) as want:
        assert sorted(got.files) == sorted(want.files)
        assert any(got[k].shape == (300, 4) for k in got.files), got.files  # the table
        for key in want.files:
            np.testing.assert_allclose(got[key], want[key], rtol=0, atol=1e-6, err_msg=key)


class Created:
    """inotify (Linux): the names created in, or moved into, one directory, as they come, so
    that a kill can follow a file system event within a scheduling delay, not a poll's."""

    IN_CREATE, IN_MOVED_TO = 0x100, 0x80

    def __init__(self, directory: Path) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self._libc.inotify_init1(os.O_CLOEXEC)
        assert self.fd >= 0, os.strerror(ctypes.get_errno())
        added = self._libc.inotify_add_watch(self.fd, os.fsencode(directory),
                                             self.IN_CREATE | self.IN_MOVED_TO)
        assert added >= 0, (directory, os.strerror(ctypes.get_errno()))
        self._names: list[str] = []

    def __enter__(self) -> "Created":
        return self

    def __exit__(self, *exc) -> None:
        os.close(self.fd)

    def next(self, prefix: str, timeout: float) -> str:
        """The next name that starts with `prefix`."""
        deadline = time.monotonic() + timeout
        while not any(n.startswith(prefix) for n in self._names):
            left = deadline - time.monotonic()
            assert left > 0 and select.select([self.fd], [], [], left)[0], \
                f"nothing named {prefix}* created in {timeout}s"
            self._names += _event_names(os.read(self.fd, 65536))
        found = next(n for n in self._names if n.startswith(prefix))
        self._names = self._names[self._names.index(found) + 1:]
        return found


def _event_names(data: bytes) -> list[str]:
    """The names in a read of inotify events (struct inotify_event: wd, mask, cookie, len,
    then len bytes of NUL-padded name)."""
    names, offset = [], 0
    while offset < len(data):
        _, _, _, size = struct.unpack_from("iIII", data, offset)
        offset += 16
        names.append(data[offset:offset + size].rstrip(b"\0").decode())
        offset += size
    return names


def _kill_mid_save(launcher: Launcher, root: Path, attempt: int, victim) -> str:
    """SIGKILL process `victim()` the moment the servers' next checkpoint of `root` (their
    resume/<run id> directory) gets its staging directory, the first thing a save writes,
    once `attempt` printed step SAVE_KILL_STEP - 2; the checkpoint's name."""
    _wait_for(launcher, f"step {SAVE_KILL_STEP - 2} of attempt {attempt}",
              lambda e: e["attempt"] == attempt and e["step"] >= SAVE_KILL_STEP - 2)
    pid = victim()
    with Created(root) as created:
        staging = created.next(".staging-", timeout=60)
        _kill(pid)
    return staging[len(".staging-"):]


def _wait_for_restart(launcher: Launcher, count: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while len(_restart_causes(launcher)) < count:
        assert time.monotonic() < deadline, f"no restart {count}:\n{launcher.output()}"
        time.sleep(0.02)


def _start_of(launcher: Launcher, attempt: int, rank: int) -> dict:
    return _wait_for(launcher, f"worker {rank} of attempt {attempt} started",
                     lambda e: e["chaos"] == "start" and e["attempt"] == attempt
                     and e["rank"] == rank)


def _server_pids(mark: str) -> list[int]:
    servers = sorted(pid for pid, cmd in marked_processes(mark).items() if "parallax_ps" in cmd)
    assert len(servers) == 2, marked_processes(mark)
    return servers


def _assert_not_completed(launcher: Launcher, root: Path, checkpoint: str,
                          restarts: int) -> None:
    """Once the launcher restarts the job, the checkpoint whose save was killed is not
    complete (not restorable): the kill landed inside the save."""
    _wait_for_restart(launcher, restarts)
    assert not (root / checkpoint / "COMPLETE").exists(), (checkpoint, sorted(os.listdir(root)))


def _resumed_together(launcher: Launcher, attempt: int) -> dict[int, dict]:
    """{rank: its start event} in `attempt`; both ranks resumed at the epoch before the
    killed save (each has a backup of its own: they must agree)."""
    starts = {rank: _start_of(launcher, attempt, rank) for rank in (0, 1)}
    resumed = {rank: e["step"] for rank, e in starts.items()}
    before = SAVE_KILL_STEP - INTERVAL
    assert resumed == {0: before, 1: before}, f"attempt {attempt} resumed at steps {resumed}"
    return starts


@pytest.mark.timeout(600)
def test_kills_mid_save_and_twice_in_a_row_end_with_the_uninterrupted_weights(
        tmp_path, mark, uninterrupted):
    """Three failures, the last two back to back: (1) a server SIGKILLed while the
    checkpoint of epoch SAVE_KILL_STEP / INTERVAL is being saved (its staging directory was
    just created), (2) after the restart, worker 0 (the chief, which has the servers save
    and writes its Keras backup meanwhile) SIGKILLed the same way, (3) worker 1 SIGKILLed as
    the next attempt starts, before its first step. Each save must count as not made: the
    checkpoint is never marked complete, the chief's temporary backup file is left behind
    beside an intact backup, and every rank resumes at the epoch before (a whole interval
    lost). The job must exit 0 with the uninterrupted run's weights, on Horovod."""
    chaos = _start(tmp_path, "chaos", mark, STEP_DELAY, paced=2)
    root = tmp_path / "chaos" / "data" / "resume" / "chaos"
    try:
        saves = [_kill_mid_save(chaos, root, 0, lambda: _server_pids(mark)[1])]
        _assert_not_completed(chaos, root, saves[0], restarts=1)
        chief = _resumed_together(chaos, 1)[0]["pid"]
        saves.append(_kill_mid_save(chaos, root, 1, lambda: chief))
        _assert_not_completed(chaos, root, saves[1], restarts=2)
        backup = tmp_path / "chaos" / "backup" / "worker-0"
        assert (backup / f".latest.parallax-{chief}.weights.h5").exists(), \
            sorted(os.listdir(backup))  # the chief died writing its backup
        _kill(_resumed_together(chaos, 2)[1]["pid"])
        _resumed_together(chaos, 3)
    finally:
        _run_to_end(chaos, mark)
    causes = _restart_causes(chaos)
    assert len(causes) == 3, chaos.output()
    assert "parameter server" in causes[0] and "-9" in causes[0], causes
    assert "worker rank 0" in causes[1] and "worker rank 1" in causes[2], causes

    events = _events(chaos)
    assert {e["workers"] for e in events if e["chaos"] == "start"} == {"HorovodWorkers"}
    assert not [e for e in events if e["attempt"] == 2 and e["chaos"] == "step"], events
    assert max(e["step"] for e in events if e["attempt"] == 3) == INTERVAL * EPOCHS
    print(f"\nchaos: saves killed: {saves}; every restart resumed at step "
          f"{SAVE_KILL_STEP - INTERVAL}")
    _assert_same_weights(tmp_path / "chaos.npz", uninterrupted())


CACHE_AND_WIRE = ("--cache-staleness", "2", "--wire-dtype", "bfloat16")


@pytest.mark.timeout(600)
def test_row_cache_and_bfloat16_wire_through_a_kill_end_with_their_uninterrupted_weights(
        tmp_path, mark, uninterrupted):
    """The worker row cache (rows served up to 2 steps stale) and bfloat16 rows on the wire,
    through a server SIGKILLed mid-epoch and the restart: the same weights as an
    uninterrupted run with the same settings, within 1e-6. Both runs must have served rows
    from the cache and sent bfloat16; a save empties the cache, as the restart does."""
    full = uninterrupted(*CACHE_AND_WIRE)
    chaos = _start(tmp_path, "chaos", mark, STEP_DELAY, *CACHE_AND_WIRE, paced=1)
    try:
        killed_at = _kill_a_server(chaos, mark)
    finally:
        _run_to_end(chaos, mark)
    causes = _restart_causes(chaos)
    assert len(causes) == 1 and "parameter server" in causes[0], chaos.output()
    events = _events(chaos)
    ends = [e for e in events if e["chaos"] == "end"]
    assert len(ends) == 2 and all(e["attempt"] == 1 for e in ends), ends
    assert all(e["cache_hits"] > 0 and e["wire"] == ["bfloat16"] for e in ends), ends
    [failure] = _failures(events, [killed_at])
    print(f"\nchaos: server killed, row cache and bfloat16 wire: {json.dumps(failure)}")
    assert failure["resumed_at"] == SERVER_KILL_STEP - SERVER_KILL_STEP % INTERVAL, failure
    _assert_same_weights(tmp_path / "chaos.npz", full)
