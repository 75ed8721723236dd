"""`parallax bench`: the command line of the benchmark harness.

    parallax bench                      # the whole comparison (docs/benchmarks.md), ~1-2 h
    parallax bench --size short --workers 1,2 --networks unlimited --rounds 1   # minutes
    parallax bench --cpu-share off,0.25 # shared cores, then 0.25 core per host (root)
    parallax bench --placement colocated,dedicated   # equal hardware, then a host each
    parallax bench --link-profile core,paper --cpu-share 0.25   # two compute:network ratios
    parallax bench --workloads ctr --systems hybrid --cache-staleness 0,4   # the row cache
    parallax bench --report-only --out DIR   # re-render DIR/results.json
    parallax bench partitions           # partition search vs a shard-count sweep (--help)

It writes DIR/results.json (after every run), DIR/logs/<run>/<host>-<role>.log, and the
report: DIR/report.md and PNG plots.
"""
from __future__ import annotations

import argparse
import shlex
import signal
import sys

from parallax.bench import cgroups, link_profiles, measure, topology, workloads
from parallax.bench.harness import (DEDICATED_SERVERS, LOOPBACK, SYSTEMS, BenchConfig,
                                    run_benchmark)
from parallax.errors import ConfigError
from parallax.runtime import logs


def _names(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _ints(what: str):
    """An argparse type: comma-separated integers, refused with `what` named."""
    def parse(text: str) -> tuple[int, ...]:
        try:
            return tuple(int(part) for part in _names(text))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{what} must be integers separated by commas, e.g. 1,2,4; "
                f"got {text!r}") from None
    return parse


_counts = _ints("worker counts")
_stalenesses = _ints("--cache-staleness values")


def _shares(text: str) -> tuple[float | None, ...]:
    """--cpu-share: comma-separated cores per process, or off (shared cores)."""
    try:
        return tuple(cgroups.parse_share(part) for part in _names(text))
    except ConfigError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
_shard_counts = _ints("shard counts")


def _profiles_text() -> str:
    return ", ".join(f"{n} ({p.network})" for n, p in link_profiles.PROFILES.items())


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="parallax bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = BenchConfig()
    window = measure.WindowConfig()
    p.add_argument("--workloads", type=_names, default=defaults.workloads,
                   help=f"comma-separated, from {','.join(workloads.WORKLOADS)}")
    p.add_argument("--systems", type=_names, default=defaults.systems,
                   help=f"comma-separated, from {','.join(SYSTEMS)}")
    p.add_argument("--workers", type=_counts, default=defaults.workers,
                   help="worker counts, e.g. 1,2,4")
    links = p.add_mutually_exclusive_group()
    links.add_argument("--networks", type=_names, default=defaults.networks,
                       help=f"emulated links (each host in its own network namespace, "
                            f"root only): unlimited, 1gbit, 10gbit, 100mbit, 1gbit+0.1ms; or "
                            f"{LOOPBACK} (no namespaces, no byte counts)")
    links.add_argument("--link-profile", type=_names, default=(), metavar="NAMES",
                       help=f"instead of --networks: named compute-to-network ratios, from "
                            f"{_profiles_text()} per core (derived in docs/benchmarks.md), "
                            f"e.g. core,paper")
    p.add_argument("--servers", type=int, default=defaults.servers,
                   help="parameter servers for hybrid, ps and tf_ps (default: one per worker "
                        "host when colocated, as `parallax run -H` places them; "
                        f"{DEDICATED_SERVERS} when dedicated)")
    p.add_argument("--placement", type=_names, default=defaults.placements, metavar="NAMES",
                   help=f"where servers run: {topology.COLOCATED} (default; equal hardware: "
                        f"W hosts for every system, server i inside worker i mod W's host, "
                        f"TF's coordinator in worker 0's) or {topology.DEDICATED} (a host, CPU "
                        f"group and link per process); comma-separated settings run one "
                        f"after the other into the same results")
    p.add_argument("--colocate", dest="placement", action="store_const",
                   const=(topology.COLOCATED,), help="the same as --placement colocated")
    p.add_argument("--rounds", type=int, default=defaults.rounds,
                   help="times each system runs per configuration, alternating systems")
    _measure_options(p, defaults.size, window)
    p.add_argument("--run-timeout", type=float, default=defaults.run_timeout,
                   help="seconds before a run is stopped and recorded as failed")
    p.add_argument("--out", default=defaults.out_dir, help="output directory")
    p.add_argument("--prefix", default=defaults.prefix,
                   help="network namespace name prefix (pick another to run two at once)")
    p.add_argument("--cpu-share", type=_shares, default=defaults.cpu_shares,
                   metavar="SHARES",
                   help="CPU isolation, root only: each process of a run in its own cgroup "
                        "v1 CPU group of this many cores, and every link's rate scaled by "
                        "the same factor (1gbit at 0.25 -> 250 Mbit/s: each process stands "
                        "for one core with a 1 Gbit/s NIC). Comma-separated settings run "
                        "one after the other into the same results, e.g. off,0.25; "
                        "default off (all processes share the machine's cores)")
    p.add_argument("--cgroup-root", default=defaults.cgroup_root,
                   help="where the cgroup v1 cpu controller is mounted")
    p.add_argument("--cpu-period-us", type=int, default=defaults.cpu_period_us,
                   help="CFS period of the CPU groups (quota = share x period); a process "
                        "that has used its quota waits up to period x (1 - share), so a "
                        "shorter period smooths synchronous steps (default 100000)")
    p.add_argument("--cache-staleness", type=_stalenesses, default=defaults.cache_staleness,
                   metavar="S,...",
                   help="also run hybrid with a worker row cache (parallax.RowCache) of each "
                        "staleness, as systems hybrid_cache<S> in the same alternating "
                        "rounds, e.g. 0,1,4,16 (default: none)")
    p.add_argument("--cache-mb", type=int, default=defaults.cache_mb,
                   help="the row cache's memory per worker, MiB (default %(default)s)")
    p.add_argument("--data-batches", type=int, default=defaults.data_batches,
                   help="batches each worker makes before timing and cycles (default "
                        "%(default)s): more batches, more rows the servers meet for the first "
                        "time while timed, as a long-tailed dataset's stream does")
    p.add_argument("--report-only", action="store_true",
                   help="do not run anything: render the report of OUT/results.json")
    return p


