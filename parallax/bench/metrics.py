"""What one benchmark run measured, from rank 0's windows and the resource sampler: per
window samples/s, CPU seconds (all processes, and per host) and bytes per host; per run the
medians over windows (samples/s, CPU seconds per sample, a worker's bytes per step, per-role
figures from `roles`), and what the traffic model expects (`analytic`, `traffic_record`).
"""
from __future__ import annotations

import statistics
from dataclasses import asdict
from typing import Sequence

from parallax.bench import roles, workloads
from parallax.bench.sampler import ResourceSampler


def window_metrics(record: dict, sampler: ResourceSampler | None) -> list[dict]:
    """Each reported window with its CPU seconds and per-host bytes from the sampler."""
    windows = []
    for w in record["windows"]:
        seconds = w["t1"] - w["t0"]
        out = {"seconds": seconds, "steps": w["steps"], "samples": w["samples"],
               "samples_per_s": w["samples"] / seconds if seconds > 0 else None,
               "cpu_seconds": None, "bytes_sent": None, "bytes_received": None}
        if sampler is not None:
            usage = sampler.between(w["t0"], w["t1"])
            out["cpu_seconds"] = usage.cpu_seconds
            out["cpu_seconds_by_host"] = usage.cpu_by_host
            if usage.bytes:
                out["bytes_sent"] = {h: sent for h, (sent, _) in usage.bytes.items()}
                out["bytes_received"] = {h: recv for h, (_, recv) in usage.bytes.items()}
        windows.append(out)
    return windows


def summarize_windows(windows: list[dict], worker_hosts: Sequence[str]) -> dict:
    """Medians over windows: samples/s, CPU s per sample, mean worker bytes per step."""
    def median(values):
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    def per_step(w: dict, key: str):
        if not w[key] or any(h not in w[key] for h in worker_hosts):
            return None  # not counted (loopback), never guessed as zero
        return statistics.fmean(w[key][h] for h in worker_hosts) / w["steps"]

    cpu = [w["cpu_seconds"] / w["samples"] if w["cpu_seconds"] is not None else None
           for w in windows]
    sent = median(per_step(w, "bytes_sent") for w in windows)
    received = median(per_step(w, "bytes_received") for w in windows)
    return {"samples_per_s": median(w["samples_per_s"] for w in windows),
            "cpu_seconds_per_sample": median(cpu),
            "worker_bytes_per_step": (None if sent is None
                                      else {"sent": sent, "received": received}),
            "per_process": roles.per_process_per_step(windows)}


def analytic(system: str, spec: workloads.WorkloadSpec, workers: int) -> dict | None:
    from parallax.bench.report import analytic_traffic
    traffic = analytic_traffic(system, workloads.traffic_workload(spec, workers))
    return None if traffic is None else {"sent": traffic.sent, "received": traffic.received}


def traffic_record(spec: workloads.WorkloadSpec, workers: int) -> dict:
    """The traffic model's view of the workload, so a report can model other worker counts
    without building the model (parallax.placement.traffic_model.Workload's fields)."""
    return asdict(workloads.traffic_workload(spec, workers))
