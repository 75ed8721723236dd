"""Elastic `parallax run` (--host-discovery-script, --min-np, --max-np, --elastic-timeout):
real launchers, servers and workers. The discovery script is a shell script printing a file
the test rewrites; the workers are tests/helpers/launch_probe.py, whose --checkpoint-every
answers the launcher's request for another worker count as parallax.tf.state.rescale does
(rank 0 notes the stop at a "checkpoint", every rank exits 75). TensorFlow's collectives
(`--collectives tensorflow`: the supervisor, no Horovod start-up) keep each job to seconds.

Every launcher runs with a LAUNCH_TEST_MARK; after each test no process may carry it (the
orphan check, tests/helpers/launching.py), the discovery script's children included.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from launching import PROBE, Launcher, marked_processes
from launching import mark  # noqa: F401 (a fixture)

RESCALE_WORKER = str(Path(__file__).resolve().parents[1] / "helpers" / "rescale_worker.py")


class Hosts:
    """A discovery script that prints `hosts` (and, while `fail` exists, prints it to
    stderr and exits 3; while `hang` exists, sleeps first); `then` queues the hosts listed
    after the next run, which leaves no time between two changes to a test's timing."""

    def __init__(self, tmp_path: Path, text: str) -> None:
        tmp_path.mkdir(exist_ok=True)
        self.file, self.fail, self.hang, self.next = (
            tmp_path / n for n in ("hosts", "fail", "hang", "next"))
        self.script = tmp_path / "discover.sh"
        self.script.write_text(f"#!/bin/sh\n"
                               f"if [ -e {self.hang} ]; then sleep 120; fi\n"
                               f"if [ -e {self.fail} ]; then cat {self.fail} >&2; exit 3; fi\n"
                               f"cat {self.file}\n"
                               f"if [ -e {self.next} ]; then mv {self.next} {self.file}; fi\n")
        self.script.chmod(0o755)
        self.set(text)

    def set(self, text: str) -> None:
        """The hosts listed from now on (whole: the script never reads half of it)."""
        partial = self.file.with_name("hosts.partial")
        partial.write_text(text)
        os.replace(partial, self.file)

    def then(self, now: str, after: str) -> None:
        """List `now` once, then `after`."""
        self.next.write_text(after)
        self.set(now)


def elastic(hosts: Hosts, *args: str, mark: str) -> Launcher:
    return Launcher("--servers", "1", "--collectives", "tensorflow",
                    "--host-discovery-script", str(hosts.script), *args, mark=mark)


def rescalable(hosts: Hosts, sleep: str, *more: str, mark: str) -> Launcher:
    """Probes (-np 2 --min-np 1) that sleep `sleep` s, answering the launcher's requests
    at checkpoints 0.3 s apart."""
    return elastic(hosts, "-np", "2", "--min-np", "1", "--", "python", PROBE, "--sleep", sleep,
                   "--checkpoint-every", "0.3", *more, mark=mark)


def wait_for_line(launcher: Launcher, text: str, timeout: float = 30.0) -> str:
    """The first line of the launcher's stderr with `text`, once it came."""
    deadline = time.monotonic() + timeout
    while not (found := [line for line in launcher.err if text in line]):
        assert time.monotonic() < deadline, f"no {text!r} in {timeout}s:\n{launcher.output()}"
        time.sleep(0.05)
    return found[0]


def said(launcher: Launcher, text: str) -> int:
    return sum(text in line for line in launcher.err)


def starts(launcher: Launcher) -> list[str]:
    """The launcher's line at the start of each attempt."""
    return [line for line in launcher.err if " worker(s); 1 parameter server(s)" in line]


@pytest.mark.multiprocess
def test_the_scripts_slots_capped_by_max_np_decide_the_worker_count(tmp_path, mark):
    hosts = Hosts(tmp_path, "# this machine\nlocalhost:3\n")
    three = elastic(hosts, "-np", "2", "--min-np", "1", PROBE, mark=mark)
    assert three.wait() == 0, three.output()
    assert sorted((p["rank"], p["size"]) for p in three.probes()) == [(0, 2), (1, 2)]
    assert {p["asked"] for p in three.probes()} == {None}  # nothing asked at the start
    assert "parallax run: --host-discovery-script without --data-dir: the servers keep " \
        "their checkpoints in" in three.output(), three.output()  # said --max-restarts
    hosts.set("localhost\n")  # one slot
    one = elastic(hosts, "--max-np", "2", "--min-np", "1", PROBE, mark=mark)
    assert one.wait() == 0, one.output()
    assert [(p["rank"], p["size"]) for p in one.probes()] == [(0, 1)], one.output()
    assert starts(one)[0].startswith("parallax run: 1 worker(s)"), one.output()


