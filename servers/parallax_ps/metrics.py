"""Prometheus metrics of one parameter server, exposed with `prometheus_client`.

`RequestMetrics` is fed by `ServerStats.record` (one call per RPC, under one lock, no
allocation beyond the first request of a label set: plain dicts, no client-library objects
on that path); at scrape time it turns them into metric families, and `render` adds the
gauges of the shards. The endpoint itself (`MetricsServer`: its HTTP layer, token, TLS,
connection bounds) is `parallax.protocol.metrics_endpoint`, which the workers' metrics use
too; it is re-exported here for the server and its tests.
"""
from __future__ import annotations

import threading

from prometheus_client.metrics_core import GaugeMetricFamily, HistogramMetricFamily, Metric

from parallax.env import split_run_id
from parallax.protocol.metrics_endpoint import (MAX_CONNECTIONS, Histogram, MetricsServer,
                                                counter, cumulative, registry, tls_context)
from parallax.version import PROTOCOL_VERSION, __version__

__all__ = ["MAX_CONNECTIONS", "MetricsServer", "RequestMetrics", "registry", "render",
           "tls_context"]

# Which way the row payload (values, gradients) of a method travels.
DIRECTION = {"Pull": "out", "Push": "in", "InitRows": "in", "PullMany": "out",
             "PushMany": "in"}


SHARD_LABELS = ("run_id", "table", "shard")  # a table shard's series (`_shard_labels`)


def _shard_labels(shard) -> tuple[str, str, str]:
    """A table shard's label values: the run id apart from the table (`split_run_id`), so a
    dashboard's series of one table carry over from job to job."""
    return (*split_run_id(shard.spec.name), str(shard.shard_index))


def _gauge(name: str, help_: str, items, labels: tuple[str, ...] = SHARD_LABELS
           ) -> GaugeMetricFamily:
    """A gauge family of ((label values...), value) items, by table shard by default."""
    family = GaugeMetricFamily(name, help_, labels=labels)
    for key, value in items:
        family.add_metric(key, value)
    return family


class RequestMetrics:
    """Counters and latency histograms of every RPC, by method, status code and table."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: dict[tuple[str, str], int] = {}
        self._latency: dict[str, Histogram] = {}
        self._bytes: dict[tuple[str, str], int] = {}
        self._rows: dict[tuple[str, str, str], int] = {}  # (method, run id, table)

    def observe(self, method: str, code: str, seconds: float, table: str, rows: int,
                nbytes: int) -> None:
        with self._lock:
            key = (method, code)
            self._requests[key] = self._requests.get(key, 0) + 1
            hist = self._latency.get(method)
            if hist is None:
                hist = self._latency[method] = Histogram()
            hist.observe(seconds)
            direction = DIRECTION.get(method)
            if direction is not None and code == "OK":
                key = (method, direction)
                self._bytes[key] = self._bytes.get(key, 0) + nbytes
            if rows and code == "OK":
                key = (method, *split_run_id(table))
                self._rows[key] = self._rows.get(key, 0) + rows

    def add_rows(self, method: str, table: str, rows: int) -> None:
        """Rows of one table moved by a successful multi-table request."""
        if rows:
            key = (method, *split_run_id(table))
            with self._lock:
                self._rows[key] = self._rows.get(key, 0) + rows

    def families(self) -> list[Metric]:
        """The counters and histograms as metric families (a copy taken under the lock)."""
        with self._lock:
            requests, rows = sorted(self._requests.items()), sorted(self._rows.items())
            nbytes = sorted(self._bytes.items())
            latency = sorted((m, list(h.counts), h.sum) for m, h in self._latency.items())
        seconds = HistogramMetricFamily(
            "parallax_request_seconds",
            "Time to handle an RPC (including waits for a sync step), by method.",
            labels=("method",))
        for method, counts, total in latency:
            seconds.add_metric((method,), cumulative(counts), total)
        return [
            counter("parallax_requests_total",
                     "RPCs handled, by method and gRPC status code (OK or the error code).",
                     ("method", "code"), requests),
            seconds,
            counter("parallax_bytes_total",
                     "Row payload bytes of successful Pull and PullMany (values sent: out), "
                     "Push and PushMany (gradients received: in) and InitRows (values "
                     "received: in).", ("method", "direction"), nbytes),
            counter("parallax_rows_total",
                     "Rows pulled, pushed, initialised, created, saved or restored by "
                     "successful RPCs, by method and table.", ("method", "run_id", "table"),
                     rows)]


def dynamic_families(shards: list) -> list[Metric]:
    """Counters of the dynamic table shards' admission and eviction (eviction.Counters)."""
    counts = [(_shard_labels(s), s.dynamic_stats()) for s in shards if s.vocab is not None]
    return [
        counter("parallax_table_admitted_total", "Keys a dynamic table shard gave a row.",
                 SHARD_LABELS, [(k, c.admitted) for k, c in counts]),
        counter("parallax_table_evicted_total", "Rows a dynamic table shard evicted, by "
                 "reason: capacity (max_rows_per_shard, lru/lfu) or ttl (ttl_steps).",
                 (*SHARD_LABELS, "reason"),
                 [(k + (reason,), getattr(c, f"evicted_{reason}")) for k, c in counts
                  for reason in ("capacity", "ttl")]),
        counter("parallax_table_dropped_gradients_total", "Gradient rows of keys not "
                 "admitted (no row), dropped by a dynamic table shard.", SHARD_LABELS,
                 [(k, c.dropped_gradients) for k, c in counts]),
        counter("parallax_table_default_rows_total", "Pulled rows a dynamic table shard "
                 "answered with the default (initializer) row: keys without a row.",
                 SHARD_LABELS, [(k, c.default_rows) for k, c in counts])]


def table_families(shards: list) -> list[Metric]:
    """Gauges of the table shards held by this server (read under each shard's lock)."""
    steps, lags, rows, sizes = [], [], [], []
    for shard in shards:
        with shard.cond:
            labels = _shard_labels(shard)
            steps.append((labels, shard.steps.step))
            if shard.steps.sync:
                lags.append((labels, shard.steps.num_workers - len(shard.steps.pushed_workers())))
            rows.append((labels, shard.storage.num_rows))
            sizes.append((labels, shard.nbytes))
    build = GaugeMetricFamily("parallax_build_info", "Always 1: the server's parallax version "
                              "and wire protocol, as labels.", labels=("version", "protocol"))
    build.add_metric((__version__, f"parallax.ps.v{PROTOCOL_VERSION}"), 1)
    return [*dynamic_families(shards), build,
        GaugeMetricFamily("parallax_up", "1 while the server is serving.", value=1),
        GaugeMetricFamily("parallax_table_shards", "Table shards held by this server.",
                          value=len(shards)),
        _gauge("parallax_table_step", "Steps applied by a table shard (sync: closed steps; "
               "async: pushes applied).", steps),
        _gauge("parallax_table_step_pending_workers", "Sync tables only: workers whose push "
               "of the open step has not arrived yet (all of them between steps, e.g. on an "
               "idle job; between 1 and num_workers-1 for long: the shard waits for "
               "stragglers).", lags),
        _gauge("parallax_table_rows", "Rows held by a table shard.", rows),
        _gauge("parallax_table_bytes", "Bytes of values and optimizer slots held by a table "
               "shard.", sizes)]


def render(service) -> list[Metric]:
    """The metric families of a `ParameterServerService`: server gauges, then requests."""
    return table_families(service.selected(())) + service.stats.metrics.families()
