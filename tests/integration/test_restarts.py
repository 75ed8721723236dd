"""`parallax run --max-restarts N`: a failed job (a worker killed or failing, a server killed)
is restarted, at most N times, with PARALLAX_RESTART_COUNT telling the workers which
attempt they are; a clean exit and the user's own signals are never restarted. The servers
start again only when one of them failed; after a worker's failure they keep running, the
run's tables (and only its) dropped, on the launcher's servers and on external ones alike.

The policy itself (`parallax.launch.restarts`) is tested without processes; the rest through the CLI
with real servers and workers (tests/helpers/launch_probe.py), with the orphan check of
tests/helpers/launching.py.
"""
from __future__ import annotations

import os
import signal
import time

import pytest

from parallax.client import PSClient
from parallax.errors import ConfigError
from parallax.protocol.specs import SGD, TableSpec
from parallax.launch.restarts import Outcome, RestartBudget
from launching import PROBE, Launcher, mark, marked_processes  # noqa: F401 (fixture)


# ---- the policy, no processes ------------------------------------------------------------
def test_budget_restarts_failures_at_most_n_times_and_says_why():
    said: list[str] = []
    budget = RestartBudget(2, delay_s=0, say=said.append)
    failure = Outcome.failed(3, "worker rank 0 exited with code 3")
    assert budget.should_restart(failure) and budget.should_restart(failure)
    assert not budget.should_restart(failure)
    assert budget.restarts == 2
    assert said[0].startswith("restart 1 of 2") and "worker rank 0 exited with code 3" in said[0]
    assert "all 2 restart(s) of --max-restarts are used; the job exits with 3" in said[-1]


def test_by_default_only_a_servers_failure_waits_before_the_restart(monkeypatch):
    """--restart-delay unset: 1 s after a server's failure (its replacements take ports
    again), none after a worker's (the servers keep running)."""
    slept: list[float] = []
    monkeypatch.setattr("parallax.launch.restarts.time.sleep", slept.append)
    said: list[str] = []
    budget = RestartBudget(3, delay_s=None, say=said.append)
    assert budget.should_restart(Outcome.failed(3, "worker rank 1 exited with code 3"))
    assert budget.should_restart(Outcome.failed(1, "parameter server 0 exited",
                                                server_failed=True))
    assert slept == [0.0, 1.0]
    assert said[0].startswith("restart 1 of 3 in 0s") and said[1].startswith("restart 2 of 3 "
                                                                              "in 1s")
    assert RestartBudget(1, delay_s=7, say=said.append).should_restart(
        Outcome.failed(3, "worker")) and slept[-1] == 7


@pytest.mark.parametrize("outcome", [Outcome(0), Outcome(130, "got SIGINT"),
                                     Outcome.failed(0, "nothing failed")])
def test_budget_never_restarts_a_clean_exit_or_a_signal(outcome):
    budget = RestartBudget(5, delay_s=0, say=lambda _: None)
    assert not budget.should_restart(outcome)
    assert budget.restarts == 0


@pytest.mark.parametrize("restarts, delay, words", [(-1, 0, "--max-restarts -1 must be >= 0"),
                                                    (1, -2, "--restart-delay -2 must be >= 0")])
def test_budget_refuses_bad_settings(restarts, delay, words):
    with pytest.raises(ConfigError, match=words):
        RestartBudget(restarts, delay_s=delay)


# ---- through the CLI ---------------------------------------------------------------------
def _restarts(launcher: Launcher) -> list[str]:
    return [line for line in launcher.err if "parallax run: restart " in line]


@pytest.mark.multiprocess
def test_a_failing_worker_is_restarted_and_the_job_then_succeeds(mark):
    launcher = Launcher("--max-restarts", "2", "--restart-delay", "0", "--servers", "1",
                        "--", "python", PROBE, "--exit", "5", "--until-restart", "1", mark=mark)
    assert launcher.wait(120) == 0, launcher.output()
    assert [p["restart"] for p in launcher.probes()] == [0, 1]
    lines = _restarts(launcher)
    assert len(lines) == 1 and lines[0].startswith("parallax run: restart 1 of 2"), lines
    assert "worker rank 0 exited with code 5" in lines[0]


@pytest.mark.multiprocess
def test_restarts_are_bounded_and_the_last_exit_code_is_the_jobs(mark):
    launcher = Launcher("--max-restarts", "2", "--restart-delay", "0", "--servers", "1",
                        "--", "python", PROBE, "--exit", "7", mark=mark)
    assert launcher.wait(180) == 7, launcher.output()
    assert [p["restart"] for p in launcher.probes()] == [0, 1, 2]
    assert len(_restarts(launcher)) == 2
    assert any("all 2 restart(s) of --max-restarts are used" in line for line in launcher.err)


def _tables(addresses: list[str], *names: str) -> set[str]:
    """Create tables `names` (one shard each) on the servers; the names of every table
    they hold."""
    with PSClient(addresses) as client:
        for name in names:
            client.create_table(TableSpec(name=name, vocabulary_size=10, dim=2, shard_count=1,
                                          optimizer=SGD(learning_rate=0.1)))
        return {t.table for reply in client.stats().values() for t in reply.tables}


