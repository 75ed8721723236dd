"""Elastic `parallax run` without processes: its flags and their refusals, the discovery
script's output format, the worker count it allows, and the request files between the
launcher and the workers (tests/parallel/test_elastic.py runs the jobs)."""
from __future__ import annotations

import types

import pytest

from parallax.env import (ELASTIC_ENV, RESCALE_AT_START, RESCALE_EXIT, RESCALE_FILE_ENV,
                          ask_rescale, global_batch, note_global_batch, note_rescale_stop,
                          rescale_request, stopped_for_rescale, withdraw_rescale)
from parallax.errors import ConfigError
from parallax.launch.elastic import Elastic
from parallax.launch.hosts import parse_discovered
from parallax.launch.run import parse_args, validate
from parallax.tf.state import rescale

SCRIPT = ["--host-discovery-script", "./discover.sh"]


def config(*argv: str):
    return parse_args([*argv, "--", "python", "-c", "pass"])


@pytest.mark.parametrize("argv, words", [
    (["-np", "2", "--min-np", "1"], "--min-np without --host-discovery-script"),
    (["--max-np", "4"], "--max-np without --host-discovery-script"),
    (["--min-np", "1", "--max-np", "4"], "--min-np and --max-np without"),
    ([*SCRIPT, "-np", "2", "-H", "localhost:2"], "--host-discovery-script and --hosts/-H/"
                                                 "--hostfile localhost:2 both given"),
    ([*SCRIPT, "-np", "2", "--hosts", "localhost:2"], "both given: an elastic job's hosts"),
    ([*SCRIPT, "-np", "2", "--min-np", "3"], r"--min-np 3 and --max-np 2: need 1 <= "
                                             r"--min-np <= --max-np \(-np is --max-np's"),
    ([*SCRIPT, "--min-np", "3", "--max-np", "2"], "--min-np 3 and --max-np 2: need"),
    ([*SCRIPT, "-np", "2", "--elastic-timeout", "0"], "--elastic-timeout 0 must be > 0"),
    ([*SCRIPT, "-np", "2", "--elastic-timeout", "nan"], "--elastic-timeout nan must be > 0"),
    # 0 is a bound given, not the default (-np): it was taken for -np
    ([*SCRIPT, "-np", "2", "--min-np", "0"], "--min-np 0 and --max-np 2: need 1 <= --min-np"),
    ([*SCRIPT, "-np", "2", "--max-np", "0"], "--min-np 2 and --max-np 0: need 1 <= --min-np"),
    ([*SCRIPT, "--max-np", "0"], "--max-np 0 must be at least 1"),
])
def test_elastic_flags_that_cannot_work_are_refused(argv, words):
    with pytest.raises(ConfigError, match=words):
        validate(config(*argv))


def test_a_script_needs_np_or_max_np():
    with pytest.raises(ConfigError, match="--host-discovery-script needs -np N or --max-np N"):
        config(*SCRIPT)


@pytest.mark.parametrize("argv, bounds, workers", [
    (["-np", "2"], (2, 2), 2),                        # -np: both bounds
    (["--max-np", "4"], (4, 4), 4),                   # --max-np alone: -np too
    (["-np", "2", "--min-np", "1"], (1, 2), 2),
    (["-np", "2", "--min-np", "1", "--max-np", "3"], (1, 3), 2)])
def test_the_bounds_default_to_np(argv, bounds, workers):
    from parallax.launch.run import _elastic
    job = config(*SCRIPT, *argv)
    validate(job)
    elastic = _elastic(job)
    assert (elastic.min_np, elastic.max_np, job.num_workers) == (*bounds, workers)


def test_the_scripts_output_gives_the_hosts_and_their_slots():
    layout = parse_discovered("# now\nlocalhost:2\n\n127.0.0.1  # one slot\n[::1]:3\n", "out")
    assert [(h.host, h.slots, h.servers) for h in layout.hosts] == [
        ("localhost", 2, 0), ("127.0.0.1", 1, 0), ("[::1]", 3, 0)]
    assert layout.num_slots == 6
    assert parse_discovered("", "out").num_slots == 0  # no hosts now: wait for some


@pytest.mark.parametrize("text, words", [
    ("localhost:0\n", r"out, line 1: 'localhost:0' should be `host:N` \(N >= 1"),
    ("localhost:two\n", "should be `host:N`"),
    ("localhost:1\nlocalhost:2\n", "line 2: host 'localhost' is listed again")])
