"""The analytic data-transfer model: the bytes a worker must send and receive per step under
each way of training, against which measured traffic is compared (Parallax, EuroSys'19, §3).

Per worker, per step, for W workers:
- sparse table on parameter servers: pull the unique rows the batch touches, push their
  gradients: U x row bytes each way (ids ride along: 8 bytes per row each way);
- dense variables by ring all-reduce: 2 (W-1)/W x dense bytes sent, and as many received;
- dense variables on parameter servers: pull all, push all: dense bytes each way;
- sparse gradients all-gathered (Horovod on IndexedSlices): a worker receives the other
  W-1 workers' rows (values and int64 indices) and, in a ring, forwards as many;
- sparse gradients densified (Horovod `sparse_as_dense=True`): the whole table all-reduced.

The calibrated step-time model (`fit_step_model`, `project`): bytes alone do not give a
step time, so measured points (one system and workload at 1, 2, 4 workers, each process in
its own CPU share, links scaled by it) calibrate one. A step costs each resource
  worker CPU   = (a + b W) / c             (CPU seconds per step of one worker; b >= 0: an
                                            all-gather grows with W)
  server CPU   = (k_s W / S + k_r W) / c   (a server serves W/S workers' rows, and the
                                            pull and push of every worker each step: their
                                            fixed cost grows with W whatever S is)
  chief CPU    = k_c W / c                 (TF's coordinator dispatches W workers' steps)
  worker link  = rho x analytic bytes(W) / r   (rho = measured / analytic bytes; where the
                                            servers sit inside the worker hosts, the
                                            host's bytes: `colocated_host`)
  server link  = k_b W / S / r
  host CPU     = worker CPU + ceil(S/W) x server CPU + chief CPU
                                            (colocated: host 0's, the busiest; its processes
                                            share its cores, so their CPU adds up, and a
                                            sync step waits for the busiest host; it stands
                                            in for the three CPU terms)
with c the cores each process (colocated: each host) has and r the link rate; each
coefficient is fitted to its own measurements (least squares for a, b and for k_s, k_r
where the points tell those two apart; means for the others). The step time is then
scale x max(terms) (resources overlap: the slowest bounds the step) or scale x sum(terms)
(nothing overlaps), and never less than max(terms) (each term is a resource's busy time:
no step is shorter than its busiest resource's); `scale` is one least-squares factor on the
relative error (`floored_scale`), and of the two forms the one with the smaller mean
relative error on the measured points is kept.
`StepFit` states that error (mean and max), the other form's, and, with 1, 2 and 4
workers, the error at 4 of a fit to 1 and 2 alone (what extrapolation costs). Projected
samples/s = W x batch per worker / step time, with any W, S, c and r.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from parallax.errors import ConfigError

ID_BYTES = 8  # int64 row ids travel with pulled rows and pushed gradients


@dataclass(frozen=True)
class StepTraffic:
    """Bytes one worker sends and receives in one training step."""

    sent: float
    received: float

    def __add__(self, other: "StepTraffic") -> "StepTraffic":
        return StepTraffic(self.sent + other.sent, self.received + other.received)

    @property
    def total(self) -> float:
        return self.sent + self.received


@dataclass(frozen=True)
class Workload:
    """What the model moves: per table, the unique rows a worker's batch touches."""

    workers: int
    dense_bytes: int
    table_rows: tuple[int, ...] = ()       # rows of each sparse table
    table_dims: tuple[int, ...] = ()       # dim of each sparse table
    unique_rows: tuple[int, ...] = ()      # unique rows per worker per step, per table
    itemsize: int = 4

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ConfigError(f"workers must be >= 1, got {self.workers}")
        if not len(self.table_rows) == len(self.table_dims) == len(self.unique_rows):
            raise ConfigError(f"table_rows, table_dims and unique_rows must have one entry "
                              f"per table, got {len(self.table_rows)}, "
                              f"{len(self.table_dims)}, {len(self.unique_rows)}")
        for rows, unique in zip(self.table_rows, self.unique_rows):
            if not 0 <= unique <= rows:
                raise ConfigError(f"unique rows per step {unique} must be in [0, {rows}]")

    def row_bytes(self, table: int) -> int:
        return self.table_dims[table] * self.itemsize