def _measure_options(p: argparse.ArgumentParser, size: str, window) -> None:
    """The model size and measurement windows, as `parallax bench` and its partitions
    subcommand both take them."""
    p.add_argument("--size", choices=workloads.SIZES, default=size,
                   help="full: the benchmark models; short: tiny ones (CI)")
    p.add_argument("--warmup-steps", type=int, default=window.warmup_steps,
                   help="steps each run takes before it is measured")
    p.add_argument("--windows", type=int, default=window.windows,
                   help="measurement windows per run (figures are medians over them)")
    p.add_argument("--window-seconds", type=float, default=window.window_seconds,
                   help="seconds of one measurement window (steps set by a calibration)")


def config_from(args: argparse.Namespace) -> BenchConfig:
    window = measure.WindowConfig(warmup_steps=args.warmup_steps, windows=args.windows,
                                  window_seconds=args.window_seconds)
    networks = args.networks
    if args.link_profile:
        networks = tuple(link_profiles.get(n).network for n in args.link_profile)
    return BenchConfig(workloads=args.workloads, systems=args.systems, workers=args.workers,
                       networks=networks, servers=args.servers, rounds=args.rounds,
                       size=args.size, window=window, run_timeout=args.run_timeout,
                       out_dir=args.out, prefix=args.prefix, cpu_shares=args.cpu_share,
                       cgroup_root=args.cgroup_root, cpu_period_us=args.cpu_period_us,
                       cache_staleness=args.cache_staleness, cache_mb=args.cache_mb,
                       placements=args.placement, data_batches=args.data_batches)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["partitions"]:
        return partitions_main(argv[1:])
    args = logs.parse(parser(), argv)
    # SIGTERM (a scheduler, `kill`) unwinds like Ctrl-C, so every run's processes are
    # stopped and every namespace is deleted on the way out.
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    from parallax.bench import report
    try:
        if args.report_only:
            results = f"{args.out}/results.json"
        else:
            config = config_from(args)
            notes = [link_profiles.note(link_profiles.get(n)) for n in args.link_profile]
            results = run_benchmark(config, "parallax bench " + shlex.join(argv), notes=notes)
        written = report.write_report(results, args.out)
    except ConfigError as err:
        print(f"parallax bench: {err}", file=sys.stderr)
        return 2
    for path in (written.values() if isinstance(written, dict) else written):
        print(f"wrote {path}")
    return 0


# --- parallax bench partitions ------------------------------------------------------------

PARTITIONS_ESTIMATE = """
Wall time of the defaults on the 2-core development machine, otherwise idle: about 25-30
minutes for 32 runs (measured pieces, full size, 4x4: a sweep run takes 20-30 s up to 16
shards and about 90 s at 32 and 64 shards on ctr, whose steps take 6.7 s there; a tuned ctr
run about 2.5 min, its search ~50 s and final resharding ~18 s of it; 2x2 runs are faster).
To fit the ~35 min budget the defaults cut: one round (single runs on this machine vary by
10-25%, so a 5% target is at the edge of what one round resolves; --rounds 3 for more), 3
windows of about 2 s (at least 2 steps each), 2 topologies of the issue's 2-4 workers x 2-4
servers (2x2 and 4x4; e.g. --topologies 2x2,2x4,4x2,4x4 for more), one network. A run past
--run-timeout (--tuned-timeout) is recorded as timed out, and the benchmark goes on.

    parallax bench partitions --size short --topologies 2x2 --shards 1,2   # ~1 min
    parallax bench partitions --report-only --out DIR    # re-render DIR/partitions.json
"""


