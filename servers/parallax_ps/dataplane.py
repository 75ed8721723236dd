"""The server's data plane (framing in `parallax.protocol.dataplane`): PullMany and PushMany on a
plain TCP or TLS port, answered by the same handlers as the gRPC methods.

A connection is greeted (TLS handshake, the token's hello) on a thread of its own, then
served by the plane's event loop (`dataloop`): one thread reads every connection's frames,
runs the handlers and writes the answers, parking a pull that waits for its step until the
step is applied, so no request waits on another's (the same guarantee as the gRPC side's
separate pools) and none costs a thread switch. The token and TLS settings are the gRPC
port's.

What a peer without the token can cost is bounded: at most `MAX_GREETING` connections may be
between accept and an accepted hello (more are closed at once, with no thread), and each has
`HELLO_TIMEOUT_S` in all for its TLS handshake and hello. Only greeted connections count
towards `max_connections`. A body is read as it arrives (memory grows with the bytes sent,
not with the length a header declares), and a frame or answer that stalls for
`FRAME_TIMEOUT_S` drops its connection; a connection idle for `IDLE_TIMEOUT_S` is closed
(clients drop their idle connections before that). A request the loop must not wait for
(memory under --memory-mb, a busy shard lock, a large body) is served on a thread of its
own, with blocking reads and writes. Stopping closes the listener at once and the
connections once the requests in flight are answered or the grace period is over.
"""
from __future__ import annotations

import contextlib
import errno
import hmac
import logging
import socket
import ssl
import threading
import time

import grpc

from parallax.protocol import dataplane
from parallax.protocol.dataplane import FrameError
from parallax_ps.dataloop import Connection, DataLoop
from parallax_ps.errors import RequestError
from parallax_ps.service import ParameterServerService, request_deserializer

log = logging.getLogger("parallax_ps")

MAX_CONNECTIONS = 512   # greeted connections open at once
MAX_GREETING = 64       # connections accepted but not yet greeted
HELLO_TIMEOUT_S = 10.0  # for the TLS handshake and the hello, in all
FRAME_TIMEOUT_S = 60.0  # for each read of a frame's rest once its header came, and each
#                         write of an answer
IDLE_TIMEOUT_S = 600.0  # a greeted connection with no request this long is closed
MAX_DEADLINE_S = 3600.0  # the longest a request may wait (a pull for its step): a frame's
#                          deadline of 0 (none), NaN, inf, negative or longer gets this
_ACCEPT_RETRY_S = 0.1   # after a failed accept (out of file descriptors, memory)
_DECODE = {name: request_deserializer(name) for name in dataplane.METHODS.values()}


