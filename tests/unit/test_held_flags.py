"""Held backups without processes: the flag of `parallax run` and `parallax k8s`, the
variable the workers read, and what the launcher does with a run's tables between attempts
(tests/integration/test_chaos.py runs them)."""
from __future__ import annotations

import dataclasses

import pytest

from parallax.env import HELD_BACKUPS_ENV, held_backups
from parallax.errors import ConfigError
from parallax.launch.job_servers import JobServers
from parallax.launch.run import parse_args, validate


def test_the_run_flag_defaults_to_every_backup_on_disk_and_refuses_a_negative_count():
    assert parse_args(["--", "true"]).held_backups == 0
    assert parse_args(["--held-backups", "4", "--", "true"]).held_backups == 4
    config = dataclasses.replace(parse_args(["--", "true"]), held_backups=-1)
    with pytest.raises(ConfigError, match="--held-backups -1 must be >= 0"):
        validate(config)


@pytest.mark.parametrize("text, want", [("", 0), ("0", 0), ("3", 3), (" 12 ", 12)])
def test_the_workers_read_the_count(text, want):
    assert held_backups({HELD_BACKUPS_ENV: text}) == want


@pytest.mark.parametrize("text", ["-1", "two", "1.5"])
def test_a_bad_count_is_refused_by_name(text):
    with pytest.raises(ConfigError, match=f"{HELD_BACKUPS_ENV}={text!r} must be a whole "
                                          f"number >= 0"):
        held_backups({HELD_BACKUPS_ENV: text})


def test_external_servers_keep_the_tables_only_for_as_many_workers_as_before():
    said: list[str] = []
    config = dataclasses.replace(parse_args(["--ps-addresses", "127.0.0.1:1", "--", "true"]),
                                 held_backups=2)
    servers = JobServers(config, None, "run1", said.append)
    assert servers.for_attempt(config, 0) is None and not said  # the first: nothing to do
    assert servers.for_attempt(config, 1) is None
    assert said == ["the servers keep running with run run1's tables: the workers roll them "
                    "back to their newest held backup (--held-backups)"]
    fewer = dataclasses.replace(config, num_workers=config.num_workers + 1)
    servers.for_attempt(fewer, 2)  # another count: dropped (here: no server to drop from)
    assert "could not drop run run1's tables" in said[-1]
