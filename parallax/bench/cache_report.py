"""The row cache's part of a benchmark report (`parallax bench --cache-staleness 0,1,4`): per
workload, network and worker count, hybrid against each hybrid_cache<S> system of the same
alternating rounds: throughput, what the servers answered to pulls (rows, bytes, requests
per worker per step, from their Stats over the timed windows), rank 0's cache hit rate, and
the loss against hybrid's at the same steps; a PNG of each (loss curves beside
throughput), and the issue's targets (ctr at the most workers, staleness <= 4).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from parallax.bench.figures import figure_row, slug
from parallax.bench.results import Results, Run
from parallax.bench.summary import PARALLAX, SYSTEMS, _rank, cache_staleness
from parallax.bench.workloads import POOL_BATCHES

SMOOTH = POOL_BATCHES  # steps of the plotted moving average: the batches cycle with it
LOSS_TAIL = 3 * POOL_BATCHES  # steps: a final loss is the mean over the last 48 common steps
BYTES_CUT_TARGET = 0.50  # the issue's targets at staleness <= TARGET_STALENESS on ctr: bytes
SPEEDUP_TARGET = 1.3     # pulled cut by half, throughput 1.3x uncached hybrid's,
LOSS_TOLERANCE = 0.01    # final loss within 1% of uncached
TARGET_STALENESS = 4
TARGET_WORKLOAD = "ctr"


@dataclass(frozen=True)
class CacheRow:
    """One system at one (workload, network, workers) point; medians over its ok rounds.
    Ratios are against hybrid's (uncached) medians; loss_change pairs each round with
    hybrid's run of the same round."""

    system: str
    staleness: int | None  # None: hybrid, uncached
    rounds: tuple[float, ...]  # samples/s of each ok round, in round order
    samples_per_s: float | None
    speedup: float | None
    pull_rows: float | None  # rows the servers answered per worker per step
    pull_bytes: float | None
    pull_requests: float | None
    bytes_cut: float | None  # 1 - pull_bytes / hybrid's
    received: float | None  # a worker's received bytes per step (interface counters)
    hit_rate: float | None  # rank 0's cache: hits / rows asked of it
    loss: float | None  # final loss: mean over the slice's last LOSS_TAIL common steps
    loss_change: float | None  # final loss / hybrid's same-round final loss - 1


@dataclass(frozen=True)
class CacheSlice:
    """hybrid and its cache systems at one point: `where` is (workload, network, workers);
    `runs` their ok runs."""

    where: tuple[str, str, int]
    rows: tuple[CacheRow, ...]
    runs: tuple[Run, ...]
    loss_steps: int  # the steps every run ran: final losses are taken over the last of them

    workload = property(lambda self: self.where[0])
    network = property(lambda self: self.where[1])
    workers = property(lambda self: self.where[2])

    @property
    def stem(self) -> str:
        return f"{slug(self.workload)}_{slug(self.network)}_w{self.workers}"


def _median(values) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _steps(run: Run) -> int:
    return sum(int(w.get("steps", 0)) for w in run.windows)


def _per_worker_step(run: Run, key: str) -> float | None:
    steps = _steps(run)
    value = run.counters.get(key)
    return None if value is None or not steps else value / (steps * run.workers)


def _hit_rate(run: Run) -> float | None:
    c = run.counters
    asked = sum(c.get(f"cache_{k}", 0) for k in ("hits", "misses", "stale"))
    return c["cache_hits"] / asked if asked and "cache_hits" in c else None


def final_loss(losses: Sequence[float], steps: int) -> float | None:
    """The mean loss over the last LOSS_TAIL of the first `steps` steps (None: fewer ran)."""
    if steps <= 0 or len(losses) < steps:
        return None
    return statistics.fmean(losses[max(0, steps - LOSS_TAIL):steps])


def _loss_change(run: Run, base: Run | None, steps: int) -> float | None:
    mine = final_loss(run.losses, steps)
    theirs = final_loss(base.losses, steps) if base is not None else None
    return None if mine is None or not theirs else mine / theirs - 1


