"""A benchmark's results aggregated: the systems and workloads it knows, one row per
(workload, network, workers, system) with medians over rounds beside the analytic traffic,
and the slices (one workload on one network) that the report's tables and the plots show.
The types and constants every report module shares; nothing here writes a file.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from typing import Iterable, Sequence

from parallax.bench.results import Results, Run
from parallax.placement import traffic_model
from parallax.placement.traffic_model import StepTraffic, Workload

SYSTEMS = ("hybrid", "ps", "allreduce", "tf_ps", "mwms", "horovod", "horovod_dense",
           "hybrid_tf", "hybrid_py", "hybrid_r2", "hybrid_replay")
# hybrid_tf: hybrid whose dense sums are TensorFlow's collectives; hybrid_py: hybrid on the
# numpy data path (PARALLAX_NATIVE=0 in every process), to measure the compiled kernels;
# hybrid_r2: hybrid with a copy of every shard (PARALLAX_REPLICAS=2), to price replication;
# hybrid_replay: hybrid whose workers keep their pushes (PARALLAX_REPLAY_MB), to price that
ON_REQUEST = ("hybrid_tf", "hybrid_py", "hybrid_r2", "hybrid_replay")  # run only when named in --systems
WORKLOADS = ("lm", "ctr", "dense")
PARALLAX = "hybrid"
CACHED = "hybrid_cache"  # + staleness: hybrid with a worker row cache, e.g. hybrid_cache4
BYTES_TARGET = 1.2      # hybrid's measured bytes within this factor of the analytic minimum
DENSE_TOLERANCE = 5.0   # percent: on a dense model hybrid is plain all-reduce, like Horovod

_MODEL = {"hybrid": "hybrid", "hybrid_tf": "hybrid", "hybrid_py": "hybrid", "hybrid_r2": "hybrid",
          "hybrid_replay": "hybrid", "ps": "ps", "tf_ps": "ps",
          "allreduce": "allreduce",
          "horovod": "allreduce", "horovod_dense": "horovod_sparse_as_dense", "mwms": "mwms"}


def analytic_traffic(system: str, workload: Workload) -> StepTraffic | None:
    """The bytes one worker of `system` is expected to send and receive per step; None for a
    system the model does not cover.

    horovod (sparse gradients as IndexedSlices) is all-gathered like parallax's allreduce mode.
    tf_ps is approximated by parallax's ps model: TensorFlow's ParameterServerStrategy keeps all
    variables on the servers, gathers only the embedding rows a step reads and pushes sparse
    gradients for them, and pulls and pushes dense variables whole. It ignores what the model
    cannot see: the coordinator's RPCs that dispatch each step, and rows read twice by one step.
    """
    model = _MODEL.get(system)
    return None if model is None else traffic_model.expected_traffic(model, workload)


def link_traffic(system: str, workload: Workload, colocated: bool) -> StepTraffic | None:
    """The bytes the model expects over the link a run measures per worker: the worker's
    own (`analytic_traffic`), or, where the servers sit inside the worker hosts, a host's,
    its worker's and its servers' together (`colocated_host`: the mean over the hosts, as
    the bench measures it)."""
    if not colocated:
        return analytic_traffic(system, workload)
    model = _MODEL.get(system)
    return None if model is None else traffic_model.colocated_host(model, workload)


def run_traffic(run: Run) -> StepTraffic | None:
    """`link_traffic` at a run's own point; older results without the traffic model's
    workload: the analytic traffic their harness recorded."""
    if run.traffic_workload is None:
        return run.analytic
    return link_traffic(run.system, replace(run.traffic_workload, workers=run.workers),
                        run.network.placement == "colocated")


def minimum_traffic(workload: Workload) -> StepTraffic:
    """The least a worker must move per step (issue 5): its unique sparse rows pulled and pushed
    (2 x U x dim x itemsize, plus ids) and dense gradients ring-all-reduced (2 (W-1)/W x dense
    bytes), which is exactly what hybrid is modelled to move."""
    return traffic_model.expected_traffic("hybrid", workload)


@dataclass(frozen=True)
class Row:
    """One (workload, network, workers, system) point, its rounds aggregated by median."""

    workload: str
    network: str
    workers: int
    system: str
    rounds_ok: int
    rounds_total: int
    samples_per_s: float | None
    cpu_seconds_per_sample: float | None
    measured: StepTraffic | None    # bytes per worker per step
    analytic: StepTraffic | None    # this system's model
    minimum: StepTraffic | None     # the analytic minimum: hybrid's model at the same point
    vs_analytic: float | None       # measured total / analytic total
    vs_minimum: float | None        # measured total / minimum total
    hosts: int | None = None        # emulated machines a run used (None: older results)
    cores: float | None = None      # cores its processes were held to; None: shared cores

    @property
    def samples_per_s_per_core(self) -> float | None:
        if self.samples_per_s is None or not self.cores:
            return None
        return self.samples_per_s / self.cores


def _median(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _median_traffic(values: Iterable[StepTraffic | None]) -> StepTraffic | None:
    present = [v for v in values if v is not None]
    return StepTraffic(_median(v.sent for v in present), _median(v.received for v in present)) \
        if present else None


def _ratio(a: StepTraffic | None, b: StepTraffic | None) -> float | None:
    return None if a is None or b is None or b.total == 0 else a.total / b.total


def cache_system(staleness: int) -> str:
    return f"{CACHED}{staleness}"


def cache_staleness(system: str) -> int | None:
    """The staleness of a cache system's name ("hybrid_cache4" -> 4), else None."""
    tail = system.removeprefix(CACHED)
    return int(tail) if system.startswith(CACHED) and tail.isdigit() else None


