"""Shared fixtures: real parameter-server processes on loopback, and table snapshots; and the
test tiers (tests/tiers.py): every test is marked with its file's tier (the folder it is in),
and a run of unit
tests alone fails a test that imports TensorFlow or starts a process; each test has a time
limit (pytest-timeout) and each tier a time budget (tests/tier_budget.py)."""
from __future__ import annotations

import importlib.abc
import itertools
import os
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import numpy.testing  # noqa: F401 (its first import runs lscpu: before any guard)
import pytest

from parallax.client import ClientOptions, PSClient
from parallax.client.local_cluster import LocalCluster

import tiers
from tier_budget import TierBudget, budget_scale
from tiers import GUARDED, tier_of

_names = itertools.count()
_DESELECTED = False  # some collected tests were deselected (-m, -k): others' imports loaded
_BACKSTOP = pytest.StashKey[threading.Timer]()
_MIXED = pytest.StashKey[bool]()  # the run has other tiers than unit: guard unit tests each
_UNGUARD = pytest.StashKey[object]()
BACKSTOP_S = 90  # after a test's time limit: what its teardown may take before the run ends


def pytest_configure(config):
    config.pluginmanager.register(
        TierBudget({tier: tiers.files(tier) for tier in tiers.TIERS}, tier_of,
                   getattr(tiers, "BUDGET_S", {}), budget_scale()), "parallax-tier-budget")


def pytest_report_header(config):
    if not config.pluginmanager.hasplugin("timeout"):
        return ["pytest-timeout is not installed: no test has a time limit (`make env` "
                "installs it: setup.cfg's test extra)"]
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    limits = getattr(tiers, "TIMEOUT_S", {})
    for item in items:
        tier = tier_of(item.path)
        if tier is None:
            folders = ", ".join(f"tests/{t}/" for t in tiers.TIERS)
            raise pytest.UsageError(
                f"{item.path} is in no tier folder: a test file belongs in one of {folders} "
                f"(tests/tiers.py; helpers that are not tests go to tests/helpers/)")
        item.add_marker(getattr(pytest.mark, tier))
        if tier in limits and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(limits[tier]))


# Time limits (pytest-timeout; pyproject.toml sets the default, tests/tiers.py TIMEOUT_S a
# tier's, @pytest.mark.timeout(S) a test's). The method is `signal`: SIGALRM fails the test
# in the main thread, so its fixtures' teardown still runs (LocalCluster and Popen context
# managers stop the processes the test started; parallax's own processes also end with
# their parent, parallax/runtime/lifeline.py) and the rest of the run goes on. `func_only`
# is off: the limit covers setup and teardown, where a server that never answers would
# hang too. SIGALRM's handler runs only when the main thread runs Python: a test stuck in
# C code (a TensorFlow op waiting forever) never sees it. So a `thread` timer is the
# backstop, BACKSTOP_S later: it prints every thread's stack and ends the whole run
# (os._exit), which is better than a hang that costs the whole CI job.

@pytest.hookimpl(optionalhook=True)
def pytest_timeout_set_timer(item, settings):
    if settings.method == "signal":
        backstop = threading.Timer(settings.timeout + BACKSTOP_S, _backstop, (item, settings))
        backstop.daemon = True
        item.stash[_BACKSTOP] = backstop
        backstop.start()
    return None  # pytest-timeout's own implementation sets the SIGALRM timer


def _backstop(item, settings) -> None:
    from pytest_timeout import timeout_timer  # the thread method: stacks, then os._exit(1)
    capture = item.config.pluginmanager.getplugin("capturemanager")
    if capture is not None:
        capture.suspend_global_capture(in_=True)
    item.config.get_terminal_writer().line(
        f"\n{item.nodeid} is still running {BACKSTOP_S} s past its {settings.timeout:g} s "
        f"limit: SIGALRM could not interrupt it (stuck in C code?); ending the run",
        red=True)
    timeout_timer(item, settings)


@pytest.hookimpl(optionalhook=True)
def pytest_timeout_cancel_timer(item):
    backstop = item.stash.get(_BACKSTOP, None)
    if backstop is not None:
        backstop.cancel()
    return None


def pytest_deselected(items):
    global _DESELECTED
    _DESELECTED = _DESELECTED or bool(items)


def pytest_collection_finish(session):
    """A run of unit tests only: no TensorFlow was imported by collecting them (unless other
    files were collected too and deselected), and none may be imported or any process or
    listening socket started from here on, fixtures of every scope included. In a run with
    other tiers too (`make test`), each unit test's setup and call are guarded alike: the
    unit tier runs once there, not again alone."""
    if not session.items:
        return
    if not all(i.get_closest_marker("unit") for i in session.items):
        session.config.stash[_MIXED] = True
        return
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in GUARDED)
    if loaded and not _DESELECTED:
        raise pytest.UsageError(f"the unit tests imported {', '.join(loaded[:3])}: a file that "
                                f"needs TensorFlow belongs to the `tf` tier (tests/tf/)")
    _guard_unit_run()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    if item.config.stash.get(_MIXED, False) and item.get_closest_marker("unit"):
        item.stash[_UNGUARD] = _guard_unit_run()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item):
    """Before the teardown: it may end other tiers' session fixtures (their processes)."""
    undo = item.stash.get(_UNGUARD, None)
    if undo is not None:
        undo()