def sparse_on_servers(workload: Workload) -> StepTraffic:
    pull_push = sum(u * (workload.row_bytes(t) + ID_BYTES)
                    for t, u in enumerate(workload.unique_rows))
    return StepTraffic(sent=pull_push, received=pull_push)


def ring_allreduce(nbytes: float, workers: int) -> StepTraffic:
    each = 2 * (workers - 1) / workers * nbytes
    return StepTraffic(sent=each, received=each)


def dense_on_servers(nbytes: float) -> StepTraffic:
    return StepTraffic(sent=nbytes, received=nbytes)


def sparse_allgathered(workload: Workload) -> StepTraffic:
    """Ring all-gather of every worker's (values, indices): each worker forwards and
    receives W-1 workers' shares."""
    share = sum(u * (workload.row_bytes(t) + ID_BYTES) for t, u in enumerate(workload.unique_rows))
    each = (workload.workers - 1) * share
    return StepTraffic(sent=each, received=each)


def table_bytes(workload: Workload) -> int:
    return sum(rows * workload.row_bytes(t) for t, rows in enumerate(workload.table_rows))


def expected_traffic(system: str, workload: Workload) -> StepTraffic:
    """Per worker per step for: hybrid, ps, allreduce (parallax's modes, the last also
    Horovod on IndexedSlices), horovod_sparse_as_dense, and mwms (TensorFlow's
    MultiWorkerMirroredStrategy all-gathers IndexedSlices gradients too: measured in
    docs/benchmarks.md, it moves what Horovod's all-gather does, not a densified table)."""
    w = workload.workers
    if system == "hybrid":
        return sparse_on_servers(workload) + ring_allreduce(workload.dense_bytes, w)
    if system == "ps":
        return sparse_on_servers(workload) + dense_on_servers(workload.dense_bytes)
    if system in ("allreduce", "mwms"):
        return sparse_allgathered(workload) + ring_allreduce(workload.dense_bytes, w)
    if system == "horovod_sparse_as_dense":
        return ring_allreduce(workload.dense_bytes + table_bytes(workload), w)
    raise ConfigError(f"system {system!r} is not one of hybrid, ps, allreduce, "
                      f"horovod_sparse_as_dense, mwms")


SERVER_PARTS = {"hybrid": "sparse", "ps": "all"}  # what each system exchanges with servers


def colocated_host(system: str, workload: Workload) -> StepTraffic:
    """Bytes over a worker host's link, the mean over the W hosts, when the servers sit
    inside the worker hosts (server i on host i mod W, as `parallax run -H` and the bench's
    colocated placement put them; the bench measures that mean). A host's link carries its
    worker's traffic with the servers on other hosts and its servers' traffic with the
    other hosts' workers; summed over the hosts that is (W - 1) x W x X each way (X: what
    one worker exchanges with all the servers a step, sent plus received), whatever the
    server count, so a host carries (W - 1)/W x (X sent + X received) each way: 1x X at 2
    workers, 1.75x at 8, on the link a dedicated server's traffic would not share. What a
    system sends past the servers (a ring all-reduce) is added whole. Systems without
    servers: their worker's traffic."""
    whole = expected_traffic(system, workload)
    part = SERVER_PARTS.get(system)
    if part is None:
        return whole
    x = sparse_on_servers(workload) if part == "sparse" else whole
    rest = StepTraffic(whole.sent - x.sent, whole.received - x.received)
    each = (workload.workers - 1) / workload.workers * (x.sent + x.received)
    return rest + StepTraffic(each, each)


# --- the calibrated step-time model -------------------------------------------------------
#
# Step time from measured points (see fit_step_model): what one step costs each process
# (CPU) and each link (bytes), combined by the form that fits the measurements better.

FORMS = ("max", "sum")
TERMS = ("worker_cpu", "server_cpu", "chief_cpu", "worker_link", "server_link", "host_cpu")


