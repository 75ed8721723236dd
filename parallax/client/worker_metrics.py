"""A worker's own Prometheus metrics (`parallax_worker_*`), counted where a step's traffic
happens and served by the same endpoint as the servers' (`parallax.protocol.metrics_endpoint`).

`WORKER_METRICS` is the process's one `WorkerMetrics`: the fused pull and push of a step
(`parallax.client.step`) report their wall time and the step's, `DirectClient` the rows
and bytes each request carries (what really travels: a row cache's hits never reach it).
That is a few additions under one lock per step, per table at most, never per row; the
metric families are built at scrape time. The row cache's counters are read from its own
`stats()` at scrape time, so they cost the step nothing.

`serve(port, host, rank)` starts the endpoint once per process (a second strategy in the
same process reuses it); `parallax run --metrics-port` asks for it through
PARALLAX_WORKER_METRICS_PORT, and the worker then prints `worker_metrics_line` on stderr for
the launcher to collect. With PARALLAX_TOKEN_FILE a scrape must carry the token, as for the
servers.
"""
from __future__ import annotations

import logging
import os
import socket
import sys
import threading
from typing import Callable, Sequence

from prometheus_client.metrics_core import GaugeMetricFamily, HistogramMetricFamily, Metric

from parallax.env import (TOKEN_FILE_ENV, WORKER_METRICS_HOST_ENV, WORKER_METRICS_PORT_ENV,
                          split_run_id, worker_metrics_line)
from parallax.errors import ConfigError
from parallax.protocol.metrics_endpoint import Histogram, MetricsServer, counter, cumulative
from parallax.protocol.security import read_token

log = logging.getLogger("parallax")

TABLE_LABELS = ("direction", "run_id", "table")  # direction: "in" pulled rows, "out" pushed
LATENCIES = {  # histogram -> its help
    "step": "Time from a fused training step's start to its push leaving (forward and "
            "backward included; the dense all-reduce may end later).",
    "pull": "Wall time of a step's fused pull on the worker: every table's rows from every "
            "server (a sync pull waits there for the previous step to be applied).",
    "push": "Wall time of a step's fused push on the worker: sending every table's gradients "
            "and reading the answers (not the step in between; a sync push is counted once "
            "the next step's pull has read its answers).",
}


