"""Request counters, per table and method and for the whole server: requests, errors, rows,
bytes, latency. A multi-table request (PullMany, PushMany) counts once for the server and
once per part for each table it concerned."""
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

    def add(self, seconds: float, requests: int, rows: int, nbytes: int, error: bool) -> None:
        self.requests += requests
        self.errors += int(error)
        self.rows += rows
        self.bytes += nbytes
        self.total_seconds += seconds
        self.max_seconds = max(self.max_seconds, seconds)

    def proto(self, method: str) -> ps_pb2.MethodStats:
        return ps_pb2.MethodStats(method=method, requests=self.requests, errors=self.errors,
                                  rows=self.rows, bytes=self.bytes,
                                  total_seconds=self.total_seconds, max_seconds=self.max_seconds)


class ServerStats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[tuple[str, str], MethodCounter] = defaultdict(MethodCounter)
        self._server: dict[str, MethodCounter] = defaultdict(MethodCounter)
        self.metrics = RequestMetrics()  # the same requests, for the Prometheus endpoint

    def record(self, table: str, method: str, seconds: float, *, rows: int = 0,
               nbytes: int = 0, error: bool = False, code: str = "") -> None:
        self.metrics.observe(method, code or ("UNKNOWN" if error else "OK"), seconds, table,
                             rows, nbytes)
        with self._lock:
            self._counters[(table, method)].add(seconds, 1, rows, nbytes, error)
            self._server[method].add(seconds, 1, rows, nbytes, error)

    def record_many(self, method: str, seconds: float, per_table: dict, *,
                    error: bool = False, code: str = "") -> None:
        """One multi-table request; `per_table`: {table: PartCounts} of its parts."""
        rows = sum(c.rows for c in per_table.values())
        nbytes = sum(c.nbytes for c in per_table.values())
        self.metrics.observe(method, code or ("UNKNOWN" if error else "OK"), seconds, "", 0,
                             nbytes)
        with self._lock:
            for table, counts in per_table.items():
                self.metrics.add_rows(method, table, counts.rows)
                self._counters[(table, method)].add(seconds, counts.parts, counts.rows,
                                                    counts.nbytes, False)
            self._server[method].add(seconds, 1, rows, nbytes, error)

    def forget(self, table: str) -> None:
        """Drop a deleted table's counts: a table made again under its name (a restarted job
        on servers kept running) counts from zero. The server's totals and the Prometheus
        counters (monotonic by contract) keep them."""
        with self._lock:
            for key in [k for k in self._counters if k[0] == table]:
                del self._counters[key]

    def methods(self, table: str) -> list[ps_pb2.MethodStats]:
        with self._lock:
            items = [(m, c) for (t, m), c in self._counters.items() if t == table]
            return [c.proto(m) for m, c in sorted(items)]

    def server_methods(self) -> list[ps_pb2.MethodStats]:
        with self._lock:
            return [c.proto(m) for m, c in sorted(self._server.items())]
