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

    def __init__(self, tiers: dict[str, list[str]], budgets: dict[str, float],
                 scale: float | None) -> None:
        self.tiers, self.budgets, self.scale = tiers, budgets, scale
        self.tier_of = {name: tier for tier, names in tiers.items() for name in names}
        self.seconds: dict[str, float] = defaultdict(float)
        self.per_test: dict[str, float] = defaultdict(float)
        self.modules: set[str] = set()       # test files collected (a skipped module too)
        self.narrowed: set[str] = set()      # files given with ::, or with tests deselected
        self.pending: dict[str, set[str]] = defaultdict(set)  # tier -> tests not finished
        self.over: list[tuple[str, float, float]] = []

    def _tier(self, nodeid: str) -> str | None:
        return self.tier_of.get(Path(nodeid.split("::")[0]).name)

    def pytest_configure(self, config) -> None:
        for arg in config.args:
            if "::" in arg:
                self.narrowed.add(Path(arg.split("::")[0]).name)

    def pytest_collectreport(self, report) -> None:
        if report.nodeid.endswith(".py") and "::" not in report.nodeid:
            self.modules.add(Path(report.nodeid).name)

    def pytest_deselected(self, items) -> None:
        self.narrowed.update(item.path.name for item in items)

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
        names = set(self.tiers[tier])
        return (names <= self.modules and not names & self.narrowed
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