@dataclass(frozen=True)
class StepPoint:
    """One measured configuration of one system and workload, per step.

    step_seconds: global batch / samples per second. *_cpu: CPU seconds one process of the
    role used per step (mean over the role's processes; 0 where the role is absent).
    worker_bytes / server_bytes: bytes over one process's link per step, the busier
    direction. analytic_bytes: the traffic model's worker bytes at this point (busier
    direction). cores: the CPU each process had (its cgroup share; colocated: each host's).
    link_bytes_per_s: each link's rate, None when links were not shaped (then transfers are
    not modelled). colocated: the servers (and a coordinator) ran inside the worker hosts."""

    workers: int
    servers: int
    step_seconds: float
    worker_cpu: float
    worker_bytes: float
    analytic_bytes: float
    cores: float
    link_bytes_per_s: float | None
    server_cpu: float = 0.0
    chief_cpu: float = 0.0
    server_bytes: float = 0.0
    colocated: bool = False

    def __post_init__(self) -> None:
        if self.workers < 1 or self.servers < 0:
            raise ConfigError(f"a step point needs workers >= 1 and servers >= 0, got "
                              f"{self.workers} and {self.servers}")
        if not (self.step_seconds > 0 and self.cores > 0):
            raise ConfigError(f"step_seconds ({self.step_seconds}) and cores ({self.cores}) "
                              f"must be > 0")


@dataclass(frozen=True)
class StepModel:
    """Step time of one system on one workload, as a function of workers W, servers S, the
    cores c each process has and the link rate r (bytes/s):

      worker_cpu  = (worker_cpu_base + worker_cpu_slope * W) / c   one worker's CPU
      server_cpu  = (server_cpu_per_worker * W / S                 a server serves W/S workers'
                     + server_cpu_per_client * W) / c              rows, and every worker's
                                                                   pull and push each step
      chief_cpu   = chief_cpu_per_worker * W / c                   TF's coordinator: W workers
      worker_link = bytes_ratio * analytic_bytes(W) / r            measured/analytic x model
      server_link = server_bytes_per_worker * W / S / r

      host_cpu    = worker_cpu + ceil(S/W) x server_cpu            colocated (`colocated`):
                    + chief_cpu                                    host 0's processes (the
                                                                   busiest host) share its
                                                                   cores; this term then
                                                                   stands for the three

      step time = scale * max(terms)   (form "max": the slowest resource bounds the step,
                                        the others overlap with it)
      step time = scale * sum(terms)   (form "sum": nothing overlaps)

    scale (fitted) absorbs what the terms do not see: waiting for the slowest worker,
    latency, scheduling. Each term is a resource's busy time a step (a process's or host's
    CPU at its cores, a link's bytes at its rate), so no step is shorter than the largest:
    step time >= max(terms) whatever the scale (a sum-form scale under 1 would otherwise
    project a step below the CPU it burns)."""

    form: str
    scale: float
    worker_cpu_base: float
    worker_cpu_slope: float
    server_cpu_per_worker: float = 0.0
    chief_cpu_per_worker: float = 0.0
    bytes_ratio: float = 1.0
    server_bytes_per_worker: float = 0.0
    server_cpu_per_client: float = 0.0
    colocated: bool = False  # servers and coordinator inside the worker hosts (host_cpu)

    def terms(self, workers: int, servers: int, cores: float, link_bytes_per_s: float | None,
              analytic_bytes: float) -> dict[str, float]:
        """Seconds per step of each resource, before `scale` (colocated: the host's CPU in
        place of its processes')."""
        w, s = workers, max(servers, 1)
        per_server = workers / s if servers else 0.0
        link = (lambda b: 0.0) if link_bytes_per_s is None else (lambda b: b / link_bytes_per_s)
        cpu = {"worker_cpu": (self.worker_cpu_base + self.worker_cpu_slope * w) / cores,
               "server_cpu": (self.server_cpu_per_worker * per_server +
                              (self.server_cpu_per_client * w if servers else 0.0)) / cores,
               "chief_cpu": self.chief_cpu_per_worker * w / cores}
        links = {"worker_link": link(self.bytes_ratio * analytic_bytes),
                 "server_link": link(self.server_bytes_per_worker * per_server)}
        if not self.colocated:
            return {**cpu, **links, "host_cpu": 0.0}
        busiest = math.ceil(servers / workers)  # host 0's servers (server i on host i mod W)
        host = cpu["worker_cpu"] + busiest * cpu["server_cpu"] + cpu["chief_cpu"]
        return {"worker_cpu": 0.0, "server_cpu": 0.0, "chief_cpu": 0.0, **links,
                "host_cpu": host}

    def step_seconds(self, workers: int, servers: int, cores: float,
                     link_bytes_per_s: float | None, analytic_bytes: float) -> float:
        terms = self.terms(workers, servers, cores, link_bytes_per_s, analytic_bytes).values()
        return max(self.scale * _combined(self.form, terms), max(terms))

    def bound(self, workers: int, servers: int, cores: float,
              link_bytes_per_s: float | None, analytic_bytes: float) -> str:
        """The largest term's name: what limits a step there."""
        terms = self.terms(workers, servers, cores, link_bytes_per_s, analytic_bytes)
        return max(terms, key=terms.get)


