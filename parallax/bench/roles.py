"""Per process role (worker, parameter server, TF coordinator): CPU seconds and bytes per
step of one process of a run, from its measurement windows.

Why: a run's total CPU per sample says how much work a system does, not where; the
step-time model (`parallax.placement.traffic_model.fit_step_model`) needs a worker's CPU per
step apart
from a server's, and a server's link apart from a worker's, to tell which one bounds a step
at 64 workers. Hosts are named by the harness: `worker<i>`, `ps<i>` (parallax or TF
parameter servers) and `chief` (TF's coordinator). A run's processes are the hosts that have
per-host CPU in a window (`cpu_seconds_by_host`); hosts of the cluster that the run did not
use are left out of the means, so an idle namespace does not dilute them.
"""
from __future__ import annotations

import statistics
from typing import Iterable

ROLES = ("worker", "server", "chief")


def role_of(host: str) -> str | None:
    """worker0 -> worker, ps1 -> server, chief -> chief; None for anything else."""
    if host.startswith("worker"):
        return "worker"
    if host.startswith("ps"):
        return "server"
    return "chief" if host == "chief" else None


def _mean(values: Iterable[float]) -> float | None:
    values = list(values)
    return statistics.fmean(values) if values else None


def _window_roles(window: dict) -> dict[str, dict]:
    """One window: per role, the mean over its processes of CPU and bytes per step."""
    steps = window["steps"]
    by_role: dict[str, list[str]] = {}
    for host in window["cpu_seconds_by_host"]:
        if role_of(host):
            by_role.setdefault(role_of(host), []).append(host)
    out = {}
    for role, hosts in by_role.items():
        entry = {"processes": len(hosts),
                 "cpu_seconds": _mean(window["cpu_seconds_by_host"][h] for h in hosts) / steps}
        for key in ("bytes_sent", "bytes_received"):
            counted = window.get(key) or {}
            entry[key] = (None if any(h not in counted for h in hosts)
                          else _mean(counted[h] for h in hosts) / steps)
        out[role] = entry
    return out


def per_process_per_step(windows: list[dict]) -> dict[str, dict] | None:
    """Per role: processes, and the median over windows of one process's CPU seconds, bytes
    sent and bytes received per step (None where not counted, e.g. on loopback). None when
    no window has per-host CPU (results of older harnesses)."""
    parts = [_window_roles(w) for w in windows if w.get("cpu_seconds_by_host") and w["steps"]]
    if not parts:
        return None
    out = {}
    for role in ROLES:
        seen = [p[role] for p in parts if role in p]
        if not seen:
            continue
        entry = {"processes": max(e["processes"] for e in seen)}
        for key in ("cpu_seconds", "bytes_sent", "bytes_received"):
            values = [e[key] for e in seen if e[key] is not None]
            entry[key] = statistics.median(values) if values else None
        out[role] = entry
    return out
