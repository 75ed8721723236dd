"""The server's data plane (framing in `parallax.dataplane`): PullMany and PushMany on a
plain TCP or TLS port, answered by the same handlers as the gRPC methods.

One thread per connection reads a frame, runs the handler and writes the answer: a worker
keeps one connection per request it has in flight, so a pull waiting for its step holds only
its own connection's thread, never one a push needs (the same guarantee as the gRPC side's
separate pools). At most `max_connections` are open at once; more are refused at their hello.
The token and TLS settings are the gRPC port's. Stopping the server closes every connection.
"""
from __future__ import annotations

import hmac
import logging
import socket
import ssl
import threading
import time

import grpc

from parallax import bulk_codec, dataplane
from parallax.dataplane import FrameError
from parallax.ps.v1 import ps_pb2
from parallax_ps.service import ParameterServerService, tolerant

log = logging.getLogger("parallax_ps")

MAX_CONNECTIONS = 512  # open at once (each a thread, mostly blocked in recv)
HELLO_TIMEOUT_S = 10.0  # a connection must say hello within this
_DECODE = {"PullMany": tolerant(ps_pb2.PullManyRequest.FromString, "PullManyRequest"),
           "PushMany": tolerant(bulk_codec.decode_push_many_request, "PushManyRequest")}


class _Refused(Exception):
    """A handler's abort: its status and message become the response frame."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class _Context:
    """What the handlers use of a gRPC ServicerContext: the deadline and abort."""

    def __init__(self, deadline_s: float) -> None:
        self._deadline = time.monotonic() + deadline_s if deadline_s > 0 else None

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def abort(self, code: grpc.StatusCode, message: str):
        raise _Refused(code, message)


def _response(code: int, body) -> bytes:
    return dataplane.RESPONSE.pack(dataplane.MAGIC, code, len(body))


class DataPlaneServer:
    """Listens on `host:port` (0: any free port; `.port` is the real one) and serves
    PullMany/PushMany frames with `service`'s handlers."""

    def __init__(self, service: ParameterServerService, host: str, port: int,
                 max_message_bytes: int, token: str | None = None,
                 tls: ssl.SSLContext | None = None,
                 max_connections: int = MAX_CONNECTIONS) -> None:
        self.service, self.max_message_bytes = service, max_message_bytes
        self._expected = (token or "").encode()
        self._tls, self._max_connections = tls, max_connections
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._listener.bind((host, port))
        except OSError as exc:
            self._listener.close()
            raise OSError(f"cannot listen for the data plane on {host}:{port} ({exc}); pick "
                          f"another --data-port, or -1 for none") from None
        self._listener.listen(128)
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._stopped = False
        threading.Thread(target=self._accept, name="ps-data-accept", daemon=True).start()

    def stop(self) -> None:
        """Close the listener and every connection (a request in progress is answered by
        its handler into a closed socket)."""
        with self._lock:
            self._stopped = True
            open_now = list(self._open)
        _close(self._listener)
        for sock in open_now:
            _close(sock)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # closed by stop()
            with self._lock:
                if self._stopped:
                    _close(sock)
                    return
                self._open.add(sock)
                crowded = len(self._open) > self._max_connections
            threading.Thread(target=self._serve, args=(sock, crowded), name="ps-data",
                             daemon=True).start()

    def _serve(self, raw: socket.socket, crowded: bool) -> None:
        sock = raw
        try:
            sock = self._secure(dataplane.tune(raw))
            if self._greet(sock, crowded):
                while self._answer(sock):
                    pass
        except (OSError, EOFError, FrameError, ssl.SSLError):
            pass  # the peer left, or sent what this protocol is not: nothing to answer
        finally:
            with self._lock:
                self._open.discard(raw)
                self._open.discard(sock)
            _close(sock)

    def _secure(self, raw: socket.socket) -> socket.socket:
        """The connection, TLS-wrapped when the server has TLS (tracked for stop())."""
        raw.settimeout(HELLO_TIMEOUT_S)
        if self._tls is None:
            return raw
        sock = self._tls.wrap_socket(raw, server_side=True)
        with self._lock:
            self._open.add(sock)
        return sock

    def _greet(self, sock: socket.socket, crowded: bool) -> bool:
        """The hello: the token, checked in constant time; True when accepted."""
        method, _, length = dataplane.read_header(sock, dataplane.REQUEST)
        if method != dataplane.HELLO or length > 4096:
            raise FrameError(f"expected a hello frame, got method {method}, {length} bytes")
        token = bytes(dataplane.recv_exact(sock, length))
        if not hmac.compare_digest(token, self._expected):
            self._refuse(sock, grpc.StatusCode.UNAUTHENTICATED,
                         "missing or wrong cluster token (ClientOptions.token / "
                         "PARALLAX_TOKEN_FILE must match the server's --token-file)")
            return False
        if crowded:
            self._refuse(sock, grpc.StatusCode.RESOURCE_EXHAUSTED,
                         f"the data plane has {self._max_connections} connections open; "
                         f"close idle clients")
            return False
        sock.sendall(_response(0, b""))
        sock.settimeout(None)
        return True

    @staticmethod
    def _refuse(sock: socket.socket, code: grpc.StatusCode, message: str) -> None:
        body = message.encode()
        sock.sendall(_response(code.value[0], body) + body)

    def _answer(self, sock: socket.socket) -> bool:
        """Serve one request frame; False when the connection must close."""
        method, deadline_s, length = dataplane.read_header(sock, dataplane.REQUEST)
        name = dataplane.METHODS.get(method)
        if name is None or length > self.max_message_bytes:
            why = (f"unknown data-plane method {method}" if name is None else
                   f"{name} of {length} bytes is over the server's message limit of "
                   f"{self.max_message_bytes} bytes; lower ClientOptions.chunk_mb or raise "
                   f"--max-message-mb")
            code = grpc.StatusCode.INVALID_ARGUMENT if name is None else \
                grpc.StatusCode.RESOURCE_EXHAUSTED
            self._refuse(sock, code, why)
            return False
        request = _DECODE[name](bytes(dataplane.recv_exact(sock, length)))
        try:
            answer = getattr(self.service, name)(request, _Context(deadline_s))
        except _Refused as refused:
            body = refused.message.encode()
            dataplane.send_frame(sock, _response(refused.code.value[0], body), body)
            return True
        body = answer if isinstance(answer, bytes) else answer.SerializeToString()
        dataplane.send_frame(sock, _response(0, body), body)
        return True


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