@pytest.mark.multiprocess
def test_a_failed_worker_restarts_on_the_same_servers_without_the_runs_tables(mark):
    launcher = Launcher("--max-restarts", "1", "--restart-delay", "0", "--servers", "2",
                        "--run-id", "kept", "--", "python", PROBE, "--sleep", "3",
                        "--exit", "5", "--until-restart", "1", mark=mark)
    first = launcher.wait_for_probes(1)[0]
    assert _tables(first["addresses"], "kept.t", "other.t") >= {"kept.t", "other.t"}
    assert launcher.wait(120) == 0, launcher.output()
    second = launcher.probes()[1]
    assert second["restart"] == 1 and second["addresses"] == first["addresses"]
    assert "the workers start again (the servers keep running)" in _restarts(launcher)[0]
    assert any("dropped 1 table(s) of run kept" in line for line in launcher.err), \
        launcher.output()


@pytest.mark.multiprocess
def test_external_servers_lose_only_the_runs_tables_at_a_restart(mark, cluster):
    """--ps-addresses: the restarted workers find none of the run's tables of the attempt
    before (the checkpoint brings them back); another run's tables stay."""
    _tables(cluster.addresses, "ext1.t", "ext2.t")
    launcher = Launcher("--max-restarts", "1", "--restart-delay", "0", "--servers", "0",
                        "--ps-addresses", ",".join(cluster.addresses), "--run-id", "ext1",
                        "--", "python", PROBE, "--exit", "5", "--until-restart", "1",
                        mark=mark)
    assert launcher.wait(120) == 0, launcher.output()
    held = _tables(cluster.addresses)
    assert "ext1.t" not in held and "ext2.t" in held, held


@pytest.mark.multiprocess
def test_a_killed_server_restarts_every_server_and_worker(mark):
    launcher = Launcher("--max-restarts", "1", "--restart-delay", "0", "--servers", "2",
                        "--", "python", PROBE, "--sleep", "120", "--until-restart", "1",
                        mark=mark)
    first = launcher.wait_for_probes(1)[0]
    servers = [pid for pid, cmd in marked_processes(mark).items() if "parallax_ps" in cmd]
    assert len(servers) == 2
    os.kill(servers[1], signal.SIGKILL)
    assert launcher.wait(120) == 0, launcher.output()
    second = launcher.probes()[1]
    assert second["restart"] == 1 and second["pid"] != first["pid"]
    assert not set(second["addresses"]) & set(first["addresses"]), (first, second)
    lines = _restarts(launcher)
    assert len(lines) == 1 and "exited with code -9" in lines[0], lines
    assert "every server and worker starts again" in lines[0]


@pytest.mark.multiprocess
def test_a_hung_server_restarts_the_job_after_its_health_timeout(mark):
    """A server that stops answering (SIGSTOP) for --health-timeout restarts every server and
    worker, as one that dies does; the restart names it."""
    launcher = Launcher("--max-restarts", "1", "--restart-delay", "0", "--servers", "2",
                        "--health-timeout", "2", "--", "python", PROBE, "--sleep", "120",
                        "--until-restart", "1", mark=mark)
    launcher.wait_for_probes(1)
    servers = sorted(pid for pid, cmd in marked_processes(mark).items() if "parallax_ps" in cmd)
    assert len(servers) == 2
    os.kill(servers[1], signal.SIGSTOP)
    assert launcher.wait(90) == 0, launcher.output()
    assert [p["restart"] for p in launcher.probes()] == [0, 1]
    lines = _restarts(launcher)
    assert len(lines) == 1 and "server 1" in lines[0], lines


@pytest.mark.multiprocess
def test_without_max_restarts_a_failure_ends_the_job(mark):
    launcher = Launcher("--servers", "1", "--", "python", PROBE, "--exit", "4", mark=mark)
    assert launcher.wait(60) == 4, launcher.output()
    assert len(launcher.probes()) == 1 and not _restarts(launcher)


@pytest.mark.multiprocess
def test_a_signal_to_the_launcher_is_not_restarted(mark):
    launcher = Launcher("--max-restarts", "3", "--restart-delay", "0", "--servers", "1",
                        "--", "python", PROBE, "--sleep", "120", mark=mark)
    launcher.wait_for_probes(1)
    launcher.proc.send_signal(signal.SIGTERM)
    assert launcher.wait(60) == 128 + signal.SIGTERM, launcher.output()
    assert len(launcher.probes()) == 1 and not _restarts(launcher)


@pytest.mark.multiprocess
def test_a_signal_during_the_restart_delay_ends_the_job_without_restarting(mark):
    launcher = Launcher("--max-restarts", "3", "--restart-delay", "60", "--servers", "1",
                        "--", "python", PROBE, "--exit", "3", mark=mark)
    deadline = time.monotonic() + 60
    while not _restarts(launcher):
        assert launcher.proc.poll() is None and time.monotonic() < deadline, launcher.output()
        time.sleep(0.05)
    started = time.monotonic()
    launcher.proc.send_signal(signal.SIGINT)
    assert launcher.wait(30) == 128 + signal.SIGINT, launcher.output()
    assert time.monotonic() - started < 10
    assert len(launcher.probes()) == 1, launcher.output()
    assert any("during the restart delay: not restarting" in line for line in launcher.err)
