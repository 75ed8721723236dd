"""Turn a benchmark results file into a report: tables, targets met or missed, and plots.

The harness runs every system for several rounds, alternating systems (A B C A B C) so that drift
in the machine hits all of them alike; this module only reads its JSON, aggregates the rounds by
median (one noisy round cannot move it) and sets measured traffic beside the analytic model of
parallax.placement.traffic_model, so that the report says both how fast each system is and why.
Usage: `python -m parallax.bench.report RESULTS.json --out DIR`.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Sequence

from parallax.bench import cache_report, projection
from parallax.bench.results import Meta, Network, Results, Run, load  # noqa: F401 (API)
from parallax.bench.summary import (  # noqa: F401 (API: what report users read)
    BYTES_TARGET, DENSE_TOLERANCE, PARALLAX, SYSTEMS, WORKLOADS, Row, Slice, _rank,
    analytic_traffic, minimum_traffic, slices, summarize)
from parallax.errors import ConfigError
from parallax.placement.traffic_model import StepTraffic


@dataclass(frozen=True)
class Target:
    """One goal of the issue, checked at the largest worker count of a workload and network."""

    workload: str
    network: str
    workers: int
    goal: str
    verdict: str    # "met", "missed" or "not measured"
    detail: str


def _verdict(met: bool) -> str:
    return "met" if met else "missed"


def _speed_target(s: Slice) -> Target:
    w = s.workers[-1]
    if s.workload == "dense":
        goal = f"hybrid within {DENSE_TOLERANCE:g}% of horovod"
        peer = next((p for p in ("horovod", "horovod_dense") if s.speedup(p)), "horovod")
        ratio = s.speedup(peer)
        if ratio is None:
            return Target(s.workload, s.network, w, goal, "not measured",
                          f"no ok rounds of both hybrid and {peer}")
        pct = (ratio - 1) * 100
        return Target(s.workload, s.network, w, goal, _verdict(pct >= -DENSE_TOLERANCE),
                      f"{pct:+.1f}% vs {peer}")
    goal = "hybrid faster than every peer"
    peers = [p for p in s.systems if p != PARALLAX and s.get(p, w)]
    ratios = {p: s.speedup(p) for p in peers}
    measured = {p: r for p, r in ratios.items() if r is not None}
    if not measured:
        return Target(s.workload, s.network, w, goal, "not measured",
                      "no ok rounds of hybrid and a peer")
    verdict = _verdict(all(r > 1 for r in measured.values()))
    detail = ", ".join(f"{p} {r:.2f}x" for p, r in measured.items())
    failed = [p for p in peers if p not in measured]
    return Target(s.workload, s.network, w, goal, verdict,
                  detail + (f"; no ok rounds: {', '.join(failed)}" if failed else ""))


def _bytes_target(s: Slice, colocated: bool = False) -> Target:
    w = s.workers[-1]
    goal = f"hybrid bytes within {BYTES_TARGET:g}x of the analytic minimum"
    row = s.get(PARALLAX, w)
    if row is None or row.vs_minimum is None or row.minimum is None or row.measured is None:
        return Target(s.workload, s.network, w, goal, "not measured",
                      "no measured bytes or no analytic model for hybrid")
    where = ("per step over a worker host's link, its server's bytes included (the "
             "minimum: traffic_model.colocated_host)" if colocated else
             "per worker per step")
    return Target(s.workload, s.network, w, goal, _verdict(row.vs_minimum <= BYTES_TARGET),
                  f"{row.vs_minimum:.2f}x: {human_bytes(row.measured.total)} vs "
                  f"{human_bytes(row.minimum.total)} {where}")


def targets(results: Results) -> list[Target]:
    colocated = {r.network.name for r in results.runs if r.network.placement == "colocated"}
    return [t for s in slices(summarize(results))
            for t in (_speed_target(s), _bytes_target(s, s.network in colocated))]


def human_bytes(n: float) -> str:
    """Decimal units, as network rates are quoted: 1740 -> '1.74 KB'."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def _table(header: Sequence[str], body: Iterable[Sequence[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |",
            "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|",
            *("| " + " | ".join(cells) + " |" for cells in body), ""]


def _throughput_cell(row: Row | None) -> str:
    if row is None:
        return "n/a"
    if row.samples_per_s is None:
        return "failed"
    cell = f"{row.samples_per_s:,.0f}"
    return cell if row.rounds_ok == row.rounds_total \
        else f"{cell} ({row.rounds_ok}/{row.rounds_total} ok)"


