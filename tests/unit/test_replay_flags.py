"""`parallax run --replay-mb` without processes: the flag, its refusals, the data directory
the launcher makes for it, and what the launcher does as a server of its own dies
(`job_servers.Replacements`, through `ServerLosses`) on a stand-in cluster
(tests/server/test_restore_newest.py starts real servers again)."""
from __future__ import annotations

import dataclasses
import time

import pytest

from parallax.errors import ConfigError, ParallaxError
from parallax.launch.job_servers import (MAX_REPLACEMENTS, RESTORE_NEWEST, HealthWatch,
                                         Replacements, ServerLosses)
from parallax.launch.run import _makes_data_dir, _restart_data_dir, parse_args, validate


def config(*argv: str):
    return parse_args([*argv, "--", "python", "-c", "pass"])


def test_the_flag_defaults_to_off_and_is_read():
    assert config().replay_mb == 0
    chosen = config("--replay-mb", "64", "--servers", "3")
    validate(chosen)
    assert chosen.replay_mb == 64


@pytest.mark.parametrize("argv, words", [
    (["--replay-mb", "-1"], "--replay-mb -1 must be >= 0"),
    (["--replay-mb", "8", "--replicas", "2"], "--replay-mb 8 with --replicas 2: give one"),
    (["--replay-mb", "8", "--async"], "--replay-mb 8 with --async: a replay rebuilds a shard "
                                      "exactly only from sync steps"),
    (["--replay-mb", "8", "--ps-addresses", "127.0.0.1:7000"],
     "--replay-mb 8 with --ps-addresses: those servers are not ours to start again"),
    (["--replay-mb", "8", "-H", "localhost:2"],
     "--replay-mb 8 with --hosts/-H/--hostfile: those servers are not ours")])
def test_what_it_cannot_do_is_refused(argv, words):
    with pytest.raises(ConfigError, match=words):
        validate(config(*argv))


def test_the_launcher_makes_a_data_directory_unless_one_is_given(capsys):
    assert not _makes_data_dir(config())
    assert _makes_data_dir(config("--replay-mb", "8"))
    assert not _makes_data_dir(config("--replay-mb", "8", "--data-dir", "/tmp/d"))
    with _restart_data_dir(config("--replay-mb", "8"), "r1") as made:
        assert made.data_dir is not None
    assert "--replay-mb without --data-dir: the servers keep their checkpoints in " \
           f"{made.data_dir} for a server started again" in capsys.readouterr().err


class _Proc:
    def __init__(self, pid: int, code: int | None = None) -> None:
        self.pid, self.returncode, self.killed = pid, code, False

    def poll(self):
        return self.returncode

    def kill(self):
        self.killed, self.returncode = True, -9


class _Server:
    def __init__(self, index: int, code: int | None = None, pid: int = 100) -> None:
        self.index, self.address = index, f"127.0.0.1:{7000 + index}"
        self.proc, self.lines = _Proc(pid, code), []

    def tail(self, n: int = 10) -> str:
        return ""


class _Cluster:
    """Servers by index; `replace` starts a live one (or fails, when `fails`)."""

    def __init__(self, count: int, fails: bool = False) -> None:
        self.servers = [_Server(i) for i in range(count)]
        self.fails, self.asked = fails, []

    def replace(self, index: int, extra_args):
        self.asked.append((index, list(extra_args)))
        new = _Server(index, code=2 if self.fails else None, pid=200 + len(self.asked))
        self.servers[index] = new
        if self.fails:
            raise ParallaxError(f"parameter server {index} exited with code 2 before it was "
                                f"ready; its output:\\ncannot listen")
        return new


def _losses(cluster, said, health=None):
    return ServerLosses(cluster, 1, said.append, replacements=Replacements(cluster, said.append,
                                                                           health))


def test_a_dead_server_is_started_again_on_its_address_with_its_checkpoints():
    cluster, said = _Cluster(2), []
    losses = _losses(cluster, said)
    assert losses.fatal() is None  # all alive
    cluster.servers[1].proc.returncode = -9
    assert losses.fatal() is None  # started again: the job goes on
    assert cluster.asked == [(1, [RESTORE_NEWEST])]
    assert said == [f"parameter server 1 (127.0.0.1:7001) exited with code -9; started again "
                    f"there (--replay-mb, start 1 of {MAX_REPLACEMENTS} this attempt, pid "
                    f"201): its tables restore from their newest checkpoint, and the workers "
                    f"replay their pushes since"]
    assert not losses.lost and cluster.servers[1].proc.poll() is None


def test_a_server_that_keeps_dying_ends_the_job_after_its_starts():
    cluster, said = _Cluster(2), []
    losses = _losses(cluster, said)
    for start in range(MAX_REPLACEMENTS):
        cluster.servers[0].proc.returncode = 1
        assert losses.fatal() is None
    cluster.servers[0].proc.returncode = 1
    dead = losses.fatal()
    assert dead is cluster.servers[0] and len(cluster.asked) == MAX_REPLACEMENTS
    assert f"after {MAX_REPLACEMENTS} start(s) again in this attempt" in said[-1]
    cluster.servers[1].proc.returncode = 1  # (another server has starts of its own)
    assert losses.fatal() is dead  # (the first dead one still ends it)


def test_a_replacement_that_does_not_start_ends_the_job_with_its_output():
    cluster, said = _Cluster(2, fails=True), []
    losses = _losses(cluster, said)
    cluster.servers[1].proc.returncode = -9
    dead = losses.fatal()
    assert dead is cluster.servers[1] and dead.proc.returncode == 2  # the replacement
    assert "exited with code -9, and could not be started again (--replay-mb): parameter " \
           "server 1 exited with code 2 before it was ready; its output:" in said[-1]


def test_a_silent_server_is_killed_to_be_started_again():
    cluster, said = _Cluster(2), []
    losses = _losses(cluster, said)
    assert losses.outlives((0, "127.0.0.1:7000", 31.0), 2)
    assert cluster.servers[0].proc.killed
    assert "with --replay-mb it is stopped (SIGKILL) and started again" in said[-1]
    assert losses.fatal() is None and cluster.asked == [(0, [RESTORE_NEWEST])]
    assert not losses.outlives((5, "10.0.0.1:1", 31.0), 2)  # not ours: the job ends


def test_a_replacement_gets_a_whole_health_timeout_to_answer():
    health = HealthWatch(["127.0.0.1:7000", "127.0.0.1:7001"], 0.5, None)
    try:
        health._answered = [time.monotonic() - 10] * 2  # (no checks run: never started)
        assert health.silent()[0] == 1
        cluster, said = _Cluster(2), []
        losses = _losses(cluster, said, health)
        cluster.servers[1].proc.returncode = -9
        assert losses.fatal() is None
        assert health.silent()[:2] == (0, "127.0.0.1:7000")  # server 1's clock restarted
        assert health.silent({"127.0.0.1:7000"}) is None
    finally:
        health.stop()


def test_it_is_off_by_default():
    cluster = _Cluster(1)
    losses = ServerLosses(cluster, 1, [].append)
    cluster.servers[0].proc.returncode = 1
    assert losses.fatal() is cluster.servers[0] and not cluster.asked


def test_the_config_field_travels_unchanged():
    assert dataclasses.replace(config(), replay_mb=3).replay_mb == 3
