"""The client's side of the data plane (framing in `parallax.protocol.dataplane`): PullMany and
PushMany to one server as frames on connections kept open, one per request in flight.

`DataPlaneClient.invoker(method)` is called like the gRPC stub's method (request, timeout)
and returns the same decoded response; a failure is raised as a `grpc.RpcError` with the
server's status code, so `ServerConnection.call` retries and reports it exactly as it does
gRPC's. A failure of the connection itself (refused, reset, another server on the port) is
UNAVAILABLE with `transport=True`: the caller then asks the server where its data plane is
again. A connection that saw an error is not reused, nor one idle long enough for the server
to have closed it.
"""
from __future__ import annotations

import os
import select
import socket
import ssl
import threading
import time

import grpc

from parallax.protocol import dataplane, packed_codec
from parallax.protocol.dataplane import FrameError

CONNECT_TIMEOUT_S = 5.0
REPLY_MARGIN_S = 5.0  # past the request's own deadline, which the server answers itself
MAX_IDLE = 16         # connections kept open per server between requests
_LATE_ANSWER_S = 1.0  # after a failed send: how long to look for the server's refusal
_CODES = {code.value[0]: code for code in grpc.StatusCode}


class DataPlaneError(grpc.RpcError):
    """A data-plane call's failure, shaped like gRPC's (code() and details()); `transport`:
    the connection failed (not an answer of the server)."""

    def __init__(self, code: grpc.StatusCode, details: str, transport: bool = False) -> None:
        super().__init__(details)
        self._code, self._details, self.transport = code, details, transport

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def _lost(details: str) -> DataPlaneError:
    return DataPlaneError(grpc.StatusCode.UNAVAILABLE, details, transport=True)


def _tls_context(options) -> ssl.SSLContext | None:
    if not options.tls_ca:
        return None
    context = ssl.create_default_context(cafile=options.tls_ca)
    if options.tls_cert:
        context.load_cert_chain(options.tls_cert, options.tls_key)
    return context