@pytest.mark.multiprocess
def test_below_min_np_the_launcher_waits_says_so_once_and_fails_naming_the_flags(tmp_path,
                                                                                 mark):
    short = elastic(Hosts(tmp_path / "short", "localhost:1\n"), "-np", "2",
                    "--elastic-timeout", "2.5", PROBE, mark=mark)
    later_hosts = Hosts(tmp_path / "later", "")
    later = elastic(later_hosts, "-np", "2", "--elastic-timeout", "60", PROBE, mark=mark)
    wait_for_line(later, "waiting up to 60s for --min-np 2 slots; the host discovery script "
                         "lists 0 slot(s)")
    time.sleep(2.5)  # discovered again meanwhile, without a word
    later_hosts.set("localhost:2\n")
    assert later.wait() == 0, later.output()
    assert sorted(p["rank"] for p in later.probes()) == [0, 1], later.output()
    assert said(later, "waiting up to") == 1, later.output()
    assert short.wait() == 1, short.output()
    assert said(short, "waiting up to 2.5s for --min-np 2 slots; the host discovery script "
                       "lists 1 slot(s)") == 1, short.output()
    assert short.err[-1] == ("parallax run: error: --host-discovery-script listed 1 slot(s) "
                             "for 2.5s (--elastic-timeout); --min-np 2 needs 2"), short.output()
    assert not short.probes() and not starts(short), short.output()  # no server started


@pytest.mark.multiprocess
def test_a_failing_script_and_bad_lines_are_said_once_and_change_nothing(tmp_path, mark):
    hosts = Hosts(tmp_path, "localhost:two\n")
    launcher = elastic(hosts, "-np", "1", "--", "python", PROBE, "--sleep", "4",
                       "--checkpoint-every", "0.5", mark=mark)
    wait_for_line(launcher, "'localhost:two' should be `host:N` (N >= 1 slots) or `host`")
    (tmp_path / "fail").write_text("no inventory yet\n")
    wait_for_line(launcher, "exited with code 3: no inventory yet")
    time.sleep(2.5)
    (tmp_path / "fail").unlink()
    hosts.set("localhost:1\n")
    launcher.wait_for_probes(1)
    (tmp_path / "fail").write_text("inventory down\n")  # while the job runs
    assert launcher.wait() == 0, launcher.output()
    assert said(launcher, "should be `host:N`") == 1, launcher.output()
    assert said(launcher, "exited with code 3: no inventory yet") == 1, launcher.output()
    assert said(launcher, "exited with code 3: inventory down") == 1, launcher.output()
    assert said(launcher, "waiting up to") == 1, launcher.output()
    assert len(starts(launcher)) == 1 and len(launcher.probes()) == 1, launcher.output()


@pytest.mark.multiprocess
def test_a_host_that_is_not_this_machine_is_refused(tmp_path, mark):
    launcher = elastic(Hosts(tmp_path, "localhost:1\n192.0.2.7:2\n"), "-np", "2", PROBE,
                       mark=mark)
    assert launcher.wait() == 2, launcher.output()
    assert "lists 192.0.2.7: an elastic job's workers run on this machine for now" in \
        launcher.err[-1] and "(localhost:N)" in launcher.err[-1], launcher.output()
    assert not starts(launcher), launcher.output()


@pytest.mark.multiprocess
def test_a_failed_worker_restarts_with_the_count_the_script_lists_then(tmp_path, mark):
    hosts = Hosts(tmp_path, "localhost:2\n")
    launcher = elastic(hosts, "-np", "2", "--min-np", "1", "--max-restarts", "1",
                       "--restart-delay", "2", "--", "python", PROBE, "--exit", "3",
                       "--until-restart", "1", mark=mark)
    wait_for_line(launcher, "restart 1 of 1 in 2s, after: worker rank")
    hosts.set("localhost:1\n")  # during the restart delay
    assert launcher.wait() == 0, launcher.output()
    assert [line.split(";")[0] for line in starts(launcher)] == [
        "parallax run: 2 worker(s)", "parallax run: 1 worker(s)"], launcher.output()
    assert [(p["rank"], p["size"]) for p in launcher.probes() if p["restart"] == 1] == \
        [(0, 1)], launcher.output()
    assert said(launcher, "restart 1 of 1 in 2s, after: worker rank") == 1, launcher.output()


