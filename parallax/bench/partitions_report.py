"""The report of `parallax bench partitions`: per workload and topology, the shard-count
sweep beside the tuned run (tuned / best sweep point, search overhead over a 1000-step run),
as markdown, summary.json and one PNG each (parallax.bench.plots.partition_plot)."""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from parallax.errors import ConfigError
from parallax.placement.tuning import counts_text

RATIO_TARGET = 0.95       # tuned samples/s over the best sweep point's
OVERHEAD_TARGET = 0.10    # search overhead over a run of REFERENCE_STEPS steps
REFERENCE_STEPS = 1000


@dataclass(frozen=True)
class Point:
    """One workload on one topology and network: the sweep, the tuned run, the targets."""

    workload: str
    network: str
    workers: int
    servers: int
    global_batch: int
    sweep: tuple[tuple[int, float | None, str], ...]   # (shards, samples/s median, note)
    tuned_samples_per_s: float | None
    tuned_note: str
    tuning: dict | None          # the (last ok) tuned run's search report

    @property
    def best(self) -> tuple[int, float] | None:
        measured = [(n, s) for n, s, _ in self.sweep if s is not None]
        return max(measured, key=lambda p: p[1]) if measured else None

    @property
    def ratio(self) -> float | None:
        best = self.best
        if best is None or self.tuned_samples_per_s is None:
            return None
        return self.tuned_samples_per_s / best[1]

    @property
    def choice_ratio(self) -> float | None:
        """The sweep's own figure at the tuned choice over the best: the decision's quality
        without the tuned run's noise (None unless every table got one count that was swept;
        counts capped by a table's rows read as that count)."""
        chosen = set(((self.tuning or {}).get("chosen") or {}).values())
        best = self.best
        at = {n: s for n, s, _ in self.sweep if s is not None}
        if best is None or len(chosen) != 1:
            return None
        n = chosen.pop()
        return at[n] / best[1] if n in at else None

    @property
    def best_step_seconds(self) -> float | None:
        best = self.best
        return None if best is None else self.global_batch / best[1]

    @property
    def overhead(self) -> float | None:
        """overhead_seconds over REFERENCE_STEPS steps at the best sweep point's pace."""
        step = self.best_step_seconds
        seconds = (self.tuning or {}).get("overhead_seconds")
        if step is None or not isinstance(seconds, (int, float)):
            return None
        return seconds / (REFERENCE_STEPS * step)

    def curve(self) -> list[tuple[float, float]]:
        """The tuner's fitted curve as (shards, samples/s)."""
        raw = (self.tuning or {}).get("fitted_curve") or []
        return [(float(n), self.global_batch / s) for n, s in raw if s and s > 0]

    def sampled(self) -> list[tuple[float, float, bool]]:
        """The tuner's samples as (shards, samples/s, every table at that count); a sample
        whose tables have different counts is placed at its largest."""
        out = []
        for sample in (self.tuning or {}).get("samples") or []:
            counts, seconds = sample.get("counts") or {}, sample.get("step_seconds")
            if counts and seconds and seconds > 0:
                out.append((float(max(counts.values())), self.global_batch / seconds,
                            len(set(counts.values())) == 1))
        return out


def load(path: str | Path) -> dict:
    """The partitions results file, checked: the harness's fields (results.load) and ours."""
    from parallax.bench.results import load as load_runs
    load_runs(path)  # ConfigError naming the file and field for a malformed run
    raw = json.loads(Path(path).read_text())
    for i, run in enumerate(raw["runs"]):
        where = f"results file {path}: runs[{i}]"
        shards, tuned = run.get("shards", "missing"), run.get("tuned", "missing")
        if not isinstance(tuned, bool):
            raise ConfigError(f"{where}.tuned must be true or false, got {tuned!r}")
        if tuned != (shards is None) or (shards is not None and not isinstance(shards, int)):
            raise ConfigError(f"{where}: shards must be an int for a sweep run and null for "
                              f"the tuned run, got shards={shards!r}, tuned={tuned!r}")
        if not isinstance(run.get("tuning"), (dict, type(None))):
            raise ConfigError(f"{where}.tuning must be an object or null")
    return raw


