"""Prometheus metrics of one parameter server, served as text (exposition format 0.0.4).

`RequestMetrics` is fed by `ServerStats.record` (one call per RPC, under one lock, no
allocation beyond the first request of a label set); `render` adds gauges read from the
shards at scrape time; `MetricsServer` answers `GET /metrics` from a daemon thread
(stdlib `http.server`, no dependency).
"""
from __future__ import annotations

import bisect
import logging
import socket
import socketserver
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Iterable

log = logging.getLogger("parallax_ps")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Upper bounds (seconds) of the latency histogram: 100 us .. 10 s.
BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
           1.0, 2.5, 5.0, 10.0)
# Which way the row payload (values, gradients) of a method travels.
DIRECTION = {"Pull": "out", "Push": "in", "InitRows": "in", "PullMany": "out",
             "PushMany": "in"}


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(**labels: object) -> str:
    inner = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
    return "{" + inner + "}" if inner else ""


def _number(value: float) -> str:
    if value == float("inf"):
        return "+Inf"
    return repr(float(value)) if isinstance(value, float) else str(value)


class _Histogram:
    __slots__ = ("counts", "sum", "count")

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)  # per bucket, not cumulative; last is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS, seconds)] += 1
        self.sum += seconds
        self.count += 1


class RequestMetrics:
    """Counters and latency histograms of every RPC, by method, status code and table."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: dict[tuple[str, str], int] = {}
        self._latency: dict[str, _Histogram] = {}
        self._bytes: dict[tuple[str, str], int] = {}
        self._rows: dict[tuple[str, str], int] = {}

    def observe(self, method: str, code: str, seconds: float, table: str, rows: int,
                nbytes: int) -> None:
        with self._lock:
            key = (method, code)
            self._requests[key] = self._requests.get(key, 0) + 1
            hist = self._latency.get(method)
            if hist is None:
                hist = self._latency[method] = _Histogram()
            hist.observe(seconds)
            direction = DIRECTION.get(method)
            if direction is not None and code == "OK":
                key = (method, direction)
                self._bytes[key] = self._bytes.get(key, 0) + nbytes
            if rows and code == "OK":
                key = (method, table)
                self._rows[key] = self._rows.get(key, 0) + rows

    def add_rows(self, method: str, table: str, rows: int) -> None:
        """Rows of one table moved by a successful multi-table request."""
        if rows:
            with self._lock:
                self._rows[(method, table)] = self._rows.get((method, table), 0) + rows

    def lines(self) -> list[str]:
        with self._lock:
            requests, rows = sorted(self._requests.items()), sorted(self._rows.items())
            nbytes = sorted(self._bytes.items())
            latency = sorted((m, list(h.counts), h.sum, h.count)
                             for m, h in self._latency.items())
        out = _family("parallax_requests_total", "counter",
                      "RPCs handled, by method and gRPC status code (OK or the error code).",
                      ((_labels(method=m, code=c), v) for (m, c), v in requests))
        out += _family("parallax_request_seconds", "histogram",
                       "Time to handle an RPC (including waits for a sync step), by method.",
                       ())
        for method, counts, total, count in latency:
            cumulative = 0
            for bound, n in zip(BUCKETS + (float("inf"),), counts):
                cumulative += n
                out.append(f"parallax_request_seconds_bucket"
                           f"{_labels(method=method, le=_number(bound))} {cumulative}")
            out.append(f"parallax_request_seconds_sum{_labels(method=method)} {total!r}")
            out.append(f"parallax_request_seconds_count{_labels(method=method)} {count}")
        out += _family("parallax_bytes_total", "counter",
                       "Row payload bytes of successful Pull and PullMany (values sent: out), "
                       "Push and PushMany (gradients received: in) and InitRows (values "
                       "received: in).",
                       ((_labels(method=m, direction=d), v) for (m, d), v in nbytes))
        out += _family("parallax_rows_total", "counter",
                       "Rows pulled, pushed, initialised, created, saved or restored by "
                       "successful RPCs, by method and table.",
                       ((_labels(method=m, table=t), v) for (m, t), v in rows))
        return out


def _family(name: str, kind: str, help_: str, samples: Iterable[tuple[str, object]]
            ) -> list[str]:
    out = [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
    out += [f"{name}{labels} {_number(value)}" for labels, value in samples]
    return out


def table_lines(shards: list) -> list[str]:
    """Gauges of the table shards held by this server (read under each shard's lock)."""
    steps, lags, rows, sizes = [], [], [], []
    for shard in shards:
        with shard.cond:
            labels = _labels(table=shard.spec.name, shard=shard.shard_index)
            steps.append((labels, shard.steps.step))
            if shard.steps.sync:
                lags.append((labels, shard.steps.num_workers - len(shard.steps.pushed_workers())))
            rows.append((labels, shard.storage.num_rows))
            sizes.append((labels, shard.nbytes))
    out = _family("parallax_up", "gauge", "1 while the server is serving.", [("", 1)])
    out += _family("parallax_tables", "gauge", "Table shards held by this server.",
                   [("", len(shards))])
    out += _family("parallax_table_step", "gauge",
                   "Steps applied by a table shard (sync: closed steps; async: pushes "
                   "applied).", steps)
    out += _family("parallax_step_lag", "gauge",
                   "Sync tables only: workers that have not yet completed their push for the "
                   "open step (num_workers: none has pushed it yet; between 1 and "
                   "num_workers-1 for long: the shard is waiting for stragglers).", lags)
    out += _family("parallax_table_rows", "gauge", "Rows held by a table shard.", rows)
    out += _family("parallax_table_bytes", "gauge",
                   "Bytes of values and optimizer slots held by a table shard.", sizes)
    return out


def render(service) -> str:
    """The whole exposition of a `ParameterServerService`: server gauges, then requests."""
    lines = table_lines(service.selected(())) + service.stats.metrics.lines()
    return "\n".join(lines) + "\n"


class MetricsServer:
    """`GET /metrics` on host:port (0: a free port) from a daemon thread."""

    def __init__(self, host: str, port: int, render: Callable[[], str]) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                if self.path.split("?", 1)[0] != "/metrics":
                    self.send_error(404, "only /metrics is served here")
                    return
                try:
                    body = render().encode()
                except Exception:  # a bug: answer 500, keep the server up
                    log.exception("rendering metrics failed")
                    self.send_error(500, "rendering metrics failed; see the server log")
                    return
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:  # scrapes are not worth a log line
                pass

        bind = host.strip("[]")

        class Server(ThreadingHTTPServer):
            address_family = socket.AF_INET6 if ":" in bind else socket.AF_INET
            daemon_threads = True

            def server_bind(self) -> None:  # HTTPServer's would resolve the host name (slow)
                socketserver.TCPServer.server_bind(self)
                self.server_name, self.server_port = bind, self.server_address[1]

        try:
            self.httpd = Server((bind, port), Handler)
        except OSError as exc:
            raise OSError(f"cannot serve metrics on {host}:{port} ({exc.strerror or exc}); "
                          f"pick another --metrics-port") from None
        shown = f"[{bind}]" if ":" in bind else bind
        self.address = f"{shown}:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True,
                                        name="metrics")
        self._thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
