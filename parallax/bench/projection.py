"""The report's projection past this machine: the calibrated step-time model of
parallax.placement.traffic_model, fitted to the CPU-isolated runs of a results file, validated on
them, and projected to 8-64 workers on 10 and 25 Gbit/s links.

Which runs: those of a CPU-isolated network ("1gbit@0.25cpu": `parallax bench --cpu-share`)
with per-process CPU and bytes (harnesses from the CPU-isolation change on), at >= 2 worker
counts; a shared-core run cannot say whose CPU bounded a step. Rounds are aggregated by
median per worker count. Each measured process stood for one core with a `nominal` link,
slowed 1/share; the projection gives every process one core (cores=1) and a 10 or 25 Gbit/s
link. Servers (hybrid, tf_ps) grow with the workers at the measured ratio of the largest
measured point (4 workers, 2 servers: one server per 2 workers), never below the count
measured, as the Parallax paper runs a server on every machine; Horovod has none.

Held out (`fit_max_workers`, default 4): when a system was measured past 4 workers (e.g. 2, 4
and 8), the model is fitted on the points at <= 4 workers only and its error at each larger
count is reported (`held_out`), so a measured 8 checks a projection made from 1-4; the
projection is then that model's. With fewer than 2 counts at <= 4, everything is fitted.
"""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

from parallax.bench.figures import figure, slug
from parallax.bench.results import Network, Results, Run
from parallax.bench.summary import link_traffic
from parallax.errors import ConfigError
from parallax.placement.traffic_model import (Projection, StepFit, StepPoint, fit_step_model,
                                              project)

SYSTEMS = ("hybrid", "horovod", "tf_ps")
WORKERS = (8, 16, 32, 64)
FIT_MAX_WORKERS = 4  # fit on points at <= this many workers; larger ones are held out
LINKS_GBIT = (10.0, 25.0)
TERM_NAMES = {"worker_cpu": "worker CPU", "server_cpu": "server CPU",
              "chief_cpu": "coordinator CPU", "worker_link": "worker link",
              "server_link": "server link", "host_cpu": "host CPU"}


@dataclass(frozen=True)
class SystemProjection:
    """One system's fit on one workload and isolated network, and its projection."""

    system: str
    workload: str
    network: str
    fit: StepFit
    points: tuple[StepPoint, ...]
    batch_per_worker: int
    workers_per_server: float | None
    min_servers: int
    projections: tuple[Projection, ...]
    analytic_bytes: Callable[[int], float]
    held_out: tuple[tuple[int, float], ...] = ()  # (workers, |model - measured| / measured)
    fit_max_workers: int | None = None


def held_out_errors(fit: StepFit, points: list[StepPoint]) -> tuple[tuple[int, float], ...]:
    """The fitted model's relative step-time error at each point, by worker count."""
    return tuple((p.workers, abs(fit.model.step_seconds(
        p.workers, p.servers, p.cores, p.link_bytes_per_s, p.analytic_bytes)
        - p.step_seconds) / p.step_seconds) for p in points)


def split_points(points: list[StepPoint], fit_max_workers: int | None
                 ) -> tuple[list[StepPoint], list[StepPoint]]:
    """(fitted, held out): points past fit_max_workers are held out, unless that leaves
    fewer than 2 worker counts to fit (then nothing is)."""
    if fit_max_workers is None:
        return points, []
    if fit_max_workers < 1:
        raise ConfigError(f"fit_max_workers {fit_max_workers} must be >= 1 worker (or None: "
                          f"fit every point)")
    fitted = [p for p in points if p.workers <= fit_max_workers]
    if len({p.workers for p in fitted}) < 2:
        return points, []
    return fitted, [p for p in points if p.workers > fit_max_workers]


def _median(values) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _analytic(system: str, run: Run) -> Callable[[int], float] | None:
    """Worker link bytes (busier direction) the traffic model expects at W workers: a
    worker's, or, colocated, a host's (`summary.link_traffic`)."""
    workload, colocated = run.traffic_workload, run.network.placement == "colocated"
    if workload is None or link_traffic(system, workload, colocated) is None:
        return None

    def at(workers: int) -> float:
        traffic = link_traffic(system, replace(workload, workers=workers), colocated)
        return max(traffic.sent, traffic.received)
    return at


def _role(runs: list[Run], role: str, attr: str) -> float | None:
    return _median(getattr(r.per_process[role], attr) if role in r.per_process else None
                   for r in runs)


