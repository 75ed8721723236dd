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


def test_a_unit_test_may_start_no_process_and_import_no_tensorflow(tmp_path):
    shutil.copy(ROOT / "tests" / "conftest.py", tmp_path)
    (tmp_path / "tiers.py").write_text(
        f"TIER_OF = {{'test_bad.py': 'unit'}}\nGUARDED = {tiers.GUARDED!r}\n")
    (tmp_path / "test_bad.py").write_text(
        "import subprocess\n\n\n"
        "def test_starts_a_process():\n    subprocess.run(['true'])\n\n\n"
        "def test_imports_tensorflow():\n    import tensorflow  # noqa: F401\n")
    run = _pytest("test_bad.py", cwd=tmp_path)
    assert run.returncode == 1, run.stdout[-4000:]
    assert "2 failed" in run.stdout.splitlines()[-1]
    assert "a unit test started a process" in run.stdout
    assert "a unit test imported tensorflow" in run.stdout
