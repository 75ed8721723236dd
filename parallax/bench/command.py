"""`parallax bench`: the command line of the benchmark harness.

    parallax bench                      # the whole comparison (docs/benchmarks.md), ~1-2 h
    parallax bench --size short --workers 1,2 --networks unlimited --rounds 1   # minutes
    parallax bench --report-only DIR    # re-render DIR/results.json

It writes DIR/results.json (after every run), DIR/logs/<run>/<host>-<role>.log, and the
report: DIR/report.md and PNG plots.
"""
from __future__ import annotations

import argparse
import shlex
import signal
import sys

from parallax.bench import measure, workloads
from parallax.bench.harness import LOOPBACK, SYSTEMS, BenchConfig, run_benchmark
from parallax.errors import ConfigError


def _names(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _counts(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in _names(text))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"worker counts must be integers separated by commas, e.g. 1,2,4; "
            f"got {text!r}") from None


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
    p.add_argument("--networks", type=_names, default=defaults.networks,
                   help=f"emulated links (each process in its own network namespace, root "
                        f"only): unlimited, 1gbit, 10gbit, 100mbit, 1gbit+0.1ms; or "
                        f"{LOOPBACK} (no namespaces, no byte counts)")
    p.add_argument("--servers", type=int, default=defaults.servers,
                   help="parameter servers for hybrid, ps and tf_ps")
    p.add_argument("--rounds", type=int, default=defaults.rounds,
                   help="times each system runs per configuration, alternating systems")
    p.add_argument("--size", choices=workloads.SIZES, default=defaults.size,
                   help="full: the benchmark models; short: tiny ones (CI)")
    p.add_argument("--warmup-steps", type=int, default=window.warmup_steps)
    p.add_argument("--windows", type=int, default=window.windows,
                   help="measurement windows per run (figures are medians over them)")
    p.add_argument("--window-seconds", type=float, default=window.window_seconds)
    p.add_argument("--run-timeout", type=float, default=defaults.run_timeout,
                   help="seconds before a run is stopped and recorded as failed")
    p.add_argument("--out", default=defaults.out_dir, help="output directory")
    p.add_argument("--prefix", default=defaults.prefix,
                   help="network namespace name prefix (pick another to run two at once)")
    p.add_argument("--report-only", action="store_true",
                   help="do not run anything: render the report of OUT/results.json")
    return p


def config_from(args: argparse.Namespace) -> BenchConfig:
    window = measure.WindowConfig(warmup_steps=args.warmup_steps, windows=args.windows,
                                  window_seconds=args.window_seconds)
    return BenchConfig(workloads=args.workloads, systems=args.systems, workers=args.workers,
                       networks=args.networks, servers=args.servers, rounds=args.rounds,
                       size=args.size, window=window, run_timeout=args.run_timeout,
                       out_dir=args.out, prefix=args.prefix)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    # SIGTERM (a scheduler, `kill`) unwinds like Ctrl-C, so every run's processes are
    # stopped and every namespace is deleted on the way out.
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    from parallax.bench import report
    try:
        if args.report_only:
            results = f"{args.out}/results.json"
        else:
            config = config_from(args)
            results = run_benchmark(config, "parallax bench " + shlex.join(argv))
        written = report.write_report(results, args.out)
    except ConfigError as err:
        print(f"parallax bench: {err}", file=sys.stderr)
        return 2
    for path in (written.values() if isinstance(written, dict) else written):
        print(f"wrote {path}")
    return 0