def _row(system: str, runs: list[Run], base: dict[int, Run], hybrid: CacheRow | None,
         steps: int) -> CacheRow:
    ok = sorted((r for r in runs if r.ok), key=lambda r: r.round)
    speed = _median(r.samples_per_s for r in ok)
    pull_bytes = _median(_per_worker_step(r, "server_pull_bytes") for r in ok)
    received = _median(r.worker_bytes_per_step.received if r.worker_bytes_per_step else None
                       for r in ok)
    return CacheRow(
        system, cache_staleness(system), tuple(r.samples_per_s for r in ok), speed,
        speed / hybrid.samples_per_s if hybrid and speed and hybrid.samples_per_s else None,
        _median(_per_worker_step(r, "server_pull_rows") for r in ok), pull_bytes,
        _median(_per_worker_step(r, "server_pull_requests") for r in ok),
        1 - pull_bytes / hybrid.pull_bytes if hybrid and pull_bytes is not None and
        hybrid.pull_bytes else None,
        received, _median(_hit_rate(r) for r in ok),
        _median(final_loss(r.losses, steps) for r in ok),
        _median(_loss_change(r, base.get(r.round), steps) for r in ok))


def cache_slices(results: Results) -> list[CacheSlice]:
    """Every (workload, network, workers) point that ran a cache system beside hybrid."""
    groups: dict[tuple[str, str, int], list[Run]] = {}
    for run in results.runs:
        if run.system == PARALLAX or cache_staleness(run.system) is not None:
            groups.setdefault((run.workload, run.network.name, run.workers), []).append(run)
    out = []
    for (workload, network, workers), runs in groups.items():
        systems = sorted({r.system for r in runs}, key=lambda s: _rank(s, SYSTEMS))
        if not any(cache_staleness(s) is not None for s in systems):
            continue
        base = {r.round: r for r in runs if r.system == PARALLAX and r.ok}
        ok = tuple(r for r in runs if r.ok)
        steps = min((len(r.losses) for r in ok if r.losses), default=0)
        hybrid = _row(PARALLAX, [r for r in runs if r.system == PARALLAX], base, None,
                      steps) if base else None
        rows = [hybrid] if hybrid else []
        rows += [_row(s, [r for r in runs if r.system == s], base, hybrid, steps)
                 for s in systems if s != PARALLAX]
        out.append(CacheSlice((workload, network, workers), tuple(rows), ok, steps))
    return out


def _percent(value: float | None) -> float | None:
    """A fraction rounded to whole percent, -0 as 0 (a cut of -0.02% reads "0%")."""
    return None if value is None else round(value, 2) + 0.0


def _fmt(value: float | None, spec: str, none: str = "-") -> str:
    return none if value is None else format(value, spec)