@pytest.mark.multiprocess
def test_a_rescale_goes_1_2_1_workers_using_no_restart_and_a_fresh_request_file(tmp_path,
                                                                               mark):
    """No --max-restarts: each rescale is a new attempt all the same, whose workers find no
    request left from the last one."""
    hosts = Hosts(tmp_path, "localhost:1\n")
    launcher = rescalable(hosts, "30", "--until-restart", "2", mark=mark)
    launcher.wait_for_probes(1)
    hosts.set("localhost:2\n")
    launcher.wait_for_probes(3)
    hosts.set("localhost:1\n")
    assert launcher.wait() == 0, launcher.output()
    probes = sorted((p["restart"], p["rank"], p["size"], p["asked"]) for p in launcher.probes())
    assert probes == [(0, 0, 1, None), (1, 0, 2, None), (1, 1, 2, None), (2, 0, 1, None)], \
        launcher.output()
    assert [line.split(";")[0] for line in starts(launcher)] == [
        "parallax run: 1 worker(s)", "parallax run: 2 worker(s)", "parallax run: 1 worker(s)"]
    assert said(launcher, "asking the 1 worker(s) to stop at their next checkpoint, to go on "
                          "with 2") == 1, launcher.output()
    assert said(launcher, "stopped after their checkpoint, as asked; the job goes on with "
                          "1") == 1, launcher.output()
    assert not said(launcher, "restart 1 of"), launcher.output()
    assert not said(launcher, "exited with code 75"), launcher.output()  # not a failure


def script_runs(mark: str, what: str = "sleep 120", timeout: float = 30.0) -> None:
    """Wait until a process of the launcher's runs `what` (the discovery script hangs)."""
    deadline = time.monotonic() + timeout
    while not any(what in line for line in marked_processes(mark).values()):
        assert time.monotonic() < deadline, f"no {what!r} in {timeout}s"
        time.sleep(0.05)


def temporary_dirs(tmp: Path) -> list[str]:
    return sorted(p.name for p in tmp.iterdir())


@pytest.mark.multiprocess
def test_servers_that_fail_to_start_are_the_error_said(tmp_path, mark):
    """The attempt's discovery watch had not started yet: stopping it raised RuntimeError
    (a traceback instead of the error, and the servers left to the lifeline)."""
    launcher = elastic(Hosts(tmp_path, "localhost:1\n"), "-np", "1",
                       "--server-start-timeout", "0.01", PROBE, mark=mark)
    assert launcher.wait() == 1, launcher.output()
    assert "Traceback" not in launcher.output(), launcher.output()
    assert any("error: parameter server 0 did not start within" in line
               for line in launcher.err), launcher.output()


@pytest.mark.multiprocess
def test_sigint_while_the_script_hangs_ends_it_and_leaves_nothing(tmp_path, mark,
                                                                  monkeypatch):
    """The shell was killed, not what it ran: that outlived the launcher."""
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    hosts = Hosts(tmp_path, "localhost:1\n")
    hosts.hang.touch()
    launcher = elastic(hosts, "-np", "1", PROBE, mark=mark)
    script_runs(mark)
    launcher.proc.send_signal(signal.SIGINT)
    assert launcher.wait(timeout=10) == 130, launcher.output()
    assert launcher.err[-1] == "parallax run: got SIGINT: stopped before the job started"
    assert temporary_dirs(tmp_path / "tmp") == [], launcher.output()


@pytest.mark.multiprocess
def test_a_script_hanging_while_the_job_runs_neither_delays_its_end_nor_outlives_it(
        tmp_path, mark):
    """The launcher waited for the script's timeout (30 s) at the job's end, then left
    what the shell ran behind."""
    hosts = Hosts(tmp_path, "localhost:1\n")
    launcher = elastic(hosts, "-np", "1", "--", "python", PROBE, "--sleep", "2", mark=mark)
    launcher.wait_for_probes(1)
    hosts.hang.touch()
    script_runs(mark)
    hung = time.monotonic()
    assert launcher.wait(timeout=60) == 0, launcher.output()
    assert time.monotonic() - hung < 10, launcher.output()
    assert not said(launcher, f"--host-discovery-script '{hosts.script}'"), \
        launcher.output()  # no failure said


