"""One parameter server as the client sees it: channels, stub, deadlines, bounded retries.

Every failure becomes a `ServerError` that names the server address, the table and the fix.
Only UNAVAILABLE (server not up yet, connection reset) is retried, a few times with backoff;
anything else is an answer from the server and is raised at once.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import math
import os
import random
import time
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Mapping

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from parallax.client.dataplane import DataPlaneClient
from parallax.env import REPLAY_ENV, REPLICAS_ENV, TLS_CA_ENV, TLS_CERT_ENV, TLS_KEY_ENV, TOKEN_FILE_ENV
from parallax.errors import ConfigError, ParallaxError, ServerError
from parallax.protocol import bulk_codec, dataplane, security, server_identity
from parallax.protocol.refusals import STEP_AHEAD
from parallax.ps.v1 import ps_pb2, ps_pb2_grpc
from parallax.version import PROTOCOL_VERSION

log = logging.getLogger("parallax")
PLANE_RETRY_S = 30.0  # after a data port could not be reached: gRPC until then
RECONNECT_MIN_MS = 100  # a channel whose server went away tries again after this (ms),
RECONNECT_MAX_MS = 1000  # growing to at most this: a restarted server is found at once

_HINTS = {
    grpc.StatusCode.UNAVAILABLE: "check that the server is running and reachable "
                                 "(`parallax server --port ...`) and that both sides agree "
                                 "on TLS (ClientOptions.tls_ca / PARALLAX_TLS_CA against a "
                                 "server with --tls-cert)",
    grpc.StatusCode.DEADLINE_EXCEEDED: "the server did not answer in time; raise "
                                       "ClientOptions.timeout or check for stalled workers",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "the message exceeds a size limit; lower "  # gRPC's
                                        "ClientOptions.max_message_mb or raise the server's "
                                        "--max-message-mb",
    grpc.StatusCode.UNIMPLEMENTED: "the server does not know this method: it is not a "
                                   "parallax server of this version (wire protocol "
                                   f"parallax.ps.v{PROTOCOL_VERSION}, see `parallax "
                                   "version` on both sides)",
}


_JITTER = random.Random()  # its own generator: training scripts seed the global one alike


def retry_delay(backoff: float, attempt: int, draw=_JITTER.random) -> float:
    """Seconds before retry `attempt` (1, 2, ...): backoff doubled per attempt, times a
    uniform 50-100% so that the workers a restarted server refused do not all come back in
    the same instant ("equal jitter")."""
    return backoff * 2 ** (attempt - 1) * (0.5 + 0.5 * draw())


@dataclass(frozen=True)
class ClientOptions:
    timeout: float = 60.0            # seconds per RPC (sync-mode pulls wait for the step)
    retries: int = 3                 # extra attempts after UNAVAILABLE
    backoff: float = 0.2             # seconds before the first retry, doubled after each,
                                     # each wait jittered to 50-100% (`retry_delay`)
    channels_per_server: int = 2     # independent HTTP/2 connections, used round-robin
    max_message_mb: int = 64         # hard limit on any message this client sends or accepts
    chunk_mb: int = 4                # bulk requests are split into chunks of about this size:
                                     # several in flight overlap server and client work, and
                                     # buffers this size are reused rather than page-faulted
    tls_ca: str | None = None        # CA certificate (PEM path) to verify servers: TLS on
    tls_cert: str | None = None      # client certificate and key (PEM paths), for servers
    tls_key: str | None = None       # with --tls-client-ca (mutual TLS)
    token: str | None = field(default=None, repr=False)  # cluster token sent with every RPC
    data_plane: bool = True          # PullMany/PushMany as frames on the server's data-plane
                                     # port when it has one (parallax.protocol.dataplane), else gRPC
    replicas: int = 1                # copies of each shard, each on its own server (2: a
                                     # server's death loses no step; parallax.client.replicas)
    replay_mb: int = 0               # MiB of this worker's pushes kept to replay to a server
                                     # started again from its newest checkpoint (0: none;
                                     # parallax.client.replay)

    @property
    def max_message_bytes(self) -> int:
        return self.max_message_mb * 1024 * 1024

    @property
    def chunk_bytes(self) -> int:
        return min(self.chunk_mb * 1024 * 1024, self.max_message_bytes)


def client_options_from_env(base: ClientOptions | None = None,
                            environ: Mapping[str, str] | None = None) -> ClientOptions:
    """`base` (default ClientOptions()) with the TLS files and token of the environment
    (`PARALLAX_TLS_*`, `PARALLAX_TOKEN_FILE`; a job's `JobCredentials.worker_env()`) and its
    `PARALLAX_REPLICAS` and `PARALLAX_REPLAY_MB` filled into the fields `base` leaves unset;
    unchanged when none is set."""
    base = base or ClientOptions()
    env = os.environ if environ is None else environ
    changes = {field: env[name] for field, name in (
        ("tls_ca", TLS_CA_ENV), ("tls_cert", TLS_CERT_ENV), ("tls_key", TLS_KEY_ENV))
        if env.get(name) and getattr(base, field) is None}
    if env.get(REPLICAS_ENV) and base.replicas == 1:
        changes["replicas"] = _replicas(env[REPLICAS_ENV])
    if env.get(REPLAY_ENV) and base.replay_mb == 0:
        changes["replay_mb"] = _replay_mb(env[REPLAY_ENV])
    if env.get(TOKEN_FILE_ENV) and base.token is None:
        changes["token"] = security.read_token(env[TOKEN_FILE_ENV])
    if (changes.get("tls_cert") or changes.get("tls_key")) and not (
            changes.get("tls_ca") or base.tls_ca):
        raise ConfigError(f"{TLS_CERT_ENV}/{TLS_KEY_ENV} are set but {TLS_CA_ENV} is not: "
                          f"a client certificate needs TLS; set {TLS_CA_ENV} to the CA that "
                          f"signed the servers' certificates")
    return dataclasses.replace(base, **changes) if changes else base


def _replay_mb(text: str) -> int:
    if not text.strip().isdigit():
        raise ConfigError(f"{REPLAY_ENV}={text!r} must be a whole number of MiB (0: no "
                          f"replay)")
    return int(text)


def _replicas(text: str) -> int:
    if text.strip() not in ("1", "2"):
        raise ConfigError(f"{REPLICAS_ENV}={text!r} must be 1 or 2 (copies of each shard)")
    return int(text)


def describe(method: str, address: str, table, err: grpc.RpcError,
             attempts: int = 1) -> ServerError:
    """`table`: a name, None, or (multi-table requests) an object whose str() is the names
    and whose repr() is how a message names them."""
    code = err.code()
    where = f"{method} of table {table!r}" if table else method
    table = None if table is None else str(table)
    tries = f" after {attempts} attempts" if attempts > 1 else ""
    details = err.details() or ""
    hint = _HINTS.get(code)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" not in details:
        hint = None  # the server's own refusals (--memory-mb, bounds) name their fix
    message = f"{where} on server {address} failed{tries}: {code.name}: {details}"
    return ServerError(message + (f" ({hint})" if hint else ""), address=address, table=table,
                       code=code)


def _stub(channel: grpc.Channel) -> ps_pb2_grpc.ParameterServerStub:
    """The generated stub, with Pull(Many) answers and Push(Many) requests through the bulk
    codec."""
    stub = ps_pb2_grpc.ParameterServerStub(channel)
    prefix = "/parallax.ps.v1.ParameterServer/"
    for method, (serialize, deserialize) in bulk_codec.CLIENT_CODECS.items():
        setattr(stub, method, channel.unary_unary(prefix + method,
                                                  request_serializer=serialize,
                                                  response_deserializer=deserialize))
    return stub


class _RpcThreads:
    """Concurrent calls run as blocking calls on long-lived daemon threads. gRPC's own
    `.future()` starts a channel polling thread whenever a channel goes from no call in
    flight to one, i.e. once or more per training step, and that start-up plus polling was
    ~20% of a small step's client CPU (py-spy). Blocking calls poll their own completion
    queue. Daemon threads (unlike ThreadPoolExecutor's) never hold up interpreter exit
    behind a call still waiting for a step."""

    def __init__(self, max_threads: int = 8192) -> None:
        # A step may have every shard of every table in flight at once (26 tables x 64
        # shards of pushes and pulls is ~3,300 calls): the cap only catches runaway waits.
        self._max = max_threads
        self._reset()
        os.register_at_fork(after_in_child=self._reset)  # a child has none of the threads

    def _reset(self) -> None:
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._idle = 0     # threads not running a call (waiting for one)
        self._queued = 0   # calls submitted and not yet taken by a thread

    def submit(self, fn, *args, **kwargs) -> Future:
        """Run fn on a thread; a new thread is started unless an idle one will take it, so
        a call never waits behind calls that are blocked (a pull waiting for a step, a
        background push waiting for its chunks). Threads are only made when none is idle,
        so their number is the peak in flight; past the cap a call is refused, not queued
        behind calls that may be waiting for it."""
        future: Future = Future()
        with self._lock:
            if self._queued + 1 > self._idle:
                if self._threads >= self._max:
                    raise ParallaxError(f"{self._max} parameter-server calls are already in "
                                      f"flight in this process; is a step waiting on itself?")
                threading.Thread(target=self._serve, name="parallax-rpc", daemon=True).start()
                self._threads += 1  # counted once started: a failed start changes nothing
                self._idle += 1
            self._queued += 1
        self._work.put((future, fn, args, kwargs))
        return future

    def _serve(self) -> None:
        while True:
            future, fn, args, kwargs = self._work.get()
            with self._lock:
                self._queued -= 1
                self._idle -= 1
            if not future.set_running_or_notify_cancel():
                with self._lock:
                    self._idle += 1
                continue
            try:
                result, error = fn(*args, **kwargs), None
            except BaseException as err:  # noqa: BLE001 - handed to the caller
                result, error = None, err
            with self._lock:  # idle before the caller wakes: its next call can reuse us
                self._idle += 1
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)


_RPC_THREADS = _RpcThreads()


def run_in_background(fn, *args, **kwargs) -> Future:
    """fn(*args, **kwargs) on one of the client's RPC threads."""
    return _RPC_THREADS.submit(fn, *args, **kwargs)


class _PlaneCall:
    """A data-plane call started by `ServerConnection.future` (`Started`), forgetting the
    data plane if its connection fails, as `ServerConnection._through` does."""

    def __init__(self, conn: "ServerConnection", plane: DataPlaneClient, started) -> None:
        self._conn, self._plane, self._started = conn, plane, started

    def result(self, timeout: float | None = None):
        try:
            return self._started.result()
        except grpc.RpcError as err:
            self._conn.forget_plane_after(self._plane, err)
            raise

    def abandon(self) -> None:
        self._started.abandon()


class ServerConnection:
    def __init__(self, address: str, options: ClientOptions | None = None) -> None:
        self.address = address
        self.options = options = options or ClientOptions()
        limit = options.max_message_bytes + (1 << 20)
        channel_options = [("grpc.max_receive_message_length", limit),
                           ("grpc.max_send_message_length", limit),
                           ("grpc.enable_retries", 0),
                           # a server started again is reached within RECONNECT_MAX_MS, not
                           # after gRPC's own backoff (1 s, then x1.6 a failed try, to 120 s)
                           ("grpc.initial_reconnect_backoff_ms", RECONNECT_MIN_MS),
                           ("grpc.min_reconnect_backoff_ms", RECONNECT_MIN_MS),
                           ("grpc.max_reconnect_backoff_ms", RECONNECT_MAX_MS)]
        self._channels = [security.channel(address, options, channel_options +
                                           [("grpc.channel_id", i)])
                          for i in range(max(1, options.channels_per_server))]
        self._stubs = [_stub(c) for c in self._channels]
        self._next = itertools.cycle(range(len(self._stubs)))
        self._plane: DataPlaneClient | None = None
        # when to ask the server (again) where its data plane listens: now, later (after a
        # data port that could not be reached), or never (gRPC only, or settled)
        self._plane_asked_at = 0.0 if options.data_plane else math.inf
        self._plane_lock = threading.Lock()
        # the server process this connection's calls ask for (its `server_id`; 0: any), as
        # the caller's thread sees it now (`parallax.client.replay`); None: any
        self.expected = None

    def stub(self) -> ps_pb2_grpc.ParameterServerStub:
        return self._stubs[next(self._next)]

    def call(self, method: str, request, table: str | None = None,
             timeout: float | None = None, done_on_retry: tuple[grpc.StatusCode, ...] = (),
             pending=None, gone=None):
        """A unary (or, given an iterator factory, client-streaming) call with retries.

        `pending`: a call already started with `future`, which counts as the first attempt.
        `done_on_retry`: codes that, answered to a retry, mean an earlier attempt landed (a
        push answered ALREADY_EXISTS, or "step already closed", which it could not be without
        this push); the call then returns None. `gone()`, asked after an UNAVAILABLE, True
        when the server is known to be gone: no more retries (a copy can answer instead).
        """
        attempts = 0
        while True:
            attempts += 1
            try:
                if pending is not None and attempts == 1:
                    return pending.result()
                payload = request() if callable(request) else request
                return self._method(method)(payload, timeout=timeout or self.options.timeout)
            except grpc.RpcError as err:
                if attempts > 1 and err.code() in done_on_retry and \
                        STEP_AHEAD not in (err.details() or ""):  # (that one never landed)
                    return None
                if err.code() != grpc.StatusCode.UNAVAILABLE or attempts > self.options.retries \
                        or (gone is not None and gone()) or \
                        server_identity.replaced(err.details()):  # (no retry reaches it)
                    raise describe(method, self.address, table, err, attempts) from None
                time.sleep(retry_delay(self.options.backoff, attempts))

    def future(self, method: str, request, timeout: float | None = None):
        """Start a unary call without waiting; resolve it with `result`. A data-plane call's
        request leaves now, from this thread, and its answer is read by whoever asks for it
        (`_PlaneCall`: no thread hand-off); any other call runs on an RPC thread."""
        timeout = timeout or self.options.timeout
        expected = self._asked()
        if method in dataplane.SERVED:
            plane = self.data_plane_of(expected)
            if plane is not None:
                return _PlaneCall(self, plane, plane.invoker(method, started=True)(
                    request, timeout=timeout))
        return _RPC_THREADS.submit(self._method(method, expected), request, timeout=timeout)

    def _asked(self) -> int:
        """The server process this thread's call asks for (0: any)."""
        return self.expected() if self.expected is not None else 0

    def _method(self, method: str, expected: int | None = None):
        """The callable for `method`: the data plane's for PullMany/PushMany when the server
        has one (and is the process `expected`), else the gRPC stub's, asking for that
        process (`server_identity`: another refuses the call)."""
        if expected is None:
            expected = self._asked()
        if method in dataplane.SERVED:
            plane = self.data_plane_of(expected)
            if plane is not None:
                return self._through(plane, plane.invoker(method))
        call = getattr(self.stub(), method)
        return functools.partial(call, metadata=server_identity.metadata(expected)) \
            if expected and method not in server_identity.ANY_PROCESS else call

    def _through(self, plane: DataPlaneClient, invoke):
        """`invoke`, forgetting the data plane when it cannot be reached: the retry of
        the call asks the server again (a restarted server has a new data port) and falls
        back to gRPC if there is none to be had."""
        def call(request, timeout=None):
            try:
                return invoke(request, timeout=timeout)
            except grpc.RpcError as err:
                self.forget_plane_after(plane, err)
                raise
        return call

    def forget_plane_after(self, plane: DataPlaneClient, err: grpc.RpcError) -> None:
        """After a failure of the data-plane connection itself (not an answer): ask the
        server where its data plane is again at the next call."""
        if getattr(err, "transport", False):
            self.forget_plane(plane)

    def forget_plane(self, plane: DataPlaneClient | None = None) -> None:
        """Ask the server where its data plane is again at the next call (`plane`: only if
        it is still the one known; None: whichever, e.g. a process before a restart's)."""
        with self._plane_lock:
            known = self._plane
            if known is None or (plane is not None and known is not plane):
                return
            self._plane, self._plane_asked_at = None, 0.0
        known.close()

    @property
    def data_plane(self) -> str | None:
        """host:port of the data plane this connection uses, once known (None: gRPC)."""
        return self._plane.where if self._plane is not None else None

    def data_plane_of(self, expected: int = 0) -> DataPlaneClient | None:
        """The data plane of the server process `expected` (0: any), if known or found now;
        None: use gRPC for this call (which another process refuses)."""
        plane = self._known_plane(expected)
        return plane if plane is None or not expected or plane.server_id == expected else None

    def _known_plane(self, expected: int) -> DataPlaneClient | None:
        """Where the server's data plane listens, asked when due and connected; None (use
        gRPC for this call) for a server without one, one whose data port cannot be reached
        now (asked again after PLANE_RETRY_S), or while another thread is asking."""
        if self._plane is not None or time.monotonic() < self._plane_asked_at:
            return self._plane
        if not self._plane_lock.acquire(blocking=False):
            return self._plane  # another call is asking: this one goes over gRPC
        try:
            if self._plane is None and time.monotonic() >= self._plane_asked_at:
                self._plane, self._plane_asked_at = self._find_data_plane(expected)
        finally:
            self._plane_lock.release()
        return self._plane

    def identity(self) -> int:
        """The server process's `server_id` (0: an older server that does not say), asked
        of whatever process serves the address now; no retries."""
        try:
            return self.stub().DataPlane(ps_pb2.DataPlaneRequest(),
                                         timeout=min(10.0, self.options.timeout)).server_id
        except grpc.RpcError as err:
            raise describe("DataPlane", self.address, None, err) from None

    def _find_data_plane(self, expected: int = 0) -> tuple[DataPlaneClient | None, float]:
        """(the data plane or None, when to ask again if None: now for a server that could
        not be asked, later for a data port that could not be reached, never for a server
        without one)."""
        try:
            reply = self.stub().DataPlane(ps_pb2.DataPlaneRequest(),
                                          timeout=min(10.0, self.options.timeout),
                                          metadata=server_identity.metadata(expected))
        except grpc.RpcError as err:
            if err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                              grpc.StatusCode.CANCELLED):
                return None, 0.0  # the call itself will say what is wrong (or was closed)
            log.warning("%s; using gRPC for PullMany/PushMany",
                        describe("DataPlane", self.address, None, err))
            return None, math.inf
        if not reply.port or reply.version != dataplane.VERSION or not reply.packed:
            return None, math.inf  # (a server that does not read packed frames: gRPC)
        plane = DataPlaneClient(self.address.rsplit(":", 1)[0].strip("[]"), reply.port,
                                self.options, reply.server_id, reply.max_message_bytes,
                                reply.idle_timeout_s)
        try:
            plane.check()
        except grpc.RpcError as err:
            log.warning("server %s: its data plane at %s cannot be reached now (%s); using "
                        "gRPC for PullMany/PushMany, trying again in %.0fs (if this lasts, "
                        "open that port, or run the server with --data-port -1)",
                        self.address, plane.where, err.details(), PLANE_RETRY_S)
            return None, time.monotonic() + PLANE_RETRY_S
        return plane, math.inf

    def result(self, future, method: str, request, table: str | None = None,
               timeout: float | None = None, done_on_retry: tuple[grpc.StatusCode, ...] = (),
               gone=None):
        """Wait for a `future` call (None: make the call now, for a call that has no others
        to overlap with); UNAVAILABLE is retried like `call` does."""
        return self.call(method, request, table, timeout, done_on_retry, pending=future,
                         gone=gone)

    def healthy(self, timeout: float = 2.0) -> bool:
        stub = health_pb2_grpc.HealthStub(self._channels[0])
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.RpcError as err:
            if err.code() in (grpc.StatusCode.UNAUTHENTICATED,
                              grpc.StatusCode.PERMISSION_DENIED):  # an answer: no use waiting
                raise describe("Check", self.address, None, err) from None
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.healthy(timeout=min(2.0, max(0.1, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                raise ServerError(f"server {self.address} is not serving after {timeout:.0f}s; "
                                  f"check that it was started, that the address is right and "
                                  f"that its TLS setting matches ClientOptions.tls_ca",
                                  address=self.address, table=None,
                                  code=grpc.StatusCode.UNAVAILABLE)
            time.sleep(0.1)

    def close(self) -> None:
        if self._plane is not None:
            self._plane.close()
        for channel in self._channels:
            channel.close()
