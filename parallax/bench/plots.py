"""The report's PNG plots: throughput against workers per system, bytes per worker per
step per system beside the analytic model, the step-time model's projection past this
machine (drawn by `projection.plot`), and (`parallax bench partitions`) throughput
against shard count beside the partition search's choice and fitted curve. Drawn with
matplotlib's Agg canvas directly, so nothing depends on pyplot's global state or on a
display."""
from __future__ import annotations

from pathlib import Path

from matplotlib.ticker import NullLocator

from parallax.bench import projection
from parallax.bench.figures import figure, slug
from parallax.bench.results import Results
from parallax.bench.summary import Slice, slices, summarize


def _throughput_plot(s: Slice, path: Path) -> None:
    fig, ax = figure()
    for system in s.systems:
        points = [(n, r.samples_per_s) for n in s.workers
                  if (r := s.get(system, n)) and r.samples_per_s is not None]
        if points:
            ax.plot(*zip(*points), marker="o", label=system)
    ax.set_xscale("log", base=2)
    ax.set_xticks(s.workers, [str(n) for n in s.workers])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set(xlabel="workers", ylabel="samples/s (median of ok rounds)",
           title=f"{s.workload} on {s.network}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.savefig(path)


def _bytes_plot(s: Slice, path: Path) -> bool:
    """Grouped sent/received bars at the largest worker count; False (nothing written) when no
    system's bytes were measured there."""
    rows = [r for p in s.systems if (r := s.get(p, s.workers[-1])) and r.measured]
    if not rows:
        return False
    fig, ax = figure()
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r.measured.sent for r in rows], 0.4, label="sent")
    ax.bar([x + 0.2 for x in xs], [r.measured.received for r in rows], 0.4, label="received")
    modelled = [(x, r.analytic.total / 2) for x, r in zip(xs, rows) if r.analytic]
    if modelled:
        ax.scatter(*zip(*modelled), marker="_", s=400, color="black", zorder=3,
                   label="analytic (mean of directions)")
    minimum = rows[0].minimum
    if minimum is not None:
        ax.axhline(minimum.total / 2, color="red", linestyle="--", label="analytic minimum")
    ax.set_yscale("log")
    ax.set_xticks(list(xs), [r.system for r in rows])
    ax.set(ylabel="bytes per worker per step",
           title=f"{s.workload} on {s.network}, {s.workers[-1]} workers")
    ax.legend(fontsize="small")
    fig.savefig(path)
    return True


def plots(results: Results, out_dir: str | Path) -> list[Path]:
    """throughput_<workload>_<network>.png and, where bytes were measured, bytes_<...>.png;
    projection_<workload>.png where the step-time model could be fitted."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for s in slices(summarize(results)):
        stem = f"{slug(s.workload)}_{slug(s.network)}.png"
        _throughput_plot(s, out / f"throughput_{stem}")
        written.append(out / f"throughput_{stem}")
        if _bytes_plot(s, out / f"bytes_{stem}"):
            written.append(out / f"bytes_{stem}")
    found = projection.projections(results)
    networks = {r.network.name: r.network for r in results.runs}
    for workload, network in dict.fromkeys((p.workload, p.network) for p in found):
        part = [p for p in found if (p.workload, p.network) == (workload, network)]
        nominal = networks[network].nominal_rate_mbit
        path = out / projection.plot_name(workload, network, found)
        written.append(projection.plot(part, path, None if nominal is None else nominal / 1e3))
    return written


def partition_plot(path: Path, title: str, sweep: list[tuple[int, float]],
                   tuned: float | None, curve: list[tuple[float, float]],
                   sampled: list[tuple[float, float, bool]]) -> Path:
    """samples/s against shards per table: the sweep's measured points, the tuned run's
    throughput (a horizontal line), the search's fitted curve and the layouts it sampled
    (uniform: every table at that count; else at its largest count)."""
    fig, ax = figure()
    if sweep:
        ax.plot(*zip(*sweep), marker="o", label="sweep (measured)")
    if curve:
        ax.plot(*zip(*sorted(curve)), linestyle=":", color="gray", label="search: fitted curve")
    for uniform, marker, label in ((True, "x", "search: sampled"),
                                   (False, "+", "search: sampled, per-table (at largest)")):
        points = [(n, s) for n, s, u in sampled if u == uniform]
        if points:
            ax.scatter(*zip(*points), marker=marker, s=60, color="black", zorder=3,
                       label=label)
    if tuned is not None:
        ax.axhline(tuned, color="red", linestyle="--", label=f"tuned plan ({tuned:,.0f})")
    ticks = sorted({n for n, _ in sweep} | {int(n) for n, _, _ in sampled}
                   | {int(n) for n, _ in curve})
    ax.set_xscale("log", base=2)
    if ticks:
        ax.set_xticks(ticks, [str(n) for n in ticks])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set(xlabel="shards per table", ylabel="samples/s", title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.savefig(path)
    return path