def _x(ratio: float | None) -> str:
    return "n/a" if ratio is None else f"{ratio:.2f}x"


def _traffic_cells(row: Row) -> list[str]:
    """A row's bytes beside its model (a co-located host's: `summary.link_traffic`)."""
    def both(t: StepTraffic | None, missing: str) -> list[str]:
        return [missing] * 2 if t is None else [human_bytes(t.sent), human_bytes(t.received)]

    vs_min = _x(row.vs_minimum)
    if row.system == PARALLAX and row.vs_minimum is not None:
        vs_min += f" (target ≤ {BYTES_TARGET:g}x: {_verdict(row.vs_minimum <= BYTES_TARGET)})"
    ratio = _x(row.vs_analytic) if row.measured else "not measured"
    return [row.system, *both(row.measured, "not measured"), *both(row.analytic, "no model"),
            ratio, vs_min if row.measured else "not measured"]


def _hardware_cells(s: Slice, system: str, w: int) -> list[str]:
    """hosts, cores, samples/s, samples/s per core and hybrid's per-core ratio to it."""
    row, mine = s.get(system, w), s.get(PARALLAX, w)
    if row is None:
        return [system, "n/a", "n/a", "n/a", "n/a", "n/a"]
    per_core = row.samples_per_s_per_core
    ratio = (mine.samples_per_s_per_core / per_core
             if mine and mine.samples_per_s_per_core and per_core else None)
    return [system, "n/a" if row.hosts is None else str(row.hosts),
            "shared" if row.cores is None else f"{row.cores:g}", _throughput_cell(row),
            "n/a" if per_core is None else f"{per_core:,.0f}", _x(ratio)]


def _slice_section(s: Slice, network: Network) -> list[str]:
    w = s.workers[-1]
    cols = [f"{n} worker{'s' if n > 1 else ''}" for n in s.workers]
    lines = [f"### {s.workload} on {network.describe()}", "",
             "Median samples/s over ok rounds:", ""]
    lines += _table(["system", *cols, f"hybrid / this ({w} workers)"],
                    ([p, *(_throughput_cell(s.get(p, n)) for n in s.workers), _x(s.speedup(p))]
                     for p in s.systems))
    lines += [f"Hardware at {w} workers (hosts: emulated machines; cores: what their "
              f"processes were held to in all):", ""]
    lines += _table(["system", "hosts", "cores", "samples/s", "samples/s per core",
                     "hybrid / this, per core"], (_hardware_cells(s, p, w) for p in s.systems))
    link = ("per worker host link (its co-located server's bytes included; mean over the "
            "hosts, measured and analytic: `traffic_model.colocated_host`)"
            if network.placement == "colocated" else "per worker")
    lines += [f"Bytes {link} per step at {w} workers (median over ok rounds):", ""]
    lines += _table(["system", "sent", "received", "analytic sent", "analytic received",
                     "measured / analytic", "measured / minimum"],
                    (_traffic_cells(r) for p in s.systems if (r := s.get(p, w))))
    lines += ["CPU seconds per sample (all processes of a run, median over ok rounds):", ""]

    def cpu(row: Row | None) -> str:
        if row is None or row.samples_per_s is None:
            return _throughput_cell(row)
        return "not measured" if row.cpu_seconds_per_sample is None \
            else f"{row.cpu_seconds_per_sample:.3g}"

    return lines + _table(["system", *cols],
                          ([p, *(cpu(s.get(p, n)) for n in s.workers)] for p in s.systems))


def _isolation_pairs(networks: dict[str, Network]) -> list[tuple[str, str]]:
    """(shared key, isolated key) of the same link and placement: "1gbit" and
    "1gbit@0.25cpu", or "1gbit:colocated" and "1gbit@0.25cpu:colocated"."""
    return [(shared.name, n.name) for n in networks.values() if n.isolated
            for shared in networks.values()
            if not shared.isolated and (shared.link, shared.placement) == (n.link, n.placement)]