def _topologies(text: str) -> tuple[tuple[int, int], ...]:
    try:
        pairs = tuple(tuple(int(x) for x in part.lower().split("x")) for part in _names(text))
    except ValueError:
        pairs = ((),)
    if not pairs or any(len(p) != 2 for p in pairs):
        raise argparse.ArgumentTypeError(
            f"topologies are WORKERSxSERVERS separated by commas, e.g. 2x2,4x4; got {text!r}")
    return pairs  # type: ignore[return-value]



def partitions_parser() -> argparse.ArgumentParser:
    from parallax.bench import partitions
    p = argparse.ArgumentParser(prog="parallax bench partitions",
                                description=partitions.__doc__ + PARTITIONS_ESTIMATE,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    d, w = partitions.PartitionConfig(), partitions.WINDOW
    p.add_argument("--workloads", type=_names, default=d.workloads, help="from lm,ctr")
    p.add_argument("--topologies", type=_topologies, default=d.topologies,
                   help="WORKERSxSERVERS, comma-separated (default 2x2,4x4)")
    p.add_argument("--shards", type=_shard_counts, default=d.shards,
                   help="the sweep's shards per table (default 1,2,4,8,16,32,64)")
    p.add_argument("--no-tuned", dest="tuned", action="store_false",
                   help="sweep only (no --search-partitions run)")
    p.add_argument("--network", default=d.network,
                   help=f"emulated link as in `parallax bench --networks`, or {LOOPBACK}")
    p.add_argument("--rounds", type=int, default=d.rounds,
                   help="times each configuration runs, alternating")
    _measure_options(p, d.size, w)
    p.add_argument("--min-window-steps", type=int, default=w.min_window_steps,
                   help="fewest steps in a window, however short its seconds")
    p.add_argument("--run-timeout", type=float, default=d.run_timeout,
                   help="seconds before a sweep run is stopped and recorded as timed out")
    p.add_argument("--tuned-timeout", type=float, default=d.tuned_timeout,
                   help="the same for the tuned run (its search steps included)")
    for name in ("min-shards", "max-shards", "steps-per-sample", "warmup-steps"):
        p.add_argument(f"--search-{name}", type=int, default=None,
                       help="parallax.PartitionSearch keyword (default: the tuner's"
                            + ("; max-shards: the largest --shards)" if name == "max-shards"
                               else ")"))
    p.add_argument("--search-cache-dir", default=d.search.cache_dir,
                   help="PartitionSearch.cache_dir (default '': no saved decisions, so every "
                        "tuned run searches afresh; a directory there reuses them)")
    p.add_argument("--search-max-steps", type=int, default=d.search.max_steps,
                   help="the tuned run fails if the search has not decided by then")
    p.add_argument("--out", default=d.out_dir, help="output directory")
    p.add_argument("--prefix", default=d.prefix, help="network namespace name prefix")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: render the report of OUT/partitions.json")
    return p


def partitions_config(args: argparse.Namespace):
    from parallax.bench import partitions
    for name in ("search_min_shards", "search_max_shards", "search_steps_per_sample",
                 "search_warmup_steps", "search_max_steps"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    max_shards = args.search_max_shards or (max(args.shards) if args.shards else None)
    search = partitions.SearchOptions(
        min_shards=args.search_min_shards, max_shards=max_shards,
        steps_per_sample=args.search_steps_per_sample, warmup_steps=args.search_warmup_steps,
        cache_dir=args.search_cache_dir, max_steps=args.search_max_steps)
    window = measure.WindowConfig(warmup_steps=args.warmup_steps,
                                  calibration_steps=partitions.WINDOW.calibration_steps,
                                  windows=args.windows, window_seconds=args.window_seconds,
                                  min_window_steps=args.min_window_steps)
    return partitions.PartitionConfig(
        workloads=args.workloads, topologies=args.topologies, shards=args.shards,
        tuned=args.tuned, network=args.network, size=args.size, rounds=args.rounds,
        window=window, search=search, run_timeout=args.run_timeout,
        tuned_timeout=args.tuned_timeout, out_dir=args.out, prefix=args.prefix)


def partitions_main(argv: list[str]) -> int:
    from parallax.bench import partitions
    args = logs.parse(partitions_parser(), argv)
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    try:
        if args.report_only:
            results = f"{args.out}/partitions.json"
        else:
            results = partitions.run_partitions(partitions_config(args),
                                                partitions.default_command(argv))
        written = partitions.write_report(results, args.out)
    except ConfigError as err:
        print(f"parallax bench partitions: {err}", file=sys.stderr)
        return 2
    for path in written.values():
        print(f"wrote {path}")
    return 0
