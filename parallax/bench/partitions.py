"""`parallax bench partitions`: the partition search (issue 6) against an exhaustive sweep.

For each workload and topology (W workers, S parameter servers) the harness runs hybrid with
every sparse table split into N shards, for each N of the sweep (1, 2, 4, ..., 64), then once
with `--search-partitions` (the strategy's partition search picks each table's shard count,
then the run is timed at its choice). Links are emulated as `parallax bench` does (a network
namespace per process, 1 Gbit/s tbf links). Every run goes through harness.run_one, so windows,
bytes, CPU, timeouts and cleanup are the harness's; OUT/partitions.json is rewritten after
every run. The report (OUT/report.md, summary.json, partitions_<workload>_<W>x<S>.png) sets,
per workload and topology, the best sweep point beside the tuned run:
  tuned / best samples/s            target >= 0.95
  search overhead / 1000-step run   target < 10%: overhead_seconds (the tuner's: search
                                    steps' seconds minus as many steps at the chosen plan, plus
                                    resharding) over 1000 steps at the best sweep point's pace
"""
from __future__ import annotations

import json
import os
import shlex
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Sequence

from parallax.bench import harness, measure, workloads
from parallax.bench.netns import EmulatedCluster, LinkSpec
from parallax.errors import ConfigError
from parallax.placement.tuning import counts_text

SHARDS = (1, 2, 4, 8, 16, 32, 64)
TOPOLOGIES = ((2, 2), (4, 4))
SYSTEM = "hybrid"
# Short windows: the slowest points (64 shards of 26 CTR tables: ~3,300 RPCs per worker per
# step) take seconds per step, so a window is min_window_steps steps there.
WINDOW = measure.WindowConfig(warmup_steps=2, calibration_steps=1, windows=3,
                              window_seconds=2.0, min_window_steps=2)


@dataclass(frozen=True, kw_only=True)
class SearchOptions:
    """The tuned run's parallax.PartitionSearch keywords (None: the tuner's default)."""

    min_shards: int | None = None
    max_shards: int | None = None
    steps_per_sample: int | None = None
    warmup_steps: int | None = None
    cache_dir: str | None = ""  # "": no saved decisions, so every tuned run searches
    max_steps: int = 2000  # the bench fails the run if the search has not decided by then

    def args(self) -> list[str]:
        out = ["--search-partitions", "--search-max-steps", str(self.max_steps)]
        for name in ("min_shards", "max_shards", "steps_per_sample", "warmup_steps",
                     "cache_dir"):
            value = getattr(self, name)
            if value is not None:
                out += [f"--search-{name.replace('_', '-')}", str(value)]
        return out


@dataclass(frozen=True)
class PartitionConfig:
    workloads: tuple[str, ...] = ("lm", "ctr")
    topologies: tuple[tuple[int, int], ...] = TOPOLOGIES   # (workers, servers)
    shards: tuple[int, ...] = SHARDS
    tuned: bool = True
    network: str = harness.BenchConfig().networks[0]
    size: str = "full"
    rounds: int = 1
    window: measure.WindowConfig = WINDOW
    search: SearchOptions = field(default_factory=SearchOptions)
    run_timeout: float = 300.0
    tuned_timeout: float = 600.0
    out_dir: str = "bench-results/partitions"
    prefix: str = "pxp"

    def __post_init__(self) -> None:
        for name in self.workloads:
            spec = workloads.get(name, self.size)  # ConfigError for a bad name or size
            if not spec.table_rows:
                raise ConfigError(f"workload {name!r} has no sparse tables to partition: "
                                  f"choose from lm, ctr")
        if not self.topologies or any(w < 1 or s < 1 for w, s in self.topologies):
            raise ConfigError(f"topologies need >= 1 worker and >= 1 server each, got "
                              f"{_topologies_text(self.topologies) or 'none'}")
        if not self.shards and not self.tuned:
            raise ConfigError("nothing to run: no shard counts and no tuned run")
        if any(n < 1 for n in self.shards):
            raise ConfigError(f"shard counts must be >= 1, got {self.shards}")
        if self.rounds < 1:
            raise ConfigError(f"rounds must be >= 1, got {self.rounds}")
        if self.network != harness.LOOPBACK:
            LinkSpec.parse(self.network)  # ConfigError for a link it does not understand

    def bench_config(self, workers: int, servers: int) -> harness.BenchConfig:
        """The harness's configuration of one topology's runs."""
        return harness.BenchConfig(workloads=self.workloads, systems=(SYSTEM,),
                                   workers=(workers,), networks=(self.network,),
                                   servers=servers, rounds=1, size=self.size,
                                   window=self.window, run_timeout=self.run_timeout,
                                   out_dir=self.out_dir, prefix=self.prefix)

    def hosts(self) -> list[str]:
        """Namespaces for the largest topology: workers and servers (no TF coordinator)."""
        workers = max(w for w, _ in self.topologies)
        servers = max(s for _, s in self.topologies)
        return [f"worker{i}" for i in range(workers)] + [f"ps{i}" for i in range(servers)]