class DataPlaneClient:
    """Connections to the data plane of the server run `server_id` at host:port, whose
    message limit is `max_message_bytes` (0: unknown) and which closes connections idle for
    `idle_timeout_s` (0: unknown)."""

    def __init__(self, host: str, port: int, options, server_id: int = 0,
                 max_message_bytes: int = 0, idle_timeout_s: float = 0) -> None:
        self.host, self.port, self.options, self.server_id = host, port, options, server_id
        self.where = f"{host}:{port}"
        self._limit = min(options.max_message_bytes, max_message_bytes or 1 << 62)
        self._reuse_s = idle_timeout_s / 2 if idle_timeout_s else 60.0
        self._tls = _tls_context(options)
        self._idle: list[tuple[socket.socket, float]] = []  # (connection, when it went idle)
        self._lock = threading.Lock()
        self._pid = os.getpid()  # a forked child opens its own connections
        self._closed = False

    def invoker(self, method: str, started: bool = False):
        """`method` (one of `dataplane.SERVED`) called like the gRPC stub's, its request and
        answer in parallax.protocol.packed_codec's layout. `started`: the callable sends the
        request and returns a `Started` call, whose `result()` reads the answer."""
        serialize, deserialize = packed_codec.CLIENT_CODECS[method]

        def start(request, timeout: float | None = None) -> Started:
            # a request encoded by its maker may want its answer as it came (RawAnswer)
            read = packed_codec.RawAnswer if getattr(request, "raw_answer", False) \
                else deserialize
            return Started(self, method, serialize(request), timeout or self.options.timeout,
                           read)

        def call(request, timeout: float | None = None):
            return start(request, timeout).result()
        return start if started else call

    def call(self, method: str, body: bytes, timeout: float) -> bytearray:
        """The response body of one request (`body`: in packed_codec's layout); raises
        DataPlaneError."""
        return self.finish(self.send(method, body, timeout), method, timeout)

    def send(self, method: str, body: bytes, timeout: float) -> socket.socket:
        """Send one request (`method`: gRPC's name, `body` packed) on a connection of its
        own, which `finish` reads the answer from; raises DataPlaneError."""
        if len(body) > self._limit:  # as gRPC's send limit, or the server, would say
            raise DataPlaneError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                 f"{method} of {len(body)} bytes is over the message limit of "
                                 f"{self._limit} bytes; lower ClientOptions.chunk_mb or raise "
                                 f"the server's --max-message-mb")
        sock = self._take()
        try:
            sock.settimeout(timeout + REPLY_MARGIN_S)
            code = dataplane.CODES[dataplane.PACKED[method]]
            header = dataplane.REQUEST.pack(dataplane.MAGIC, code, float(timeout), len(body))
            _send(sock, header, body)
        except socket.timeout:
            close_quietly(sock)
            raise self._late(timeout) from None
        except OSError as exc:
            close_quietly(sock)
            raise _lost(f"data-plane connection to {self.where} failed: {exc}") from None
        return sock

    def finish(self, sock: socket.socket, method: str, timeout: float) -> bytearray:
        """The answer to the request `send` sent on `sock`; the connection is kept for
        reuse, or closed after any failure."""
        try:
            status, length = dataplane.read_header(sock, dataplane.RESPONSE)
            payload = dataplane.recv_exact(sock, self._answer_size(sock, method, length))
        except socket.timeout:
            close_quietly(sock)
            raise self._late(timeout) from None
        except (OSError, EOFError, FrameError) as exc:
            close_quietly(sock)
            raise _lost(f"data-plane connection to {self.where} failed: {exc}") from None
        if status:
            close_quietly(sock)  # the server may close it after an error: never reuse it
            raise DataPlaneError(_CODES.get(status, grpc.StatusCode.UNKNOWN),
                                 payload.decode("utf-8", "replace"))
        self._give_back(sock)
        return payload

    def _late(self, timeout: float) -> DataPlaneError:
        return DataPlaneError(grpc.StatusCode.DEADLINE_EXCEEDED,
                              f"no answer from the data plane at {self.where} within "
                              f"{timeout + REPLY_MARGIN_S:.0f}s")

    def _answer_size(self, sock: socket.socket, method: str, length: int) -> int:
        if length > self.options.max_message_bytes + (1 << 20):
            close_quietly(sock)
            raise DataPlaneError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                 f"{method}'s answer of {length} bytes is over this client's "
                                 f"limit of {self.options.max_message_bytes} bytes; raise "
                                 f"ClientOptions.max_message_mb or lower chunk_mb")
        return length

    def check(self) -> None:
        """Open (and keep) one connection now; raises DataPlaneError if it cannot."""
        self._give_back(self._take())

    def close(self) -> None:
        with self._lock:
            idle, self._idle, self._closed = self._idle, [], True
        for sock, _ in idle:
            close_quietly(sock)

    def _give_back(self, sock: socket.socket) -> None:
        with self._lock:  # not into a forked child's pool: the socket is its parent's
            if not self._closed and len(self._idle) < MAX_IDLE and self._pid == os.getpid():
                self._idle.append((sock, time.monotonic()))
                return
        close_quietly(sock)

    def _take(self) -> socket.socket:
        while True:
            with self._lock:
                if self._pid != os.getpid():  # the parent's connections are the parent's
                    self._idle, self._pid = [], os.getpid()
                sock, since = self._idle.pop() if self._idle else (None, 0.0)
            if sock is None:
                break
            if time.monotonic() - since < self._reuse_s and _still_open(sock):
                return sock
            close_quietly(sock)  # idle long enough for the server to have closed it, or closed
        return self.connect()

    def connect(self) -> socket.socket:
        """A new connection, greeted (and, when this client knows the server's id, to that
        server process only); raises DataPlaneError."""
        try:
            return self._connect()
        except (OSError, EOFError, FrameError, ssl.SSLError) as exc:
            raise _lost(f"cannot connect to the data plane at {self.where}: {exc}") from None

    def _connect(self) -> socket.socket:
        sock = dataplane.tune(socket.create_connection((self.host, self.port),
                                                       timeout=CONNECT_TIMEOUT_S))
        try:
            if self._tls is not None:
                sock = self._tls.wrap_socket(sock, server_hostname=self.host)
            token = (self.options.token or "").encode()
            sock.sendall(dataplane.REQUEST.pack(dataplane.MAGIC, dataplane.HELLO, 0.0,
                                                len(token)) + token)
            status, length = dataplane.read_header(sock, dataplane.RESPONSE)
            payload = dataplane.recv_exact(sock, min(length, 1 << 16))
        except BaseException:
            close_quietly(sock)
            raise
        if status:  # refused: a wrong token is an answer; a full server sends us to gRPC
            close_quietly(sock)
            details = payload.decode("utf-8", "replace")
            code = _CODES.get(status, grpc.StatusCode.UNKNOWN)
            raise _lost(details) if code == grpc.StatusCode.RESOURCE_EXHAUSTED else \
                DataPlaneError(code, details)
        if self.server_id and bytes(payload) != dataplane.SERVER_ID.pack(self.server_id):
            close_quietly(sock)
            raise _lost(f"{self.where} is the data plane of another server (a restarted "
                        f"server, or another job's on the same port)")
        return sock