def test_bad_lines_are_named(text, words):
    with pytest.raises(ConfigError, match=words):
        parse_discovered(text, "out")


def test_the_workers_are_the_slots_capped_by_max_np_and_none_below_min_np():
    elastic = Elastic("true", min_np=2, max_np=3)
    assert [elastic.workers(parse_discovered(f"localhost:{n}", "out")) for n in (1, 2, 3, 5)] \
        == [0, 2, 3, 3]
    assert elastic.workers(None) == 0  # the script failed


def test_the_workers_split_the_global_batch_the_chief_noted_evenly(tmp_path):
    """A count that does not divide the global batch would fail every worker at its first
    step (`shard_for_worker`): the most that do, within the bounds, once the chief noted
    the batch (any count before)."""
    said = []
    elastic = Elastic("true", min_np=2, max_np=8, say=said.append)
    elastic.request = tmp_path / "rescale.json"
    slots = [parse_discovered(f"localhost:{n}", "out") for n in (3, 5, 8)]
    assert [elastic.workers(layout) for layout in slots] == [3, 5, 8]  # nothing noted yet
    note_global_batch(elastic.request, 16)
    assert global_batch(elastic.request) == 16
    assert [elastic.workers(layout) for layout in slots] == [2, 4, 8]
    assert said == ["3 worker(s) would not split the global batch of 16 evenly: running 2",
                    "5 worker(s) would not split the global batch of 16 evenly: running 4"]
    note_global_batch(elastic.request, 9)
    assert [elastic.workers(layout) for layout in slots] == [3, 3, 3]
    note_global_batch(elastic.request, 7)  # only 1 (and 7) split it: below --min-np 2
    assert [elastic.workers(layout) for layout in slots] == [0, 0, 7]
    (tmp_path / "rescale.json.batch").write_text("{")
    assert global_batch(elastic.request) is None


def test_a_request_is_read_whole_or_not_at_all(tmp_path):
    path = tmp_path / "rescale.json"
    assert rescale_request(path) is None  # none asked
    ask_rescale(path, 3)
    assert rescale_request(path) == 3 and not (tmp_path / "rescale.json.partial").exists()
    for garbage in ("", "{", '{"workers": 0}', '{"workers": "2"}', "[2]"):
        path.write_text(garbage)
        assert rescale_request(path) is None, garbage
    ask_rescale(path, 2)
    withdraw_rescale(path)  # the count came back before the workers stopped
    assert rescale_request(path) is None
    withdraw_rescale(path)  # nothing left to withdraw
    assert not stopped_for_rescale(path)
    note_rescale_stop(path, "epoch 4")
    assert stopped_for_rescale(path) == "epoch 4" and not stopped_for_rescale(path)  # once


class FakeWorkers:
    """`Workers` of `size`, as rank 0 sees them (its broadcast: its own object)."""

    def __init__(self, size: int) -> None:
        self.info = types.SimpleNamespace(size=size, rank=0, is_chief=True)

    def broadcast_object(self, obj):
        return obj


def test_the_chief_notes_a_batch_every_count_must_split_and_stops_a_count_that_cannot(
        tmp_path, monkeypatch):
    """Several datasets distributed (a custom loop's training and evaluation data): the
    note is the greatest common divisor of their batches, so a count the launcher picks
    splits each of them (the last one's alone could send the job back and forth between
    counts). A count that cannot split the batch stops the workers before their first step
    (the first attempt, started before any note), noted as such for the launcher."""
    path = tmp_path / "rescale.json"
    monkeypatch.setenv(RESCALE_FILE_ENV, str(path))
    rescale.publish_global_batch(FakeWorkers(2), lambda: 15)  # not elastic: a fixed count
    assert global_batch(path) is None and not stopped_for_rescale(path)
    monkeypatch.setenv(ELASTIC_ENV, "1")
    rescale.publish_global_batch(FakeWorkers(1), lambda: 16)
    rescale.publish_global_batch(FakeWorkers(1), lambda: 12)
    assert global_batch(path) == 4
    rescale.publish_global_batch(FakeWorkers(2), lambda: 16)
    assert global_batch(path) == 4 and not stopped_for_rescale(path)
    with pytest.raises(SystemExit) as stop:
        rescale.publish_global_batch(FakeWorkers(2), lambda: 15)
    assert stop.value.code == RESCALE_EXIT and global_batch(path) == 1
    assert stopped_for_rescale(path) == RESCALE_AT_START