@dataclass(frozen=True)
class StepFit:
    """A fitted model with its validation on the points it was fitted to (relative error
    |predicted - measured| / measured: mean and max), the other form's mean error, and,
    with 3 or more worker counts, the error at the largest count when fitted without it."""

    model: StepModel
    mean_error: float
    max_error: float
    other_form_error: float
    holdout_error: float | None
    workers: tuple[int, ...]


def _linear(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope), the slope kept >= 0 (CPU per step does not fall as
    workers are added; a negative slope is noise, and would go below zero at 64)."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    if slope < 0:
        return my, 0.0
    return my - slope * mx, slope


def _mean(values: list[float], default: float = 0.0) -> float:
    return sum(values) / len(values) if values else default


def _components(points: list[StepPoint]) -> StepModel:
    """The per-resource parts of the model, each from its own measurements (scale 1)."""
    if len({p.colocated for p in points}) > 1:
        raise ConfigError("the step-time model fits one placement at a time: these points "
                          "mix colocated and dedicated servers")
    base, slope = _linear([p.workers for p in points], [p.worker_cpu for p in points])
    with_servers = [p for p in points if p.servers]
    per_worker, per_client = _server_cpu(with_servers)
    return StepModel(
        form="max", scale=1.0, worker_cpu_base=base, worker_cpu_slope=slope,
        server_cpu_per_worker=per_worker, server_cpu_per_client=per_client,
        chief_cpu_per_worker=_mean([p.chief_cpu / p.workers for p in points]),
        bytes_ratio=_mean([p.worker_bytes / p.analytic_bytes for p in points
                           if p.analytic_bytes > 0], default=1.0),
        server_bytes_per_worker=_mean([p.server_bytes * p.servers / p.workers
                                       for p in with_servers]),
        colocated=points[0].colocated)


def _server_cpu(points: list[StepPoint]) -> tuple[float, float]:
    """(server_cpu_per_worker, server_cpu_per_client): least squares of a server's CPU per
    step on W/S and W where the points tell the two apart (servers that grow with the
    workers, as co-located ones do); else, or where either comes out negative (noise), all
    of it per worker's rows, as a fixed server count measures it."""
    if not points:
        return 0.0, 0.0
    xs = [(p.workers / p.servers, float(p.workers)) for p in points]
    ys = [p.server_cpu for p in points]
    a11 = sum(x * x for x, _ in xs)
    a12 = sum(x * w for x, w in xs)
    a22 = sum(w * w for _, w in xs)
    det = a11 * a22 - a12 * a12
    if det > 1e-9 * a11 * a22:  # (W/S proportional to W: not separable)
        b1 = sum(x * y for (x, _), y in zip(xs, ys))
        b2 = sum(w * y for (_, w), y in zip(xs, ys))
        per_worker, per_client = (b1 * a22 - b2 * a12) / det, (a11 * b2 - a12 * b1) / det
        if per_worker >= 0 and per_client >= 0:
            return per_worker, per_client
    return _mean([y / x for (x, _), y in zip(xs, ys)]), 0.0


def _combined(form: str, terms) -> float:
    return max(terms) if form == "max" else sum(terms)


def _raw(model: StepModel, p: StepPoint) -> float:
    return model.step_seconds(p.workers, p.servers, p.cores, p.link_bytes_per_s,
                              p.analytic_bytes)


def _with_scale(parts: StepModel, form: str, points: list[StepPoint]) -> StepModel:
    """The scale minimising the squared relative error of the floored step (`step_seconds`)
    on the points."""
    unscaled = replace(parts, form=form, scale=1.0)
    pairs = []
    for p in points:
        terms = unscaled.terms(p.workers, p.servers, p.cores, p.link_bytes_per_s,
                               p.analytic_bytes).values()
        pairs.append((_combined(form, terms) / p.step_seconds, max(terms) / p.step_seconds))
    return replace(unscaled, scale=floored_scale(pairs))


