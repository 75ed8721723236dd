"""Prometheus metrics of one parameter server, served as text (exposition format 0.0.4).

`RequestMetrics` is fed by `ServerStats.record` (one call per RPC, under one lock, no
allocation beyond the first request of a label set); `render` adds gauges read from the
shards at scrape time; `MetricsServer` answers `GET /metrics` from a daemon thread
(stdlib `http.server`, no dependency).

The endpoint is guarded like the gRPC API: with a token, a scrape must carry
`Authorization: Bearer <token>` (else 401); with TLS, it is HTTPS with the server's
certificate (and, for mutual TLS, requires a client certificate signed by the same CA). At
most `MAX_CONNECTIONS` connections are served at once (more are closed on arrival), and one
that has not sent its whole request (TLS handshake and headers) within
`PARALLAX_METRICS_IDLE_S` seconds of arriving (default 5) is closed, however steadily it
trickles: slow clients cannot hold the slots, whether or not they know the token.
"""
from __future__ import annotations

import bisect
import hmac
import io
import logging
import os
import socket
import socketserver
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Iterable

from parallax.errors import ConfigError
from parallax.security import TOKEN_SCHEME

log = logging.getLogger("parallax_ps")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Upper bounds (seconds) of the latency histogram: 100 us .. 10 s.
BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
           1.0, 2.5, 5.0, 10.0)
MAX_CONNECTIONS = 8  # served at once; more are closed on arrival
IDLE_ENV = "PARALLAX_METRICS_IDLE_S"  # seconds a connection has for its request (default 5)
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


def tls_context(cert, key, client_ca=None) -> ssl.SSLContext:
    """The server side of HTTPS with the gRPC API's certificate and key; with `client_ca`,
    client certificates signed by it are required (mutual TLS)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(str(cert), str(key))
    if client_ca is not None:
        context.load_verify_locations(str(client_ca))
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def _idle_seconds() -> float:
    text = os.environ.get(IDLE_ENV, "5")
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise ConfigError(f"{IDLE_ENV}={text!r} must be a number of seconds > 0")
    return seconds


class _DeadlineReader(io.RawIOBase):
    """A socket's reads that time out at `deadline` (time.monotonic()) in all, not per read:
    a request trickling in a byte at a time still ends there."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        super().__init__()
        self.sock, self.deadline = sock, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"the request was not complete within {IDLE_ENV} seconds")
        self.sock.settimeout(left)
        return self.sock.recv_into(buffer)


def _handler(render: Callable[[], str], token: str | None, idle: float):
    """The request handler class: checks the token, answers /metrics, 404 elsewhere."""
    expected = (TOKEN_SCHEME + token).encode() if token else None

    class Handler(BaseHTTPRequestHandler):
        timeout = idle  # writes: a scraper that stops reading is dropped

        def setup(self) -> None:
            deadline = time.monotonic() + idle  # for the whole request, from arrival
            self.request.settimeout(idle)  # the TLS handshake counts it in all, too
            if isinstance(self.request, ssl.SSLSocket):
                self.request.do_handshake()  # here, not in the accepting thread
            super().setup()
            self.rfile.close()  # the socket's own file: it would keep the socket open
            self.rfile = io.BufferedReader(_DeadlineReader(self.request, deadline))

        def parse_request(self) -> bool:
            parsed = super().parse_request()  # the headers are read: writes get `idle`
            self.request.settimeout(idle)
            return parsed

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            given = (self.headers.get("Authorization") or "").encode()
            if expected is not None and not hmac.compare_digest(given, expected):
                self.send_response(401, "this server's metrics need the cluster token")
                self.send_header("WWW-Authenticate", "Bearer")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
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

    return Handler


class _Server(ThreadingHTTPServer):
    """One daemon thread per connection, at most `MAX_CONNECTIONS` at once; TLS, when
    given, is negotiated in the connection's thread."""

    daemon_threads = True
    tls: ssl.SSLContext | None = None

    def __init__(self, address, handler, tls: ssl.SSLContext | None) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.tls = tls
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__(address, handler)

    def server_bind(self) -> None:  # HTTPServer's would resolve the host name (slow)
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = self.server_address[:2]

    def get_request(self):
        sock, address = self.socket.accept()
        if self.tls is not None:
            sock = self.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return sock, address

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # over the bound: closed at once
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request, client_address) -> None:
        log.debug("metrics connection from %s failed", client_address, exc_info=True)


class MetricsServer:
    """`GET /metrics` on host:port (0: a free port) from a daemon thread; with `token`, a
    scrape must carry it; with `tls`, the endpoint is HTTPS."""

    def __init__(self, host: str, port: int, render: Callable[[], str],
                 token: str | None = None, tls: ssl.SSLContext | None = None) -> None:
        bind = host.strip("[]")
        try:
            self.httpd = _Server((bind, port), _handler(render, token, _idle_seconds()), tls)
        except OSError as exc:
            raise OSError(f"cannot serve metrics on {host}:{port} ({exc.strerror or exc}); "
                          f"pick another --metrics-port or --metrics-host") from None
        shown = f"[{bind}]" if ":" in bind else bind
        self.address = f"{shown}:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True,
                                        name="metrics")
        self._thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
