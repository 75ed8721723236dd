"""The test tiers themselves (tests/tiers.py): a test file's tier is its folder, and a test
file in no tier folder is refused; collecting the unit tier imports no TensorFlow,
as `make test-fast` needs; its guard fails a unit test that starts a process or imports
TensorFlow, in a unit-only run and in a run of every tier (where the unit tests run once, not
again alone); each tier's time budget (tests/tier_budget.py) fails a run that ran the whole
tier too slowly, and only such a run; a test past its time limit fails with its fixtures torn
down, or, where the signal cannot reach it, ends the run (tests/conftest.py)."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import tier_budget
import tiers

ROOT = Path(__file__).resolve().parents[2]


def _pytest(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                          cwd=cwd, capture_output=True, text=True, timeout=600,
                          env=None if env is None else {**os.environ, **env})


def test_every_test_file_is_in_a_tier_folder_and_every_other_module_in_helpers():
    tests = ROOT / "tests"
    assert tiers.TESTS == tests
    for path in tests.rglob("*.py"):
        where = path.relative_to(tests)
        if path.name.startswith("test_"):
            assert tiers.tier_of(path) == where.parts[0], where
        elif len(where.parts) == 1:
            assert path.name in ("conftest.py", "tiers.py", "tier_budget.py"), where
        else:
            assert where.parts[0] == "helpers", f"{where}: not a test, so in tests/helpers/"
    assert all(tiers.files(tier) for tier in tiers.TIERS)
    assert tiers.tier_of(tests / "test_x.py") is None
    assert tiers.tier_of(tests / "helpers" / "test_x.py") is None
    assert tiers.tier_of(tests / "unit" / "deeper" / "test_x.py") is None


def test_a_test_file_in_no_tier_folder_is_refused_naming_the_folders(tmp_path):
    _tiers_dir(tmp_path)
    (tmp_path / "test_loose.py").write_text("def test_loose():\n    pass\n")
    run = _pytest("--collect-only", "test_loose.py", cwd=tmp_path)
    assert run.returncode == pytest.ExitCode.USAGE_ERROR, run.stdout[-2000:] + run.stderr[-2000:]
    assert "test_loose.py is in no tier folder" in run.stderr, run.stderr[-2000:]
    assert all(f"tests/{tier}/" in run.stderr for tier in tiers.TIERS), run.stderr[-2000:]


def test_collecting_the_unit_tier_imports_no_tensorflow():
    """What a unit-only run checks before its first test (the tests themselves run in this
    session, guarded one by one: see the mixed run below)."""
    run = _pytest("--collect-only", "tests/unit", cwd=ROOT)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " tests collected" in run.stdout.splitlines()[-1], run.stdout[-2000:]


BAD_UNIT_TESTS = """
import os
import socket
import subprocess

import pytest


@pytest.fixture(scope="module")
def server_process():
    subprocess.run(["true"])


def test_starts_a_process():
    subprocess.run(["true"])


def test_starts_one_in_a_module_fixture(server_process):
    pass


def test_runs_a_shell_command():
    os.system("true")


def test_listens():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()


def test_imports_tensorflow():
    import tensorflow  # noqa: F401
"""


OTHER_TIER_TESTS = """
import subprocess


def test_a_server_test_starts_a_process():
    subprocess.run(["true"], check=True)


def test_and_another():
    subprocess.run(["true"], check=True)
"""


def _tiers_dir(tmp_path: Path, tiers_py: str = "") -> Path:
    """tmp_path as a tests/ folder: the tier machinery (`tiers_py` appended to tiers.py), an
    empty folder of each tier, and an ini file that makes it the rootdir."""
    for name in ("conftest.py", "tier_budget.py"):
        shutil.copy(ROOT / "tests" / name, tmp_path)
    (tmp_path / "tiers.py").write_text((ROOT / "tests" / "tiers.py").read_text() + tiers_py)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    for tier in tiers.TIERS:
        (tmp_path / tier).mkdir()
    return tmp_path


@pytest.mark.parametrize("mixed", [False, True], ids=["unit-only", "with-another-tier"])
def test_a_unit_test_may_start_no_process_listen_or_import_tensorflow(tmp_path, mixed):
    _tiers_dir(tmp_path)
    (tmp_path / "unit" / "test_bad.py").write_text(BAD_UNIT_TESTS)
    (tmp_path / "server" / "test_other.py").write_text(OTHER_TIER_TESTS)
    run = _pytest("unit/test_bad.py", *(["server/test_other.py"] if mixed else []),
                  cwd=tmp_path)
    assert run.returncode == 1, run.stdout[-4000:]
    assert "4 failed" in run.stdout.splitlines()[-1], run.stdout[-4000:]  # and 1 error:
    assert "1 error" in run.stdout.splitlines()[-1]  # the module fixture's
    for what in ("started a process", "opened a listening socket", "imported tensorflow"):
        assert f"a unit test {what}" in run.stdout
    if mixed:  # the other tier's tests, after the unit tests, are not guarded
        assert "2 passed" in run.stdout.splitlines()[-1], run.stdout[-4000:]


def test_a_tier_is_selected_by_marker():
    """`pytest -m unit` collects (imports) every file given, TensorFlow's too, then runs the
    unit tests alone: that is not the unit tests' import."""
    run = _pytest("-m", "unit", "tests/unit/test_plan.py", "tests/tf/test_capacity.py", cwd=ROOT)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "deselected" in run.stdout.splitlines()[-1]


SLOW_TIER_TESTS = """
import time


def test_slow():
    time.sleep(0.6)


def test_quick():
    pass
"""