def floored_scale(pairs: Sequence[tuple[float, float]]) -> float:
    """The s minimising sum((max(s a, b) - 1)^2) over (a, b) = (combined terms, floor) /
    measured step, exactly: between consecutive cuts s = b / a the same points are floored,
    and the rest's sum is a quadratic in s, least at sum(a) / sum(a^2) clamped to the
    interval. Without a floor above the line it is that closed form; where every point
    sits on its floor, any s under the cuts fits as well, and 1 (no correction) is kept
    if it is one of them."""
    cuts = sorted({b / a for a, b in pairs if a > 0})
    edges = [0.0, *cuts, math.inf]
    best: tuple[float, float, float] | None = None
    for lo, hi in zip(edges, edges[1:]):
        free = [a for a, b in pairs if a > 0 and b / a <= lo]
        squares = sum(a * a for a in free)
        s = min(max(sum(free) / squares, lo), hi) if squares else min(max(1.0, lo), hi)
        if math.isinf(s):
            continue
        error = sum((max(s * a, b) - 1) ** 2 for a, b in pairs)
        key = (round(error, 12), abs(math.log(s)) if s > 0 else math.inf, s)
        if best is None or key < best:
            best = key
    return best[2] if best else 1.0


def _errors(model: StepModel, points: list[StepPoint]) -> list[float]:
    return [abs(_raw(model, p) - p.step_seconds) / p.step_seconds for p in points]


def _fit_form(points: list[StepPoint], form: str) -> StepModel:
    return _with_scale(_components(points), form, points)


def fit_step_model(points: list[StepPoint], forms: tuple[str, ...] = FORMS) -> StepFit:
    """Fit the components to the points, then each form's scale; keep the form with the
    smaller mean relative error on the points (ties: max). Needs >= 2 worker counts."""
    counts = sorted({p.workers for p in points})
    if len(counts) < 2:
        raise ConfigError(f"the step-time model needs points at >= 2 worker counts, got "
                          f"{counts or 'none'}: measure more --workers, e.g. 1,2,4")
    unknown = set(forms) - set(FORMS)
    if unknown or not forms:
        raise ConfigError(f"forms {forms} must be among {FORMS}")
    fits = {form: _fit_form(points, form) for form in forms}
    errors = {form: _mean(_errors(model, points)) for form, model in fits.items()}
    best = min(forms, key=lambda f: (errors[f], FORMS.index(f)))
    others = [errors[f] for f in forms if f != best]
    holdout = None
    if len(counts) >= 3:
        held = [p for p in points if p.workers != counts[-1]]
        model = _fit_form(held, best)
        holdout = _mean(_errors(model, [p for p in points if p.workers == counts[-1]]))
    return StepFit(fits[best], errors[best], max(_errors(fits[best], points)),
                   others[0] if others else errors[best], holdout, tuple(counts))


@dataclass(frozen=True)
class Projection:
    """The model's samples/s for W workers and S servers on links of link_gbit, each
    process on `cores` cores, and the resource that bounds the step there."""

    workers: int
    servers: int
    link_gbit: float
    cores: float
    step_seconds: float
    samples_per_s: float
    bound: str


def scaled_servers(workers: int, workers_per_server: float | None,
                   min_servers: int = 1) -> int:
    """Servers for W workers: W / workers_per_server rounded up, at least min_servers (the
    count measured, so small W keep the measured setup); 0 (no servers) when
    workers_per_server is None."""
    if workers_per_server is None:
        return 0
    if workers_per_server <= 0:
        raise ConfigError(f"workers per server must be > 0, got {workers_per_server}")
    return max(min_servers, 1, math.ceil(workers / workers_per_server - 1e-9))


def project(model: StepModel, analytic_bytes: Callable[[int], float], batch_per_worker: int,
            workers: Sequence[int], link_gbits: Sequence[float],
            workers_per_server: float | None, cores: float = 1.0,
            min_servers: int = 1) -> list[Projection]:
    """samples/s = W x batch per worker / step time, for every (link, W)."""
    out = []
    for gbit in link_gbits:
        rate = gbit * 1e9 / 8
        for w in workers:
            s = scaled_servers(w, workers_per_server, min_servers)
            step = model.step_seconds(w, s, cores, rate, analytic_bytes(w))
            out.append(Projection(w, s, gbit, cores, step, w * batch_per_worker / step,
                                  model.bound(w, s, cores, rate, analytic_bytes(w))))
    return out