def _isolation_section(rows: list[Row], networks: dict[str, Network]) -> list[str]:
    """Shared-core and CPU-isolated runs of one link side by side, per workload, at the
    largest worker count both have; isolated samples/s / share is what one core per
    process would do at the link's nominal rate."""
    lines = []
    for shared, isolated in _isolation_pairs(networks):
        share = networks[isolated].cpu_share
        for workload in dict.fromkeys(r.workload for r in rows):
            pick = {n: {(r.system, r.workers): r for r in rows
                        if (r.workload, r.network) == (workload, n)} for n in (shared, isolated)}
            common = set(pick[shared]) & set(pick[isolated])
            if not common:
                continue
            w = max(k[1] for k in common)
            systems = sorted({k[0] for k in common if k[1] == w}, key=lambda x: _rank(x, SYSTEMS))
            lines += [f"### {workload}: {shared} against {isolated}, {w} workers", ""]
            lines += _table(["system", "shared cores samples/s", f"{share:g} core each",
                             "isolated / share (one core each)", "CPU s/sample shared",
                             "CPU s/sample isolated"],
                            (_isolation_cells(p, pick[shared][(p, w)], pick[isolated][(p, w)],
                                              share) for p in systems))
    return ["## Shared cores against CPU isolation", "", *lines] if lines else []


def _isolation_cells(system: str, shared: Row, isolated: Row, share: float) -> list[str]:
    def cpu(row: Row) -> str:
        return "n/a" if row.cpu_seconds_per_sample is None else f"{row.cpu_seconds_per_sample:.3g}"
    per_core = ("n/a" if isolated.samples_per_s is None
                else f"{isolated.samples_per_s / share:,.0f}")
    return [system, _throughput_cell(shared), _throughput_cell(isolated), per_core,
            cpu(shared), cpu(isolated)]


def markdown(results: Results, plot_files: Sequence[str] = ()) -> str:
    """The report body: per workload and network, throughput, traffic and CPU, then targets."""
    m = results.meta
    lines = ["# Parallax benchmark report", "",
             f"- date: {m.date}", f"- commit: {m.commit}", f"- command: `{m.command}`",
             f"- machine: {m.machine}", *(f"- note: {n}" for n in m.notes), ""]
    networks = {r.network.name: r.network for r in results.runs}
    parts = slices(summarize(results))
    for workload in dict.fromkeys(s.workload for s in parts):
        lines += [f"## Workload {workload}", ""]
        for s in (s for s in parts if s.workload == workload):
            lines += _slice_section(s, networks[s.network])
    lines += _isolation_section(summarize(results), networks)
    found = projection.projections(results)
    inline = {key: name for key in dict.fromkeys((p.workload, p.network) for p in found)
              if (name := projection.plot_name(*key, found)) in plot_files}
    lines += projection.section(found, networks, inline)
    lines += cache_report.section(results, plot_files)
    lines += ["## Targets", ""]
    lines += [f"- {t.workload} on {t.network}, {t.workers} workers: {t.goal}: **{t.verdict}** "
              f"({t.detail})" for t in targets(results)] or ["- not measured: no runs"]
    others = [f for f in plot_files
              if f not in inline.values() and not cache_report.is_plot(f)]
    if others:
        lines += ["", "## Plots", "", *(f"![{Path(f).stem}]({f})" for f in others)]
    return "\n".join(lines).rstrip() + "\n"


def write_report(results_path: str | Path, out_dir: str | Path) -> dict[str, Path]:
    """report.md, summary.json (rows and targets, for tools) and the PNGs, keyed by file name."""
    results = load(results_path)
    out = Path(out_dir)
    from parallax.bench.plots import plots
    pngs = plots(results, out) + cache_report.plots(results, out)
    written = {p.name: p for p in pngs}
    written["report.md"] = out / "report.md"
    written["report.md"].write_text(markdown(results, [p.name for p in pngs]))
    written["summary.json"] = out / "summary.json"
    summary = {"source": str(results_path), "meta": asdict(results.meta),
               "rows": [{**asdict(r), "samples_per_s_per_core": r.samples_per_s_per_core}
                        for r in summarize(results)],
               "targets": [asdict(t) for t in targets(results)],
               "projections": [projection.summary(p)
                               for p in projection.projections(results)]}
    written["summary.json"].write_text(json.dumps(summary, indent=2) + "\n")
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m parallax.bench.report",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("results", help="the harness's results JSON")
    parser.add_argument("--out", required=True, help="directory to write the report into")
    args = parser.parse_args(argv)
    try:
        written = write_report(args.results, args.out)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(str(p) for p in written.values()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
