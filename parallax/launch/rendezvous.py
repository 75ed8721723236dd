"""Worker 0's rendezvous port in a `parallax k8s` job: Horovod's gloo key-value store (what
`horovodrun --gloo` serves, initialised with its host plan) and, with --max-restarts, the
gang coordinator (parallax.launch.gang) under /parallax/gang.

Horovod's ranks (gloo, in C++) cannot send a token, so the store takes requests from anyone
who reaches the port: the job's NetworkPolicy is its guard (parallax.launch.k8s_security).
What one request can cost is bounded here all the same, whoever sends it: a PUT of at most
MAX_VALUE_BYTES, a store of at most MAX_STORE_BYTES, at most MAX_CONNECTIONS connections
at once (more are closed at once), REQUEST_TIMEOUT_S for each request's bytes, no file
served (Horovod's handler is a SimpleHTTPRequestHandler: HEAD would answer for the working
directory's files), and a peer that hangs up early costs no traceback in the log.
"""
from __future__ import annotations

import http.server
import sys
import threading

from parallax.launch import gang

MAX_VALUE_BYTES = 64 << 10      # one rank's gloo address is about a hundred bytes
MAX_STORE_BYTES = 16 << 20      # every value held at once
MAX_CONNECTIONS = 1024          # open at once; each is a thread
REQUEST_TIMEOUT_S = 10.0        # to send a request's bytes, and to take the answer's
_HANGUPS = (BrokenPipeError, ConnectionResetError, TimeoutError)


def horovod_env(rank: int, size: int, rendezvous_host: str, rendezvous_port: int,
                iface: str) -> dict[str, str]:
    """What `horovodrun --gloo` gives a rank whose host has one slot (gloo_run.py)."""
    return {
        "HOROVOD_HOSTNAME": f"worker-{rank}",
        "HOROVOD_RANK": str(rank), "HOROVOD_SIZE": str(size),
        "HOROVOD_LOCAL_RANK": "0", "HOROVOD_LOCAL_SIZE": "1",
        "HOROVOD_CROSS_RANK": str(rank), "HOROVOD_CROSS_SIZE": str(size),
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": rendezvous_host,
        "HOROVOD_GLOO_RENDEZVOUS_PORT": str(rendezvous_port),
        "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_GLOO_IFACE": iface,
    }


def host_plan(size: int):
    """horovodrun's host plan for `size` hosts named worker-<rank> with one slot each."""
    from horovod.runner.common.util.hosts import HostInfo, get_host_assignments
    return get_host_assignments([HostInfo(f"worker-{r}", 1) for r in range(size)], size)


def start_rendezvous(port: int, size: int, host: str = "0.0.0.0", coordinator=None,
                     horovod: bool = True, token: str | None = None):
    """Horovod's rendezvous server on a fixed port, initialised with one slot per host
    named worker-<rank> (as horovodrun does with its host plan); with a `gang.Gang` it also
    answers the gang's requests (with `token`, only those carrying it). Without `horovod`
    (TensorFlow's collectives) it serves only the gang. Returns the server; call
    .shutdown() and .server_close() to stop it."""
    if horovod:
        from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer
        base, server_class = _store_handler(RendezvousHandler), RendezvousHTTPServer
    else:
        base, server_class = QuietHandler, http.server.ThreadingHTTPServer
    handler = base if coordinator is None else gang.handler_class(base, coordinator, token)
    httpd = _bounded(server_class)((host, port), handler, *([0] if horovod else []))
    if horovod:
        httpd.init(host_plan(size))
    threading.Thread(target=httpd.serve_forever, name="rendezvous", daemon=True).start()
    return httpd


class QuietHandler(http.server.BaseHTTPRequestHandler):
    """The gang's server without Horovod: no line per request (each rank polls twice a
    second, as Horovod's handler is silent too), 404 for any other path."""

    timeout = REQUEST_TIMEOUT_S

    def log_message(self, format, *args):  # noqa: A002 - http.server's signature
        pass

    def do_GET(self):  # noqa: N802
        self.send_error(404)

    do_PUT = do_GET


def _store_handler(base: type) -> type:
    """Horovod's store handler, bounded: no files, values and the store capped."""

    class StoreHandler(base):
        timeout = REQUEST_TIMEOUT_S

        def do_HEAD(self):  # noqa: N802 - never a file of the working directory
            self.send_status_code(405)

        def do_PUT(self):  # noqa: N802
            length = self.headers.get("Content-Length", "")
            if not length.isdigit() or int(length) > MAX_VALUE_BYTES:
                return self.send_status_code(413)
            if _store_bytes(self.server) + int(length) > MAX_STORE_BYTES:
                return self.send_status_code(507)
            super().do_PUT()

    return StoreHandler


def _store_bytes(server) -> int:
    with server.cache_lock:
        return sum(len(v) for scope in server.cache.values() for v in scope.values())


def _bounded(server_class: type) -> type:
    """`server_class` taking at most MAX_CONNECTIONS connections at once, quiet about
    peers that hang up or time out."""

    class Bounded(server_class):
        daemon_threads = True

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

        def process_request(self, request, client_address):
            if not self._slots.acquire(blocking=False):
                self.shutdown_request(request)
                return
            try:
                super().process_request(request, client_address)
            except BaseException:
                self._slots.release()
                raise

        def process_request_thread(self, request, client_address):
            try:
                super().process_request_thread(request, client_address)
            finally:
                self._slots.release()

        def handle_error(self, request, client_address):
            if not isinstance(sys.exc_info()[1], _HANGUPS):
                super().handle_error(request, client_address)

    return Bounded
