"""The test tiers themselves (tests/tiers.py): the unit tier passes on its own, as
`make test-fast` runs it, and its guard fails a unit test that starts a process or imports
TensorFlow."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import tiers

ROOT = Path(__file__).resolve().parents[1]


def _pytest(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                          cwd=cwd, capture_output=True, text=True, timeout=600)


def test_every_test_file_has_one_tier():
    files = sorted(p.name for p in (ROOT / "tests").glob("test_*.py"))
    listed = [name for names in tiers.TIERS.values() for name in names]
    assert sorted(listed) == files


def test_the_unit_tier_passes_alone():
    run = _pytest(*tiers.files("unit"), cwd=ROOT)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout.splitlines()[-1]


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


def test_a_unit_test_may_start_no_process_listen_or_import_tensorflow(tmp_path):
    shutil.copy(ROOT / "tests" / "conftest.py", tmp_path)
    (tmp_path / "tiers.py").write_text(
        f"TIER_OF = {{'test_bad.py': 'unit'}}\nGUARDED = {tiers.GUARDED!r}\n")
    (tmp_path / "test_bad.py").write_text(BAD_UNIT_TESTS)
    run = _pytest("test_bad.py", cwd=tmp_path)
    assert run.returncode == 1, run.stdout[-4000:]
    assert "4 failed" in run.stdout.splitlines()[-1], run.stdout[-4000:]  # and 1 error:
    assert "1 error" in run.stdout.splitlines()[-1]  # the module fixture's
    for what in ("started a process", "opened a listening socket", "imported tensorflow"):
        assert f"a unit test {what}" in run.stdout


def test_a_tier_is_selected_by_marker():
    """`pytest -m unit` collects (imports) every file given, TensorFlow's too, then runs the
    unit tests alone: that is not the unit tests' import."""
    run = _pytest("-m", "unit", "tests/test_plan.py", "tests/test_capacity.py", cwd=ROOT)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "deselected" in run.stdout.splitlines()[-1]