def _topologies_text(topologies) -> str:
    return ",".join(f"{w}x{s}" for w, s in topologies)


def _worker_lines(log_dir: Path) -> dict[str, dict]:
    """Rank 0's BENCH_TUNING and BENCH_PLAN records, where it printed them."""
    from parallax.bench.worker import PLAN_PREFIX, TUNING_PREFIX, parse_line
    found: dict[str, dict] = {}
    log = log_dir / "worker0-worker.log"
    if not log.exists():
        return found
    for line in log.read_text(errors="replace").splitlines():
        for key, prefix in (("tuning", TUNING_PREFIX), ("plan", PLAN_PREFIX)):
            try:
                record = parse_line(prefix, line)
            except json.JSONDecodeError:
                continue
            if record is not None:
                found[key] = record
    return found


def run_point(config: PartitionConfig, spec: workloads.WorkloadSpec, workers: int,
              servers: int, shards: int | None, placement: harness.Placement,
              log_dir: Path) -> dict:
    """One run: `shards` shards per table, or the tuned run (shards None)."""
    bench = config.bench_config(workers, servers)
    if shards is None:
        bench = replace(bench, run_timeout=config.tuned_timeout)
        args = config.search.args()
    else:
        args = ["--shards", str(shards)]
    result = harness.run_one(SYSTEM, spec, workers, bench, placement, log_dir, args)
    lines = _worker_lines(log_dir)
    result.update(shards=shards, tuned=shards is None, tuning=lines.get("tuning"),
                  plan=lines.get("plan"))
    return result


def run_partitions(config: PartitionConfig, command: str = "", echo=sys.stdout) -> Path:
    """Every run, in order: per workload, topology and round, the sweep, then the tuned run.
    Returns OUT/partitions.json (rewritten after every run)."""
    out = Path(config.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "partitions.json"
    results = {"meta": {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                        "commit": harness._git_commit(), "command": command,
                        "machine": f"{os.cpu_count()} cores, "
                                   f"{harness._memory_gib():.0f} GiB RAM",
                        "notes": []},
               "runs": []}
    cluster = None
    if config.network != harness.LOOPBACK:
        cluster = EmulatedCluster(config.hosts(), LinkSpec.parse(config.network),
                                  prefix=config.prefix).up()
    try:
        if cluster is not None and not cluster.latency_emulated and cluster.link.latency_ms:
            results["meta"]["notes"].append(
                f"{config.network}: latency not emulated ({cluster.latency_note})")
        placement = harness.Placement(cluster)
        network = harness._network_record(config.network, cluster)
        for name, (workers, servers), rnd, shards in _plan(config):
            spec = workloads.get(name, config.size)
            label = "tuned" if shards is None else f"s{shards}"
            log_dir = out / "logs" / f"{name}-{workers}x{servers}-r{rnd}-{label}"
            started = time.monotonic()
            result = run_point(config, spec, workers, servers, shards, placement, log_dir)
            result.update(network=network, round=rnd)
            results["runs"].append(result)
            path.write_text(json.dumps(results, indent=1))
            _echo(result, time.monotonic() - started, echo)
    finally:
        if cluster is not None:
            cluster.down()
    return path


def _plan(config: PartitionConfig):
    for name in config.workloads:
        for topology in config.topologies:
            for rnd in range(config.rounds):
                for shards in (*config.shards, *((None,) if config.tuned else ())):
                    yield name, topology, rnd, shards


def _echo(result: dict, elapsed: float, echo) -> None:
    what = "tuned" if result["tuned"] else f"{result['shards']} shards"
    head = (f"{result['workload']:<4} {result['workers']}x{result['servers']} "
            f"r{result['round']} {what:>10}")
    if harness.echo_failure(head, result, elapsed, echo):
        return
    chosen = ""
    if result["tuning"]:
        chosen = f"  chose {counts_text(result['tuning'].get('chosen') or {})}"
    print(f"{head} {result['samples_per_s']:10.1f} samples/s  ({elapsed:.0f} s){chosen}",
          file=echo, flush=True)



def default_command(argv: Sequence[str]) -> str:
    return "parallax bench partitions " + shlex.join(argv)


def write_report(results_path: str | Path, out_dir: str | Path) -> dict[str, Path]:
    """report.md, summary.json and the PNGs (partitions_report.write_report)."""
    from parallax.bench import partitions_report
    return partitions_report.write_report(results_path, out_dir)