@pytest.mark.multiprocess
def test_a_signal_while_waiting_for_slots_after_a_rescale_ends_the_launcher(tmp_path, mark,
                                                                            monkeypatch):
    """After a rescale the launcher still forwarded signals to the last attempt's job, gone:
    SIGTERM during the wait for --min-np slots was lost (and --elastic-timeout is 600 s)."""
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    hosts = Hosts(tmp_path, "localhost:2\n")
    launcher = elastic(hosts, "-np", "3", "--min-np", "2", "--", "python", PROBE, "--sleep",
                       "30", "--checkpoint-every", "0.5", mark=mark)
    launcher.wait_for_probes(2)
    hosts.then("localhost:3\n", "localhost:1\n")  # a rescale to 3 asked, then one slot
    wait_for_line(launcher, "stopped after their checkpoint, as asked")
    wait_for_line(launcher, "waiting up to 600s for --min-np 2 slots; the host discovery "
                            "script lists 1 slot(s)")
    launcher.proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    assert launcher.wait(timeout=20) == 143, launcher.output()
    assert time.monotonic() - signalled < 5, launcher.output()
    assert temporary_dirs(tmp_path / "tmp") == [], launcher.output()


@pytest.mark.multiprocess
def test_hosts_back_before_the_next_checkpoint_withdraw_the_request(tmp_path, mark):
    """2 -> 1 -> 2 slots within a checkpoint interval: the request for 1 stayed, and the
    workers stopped at their checkpoint to go on with the 2 they were."""
    hosts = Hosts(tmp_path, "localhost:2\n")
    launcher = elastic(hosts, "-np", "2", "--min-np", "1", "--", "python", PROBE, "--sleep",
                       "7", "--checkpoint-every", "5", "--until-restart", "1", mark=mark)
    launcher.wait_for_probes(2)
    hosts.then("localhost:1\n", "localhost:2\n")
    assert launcher.wait() == 0, launcher.output()
    assert said(launcher, "to go on with 1") == 1, launcher.output()
    assert said(launcher, "lists 2 slot(s) again: the 2 worker(s) go on; the request to "
                          "stop is withdrawn") == 1, launcher.output()
    assert len(starts(launcher)) == 1, launcher.output()
    assert not said(launcher, "stopped after their checkpoint"), launcher.output()


@pytest.mark.multiprocess
def test_a_lost_servers_request_outlives_a_count_asked_and_withdrawn(tmp_path, mark):
    """--replicas 2: a server killed, so the launcher asks the workers to stop at their next
    checkpoint to start it again; then 2 -> 1 -> 2 slots before it. The request for 1 and
    its withdrawal share the file: the withdrawal deleted the server's request too, and the
    job ran to its end on one copy of the lost server's shards (the launcher had said it
    asked). It must stop there and go on with every server again."""
    hosts = Hosts(tmp_path, "localhost:2\n")
    launcher = Launcher("--servers", "2", "--replicas", "2", "--collectives", "tensorflow",
                        "--host-discovery-script", str(hosts.script), "-np", "2",
                        "--min-np", "1", "--", "python", PROBE, "--sleep", "14",
                        "--checkpoint-every", "9", "--until-restart", "1", mark=mark)
    launcher.wait_for_probes(2)
    os.kill(max(pid for pid, cmd in marked_processes(mark).items() if "parallax_ps" in cmd),
            signal.SIGKILL)
    wait_for_line(launcher, "asking the 2 worker(s) to stop at their next checkpoint")
    hosts.then("localhost:1\n", "localhost:2\n")
    wait_for_line(launcher, "lists 2 slot(s) again")
    assert launcher.wait() == 0, launcher.output()
    assert said(launcher, "stopped after their checkpoint, as asked; the job goes on from it "
                          "with every server again") == 1, launcher.output()
    assert said(launcher, " worker(s); 2 parameter server(s)") == 2, launcher.output()


@pytest.mark.multiprocess
def test_a_script_past_its_timeout_is_ended_whole_and_said_once(tmp_path, mark, monkeypatch):
    """Its timeout (DISCOVERY_TIMEOUT_S, 30 s: shortened here) killed the shell, not what
    it ran."""
    from launching import MARK
    from parallax.launch import elastic as elastic_module
    monkeypatch.setenv(MARK, mark)  # the script's processes carry the mark: the orphan check
    monkeypatch.setattr(elastic_module, "DISCOVERY_TIMEOUT_S", 0.5)
    hosts = Hosts(tmp_path, "localhost:1\n")
    hosts.hang.touch()
    messages: list[str] = []
    discovery = elastic_module.Elastic(str(hosts.script), 1, 1, say=messages.append)
    assert discovery.discover() is None and discovery.discover() is None
    assert len(messages) == 1 and "timed out after 0.5 seconds" in messages[0], messages
    hosts.hang.unlink()
    assert discovery.discover().num_slots == 1