def _table(s: CacheSlice) -> list[str]:
    lines = ["| system | samples/s by round | median | vs hybrid | rows pulled /worker/step "
             "| bytes pulled /worker/step | cut | pull requests /worker/step "
             "| received B /worker/step | hit rate | final loss | loss vs hybrid |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in s.rows:
        rounds = ", ".join(f"{v:,.0f}" for v in r.rounds) or "failed"
        lines.append(
            f"| {r.system} | {rounds} | {_fmt(r.samples_per_s, ',.0f')} "
            f"| {_fmt(r.speedup, '.2f') + 'x' if r.speedup else '-'} | {_fmt(r.pull_rows, ',.0f')} "
            f"| {_fmt(r.pull_bytes, ',.0f')} | {_fmt(_percent(r.bytes_cut), '.0%')} "
            f"| {_fmt(r.pull_requests, '.1f')} | {_fmt(r.received, ',.0f')} "
            f"| {_fmt(r.hit_rate, '.1%')} | {_fmt(r.loss, '.4f')} "
            f"| {_fmt(None if r.loss_change is None else r.loss_change * 100, '+.3f')}% |")
    return lines


def targets(slices: Sequence[CacheSlice]) -> list[str]:
    """The issue's targets at the largest worker count of the target workload, per network:
    some staleness <= TARGET_STALENESS must cut pulled bytes by BYTES_CUT_TARGET, reach
    SPEEDUP_TARGET and keep the final loss within LOSS_TOLERANCE."""
    lines = []
    for s in slices:
        if s.workload != TARGET_WORKLOAD or s.workers != max(
                x.workers for x in slices if (x.workload, x.network) == (s.workload, s.network)):
            continue
        for r in (r for r in s.rows if r.staleness is not None and
                  r.staleness <= TARGET_STALENESS):
            checks = [("bytes cut", r.bytes_cut, BYTES_CUT_TARGET,
                       f"{_fmt(_percent(r.bytes_cut), '.0%')}"
                       f" (target >= {BYTES_CUT_TARGET:.0%})"),
                      ("throughput", r.speedup, SPEEDUP_TARGET,
                       f"{_fmt(r.speedup, '.2f')}x (target >= {SPEEDUP_TARGET}x)")]
            parts = [f"{name} {text}: {'met' if v is not None and v >= goal else 'missed'}"
                     for name, v, goal, text in checks]
            loss_ok = r.loss_change is not None and abs(r.loss_change) <= LOSS_TOLERANCE
            change = None if r.loss_change is None else r.loss_change * 100
            parts.append(f"final loss {_fmt(change, '+.3f')}% "
                         f"(target within {LOSS_TOLERANCE:.0%}): "
                         f"{'met' if loss_ok else 'missed'}")
            lines.append(f"- {s.workload} on {s.network}, {s.workers} workers, {r.system}: "
                         + "; ".join(parts))
    return lines


def section(results: Results, plot_files: Sequence[str] = ()) -> list[str]:
    """The report's "Row cache" section (nothing when no cache system ran)."""
    found = cache_slices(results)
    if not found:
        return []
    lines = ["## Row cache", "",
             f"hybrid against hybrid with a worker row cache (`hybrid_cache<S>`: "
             f"`parallax.RowCache`, staleness S) in the same alternating rounds. Rows, bytes "
             f"and requests pulled are what the servers answered (their Stats, every worker, "
             f"over the timed windows) per worker per step; the hit rate is rank 0's cache; "
             f"the final loss is rank 0's mean loss over the last {LOSS_TAIL} of the steps "
             f"every run of the point ran (the same batches), against hybrid's of the same "
             f"round.", ""]
    for s in found:
        lines += [f"### {s.workload} on {s.network}, {s.workers} workers", "",
                  f"Final losses over steps {max(1, s.loss_steps - LOSS_TAIL + 1)}-"
                  f"{s.loss_steps}.", "", *_table(s), ""]
        name = f"{PLOT_PREFIX}{s.stem}.png"
        if name in plot_files:
            lines += [f"![{Path(name).stem}]({name})", ""]
    lines += ["### Row cache targets", "", *(targets(found) or ["- not measured"]), ""]
    return lines


def _smoothed(values: Sequence[float]) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= SMOOTH:
            total -= values[i - SMOOTH]
        out.append(total / min(i + 1, SMOOTH))
    return out


def _mean_curve(runs: list[Run]) -> list[float]:
    """The rounds' loss curves averaged step by step, over the steps all of them ran."""
    curves = [r.losses for r in runs if r.losses]
    if not curves:
        return []
    n = min(len(c) for c in curves)
    return [statistics.fmean(c[i] for c in curves) for i in range(n)]


def plot(s: CacheSlice, path: Path) -> Path:
    """Loss curves (moving average, mean over rounds) beside samples/s per system."""
    fig, (loss_ax, speed_ax) = figure_row(2)
    for r in s.rows:
        curve = _mean_curve([run for run in s.runs if run.system == r.system])
        if curve:
            loss_ax.plot(range(1, len(curve) + 1), _smoothed(curve), label=r.system,
                         linewidth=1.2)
    loss_ax.set(xlabel="step", ylabel=f"rank 0's loss ({SMOOTH}-step moving average)",
                title=f"{s.workload} on {s.network}, {s.workers} workers: loss")
    loss_ax.grid(alpha=0.3)
    loss_ax.legend(fontsize="small")
    xs = range(len(s.rows))
    speed_ax.bar(list(xs), [r.samples_per_s or 0 for r in s.rows], 0.6, color="lightsteelblue",
                 label="median")
    for x, r in zip(xs, s.rows):
        speed_ax.scatter([x] * len(r.rounds), r.rounds, color="black", s=12, zorder=3)
    speed_ax.set_xticks(list(xs), [r.system.replace("hybrid_", "") for r in s.rows])
    speed_ax.set(ylabel="samples/s (bar: median; dots: rounds)",
                 title="throughput")
    speed_ax.grid(alpha=0.3, axis="y")
    fig.savefig(path)
    return path


PLOT_PREFIX = "cache_"


def is_plot(name: str) -> bool:
    """Whether a report PNG is one of this section's (shown inline there)."""
    return name.startswith(PLOT_PREFIX)


def plots(results: Results, out_dir: str | Path) -> list[Path]:
    """cache_<workload>_<network>_w<workers>.png for every cache slice."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return [plot(s, out / f"{PLOT_PREFIX}{s.stem}.png") for s in cache_slices(results)]
