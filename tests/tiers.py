"""The test tiers (Horovod's single / parallel / integration split, by marker), one place.

- `unit`: no TensorFlow, no process, no socket server: seconds (`make test-fast`). When a
  run selects only unit tests, importing TensorFlow or starting a process fails the test.
- `server`: real parameter-server processes on loopback, driven by the client; no TensorFlow.
- `tf`: TensorFlow in this process (the strategy, Keras), usually with real servers.
- `parallel`: several worker processes (`parallax run`, horovodrun) or the benchmark's
  namespaces and cgroups.
- `integration`: the command line end to end, containers and manifests, chaos.

The tier of a test file is the folder it is in: `tests/unit/`, `tests/server/`, `tests/tf/`,
`tests/parallel/`, `tests/integration/` (a test file elsewhere is a usage error; helper scripts
and modules that are not tests live in `tests/helpers/`). `make test` runs every tier, `make
test-fast` the folder `tests/unit`.

Time: each test has a limit (pytest-timeout: pyproject.toml's default, `TIMEOUT_S` for a
tier, `@pytest.mark.timeout(S)` for a long test), and each tier a budget (`BUDGET_S`: the sum
of its tests' durations in a run of the whole tier; tests/tier_budget.py checks it).
"""
from __future__ import annotations

from pathlib import Path

TIERS = ("unit", "server", "tf", "parallel", "integration")
TESTS = Path(__file__).resolve().parent  # tests/: each tier is a folder of it

# Seconds a whole tier's tests may take together (setup, call and teardown, as --durations
# counts them); `make test` fails past it, naming the tier's slowest tests. Each is about
# 1.6x or more the slowest of the two fresh-clone CI runs of 2026-12-06 on this project's
# 2-core machine (docs/testing.md has the figures), so a noisy CI machine does not fail on
# them while a tier that doubles does. A tier that grows for good raises its budget here,
# with its new figure. PARALLAX_TIER_BUDGET=off or a factor relaxes them all.
BUDGET_S = {"unit": 120, "server": 450, "tf": 800, "parallel": 2000, "integration": 1200}
# A tier's own limit per test, where pyproject.toml's default (300 s) does not fit it: a unit
# test takes milliseconds; a parallel one may run several multi-worker jobs in a module
# fixture, which the first test to need it pays for (test_strategy_equivalence's, 660 s on
# a loaded machine, has 1800 s of its own).
TIMEOUT_S = {"unit": 60, "parallel": 900}
GUARDED = ("tensorflow", "keras", "horovod")  # what a unit-only run may not import


def tier_of(path: Path | str) -> str | None:
    """The tier of the test file at `path`: the tier folder of tests/ it sits in (None when it
    sits in none: tests/conftest.py refuses it)."""
    folder = Path(path).resolve().parent
    return folder.name if folder.parent == TESTS and folder.name in TIERS else None


def files(tier: str) -> list[Path]:
    """The test files of `tier`."""
    return sorted((TESTS / tier).glob("test_*.py"))