def _note(runs: list[dict]) -> str:
    failed = [r for r in runs if r["status"] != "ok"]
    if not failed:
        return ""
    error = (failed[-1]["error"] or "failed").splitlines()[0]
    kind = "timed out" if error.startswith("timed out") else "failed"
    return f"{len(failed)}/{len(runs)} {kind}: {error[:120]}"


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(raw: dict) -> list[Point]:
    groups: dict[tuple, list[dict]] = {}
    for run in raw["runs"]:
        key = (run["workload"], run["network"]["name"], run["workers"], run["servers"])
        groups.setdefault(key, []).append(run)
    points = []
    for key, runs in groups.items():
        sweep = []
        for n in sorted({r["shards"] for r in runs if not r["tuned"]}):
            at = [r for r in runs if r["shards"] == n and not r["tuned"]]
            sweep.append((n, _median(r["samples_per_s"] for r in at if r["status"] == "ok"),
                          _note(at)))
        tuned = [r for r in runs if r["tuned"]]
        ok = [r for r in tuned if r["status"] == "ok"]
        reports = [r["tuning"] for r in tuned if r["tuning"]]
        tuning = None
        if reports:
            tuning = dict(reports[-1])
            overheads = [t.get("overhead_seconds") for t in reports]
            if all(isinstance(o, (int, float)) for o in overheads):
                tuning["overhead_seconds"] = statistics.median(overheads)
        points.append(Point(*key, runs[0]["global_batch"], tuple(sweep),
                            _median(r["samples_per_s"] for r in ok),
                            _note(tuned) if tuned else "not run", tuning))
    return points


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _verdicts(p: Point) -> tuple[str, str]:
    ratio = "not measured" if p.ratio is None else \
        ("met" if p.ratio >= RATIO_TARGET else "missed")
    overhead = "not measured" if p.overhead is None else \
        ("met" if p.overhead < OVERHEAD_TARGET else "missed")
    return ratio, overhead


def _summary_row(p: Point) -> list[str]:
    best = p.best
    ratio, overhead = _verdicts(p)
    tuned = "n/a" if p.tuned_samples_per_s is None else f"{p.tuned_samples_per_s:,.0f}"
    chosen = counts_text((p.tuning or {}).get("chosen") or {})
    return [p.workload, f"{p.workers}x{p.servers}",
            "n/a" if best is None else f"{best[1]:,.0f} @ {best[0]}", tuned,
            "n/a" if p.ratio is None else f"{p.ratio:.3f} ({ratio})",
            "n/a" if p.choice_ratio is None else f"{p.choice_ratio:.3f}",
            f"{_pct(p.overhead)} ({overhead})", chosen]


def _point_section(p: Point, plot: str | None) -> list[str]:
    best = p.best
    lines = [f"### {p.workload}, {p.workers} workers x {p.servers} servers ({p.network})", "",
             "| shards | samples/s | / best | note |", "|---:|---:|---:|---|"]
    for n, sps, note in p.sweep:
        rel = "n/a" if sps is None or best is None else f"{sps / best[1]:.3f}"
        lines.append(f"| {n} | {'failed' if sps is None else f'{sps:,.0f}'} | {rel} | "
                     f"{note} |")
    tuned = f"{p.tuned_samples_per_s:,.0f}" if p.tuned_samples_per_s is not None else \
        ("n/a" if p.tuned_note == "not run" else "failed")
    lines.append(f"| tuned | {tuned} | "
                 f"{'n/a' if p.ratio is None else f'{p.ratio:.3f}'} | {p.tuned_note} |")
    lines.append("")
    t = p.tuning
    if t:
        def num(key: str, fmt: str = "{:.2f}") -> str:
            value = t.get(key, t.get("final_" + key))  # the tuner's final_reshard_seconds
            return fmt.format(value) if isinstance(value, (int, float)) else "n/a"
        lines += [f"- search: {len(t.get('samples') or [])} samples, "
                  f"{num('search_steps', '{:.0f}')} steps, {num('search_seconds')} s; decided "
                  f"at step {num('decided_at_step', '{:.0f}')}; from cache: "
                  f"{t.get('from_cache', 'n/a')}",
                  f"- overhead: {num('overhead_seconds')} s (final resharding "
                  f"{num('reshard_seconds')} s) = {_pct(p.overhead)} of {REFERENCE_STEPS} "
                  f"steps at {_num(p.best_step_seconds)} s/step (the best sweep point)",
                  f"- chosen: {counts_text(t.get('chosen') or {})}", ""]
    if plot:
        lines += [f"![{Path(plot).stem}]({plot})", ""]
    return lines