class Started:
    """A data-plane call whose request left when it was made and whose answer is read by
    the first thread that asks for it (no thread of its own): the shape of a
    `concurrent.futures.Future` that `ServerConnection.result` needs. A failure to send is
    raised by `result`, so a caller retries it as it retries any other failure."""

    def __init__(self, plane: DataPlaneClient, method: str, body: bytes, timeout: float,
                 deserialize) -> None:
        self._plane, self._method, self._timeout = plane, method, timeout
        self._deserialize = deserialize
        self._lock = threading.Lock()
        self._pid = os.getpid()  # a forked child must not read the parent's answer
        self._sock: socket.socket | None = None
        self._error: BaseException | None = None
        self._done, self._value = False, None
        try:
            self._sock = plane.send(method, body, timeout)
        except grpc.RpcError as err:
            self._error, self._done = err, True

    def result(self, timeout: float | None = None):
        """The decoded answer (read now if no thread read it yet); raises DataPlaneError."""
        if os.getpid() != self._pid:
            self.abandon()
        with self._lock:
            if not self._done:
                sock, self._sock = self._sock, None
                try:
                    self._value = self._deserialize(self._plane.finish(sock, self._method,
                                                                       self._timeout))
                except BaseException as err:  # noqa: BLE001 - raised to every asker
                    self._error = err
                self._done = True
        if self._error is not None:
            raise self._error
        return self._value

    def abandon(self) -> None:
        """Nobody will read the answer: close the connection now rather than hold it."""
        with self._lock:
            sock, self._sock = self._sock, None
            if not self._done:
                self._error = self._abandoned()
                self._done = True
        if sock is not None:
            close_quietly(sock)

    def _abandoned(self) -> DataPlaneError:
        """What reading an abandoned call raises: in a forked child, a lost connection (the
        child's retry sends the call again on its own); in this process, CANCELLED, retried
        by nobody (its step failed: a retry would only wait for a step nobody pushes)."""
        where = self._plane.where
        if os.getpid() != self._pid:
            return _lost(f"the call to {where} was abandoned by a forked process")
        return DataPlaneError(grpc.StatusCode.CANCELLED, f"the call to {where} was abandoned")


def _still_open(sock: socket.socket) -> bool:
    """An idle connection has nothing to read; readable means the server closed it."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return False
    return not readable


def _send(sock: socket.socket, header: bytes, body: bytes) -> None:
    """Send a frame; if the server stops reading half-way (it refused the frame), its
    answer is what matters: leave it to be read, rather than report a broken pipe."""
    try:
        dataplane.send_frame(sock, header, body)
    except (BrokenPipeError, ConnectionResetError):
        sock.settimeout(_LATE_ANSWER_S)


def close_quietly(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:
        pass