class _Refused(Exception):
    """A handler's abort: its status and message become the response frame."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class _Context:
    """What the handlers use of a gRPC ServicerContext: the deadline and abort; and what a
    request parked by the loop keeps between its attempts: when the first began (`started`,
    perf_counter, for the stats) and the shards it found (`shards`: a table deleted while
    it waits fails it as it did a waiting thread, never reaches a table made since)."""

    def __init__(self, deadline_s: float) -> None:
        if not 0 < deadline_s <= MAX_DEADLINE_S:  # (False for NaN too)
            deadline_s = MAX_DEADLINE_S
        self._deadline = time.monotonic() + deadline_s
        self.deadline = self._deadline
        self.started: float | None = None
        self.shards = None
        self.wait_until: float | None = None  # its waits' deadline, set by the first one

    def time_remaining(self) -> float:
        return max(0.0, self._deadline - time.monotonic())

    def expire(self) -> None:
        """Its wait is over: the handler answers with its explanation now."""
        self._deadline = self.wait_until = min(self._deadline, time.monotonic())

    def abort(self, code: grpc.StatusCode, message: str):
        raise _Refused(code, message)


def _refuse(sock: socket.socket, code: grpc.StatusCode, message: str) -> None:
    body = message.encode()
    sock.sendall(dataplane.response_header(code.value[0], body) + body)


class DataPlaneServer:
    """Listens on `host:port` (0: any free port; `.port` is the real one) and serves
    PullMany/PushMany frames with `service`'s handlers; `.server_id` identifies this run:
    the service's (`ParameterServerService.server_id`), so its hello and the DataPlane RPC
    always agree."""

    def __init__(self, service: ParameterServerService, host: str, port: int,
                 max_message_bytes: int, token: str | None = None,
                 tls: ssl.SSLContext | None = None,
                 max_connections: int = MAX_CONNECTIONS) -> None:
        self.service, self.max_message_bytes = service, max_message_bytes
        self.server_id = service.server_id
        self._expected = (token or "").encode()
        self._tls, self._max_connections = tls, max_connections
        self._listener = _listen(host, port)
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._open: dict[int, socket.socket] = {}  # by connection number: the live socket
        self._greeting = 0   # accepted, not yet greeted
        self._greeted = 0
        self._in_flight = 0  # requests being answered
        self._idle = threading.Condition(self._lock)
        self._stopped = False
        self.idle_timeout_s = IDLE_TIMEOUT_S
        self.frame_timeout_s = FRAME_TIMEOUT_S
        self._loop = DataLoop(self)
        threading.Thread(target=self._accept, name="ps-data-accept", daemon=True).start()

    def stop_listening(self) -> None:
        """No new connections (the ones open keep being served)."""
        with self._lock:
            self._stopped = True
        _close(self._listener)

    def wait_idle(self, seconds: float) -> None:
        """Wait up to `seconds` for the requests being answered to be answered."""
        deadline = time.monotonic() + seconds
        with self._idle:
            while self._in_flight and time.monotonic() < deadline:
                self._idle.wait(max(0.0, deadline - time.monotonic()))

    def stop(self) -> None:
        """Close the listener and every connection."""
        self.stop_listening()
        self._loop.stop()
        with self._lock:
            open_now = list(self._open.values())
        for sock in open_now:
            _close(sock)

    # ---- connections --------------------------------------------------------------------
    def _accept(self) -> None:
        number = 0
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError as exc:
                if self._stopped:
                    return
                if exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    log.warning("data plane: accept failed (%s); still listening", exc)
                time.sleep(_ACCEPT_RETRY_S)  # out of descriptors or memory: later
                continue
            number += 1
            if not self._admit(number, sock):
                _close(sock)
                continue
            try:
                threading.Thread(target=self._serve, args=(number, sock),
                                 name="ps-data-hello", daemon=True).start()
            except RuntimeError:  # no thread to be had: drop this one, keep serving
                self._forget(number, greeted=False)
                _close(sock)

    def _admit(self, number: int, sock: socket.socket) -> bool:
        with self._lock:
            if self._stopped or self._greeting >= MAX_GREETING:
                return False
            self._greeting += 1
            self._open[number] = sock
            return True

    def _forget(self, number: int, greeted: bool) -> None:
        with self._lock:
            self._open.pop(number, None)
            if greeted:
                self._greeted -= 1
            else:
                self._greeting -= 1

    def forget(self, number: int, sock: socket.socket) -> None:
        """A greeted connection is over (its loop closes it): closed and not counted."""
        self._forget(number, greeted=True)
        _close(sock)

    def _serve(self, number: int, raw: socket.socket) -> None:
        """Greet a new connection, then hand it to the loop."""
        sock, greeted = raw, False
        try:
            sock = self._secure(number, dataplane.tune(raw))
            greeted = self._greet(number, sock)
        except (OSError, EOFError, FrameError, ssl.SSLError, ValueError):
            pass  # the peer left, went quiet, or sent what this protocol is not
        if greeted:
            self._loop.adopt(Connection(number, sock))
            return
        self._forget(number, greeted)
        _close(sock)

    def _secure(self, number: int, raw: socket.socket) -> socket.socket:
        """The connection, TLS-wrapped when the server has TLS (stop() closes whichever
        socket is live)."""
        raw.settimeout(HELLO_TIMEOUT_S)
        if self._tls is None:
            return raw
        sock = self._tls.wrap_socket(raw, server_side=True)
        with self._lock:
            self._open[number] = sock
        return sock

    def _greet(self, number: int, sock: socket.socket) -> bool:
        """The hello, within HELLO_TIMEOUT_S of the handshake: the token (compared in
        constant time); True, counted as greeted, when accepted."""
        deadline = time.monotonic() + HELLO_TIMEOUT_S
        method, _, length = dataplane.read_header(sock, dataplane.REQUEST, deadline)
        if method != dataplane.HELLO or length > 4096:
            raise FrameError(f"expected a hello frame, got method {method}, {length} bytes")
        token = bytes(dataplane.recv_exact(sock, length, deadline))
        if not hmac.compare_digest(token, self._expected):
            _refuse(sock, grpc.StatusCode.UNAUTHENTICATED,
                    "missing or wrong cluster token (ClientOptions.token / PARALLAX_TOKEN_FILE "
                    "must match the server's --token-file)")
            return False
        if not self._count_greeted(+1):
            _refuse(sock, grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"the data plane has its {self._max_connections} connections open; this "
                    f"client uses gRPC instead")
            return False
        try:
            server_id = dataplane.SERVER_ID.pack(self.server_id)
            sock.sendall(dataplane.response_header(0, server_id) + server_id)
        except BaseException:
            self._count_greeted(-1)  # the caller forgets it as not greeted
            raise
        return True

    def _count_greeted(self, change: int) -> bool:
        """Move one connection from greeting to greeted (+1; False when full) or back (-1)."""
        with self._lock:
            if change > 0 and self._greeted >= self._max_connections:
                return False
            self._greeting -= change
            self._greeted += change
            return True

    # ---- requests (for the loop) --------------------------------------------------------
    @staticmethod
    def context(deadline_s: float) -> _Context:
        return _Context(deadline_s)

    @staticmethod
    def decode(name: str, body: bytes):
        return _DECODE[name](body)

    def count_in_flight(self, change: int) -> None:
        with self._idle:
            self._in_flight += change
            if not self._in_flight:
                self._idle.notify_all()

    def answer_frame(self, sock: socket.socket, name: str, length: int,
                     deadline_s: float) -> bool:
        """Serve one request whose header has been read, blocking (a hand-off thread's):
        its body's room waited for (or refused, the body read past), its answer sent; False
        when the connection must close."""
        context = _Context(deadline_s)
        with contextlib.ExitStack() as admitted:  # its working memory, until answered
            try:  # (before the body is read: --memory-mb, waiting for room if need be)
                admitted.enter_context(self.service.admitted(name, length, context.deadline))
            except RequestError as refused:  # read past the body: the connection stays
                _skip(sock, length)          # usable, its client on the data plane
                _refuse(sock, refused.code, refused.message)
                return True
            request = _DECODE[name](bytes(dataplane.recv_exact(sock, length)))
            self.count_in_flight(+1)
            try:
                code, body = self.handle(name, request, context)
                del request  # (its bytes go before the memory they held is given back)
                dataplane.send_frame(sock, dataplane.response_header(code, body), body)
                del body
            finally:
                self.count_in_flight(-1)
        return True

    def handle(self, name: str, request, context: _Context) -> tuple[int, bytes]:
        """(status code, body) of one request. On the loop's thread the handler raises
        `waits.WouldWait` where it would wait; on a hand-off thread it waits (the client has
        its own deadline)."""
        try:
            answer = getattr(self.service, name)(request, context)
        except _Refused as refused:
            return refused.code.value[0], refused.message.encode()
        return 0, answer if isinstance(answer, bytes) else answer.SerializeToString()

    def refuse_frame(self, sock: socket.socket, name: str | None, method: int,
                     length: int) -> None:
        """Answer a frame that cannot be served, then let the client finish sending before
        closing (so it reads the answer rather than a broken pipe)."""
        if name is None:
            _refuse(sock, grpc.StatusCode.INVALID_ARGUMENT,
                    f"unknown data-plane method {method} (this server serves "
                    f"{sorted(dataplane.METHODS)}: PullMany and PushMany in packed_codec's "
                    f"layout); use a client of this server's parallax version")
        else:
            _refuse(sock, grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{name} of {length} bytes is over the server's message limit of "
                    f"{self.max_message_bytes} bytes; lower ClientOptions.chunk_mb or raise "
                    f"--max-message-mb")
        _drain(sock, min(length, 2 * self.max_message_bytes))


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except OSError as exc:
        listener.close()
        raise OSError(f"cannot listen for the data plane on {host}:{port} ({exc}); pick "
                      f"another --data-port, or -1 for none") from None
    listener.listen(128)
    return listener


def _drain(sock: socket.socket, limit: int) -> None:
    """Read and drop up to `limit` bytes (2 s at most), then stop writing."""
    try:
        sock.shutdown(socket.SHUT_WR)
        deadline, dropped = time.monotonic() + 2.0, 0
        while dropped < limit and time.monotonic() < deadline:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            piece = sock.recv(dataplane.PIECE)
            if not piece:
                return
            dropped += len(piece)
    except OSError:
        pass


def _skip(sock: socket.socket, length: int) -> None:
    """Read and drop a body of `length` bytes, a piece at a time (no memory grows)."""
    piece = bytearray(min(length, dataplane.PIECE))
    with memoryview(piece) as view:
        while length > 0:
            got = sock.recv_into(view[:min(length, len(piece))])
            if not got:
                raise EOFError(f"connection closed with {length} bytes of a body unread")
            length -= got


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
