"""Per-table, per-method request counters: requests, errors, rows, bytes, latency."""
from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass

from parallax.ps.v1 import ps_pb2
from parallax_ps.metrics import RequestMetrics


@dataclass
class MethodCounter:
    requests: int = 0
    errors: int = 0
    rows: int = 0
    bytes: int = 0
    total_seconds: float = 0.0
    max_seconds: float = 0.0


class ServerStats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[tuple[str, str], MethodCounter] = defaultdict(MethodCounter)
        self.metrics = RequestMetrics()  # the same requests, for the Prometheus endpoint

    def record(self, table: str, method: str, seconds: float, *, rows: int = 0,
               nbytes: int = 0, error: bool = False, code: str = "") -> None:
        self.metrics.observe(method, code or ("UNKNOWN" if error else "OK"), seconds, table,
                             rows, nbytes)
        with self._lock:
            c = self._counters[(table, method)]
            c.requests += 1
            c.errors += int(error)
            c.rows += rows
            c.bytes += nbytes
            c.total_seconds += seconds
            c.max_seconds = max(c.max_seconds, seconds)

    def methods(self, table: str) -> list[ps_pb2.MethodStats]:
        with self._lock:
            items = [(m, c) for (t, m), c in self._counters.items() if t == table]
            return [ps_pb2.MethodStats(method=m, requests=c.requests, errors=c.errors, rows=c.rows,
                                       bytes=c.bytes, total_seconds=c.total_seconds,
                                       max_seconds=c.max_seconds) for m, c in sorted(items)]
