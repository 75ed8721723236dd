"""A process's Prometheus endpoint, `GET /metrics` (the servers' and the workers' alike).

`MetricsServer` answers from a daemon thread with a `CollectorRegistry` of its own (never
the process-wide default: several servers, or a server and a worker, can live in one
process): the families a `render()` callable returns at each scrape, plus the library's
`process_*` and `python_*` ones (process, platform and garbage collector). The text is the
library's: Prometheus text format 0.0.4, or OpenMetrics when the scraper's `Accept` header
asks for it (`choose_encoder`).

The HTTP layer is our own (`http.server`), because it is what enforces the endpoint's guard,
like the gRPC API's: with a token, a scrape must carry `Authorization: Bearer <token>` (else
401); with TLS, it is HTTPS with the given certificate (and, for mutual TLS, requires a
client certificate signed by the same CA). At most `MAX_CONNECTIONS` connections are served
at once (more are closed on arrival), and one that has not sent its whole request (TLS
handshake and headers) within `PARALLAX_METRICS_IDLE_S` seconds of arriving (default 5) is
closed, however steadily it trickles: slow clients cannot hold the slots, whether or not
they know the token. It lives here, below both the server and the client, because workers
serve their own metrics through it too (`parallax.client.worker_metrics`).
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

from prometheus_client import (CollectorRegistry, GCCollector, PlatformCollector,
                               ProcessCollector)
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from parallax.env import METRICS_IDLE_ENV
from parallax.errors import ConfigError
from parallax.protocol.security import TOKEN_SCHEME

log = logging.getLogger("parallax")

MAX_CONNECTIONS = 8  # served at once; more are closed on arrival

# Upper bounds (seconds) of the latency histogram: 100 us .. 10 s.
BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
           1.0, 2.5, 5.0, 10.0)
BUCKET_LABELS = tuple(floatToGoString(b) for b in BUCKETS + (float("inf"),))  # "le" values


class Histogram:
    """A latency histogram over `BUCKETS`, fed without the client library's objects (plain
    counts: one bisect and two additions an observation, under the caller's lock)."""

    __slots__ = ("counts", "sum")  # the count is the +Inf bucket's, summed at scrape time

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)  # per bucket, not cumulative; last is +Inf
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS, seconds)] += 1
        self.sum += seconds


def cumulative(counts: list[int]) -> list[tuple[str, int]]:
    """(le, count) pairs of a histogram from its per-bucket counts."""
    out, total = [], 0
    for label, n in zip(BUCKET_LABELS, counts):
        total += n
        out.append((label, total))
    return out


def counter(name: str, help_: str, labels: tuple[str, ...], items) -> CounterMetricFamily:
    """A counter family (`name` ends in _total) of ((label values...), value) items."""
    family = CounterMetricFamily(name, help_, labels=labels)
    for key, value in items:
        family.add_metric(key, value)
    return family


class _Families:
    """A collector of the families `render()` returns at each scrape."""

    def __init__(self, render: Callable[[], Iterable[Metric]]) -> None:
        self._render = render

    def collect(self) -> Iterable[Metric]:
        return self._render()


def registry(render: Callable[[], Iterable[Metric]]) -> CollectorRegistry:
    """A registry of its own: the families of `render` and the process, platform and
    garbage collector metrics of this process (`process_*`, `python_*`)."""
    made = CollectorRegistry(auto_describe=False)  # describing would render at register
    made.register(_Families(render))
    ProcessCollector(registry=made)
    PlatformCollector(registry=made)
    GCCollector(registry=made)
    return made


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
    text = os.environ.get(METRICS_IDLE_ENV, "5")
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise ConfigError(f"{METRICS_IDLE_ENV}={text!r} must be a number of seconds > 0")
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
            raise TimeoutError(f"the request was not complete within {METRICS_IDLE_ENV} seconds")
        self.sock.settimeout(left)
        return self.sock.recv_into(buffer)


def _encoder(accept: str | None):
    """(encode, content type) of the format `accept` (an Accept header) asks for; one the
    library cannot parse (a version that is not a number) gets the default, like none."""
    try:
        return choose_encoder(accept or "")
    except (TypeError, ValueError):
        return choose_encoder("")


def _handler(exposed: CollectorRegistry, token: str | None, idle: float):
    """The request handler class: checks the token, answers /metrics with `exposed` in the
    format the Accept header asks for (text 0.0.4 unless OpenMetrics is), 404 elsewhere."""
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
                self.send_response(401, "these metrics need the cluster token")
                self.send_header("WWW-Authenticate", "Bearer")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            if self.path.split("?", 1)[0] != "/metrics":
                self.send_error(404, "only /metrics is served here")
                return
            encode, content_type = _encoder(self.headers.get("Accept"))
            try:
                body = encode(exposed)
            except Exception:  # a bug: answer 500, keep the server up
                log.exception("rendering metrics failed")
                self.send_error(500, "rendering metrics failed; see the server log")
                return
            self.send_response(200)
            self.send_header("Content-Type", content_type)
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
    """`GET /metrics` on host:port (0: a free port) from a daemon thread: the families
    `render()` returns at each scrape, and this process's; with `token`, a scrape must carry
    it; with `tls`, the endpoint is HTTPS."""

    def __init__(self, host: str, port: int, render: Callable[[], Iterable[Metric]],
                 token: str | None = None, tls: ssl.SSLContext | None = None,
                 fix: str = "pick another --metrics-port or --metrics-host") -> None:
        bind = host.strip("[]")
        self.registry = registry(render)
        handler = _handler(self.registry, token, _idle_seconds())
        try:
            self.httpd = _Server((bind, port), handler, tls)
        except OSError as exc:
            raise OSError(f"cannot serve metrics on {host}:{port} ({exc.strerror or exc}); "
                          f"{fix}") from None
        shown = f"[{bind}]" if ":" in bind else bind
        self.address = f"{shown}:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True,
                                        name="metrics")
        self._thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