def test_a_whole_tier_over_its_budget_fails_the_run_and_names_its_slowest_tests(tmp_path):
    _tiers_dir(tmp_path, "BUDGET_S = {'server': 0.3}\n")
    (tmp_path / "server" / "test_slow.py").write_text(SLOW_TIER_TESTS)
    (tmp_path / "server" / "test_fine.py").write_text("def test_fine():\n    pass\n")
    env = {"PARALLAX_TIER_BUDGET": ""}
    run = _pytest("server", cwd=tmp_path, env=env)
    assert run.returncode == 1, run.stdout[-4000:]
    assert "3 passed" in run.stdout.splitlines()[-1]  # every test passed: the budget failed
    assert "tier budget exceeded: server" in run.stdout, run.stdout[-4000:]
    slowest = run.stdout.split("over its budget of")[1].splitlines()[1]
    assert "test_slow.py::test_slow" in slowest, run.stdout[-4000:]
    # a part of the tier is reported, not checked: a test deselected, a file narrowed
    for part in (["server", "-k", "slow"], ["server/test_slow.py", "server/test_fine.py", "-k",
                                            "slow"],
                 ["server/test_slow.py::test_slow", "server/test_fine.py"],
                 ["server/test_slow.py"]):
        run = _pytest(*part, cwd=tmp_path, env=env)
        assert run.returncode == 0, (part, run.stdout[-4000:])
        assert "part of the tier: not checked" in run.stdout, run.stdout[-4000:]
    # PARALLAX_TIER_BUDGET relaxes it (a factor; `off` checks nothing)
    run = _pytest("server/test_slow.py", "server/test_fine.py", cwd=tmp_path,
                  env={"PARALLAX_TIER_BUDGET": "3"})
    assert run.returncode == 0, run.stdout[-4000:]
    assert "budget 1 s   (whole tier)" in run.stdout, run.stdout[-4000:]


@pytest.mark.parametrize("setting, scale", [("", 1.0), ("on", 1.0), ("off", None),
                                            ("0", None), ("2", 2.0), ("1.5", 1.5)])
def test_the_budget_setting(setting, scale):
    assert tier_budget.budget_scale({tier_budget.ENV: setting}) == scale
    assert tier_budget.budget_scale({}) == 1.0


@pytest.mark.parametrize("setting", ["fast", "-1", "nan"])
def test_a_bad_budget_setting_is_refused(setting):
    with pytest.raises(pytest.UsageError, match="PARALLAX_TIER_BUDGET"):
        tier_budget.budget_scale({tier_budget.ENV: setting})


def test_every_tier_has_a_budget():
    assert set(tiers.BUDGET_S) == set(tiers.TIERS)
    assert all(budget > 0 for budget in tiers.BUDGET_S.values())
    assert set(tiers.TIMEOUT_S) <= set(tiers.TIERS)


TIMED_TESTS = """
import signal
import subprocess
import time
from pathlib import Path

import pytest


@pytest.fixture
def child():
    proc = subprocess.Popen(["sleep", "300"])
    Path("child.pid").write_text(str(proc.pid))
    yield proc
    proc.kill()
    proc.wait()
    Path("teardown.ran").write_text("yes")


@pytest.mark.timeout(1)
def test_hangs_in_python(child):
    time.sleep(60)


@pytest.mark.timeout(1)
def test_hangs_where_the_signal_cannot_reach(child):
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})  # as if stuck in C code
    time.sleep(60)


def test_after():
    pass
"""


def test_a_test_past_its_limit_fails_its_fixtures_stop_its_processes_and_the_run_goes_on(
        tmp_path):
    _tiers_dir(tmp_path)
    (tmp_path / "server" / "test_timed.py").write_text(TIMED_TESTS)
    run = _pytest("server/test_timed.py", "-k", "python or after", cwd=tmp_path)
    assert run.returncode == 1, run.stdout[-4000:]
    assert "1 failed, 1 passed" in run.stdout.splitlines()[-1], run.stdout[-4000:]
    assert "Timeout (>1.0s)" in run.stdout, run.stdout[-4000:]
    assert (tmp_path / "teardown.ran").exists()  # the fixture's teardown stopped its child
    assert not Path(f"/proc/{(tmp_path / 'child.pid').read_text()}").exists()


def test_a_test_the_signal_cannot_reach_ends_the_run_at_the_backstop(tmp_path):
    """The main thread never runs Python again (SIGALRM blocked, as in C code that never
    returns): the thread backstop prints the stacks and ends the run, BACKSTOP_S later."""
    _tiers_dir(tmp_path)
    with open(tmp_path / "conftest.py", "a") as conftest:
        conftest.write("\nBACKSTOP_S = 1\n")
    (tmp_path / "server" / "test_timed.py").write_text(TIMED_TESTS)
    started = time.monotonic()
    run = _pytest("server/test_timed.py", "-k", "reach or after", cwd=tmp_path)
    assert time.monotonic() - started < 30, run.stdout[-4000:]
    assert run.returncode == 1, run.stdout[-4000:]
    assert "SIGALRM could not interrupt it" in run.stdout, run.stdout[-4000:]
    assert "Timeout" in run.stdout and "time.sleep(60)" in run.stdout, run.stdout[-4000:]
    assert " passed" not in run.stdout  # the run ended there
    pid = int((tmp_path / "child.pid").read_text())  # (no teardown ran: this test's to end)
    if Path(f"/proc/{pid}").exists():
        os.kill(pid, signal.SIGKILL)
