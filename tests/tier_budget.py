"""Each tier's time budget (`BUDGET_S` in tests/tiers.py), checked at the end of a run.

A tier's time is the sum of its tests' setup, call and teardown durations in this run (what
`--durations` reports; collection and imports are not in it). When a run has the whole tier
(every file of it collected, no test deselected by -k, -m or --deselect, no file narrowed to
some of its tests with `::`, every test finished: no -x stop) and the tier took longer than
its budget, the run fails and names the tier's slowest tests. A part of a tier is reported,
never checked.

PARALLAX_TIER_BUDGET relaxes it: `off` (or 0) checks nothing, a number scales every budget
(2: twice as long, for a slow or busy machine). The budgets have at least 1.5x margin over the
times measured on 2 quiet cores, so that a loaded CI machine does not fail on them.
"""
from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path
from typing import Callable

import pytest

ENV = "PARALLAX_TIER_BUDGET"
SLOWEST = 10  # tests named when a tier is over its budget


def budget_scale(environ=os.environ) -> float | None:
    """The factor PARALLAX_TIER_BUDGET gives every budget; None when it turns them off."""
    text = environ.get(ENV, "").strip().lower()
    if text in ("", "on"):
        return 1.0
    if text in ("off", "0", "no", "false"):
        return None
    try:
        scale = float(text)
    except ValueError:
        scale = -1.0
    if not scale > 0:
        raise pytest.UsageError(f"{ENV}={environ[ENV]!r}: give off, or a factor for every "
                                f"tier's budget (e.g. 2 on a slow machine)")
    return scale


class TierBudget:
    """The pytest plugin: sums durations per tier, finds the tiers that ran whole, and fails
    the session when one of them is over its (scaled) budget."""

    def __init__(self, tiers: dict[str, list[Path]], tier_of: Callable[[Path], str | None],
                 budgets: dict[str, float], scale: float | None) -> None:
        """`tiers`: each tier's test files; `tier_of`: a test file's tier (tests/tiers.py)."""
        self.tiers = {tier: {Path(f).resolve() for f in files} for tier, files in tiers.items()}
        self.tier_of, self.budgets, self.scale = tier_of, budgets, scale
        self.root = Path.cwd()  # node ids are relative to the rootdir (pytest_configure)
        self._tier_of_file: dict[str, str | None] = {}  # node id's file part -> its tier
        self.seconds: dict[str, float] = defaultdict(float)
        self.per_test: dict[str, float] = defaultdict(float)
        self.modules: set[Path] = set()      # test files collected (a skipped module too)
        self.narrowed: set[Path] = set()     # files given with ::, or with tests deselected
        self.pending: dict[str, set[str]] = defaultdict(set)  # tier -> tests not finished
        self.over: list[tuple[str, float, float]] = []

    def _file(self, nodeid: str) -> Path:
        return (self.root / nodeid.split("::")[0]).resolve()

    def _tier(self, nodeid: str) -> str | None:
        file = nodeid.split("::")[0]
        if file not in self._tier_of_file:
            self._tier_of_file[file] = self.tier_of(self._file(file))
        return self._tier_of_file[file]

    def pytest_configure(self, config) -> None:
        self.root = config.rootpath
        for arg in config.args:  # relative to the invocation directory, as given
            if "::" in arg:
                self.narrowed.add((config.invocation_params.dir / arg.split("::")[0]).resolve())

    def pytest_collectreport(self, report) -> None:
        if report.nodeid.endswith(".py") and "::" not in report.nodeid:
            self.modules.add(self._file(report.nodeid))

    def pytest_deselected(self, items) -> None:
        self.narrowed.update(item.path.resolve() for item in items)

    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self, session) -> None:
        for item in session.items:
            tier = self._tier(item.nodeid)
            if tier:
                self.pending[tier].add(item.nodeid)

    def pytest_runtest_logreport(self, report) -> None:
        tier = self._tier(report.nodeid)
        if tier is None:
            return
        self.seconds[tier] += report.duration
        self.per_test[report.nodeid] += report.duration
        if report.when == "teardown":
            self.pending[tier].discard(report.nodeid)

    def whole(self, tier: str) -> bool:
        files = self.tiers[tier]
        return (files <= self.modules and not files & self.narrowed
                and not self.pending[tier])

    def pytest_sessionfinish(self, session) -> None:
        if self.scale is None:
            return
        for tier in self.tiers:
            budget = self.budgets.get(tier)
            if budget and self.whole(tier) and self.seconds[tier] > budget * self.scale:
                self.over.append((tier, self.seconds[tier], budget * self.scale))
        if self.over:
            tiers = ", ".join(f"{t} {s:.0f} s > {b:.0f} s" for t, s, b in self.over)
            session.shouldfail = (f"tier budget exceeded: {tiers} (tests/tiers.py BUDGET_S; "
                                  f"{ENV}=off or a factor relaxes it)")
            if session.exitstatus == pytest.ExitCode.OK:
                session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        ran = [t for t in self.tiers if self.seconds.get(t)]
        if not ran:
            return
        write = terminalreporter.write_line
        terminalreporter.write_sep("=", "tier times (tests/tiers.py BUDGET_S)")
        for tier in ran:
            budget = self.budgets.get(tier)
            limit = (f"budget {budget * self.scale:.0f} s" if budget and self.scale
                     else "no budget" if not budget else f"budget off ({ENV})")
            scope = "whole tier" if self.whole(tier) else "part of the tier: not checked"
            write(f"{tier:<12} {self.seconds[tier]:8.1f} s   {limit}   ({scope})")
        for tier, seconds, budget in self.over:
            terminalreporter.write_sep("!", f"tier {tier} took {seconds:.0f} s, over its "
                                            f"budget of {budget:.0f} s", red=True)
            slowest = sorted(((s, n) for n, s in self.per_test.items()
                              if self._tier(n) == tier), reverse=True)[:SLOWEST]
            for s, name in slowest:
                write(f"{s:8.1f} s  {name}", red=True)