def _point(runs: list[Run], analytic: Callable[[int], float]) -> StepPoint | None:
    """The rounds of one worker count as one point (medians); None if a figure is missing."""
    first, network = runs[0], runs[0].network
    sps, worker_cpu = _median(r.samples_per_s for r in runs), _role(runs, "worker", "cpu_seconds")
    worker_bytes = _role(runs, "worker", "link_bytes")
    if sps is None or worker_cpu is None or (worker_bytes is None and network.rate_mbit):
        return None
    servers = first.servers if any("server" in r.per_process for r in runs) else 0
    rate = None if network.rate_mbit is None else network.rate_mbit * 1e6 / 8
    return StepPoint(
        workers=first.workers, servers=servers, step_seconds=first.global_batch / sps,
        worker_cpu=worker_cpu, worker_bytes=worker_bytes or 0.0,
        analytic_bytes=analytic(first.workers), cores=network.cpu_share, link_bytes_per_s=rate,
        server_cpu=_role(runs, "server", "cpu_seconds") or 0.0,
        chief_cpu=_role(runs, "chief", "cpu_seconds") or 0.0,
        server_bytes=_role(runs, "server", "link_bytes") or 0.0,
        colocated=network.placement == "colocated")


def _fit_system(system: str, runs: list[Run],
                fit_max_workers: int | None = FIT_MAX_WORKERS) -> SystemProjection | None:
    analytic = _analytic(system, runs[0])
    if analytic is None:
        return None
    by_workers: dict[int, list[Run]] = {}
    for run in runs:
        by_workers.setdefault(run.workers, []).append(run)
    points = [p for w in sorted(by_workers) if (p := _point(by_workers[w], analytic))]
    if len({p.workers for p in points}) < 2:
        return None
    fitted, held = split_points(points, fit_max_workers)
    fit = fit_step_model(fitted)
    largest = points[-1]
    per_server = largest.workers / largest.servers if largest.servers else None
    batch = runs[0].batch_per_worker
    return SystemProjection(system, runs[0].workload, runs[0].network.name, fit,
                            tuple(points), batch, per_server, largest.servers,
                            tuple(project(fit.model, analytic, batch, WORKERS, LINKS_GBIT,
                                          per_server, min_servers=largest.servers)),
                            analytic, held_out_errors(fit, held),
                            fit_max_workers if held else None)


def projections(results: Results, fit_max_workers: int | None = FIT_MAX_WORKERS
                ) -> list[SystemProjection]:
    """Every (workload, isolated network, system) with enough points, in results order;
    points past fit_max_workers held out of the fit (`split_points`)."""
    groups: dict[tuple[str, str, str], list[Run]] = {}
    for run in results.runs:
        if run.ok and run.network.isolated and run.system in SYSTEMS and run.per_process:
            groups.setdefault((run.workload, run.network.name, run.system), []).append(run)
    order = sorted(groups, key=lambda k: SYSTEMS.index(k[2]))
    found = [_fit_system(key[2], groups[key], fit_max_workers) for key in order]
    return [p for p in found if p is not None]


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def _fit_rows(found: list[SystemProjection]) -> list[list[str]]:
    rows = []
    for p in found:
        m, counts = p.fit.model, ",".join(str(w) for w in p.fit.workers)
        held = ", ".join(f"{_pct(e)} at {w}" for w, e in p.held_out) or "none"
        rows.append([p.system, m.form, f"{m.scale:.3g}", counts, _pct(p.fit.mean_error),
                     _pct(p.fit.max_error), _pct(p.fit.other_form_error),
                     _pct(p.fit.holdout_error), held])
    return rows


def _component_rows(found: list[SystemProjection]) -> list[list[str]]:
    ms = lambda seconds: f"{1e3 * seconds:.3g}"  # noqa: E731
    return [[p.system, f"{ms(p.fit.model.worker_cpu_base)} + {ms(p.fit.model.worker_cpu_slope)}"
             f" W", f"{ms(p.fit.model.server_cpu_per_worker)} W/S + "
             f"{ms(p.fit.model.server_cpu_per_client)} W",
             ms(p.fit.model.chief_cpu_per_worker), f"{p.fit.model.bytes_ratio:.3g}",
             f"{p.fit.model.server_bytes_per_worker / 1e3:.3g}"] for p in found]


def _projection_rows(found: list[SystemProjection]) -> list[list[str]]:
    rows = []
    for p in found:
        for gbit in LINKS_GBIT:
            cells = [f"{q.samples_per_s:,.0f} ({TERM_NAMES[q.bound]}"
                     + (f", S={q.servers}" if q.servers else "") + ")"
                     for q in p.projections if q.link_gbit == gbit]
            rows.append([p.system, f"{gbit:g} Gbit/s", *cells])
    return rows


def _table(header: list[str], body: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |",
            "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|",
            *("| " + " | ".join(cells) + " |" for cells in body), ""]


def _ratio_text(found: list[SystemProjection]) -> str:
    ratios = sorted({p.workers_per_server for p in found if p.workers_per_server})
    if not ratios:
        return "no servers"
    return ("servers grow with workers at the measured ratio of the largest measured point "
            f"(workers per server: {', '.join(f'{r:g}' for r in ratios)}; never fewer "
            "servers than measured), as the Parallax paper runs a server on every machine")