@pytest.mark.horovod
@pytest.mark.multiprocess
def test_a_chief_slow_to_note_its_stop_still_rescales(tmp_path, mark):
    """A custom loop's rescale point (tests/helpers/rescale_worker.py), 2 -> 1 workers under
    horovodrun. Rank 1 left as soon as the chief's broadcast said stop, and its exit (75)
    ended the job (horovodrun stops the other workers) before the chief noted the stop: a
    failure, the job's end without --max-restarts. (Under TensorFlow's collectives rank 1
    exits too slowly to show it.)"""
    hosts = Hosts(tmp_path, "localhost:2\n")
    launcher = Launcher("--servers", "1", "--host-discovery-script", str(hosts.script),
                        "-np", "2", "--min-np", "1", "--", "python", RESCALE_WORKER,
                        "--slow-note", "3", mark=mark)
    deadline = time.monotonic() + 90
    while sum('"ready"' in line for line in launcher.out) < 2:
        assert launcher.proc.poll() is None and time.monotonic() < deadline, launcher.output()
        time.sleep(0.1)
    hosts.set("localhost:1\n")
    assert launcher.wait(timeout=90) == 0, launcher.output()
    assert said(launcher, "stopped after their checkpoint, as asked; the job goes on with "
                          "1") == 1, launcher.output()
    again = [line[line.index("{"):] for line in launcher.out if '"again"' in line]
    assert again == ['{"rescale_worker": "again", "attempt": 1, "rank": 0, "size": 1}'], \
        launcher.output()


@pytest.mark.multiprocess
@pytest.mark.parametrize("how", [(), ("--from-function",)], ids=["dataset", "function"])
def test_a_count_that_cannot_split_the_global_batch_stops_before_the_first_step(tmp_path,
                                                                              mark, how):
    """2 slots and a global batch of 15: the first attempt starts 2 workers, before the
    chief noted the batch. They stop where they distribute the data (each failed there, 'not
    divisible by the 2 workers', or for distribute_datasets_from_function, whose batch was
    never noted, TensorFlow's 'not divisible by num_replicas_in_sync' in every attempt), and
    the job goes on with 1, using no restart."""
    hosts = Hosts(tmp_path, "localhost:2\n")
    launcher = elastic(hosts, "-np", "2", "--min-np", "1", "--", "python", RESCALE_WORKER,
                       "--global-batch", "15", *how, mark=mark)
    assert launcher.wait(timeout=90) == 0, launcher.output()
    assert said(launcher, "the 2 worker(s) stopped before their first step: they cannot "
                          "split the global batch evenly") == 1, launcher.output()
    assert not said(launcher, "restart 1 of"), launcher.output()
    again = [line[line.index("{"):] for line in launcher.out if '"again"' in line]
    assert again == ['{"rescale_worker": "again", "attempt": 1, "rank": 0, "size": 1}'], \
        launcher.output()


@pytest.mark.multiprocess
def test_a_remote_host_listed_while_the_job_runs_is_said_once_and_changes_nothing(tmp_path,
                                                                                mark):
    """The refusal was said at every discovery (every second): discovery forgot the last
    failure before it checked the hosts."""
    hosts = Hosts(tmp_path, "localhost:1\n")
    launcher = rescalable(hosts, "4", mark=mark)
    launcher.wait_for_probes(1)
    hosts.set("localhost:1\n192.0.2.7:1\n")
    assert launcher.wait() == 0, launcher.output()
    assert said(launcher, "lists 192.0.2.7: an elastic job's workers run on this machine") \
        == 1, launcher.output()
    assert len(starts(launcher)) == 1, launcher.output()


@pytest.mark.multiprocess
def test_a_failure_that_prints_the_time_is_said_once(tmp_path, mark):
    """Each failure was compared whole with the last one said: a script whose error names
    the time (kubectl's do) was said every second."""
    hosts = Hosts(tmp_path, "localhost:1\n")
    hosts.script.write_text(f"#!/bin/sh\nif [ -e {hosts.fail} ]; then\n"
                            f"  echo \"E$(date +%H%M%S.%N) inventory down\" >&2; exit 3\nfi\n"
                            f"cat {hosts.file}\n")
    hosts.fail.touch()
    launcher = elastic(hosts, "-np", "1", PROBE, mark=mark)
    wait_for_line(launcher, "inventory down")
    time.sleep(2.5)
    hosts.fail.unlink()
    assert launcher.wait() == 0, launcher.output()
    assert said(launcher, "inventory down") == 1, launcher.output()
