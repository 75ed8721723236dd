"""The harness's results file, loaded into typed records: every field checked, and a
malformed file refused with a ConfigError naming the file and the field. Fields added after
the first results files (CPU isolation, per-process figures, the traffic workload) are
optional, so older files still load."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from parallax.errors import ConfigError
from parallax.placement.traffic_model import StepTraffic, Workload


@dataclass(frozen=True)
class Network:
    """A network setting of the results: its key (`name`, "1gbit@0.25cpu" when isolated),
    the links' effective rate and latency, and, for a CPU-isolated setting, the cores per
    process and the link as asked for (nominal: before scaling by the share)."""

    name: str
    rate_mbit: float | None
    latency_ms: float | None
    latency_emulated: bool
    cpu_share: float | None = None
    nominal_rate_mbit: float | None = None
    placement: str | None = None  # colocated or dedicated; None: older files (dedicated)

    @property
    def isolated(self) -> bool:
        return self.cpu_share is not None

    @property
    def link(self) -> str:
        """The link as asked for, without share or placement: "1gbit@0.25cpu:colocated" ->
        "1gbit"."""
        return self.name.partition(":")[0].partition("@")[0]

    def describe(self) -> str:
        rate = "unshaped" if self.rate_mbit is None else f"{self.rate_mbit:g} Mbit/s"
        if self.isolated and self.nominal_rate_mbit is not None:
            rate += f" = {self.nominal_rate_mbit:g} Mbit/s x {self.cpu_share:g}"
        if self.latency_ms is not None:
            emulated = "emulated" if self.latency_emulated else "not emulated"
            rate += f", {self.latency_ms:g} ms latency, {emulated}"
        if self.isolated:
            rate += f"; {self.cpu_share:g} core per host"
        elif self.link != "loopback":
            rate += "; processes share the machine's cores"
        if self.placement == "colocated":
            rate += "; servers inside worker hosts (equal hardware)"
        elif self.placement == "dedicated":
            rate += "; a host per process (servers on hosts of their own)"
        return f"{self.name} ({rate})"


@dataclass(frozen=True)
class RoleStep:
    """One process of a role (worker, server, chief) in one step: CPU seconds and bytes
    (None where not counted)."""

    processes: int
    cpu_seconds: float | None
    bytes_sent: float | None
    bytes_received: float | None

    @property
    def link_bytes(self) -> float | None:
        """The busier direction of the process's link: what bounds its transfer time."""
        if self.bytes_sent is None or self.bytes_received is None:
            return None
        return max(self.bytes_sent, self.bytes_received)


@dataclass(frozen=True)
class Run:
    system: str
    workload: str
    size: str
    workers: int
    servers: int
    network: Network
    round: int
    batch_per_worker: int
    global_batch: int
    status: str
    error: str | None
    windows: tuple[dict[str, Any], ...]  # raw: the report reads only the harness's medians
    samples_per_s: float | None
    cpu_seconds_per_sample: float | None
    worker_bytes_per_step: StepTraffic | None
    analytic: StepTraffic | None
    per_process: dict[str, RoleStep] = field(default_factory=dict)
    traffic_workload: Workload | None = None
    losses: tuple[float, ...] = ()  # rank 0's loss at every step (parallax systems)
    counters: dict[str, float] = field(default_factory=dict)  # growth over the windows
    hosts: int | None = None    # emulated machines the run used (None: older files)
    cores: float | None = None  # cores its processes were held to in all; None: shared

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass(frozen=True)
class Meta:
    date: str
    commit: str
    command: str
    machine: str
    notes: tuple[str, ...]


@dataclass(frozen=True)
class Results:
    path: str
    meta: Meta
    runs: tuple[Run, ...]


def _get(obj: dict, key: str, where: str, kinds: tuple[type, ...], optional: bool = False) -> Any:
    name = f"{where}.{key}" if where else key
    if key not in obj:
        raise ConfigError(f"{name} is missing")
    value = obj[key]
    if value is None and optional:
        return None
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        want = " or ".join(k.__name__ for k in kinds) + (" or null" if optional else "")
        raise ConfigError(f"{name} must be {want}, got {value!r}")
    return float(value) if kinds == (int, float) else value


_NUM = (int, float)


def _traffic(obj: dict, key: str, where: str) -> StepTraffic | None:
    raw = _get(obj, key, where, (dict,), True)
    name = f"{where}.{key}"
    return None if raw is None else StepTraffic(_get(raw, "sent", name, _NUM),
                                                _get(raw, "received", name, _NUM))


def _optional(raw: dict, key: str, where: str, kinds: tuple[type, ...]) -> Any:
    """A field newer harnesses write: absent (older files) or null reads as None."""
    return _get(raw, key, where, kinds, True) if key in raw else None


def _network(raw: dict, where: str) -> Network:
    share = _optional(raw, "cpu_share", where, _NUM)
    if share is not None and share <= 0:
        raise ConfigError(f"{where}.cpu_share must be > 0 cores, got {share!r}")
    placement = _optional(raw, "placement", where, (str,))
    if placement not in (None, "colocated", "dedicated"):
        raise ConfigError(f"{where}.placement must be 'colocated' or 'dedicated', got "
                          f"{placement!r}")
    return Network(_get(raw, "name", where, (str,)), _get(raw, "rate_mbit", where, _NUM, True),
                   _get(raw, "latency_ms", where, _NUM, True),
                   _get(raw, "latency_emulated", where, (bool,)), share,
                   _optional(raw, "nominal_rate_mbit", where, _NUM), placement)