def _num(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4g}"


def markdown(raw: dict, points: Sequence[Point], plots: dict[tuple, str]) -> str:
    m = raw["meta"]
    lines = ["# Partition search benchmark", "",
             f"- date: {m['date']}", f"- commit: {m['commit']}", f"- command: `{m['command']}`",
             f"- machine: {m['machine']}", *(f"- note: {n}" for n in m["notes"]), "",
             f"Targets: tuned within {100 * (1 - RATIO_TARGET):g}% of the best sweep point "
             f"(tuned / best >= {RATIO_TARGET}); search overhead under "
             f"{100 * OVERHEAD_TARGET:g}% of a {REFERENCE_STEPS}-step run (the tuner's "
             f"overhead_seconds over {REFERENCE_STEPS} steps at the best sweep point's pace). "
             f"'sweep at choice / best' reads the sweep's own figure at the tuned choice: the "
             f"decision's quality apart from run-to-run noise.", "",
             "| workload | W x S | best sweep (samples/s @ shards) | tuned samples/s | "
             "tuned / best | sweep at choice / best | overhead | chosen shards |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    lines += ["| " + " | ".join(_summary_row(p)) + " |" for p in points] + [""]
    for p in points:
        lines += _point_section(p, plots.get(_key(p)))
    return "\n".join(lines).rstrip() + "\n"


def _key(p: Point) -> tuple:
    return (p.workload, p.network, p.workers, p.servers)


def write_report(results_path: str | Path, out_dir: str | Path) -> dict[str, Path]:
    """report.md, summary.json and one PNG per workload and topology, keyed by file name."""
    from parallax.bench.figures import slug
    from parallax.bench.plots import partition_plot
    raw = load(results_path)
    points = summarize(raw)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    plots: dict[tuple, str] = {}
    for p in points:
        path = out / (f"partitions_{slug(p.workload)}_{p.workers}x{p.servers}_"
                      f"{slug(p.network)}.png")
        partition_plot(path, f"{p.workload}, {p.workers} workers x {p.servers} servers, "
                             f"{p.network}",
                       [(n, s) for n, s, _ in p.sweep if s is not None],
                       p.tuned_samples_per_s, p.curve(), p.sampled())
        written[path.name], plots[_key(p)] = path, path.name
    written["report.md"] = out / "report.md"
    written["report.md"].write_text(markdown(raw, points, plots))
    summary = [{"workload": p.workload, "network": p.network, "workers": p.workers,
                "servers": p.servers, "sweep": p.sweep, "best": p.best,
                "tuned_samples_per_s": p.tuned_samples_per_s, "ratio": p.ratio,
                "choice_ratio": p.choice_ratio,
                "overhead": p.overhead, "targets": dict(zip(("ratio", "overhead"),
                                                            _verdicts(p))),
                "tuning": p.tuning} for p in points]
    written["summary.json"] = out / "summary.json"
    written["summary.json"].write_text(json.dumps(summary, indent=1) + "\n")
    return written