class WorkerMetrics:
    """Counters and latency histograms of one worker process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.steps = 0
        self._latency = {name: Histogram() for name in LATENCIES}
        self._moved: dict[tuple[str, str, str], list[int]] = {}  # labels -> [rows, bytes]
        self._tables: dict[str, tuple[str, str, int]] = {}  # name -> run id, table, row bytes
        self.rank: int | None = None
        self.size: int | None = None
        self.cache_stats: Callable[[], object] | None = None  # the row cache's, if on

    def step(self, seconds: float | None) -> None:
        """A fused training step ended (its push left), `seconds` after it began (None: a
        step without a fused pull, whose start is not known)."""
        with self._lock:
            self.steps += 1
            if seconds is not None:
                self._latency["step"].observe(seconds)

    def observe(self, name: str, seconds: float) -> None:
        """One fused pull's or push's wall time (`name`: "pull" or "push")."""
        with self._lock:
            self._latency[name].observe(seconds)

    def moved(self, direction: str, tables: Sequence, lengths: Sequence[int]) -> None:
        """One request's rows per table (`direction`: "in" pulled, "out" pushed); bytes are
        the row payload on the wire (the table's wire dtype), as the servers count them."""
        with self._lock:
            for table, rows in zip(tables, lengths):
                if not rows:
                    continue
                run_id, name, row_bytes = self._labels(table)
                counts = self._moved.get((direction, run_id, name))
                if counts is None:
                    counts = self._moved[(direction, run_id, name)] = [0, 0]
                counts[0] += rows
                counts[1] += rows * row_bytes

    def _labels(self, table) -> tuple[str, str, int]:
        known = self._tables.get(table.name)
        if known is None:
            known = self._tables[table.name] = (*split_run_id(table.name),
                                                table.spec.dim * table.push_dtype.itemsize)
        return known

    def families(self) -> list[Metric]:
        """Every family, from a copy taken under the lock."""
        with self._lock:
            steps = self.steps
            latency = [(n, list(h.counts), h.sum) for n, h in self._latency.items()]
            moved = sorted(self._moved.items())
        out: list[Metric] = [counter("parallax_worker_steps_total", "Fused training steps "
                                     "this worker ran (traced steps with a fused push, "
                                     "whether or not it sent rows).",
                                     (), [((), steps)])]
        for name, counts, total in latency:
            family = HistogramMetricFamily(f"parallax_worker_{name}_seconds", LATENCIES[name])
            family.add_metric((), cumulative(counts), total)
            out.append(family)
        out += [counter("parallax_worker_rows_total", "Table rows this worker's requests "
                        "carried, by direction (in: pulled, out: pushed gradients) and table.",
                        TABLE_LABELS, [(k, v[0]) for k, v in moved]),
                counter("parallax_worker_bytes_total", "Row payload bytes of this worker's "
                        "requests (rows x dim x wire dtype size), by direction and table.",
                        TABLE_LABELS, [(k, v[1]) for k, v in moved])]
        return out + self._identity() + self._cache()

    def _identity(self) -> list[Metric]:
        if self.rank is None:
            return []
        return [GaugeMetricFamily("parallax_worker_rank", "This worker's rank (0: the chief).",
                                  value=self.rank),
                GaugeMetricFamily("parallax_worker_size", "Workers in the job.",
                                  value=self.size or 1)]

    def _cache(self) -> list[Metric]:
        """The row cache's counters (`CacheStats`), when this worker has one."""
        stats = self.cache_stats() if self.cache_stats is not None else None
        if stats is None:
            return []
        return [counter(f"parallax_worker_row_cache_{name}_total", help_, (),
                        [((), getattr(stats, name))])
                for name, help_ in (("hits", "Rows the row cache answered."),
                                    ("misses", "Rows the row cache did not hold (pulled)."),
                                    ("stale", "Rows the row cache held too old (pulled "
                                              "again)."))]


WORKER_METRICS = WorkerMetrics()
_served: list[MetricsServer] = []  # the process's endpoint, once started


def serve(port: int, rank: int, local_rank: int, size: int,
          host: str | None = None) -> MetricsServer:
    """This process's /metrics on `host` (PARALLAX_WORKER_METRICS_HOST, else loopback) at
    `port + local_rank` (`port` 0: a free port), started once per process; prints the line
    `parallax run` collects (on stderr, whatever the log level: it is the launcher's
    contract, like a server's READY line)."""
    WORKER_METRICS.rank, WORKER_METRICS.size = rank, size
    if _served:
        return _served[0]
    if port and not 0 < port + local_rank <= 65535:
        raise ConfigError(f"worker {rank}: metrics port {port} + local rank {local_rank} is "
                          f"not a TCP port (1-65535); give a lower first port, or 0 for "
                          f"free ports")
    host = host or os.environ.get(WORKER_METRICS_HOST_ENV) or "127.0.0.1"
    token_file = os.environ.get(TOKEN_FILE_ENV)
    server = MetricsServer(host, port + local_rank if port else 0, WORKER_METRICS.families,
                           read_token(token_file) if token_file else None,
                           fix=f"worker {rank}: give another first port (ParallaxStrategy("
                               f"metrics_port=), {WORKER_METRICS_PORT_ENV} or `parallax run "
                               f"--metrics-port`), or 0 for free ports")
    _served.append(server)
    address = server.address
    if address.startswith(("0.0.0.0:", "[::]:")):  # every interface: name this machine
        address = f"{socket.gethostname()}:{address.rpartition(':')[2]}"
    sys.stderr.write(worker_metrics_line(rank, address) + "\n")
    sys.stderr.flush()
    log.debug("worker %d serves its metrics at http://%s/metrics", rank, address)
    return server


def stop() -> None:
    """Close this process's endpoint, if it serves one (a later `serve` starts another)."""
    while _served:
        _served.pop().stop()