def _rank(name: str, known: Sequence[str]) -> tuple[int, int, str]:
    """Known names in `known`'s order, cache systems after hybrid by staleness, then the
    rest by name."""
    staleness = cache_staleness(name)
    if staleness is not None and PARALLAX in known:
        return (known.index(PARALLAX), 1 + staleness, name)
    return (known.index(name) if name in known else len(known), 0, name)


def summarize(results: Results) -> list[Row]:
    """Rows ordered by workload, network (as first run), workers and system."""
    groups: dict[tuple[str, str, int, str], list[Run]] = {}
    for run in results.runs:
        groups.setdefault((run.workload, run.network.name, run.workers, run.system), []).append(run)
    analytic = {k: next((t for r in runs if (t := run_traffic(r))), None)
                for k, runs in groups.items()}
    networks = list(dict.fromkeys(r.network.name for r in results.runs))
    rows = []
    for key in sorted(groups, key=lambda k: (_rank(k[0], WORKLOADS), networks.index(k[1]),
                                             k[2], _rank(k[3], SYSTEMS))):
        ok = [r for r in groups[key] if r.ok]
        measured = _median_traffic(r.worker_bytes_per_step for r in ok)
        minimum = analytic.get(key[:3] + (PARALLAX,))
        first = groups[key][0]
        rows.append(Row(*key, len(ok), len(groups[key]), _median(r.samples_per_s for r in ok),
                        _median(r.cpu_seconds_per_sample for r in ok), measured, analytic[key],
                        minimum, _ratio(measured, analytic[key]), _ratio(measured, minimum),
                        first.hosts, first.cores))
    return rows


@dataclass(frozen=True)
class Slice:
    """The rows of one workload on one network: what one group of tables and plots shows."""

    workload: str
    network: str
    rows: tuple[Row, ...]

    @property
    def workers(self) -> list[int]:
        return sorted({r.workers for r in self.rows})

    @property
    def systems(self) -> list[str]:
        return sorted({r.system for r in self.rows}, key=lambda s: _rank(s, SYSTEMS))

    def get(self, system: str, workers: int) -> Row | None:
        return next((r for r in self.rows if (r.system, r.workers) == (system, workers)), None)

    def speedup(self, system: str) -> float | None:
        """hybrid's samples/s over `system`'s at the largest worker count."""
        mine, theirs = (self.get(s, self.workers[-1]) for s in (PARALLAX, system))
        if not (mine and theirs and mine.samples_per_s and theirs.samples_per_s):
            return None
        return mine.samples_per_s / theirs.samples_per_s


def slices(rows: list[Row]) -> list[Slice]:
    keys = dict.fromkeys((r.workload, r.network) for r in rows)
    return [Slice(w, n, tuple(r for r in rows if (r.workload, r.network) == (w, n)))
            for w, n in keys]