class _Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in GUARDED:
            raise ImportError(f"a unit test imported {name}: move its file to the `tf` tier "
                              f"(tests/tf/)")
        return None


def _refused(what: str):
    def refuse(*args, **kwargs):
        raise AssertionError(f"a unit test {what}: move its file to the `server`, `parallel` "
                             f"or `integration` tier (tests/server/, tests/parallel/, "
                             f"tests/integration/)")
    return refuse


_STARTERS = ("fork", "forkpty", "system", "posix_spawn", "posix_spawnp", "spawnv", "spawnve",
             "spawnvp", "spawnvpe", "execv", "execve")


def _guard_unit_run():
    """No TensorFlow (where not imported yet), no process, no server socket, until the
    returned function undoes it (a unit-only session never does)."""
    finder = _Refuse()
    saved = [(subprocess.Popen, "__init__"), (socket.socket, "listen")] + [
        (os, name) for name in _STARTERS if hasattr(os, name)]
    saved = [(owner, name, getattr(owner, name)) for owner, name in saved]
    sys.meta_path.insert(0, finder)
    started = _refused("started a process")
    subprocess.Popen.__init__ = started
    for name in _STARTERS:
        if hasattr(os, name):
            setattr(os, name, started)
    socket.socket.listen = _refused("opened a listening socket")

    def undo() -> None:
        sys.meta_path.remove(finder)
        for owner, name, value in saved:
            setattr(owner, name, value)
    return undo


@pytest.fixture(scope="session", autouse=True)
def plan_cache(tmp_path_factory):
    """Partition-search decisions of the tests' jobs (and their subprocesses) go to a fresh
    directory, not the user's cache: every test run searches again."""
    path = tmp_path_factory.mktemp("plan-cache")
    previous = os.environ.get("PARALLAX_PLAN_CACHE")
    os.environ["PARALLAX_PLAN_CACHE"] = str(path)
    yield path
    if previous is None:
        os.environ.pop("PARALLAX_PLAN_CACHE", None)
    else:
        os.environ["PARALLAX_PLAN_CACHE"] = previous


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ps-data")


@pytest.fixture(scope="session")
def cluster(data_dir):
    """Two real server processes sharing one data directory (as on a shared filesystem)."""
    with LocalCluster(2, data_dir=data_dir, extra_args=["--max-message-mb", "8"]) as c:
        yield c
    assert c.exit_codes == [0, 0], f"servers exited with {c.exit_codes}"


@pytest.fixture
def client(cluster):
    with PSClient(cluster.addresses, ClientOptions(timeout=20, max_message_mb=4)) as c:
        yield c


@pytest.fixture
def table_name(request) -> str:
    """A table name unique within the session (tables outlive a test on the shared cluster)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", f"t{next(_names)}_{request.node.name[:40]}")


PER_SHARD = ("dyn_counters", "dyn_sketch")  # checkpoint arrays that are not per row


class Snapshot:
    """Everything observable about a table: rows, optimizer slots and step (via a checkpoint)."""

    def __init__(self, client: PSClient, data_dir: Path, name: str) -> None:
        path = f"snap-{name}-{next(_names)}"
        shards = client.save(path, [name])
        self.step = {(s.shard_index): s.step for s in shards}
        self.checkpoint = shards[0].checkpoint if shards else ""  # its name (ckpt-...)
        self.arrays: dict[str, np.ndarray] = {}
        parts = sorted(Path(s.file) for s in shards)  # in the new checkpoint directory
        loaded = [dict(np.load(p)) for p in parts]
        order = np.argsort(np.concatenate([p["ids"] for p in loaded]), kind="stable")
        for key in loaded[0]:
            if key in PER_SHARD:  # a dynamic table's counters and sketch: one per shard
                self.arrays[key] = np.stack([p[key] for p in loaded])
                continue
            self.arrays[key] = np.concatenate([p[key] for p in loaded])[order]

    def assert_equal(self, other: "Snapshot") -> None:
        assert self.step == other.step
        assert self.arrays.keys() == other.arrays.keys()
        for key, value in self.arrays.items():
            np.testing.assert_array_equal(value, other.arrays[key], err_msg=key)


@pytest.fixture
def snapshot(client, data_dir):
    return lambda name: Snapshot(client, data_dir, name)


def free_ports(count: int) -> list[int]:
    """Ports the OS just handed out; held together so no two are the same."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def freeze(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP `pid` and return once every one of its threads is stopped: `kill` returns
    before the stop has taken effect on some kernels and sandboxes, and a thread still
    running could answer one more request."""
    import signal
    import time
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while not all(_thread_state(pid, t) in ("T", "t", "") for t in os.listdir(
            f"/proc/{pid}/task")):
        if time.monotonic() > deadline:
            raise AssertionError(f"process {pid} did not stop within {timeout:.0f} s")
        time.sleep(0.005)


def _thread_state(pid: int, tid: str) -> str:
    """One thread's state letter from /proc ("" once the thread is gone)."""
    try:
        stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[0]


def in_threads(work, count: int, timeout: float = 120.0) -> list:
    """`work(i)` for i in range(count), each on its own thread (workers of a test job);
    returns their results in order once all have ended, raising the first error."""
    results: list = [None] * count
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = work(i)
        except BaseException as exc:  # noqa: BLE001 - raised below, in the test's thread
            errors.append(exc)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    assert not any(t.is_alive() for t in threads), f"threads still running after {timeout}s"
    if errors:
        raise errors[0]
    return results
