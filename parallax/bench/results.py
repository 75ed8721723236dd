"""The harness's results file, loaded into typed records: every field checked, and a
malformed file refused with a ConfigError naming the file and the field."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from parallax.errors import ConfigError
from parallax.traffic_model import StepTraffic


@dataclass(frozen=True)
class Network:
    name: str
    rate_mbit: float | None
    latency_ms: float | None
    latency_emulated: bool

    def describe(self) -> str:
        rate = "unshaped" if self.rate_mbit is None else f"{self.rate_mbit:g} Mbit/s"
        if self.latency_ms is None:
            return f"{self.name} ({rate})"
        emulated = "emulated" if self.latency_emulated else "not emulated"
        return f"{self.name} ({rate}, {self.latency_ms:g} ms latency, {emulated})"


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


def _network(raw: dict, where: str) -> Network:
    return Network(_get(raw, "name", where, (str,)), _get(raw, "rate_mbit", where, _NUM, True),
                   _get(raw, "latency_ms", where, _NUM, True),
                   _get(raw, "latency_emulated", where, (bool,)))


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
        _traffic(raw, "worker_bytes_per_step", where), _traffic(raw, "analytic", where))
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