def _per_process(raw: dict, where: str) -> dict[str, RoleStep]:
    roles = _optional(raw, "per_process", where, (dict,)) or {}
    out = {}
    for role, entry in roles.items():
        name = f"{where}.per_process.{role}"
        entry = _object_at(entry, name)
        out[role] = RoleStep(_get(entry, "processes", name, (int,)),
                             *(_get(entry, k, name, _NUM, True)
                               for k in ("cpu_seconds", "bytes_sent", "bytes_received")))
    return out


def _traffic_workload(raw: dict, where: str) -> Workload | None:
    entry = _optional(raw, "traffic_workload", where, (dict,))
    if entry is None:
        return None
    name = f"{where}.traffic_workload"
    ints = (int,)
    lists = {k: tuple(_get(entry, k, name, (list,))) for k in
             ("table_rows", "table_dims", "unique_rows")}
    for key, values in lists.items():
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise ConfigError(f"{name}.{key} must be a list of integers, got {values!r}")
    return Workload(_get(entry, "workers", name, ints), _get(entry, "dense_bytes", name, ints),
                    **lists, itemsize=_get(entry, "itemsize", name, ints))


def _losses(raw: dict, where: str) -> tuple[float, ...]:
    values = _optional(raw, "losses", where, (list,)) or []
    if not all(isinstance(v, _NUM) and not isinstance(v, bool) for v in values):
        raise ConfigError(f"{where}.losses must be a list of numbers, got {values[:5]!r}...")
    return tuple(float(v) for v in values)


def _counters(raw: dict, where: str) -> dict[str, float]:
    counters = _optional(raw, "counters", where, (dict,)) or {}
    for key, value in counters.items():
        if not isinstance(value, _NUM) or isinstance(value, bool):
            raise ConfigError(f"{where}.counters.{key} must be a number, got {value!r}")
    return {key: float(value) for key, value in counters.items()}


def _hardware(raw: dict, where: str) -> tuple[int | None, float | None]:
    """(hosts, cores): both optional; hosts >= 1, cores > 0 where given."""
    hosts = _optional(raw, "hosts", where, (int,))
    cores = _optional(raw, "cores", where, _NUM)
    if hosts is not None and hosts < 1:
        raise ConfigError(f"{where}.hosts must be >= 1 emulated machines, got {hosts!r}")
    if cores is not None and cores <= 0:
        raise ConfigError(f"{where}.cores must be > 0 (or null on shared cores), got "
                          f"{cores!r}")
    return hosts, None if cores is None else float(cores)


def _object_at(raw: Any, where: str) -> dict:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be an object, got {raw!r}")
    return raw


def _run(raw: Any, where: str) -> Run:
    raw = _object_at(raw, where)
    status = _get(raw, "status", where, (str,))
    if status not in ("ok", "failed"):
        raise ConfigError(f"{where}.status must be 'ok' or 'failed', got {status!r}")
    run = Run(
        *(_get(raw, k, where, (str,)) for k in ("system", "workload", "size")),
        _get(raw, "workers", where, (int,)), _get(raw, "servers", where, (int,)),
        _network(_get(raw, "network", where, (dict,)), f"{where}.network"),
        *(_get(raw, k, where, (int,)) for k in ("round", "batch_per_worker", "global_batch")),
        status, _get(raw, "error", where, (str,), optional=True),
        tuple(_object_at(w, f"{where}.windows[{i}]")
              for i, w in enumerate(_get(raw, "windows", where, (list,)))),
        _get(raw, "samples_per_s", where, _NUM, True),
        _get(raw, "cpu_seconds_per_sample", where, _NUM, True),
        _traffic(raw, "worker_bytes_per_step", where), _traffic(raw, "analytic", where),
        _per_process(raw, where), _traffic_workload(raw, where),
        _losses(raw, where), _counters(raw, where), *_hardware(raw, where))
    if run.ok and run.samples_per_s is None:
        raise ConfigError(f"{where}.samples_per_s is null but the run's status is 'ok'")
    return run


def load(path: str | Path) -> Results:
    """Read and check a results file; a malformed one raises ConfigError naming file and field."""
    try:
        raw = json.loads(Path(path).read_text())
        if not isinstance(raw, dict):
            raise ConfigError(f"the top level must be an object, got {type(raw).__name__}")
        meta = _get(raw, "meta", "", (dict,))
        fields = [_get(meta, k, "meta", (str,)) for k in ("date", "commit", "command", "machine")]
        notes = _get(meta, "notes", "meta", (list,))
        if not all(isinstance(n, str) for n in notes):
            raise ConfigError(f"meta.notes must be a list of strings, got {notes!r}")
        runs = _get(raw, "runs", "", (list,))
        return Results(str(path), Meta(*fields, tuple(notes)),
                       tuple(_run(r, f"runs[{i}]") for i, r in enumerate(runs)))
    except (OSError, json.JSONDecodeError, ConfigError) as e:
        raise ConfigError(f"results file {path}: {e}") from e