def section(found: list[SystemProjection], networks: dict[str, Network],
            plot_files: dict[tuple[str, str], str]) -> list[str]:
    """The report's projection section (a reason instead when nothing could be fitted)."""
    lines = ["## Projection past this machine", ""]
    if not found:
        return lines + ["Not available: the step-time model needs CPU-isolated runs "
                        "(`parallax bench --cpu-share 0.25`) with per-process CPU seconds "
                        "at 2 or more worker counts of hybrid, horovod or tf_ps.", ""]
    lines += ["The calibrated step-time model of `parallax/placement/traffic_model.py` "
              "(step time = "
              "scale x max or sum of worker CPU, server CPU, coordinator CPU, worker link "
              "and server link per step, where servers sit inside worker hosts the host's "
              "CPU in place of its processes', and never less than the largest of them: "
              "no step is shorter than its busiest resource's time; the form with the "
              "smaller error is kept), "
              "fitted per system to the measured points, then evaluated with every process "
              "(colocated: every host) on one "
              f"core and links of {' and '.join(f'{g:g}' for g in LINKS_GBIT)} Gbit/s; "
              f"{_ratio_text(found)}. Errors are |model - measured| / measured on the "
              "measured points.", ""]
    for key in dict.fromkeys((p.workload, p.network) for p in found):
        part = [p for p in found if (p.workload, p.network) == key]
        lines += [f"### {key[0]}, fitted on {networks[key[1]].describe()}", ""]
        lines += _table(["system", "form", "scale", "workers fitted", "mean error",
                         "max error", "other form's mean error",
                         "error at the largest count, fitted without it",
                         "error at held-out counts (not fitted)"], _fit_rows(part))
        lines += ["Fitted components (ms of CPU per step; worker link bytes = ratio x "
                  "analytic):", ""]
        lines += _table(["system", "worker CPU (ms)", "server CPU (ms): x W/S + x W",
                         "coordinator CPU per worker (ms)", "measured / analytic bytes",
                         "server KB per worker"], _component_rows(part))
        lines += ["Projected samples/s (what bounds the step; S = servers):", ""]
        lines += _table(["system", "link", *(f"{w} workers" for w in WORKERS)],
                        _projection_rows(part))
        if key in plot_files:
            lines += [f"![{Path(plot_files[key]).stem}]({plot_files[key]})", ""]
    return lines


def plot_name(workload: str, network: str, found: list[SystemProjection]) -> str:
    """projection_<workload>.png, with the network when the workload has several."""
    networks = {p.network for p in found if p.workload == workload}
    return (f"projection_{slug(workload)}.png" if len(networks) <= 1
            else f"projection_{slug(workload)}_{slug(network)}.png")


def plot(part: list[SystemProjection], path: Path, nominal_gbit: float | None) -> Path:
    """samples/s against workers (1-64): the model at each projected link (solid, dashed),
    the model at the measured conditions (one core, the nominal link; dotted) and the
    measured points as one core would run them (samples/s / share)."""
    if not part:
        raise ConfigError("nothing to plot: no system has a fitted projection")
    fig, ax = figure()
    xs = [1, 2, 4, *WORKERS]
    styles = dict(zip(LINKS_GBIT, ("-", "--")))
    for i, p in enumerate(part):
        color = f"C{i}"
        for gbit, style in styles.items():
            ax.plot(xs, [_sps(p, w, gbit) for w in xs], style, color=color,
                    label=f"{p.system}, {gbit:g} Gbit/s")
        if nominal_gbit is not None:
            ax.plot(xs, [_sps(p, w, nominal_gbit) for w in xs], ":", color=color,
                    label=f"{p.system}, {nominal_gbit:g} Gbit/s (measured links)")
        ax.scatter([q.workers for q in p.points],
                   [q.workers * p.batch_per_worker / q.step_seconds / q.cores
                    for q in p.points],
                   color=color, marker="o", zorder=3)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set(xlabel="workers (one core each)", ylabel="samples/s",
           title=f"{part[0].workload}: projection (fitted on {part[0].network}; "
                 "dots: measured / share)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="x-small")
    fig.savefig(path)
    return path


def _sps(p: SystemProjection, workers: int, gbit: float) -> float:
    [q] = project(p.fit.model, p.analytic_bytes, p.batch_per_worker, (workers,), (gbit,),
                  p.workers_per_server, min_servers=p.min_servers)
    return q.samples_per_s


def summary(p: SystemProjection) -> dict:
    """One system's fit and projection as plain data (for summary.json)."""
    return {"system": p.system, "workload": p.workload, "network": p.network,
            "model": asdict(p.fit.model), "mean_error": p.fit.mean_error,
            "max_error": p.fit.max_error, "other_form_error": p.fit.other_form_error,
            "holdout_error": p.fit.holdout_error, "workers_fitted": list(p.fit.workers),
            "held_out_errors": {str(w): e for w, e in p.held_out},
            "fit_max_workers": p.fit_max_workers,
            "workers_per_server": p.workers_per_server, "min_servers": p.min_servers,
            "points": [asdict(q) for q in p.points],
            "projections": [asdict(q) for q in p.projections]}
