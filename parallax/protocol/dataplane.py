"""The data plane: PullMany and PushMany over plain TCP, beside gRPC.

A training step's traffic is a few large multi-table requests per server, and Python gRPC
costs about 0.4 ms of CPU per request on each side (measured against an echo of the same
bytes: `examples/benchmarks/grpc_echo.py`), more than the server's work for a small table.
Length-prefixed frames on a socket that stays open cost about 15 us a request. So the two
methods of the step also travel here; everything else (tables, checkpoints, health, stats,
and these two methods for a client or server without the data plane) stays on gRPC, which
also tells the client where the data plane listens (the `DataPlane` RPC).

Methods 3 and 4 carry PullMany and PushMany in `parallax.protocol.packed_codec`'s layout,
which costs a few numpy calls a request instead of the protobuf messages' tens of
microseconds a part; a request means what its gRPC twin means and the server answers it
with the same handler. Methods 1 and 2 (the protobuf messages as frames) are retired: client
and server ship in one wheel, and a frame naming them gets the unknown-method error.

A connection (TCP, or TLS with the gRPC port's certificates) starts with a hello frame that
carries the cluster token (empty without one); the server answers OK with its 8-byte id (the
`server_id` of its DataPlane answer: a client checks it is talking to the server it asked),
or an error and closes. Then each request frame gets one response frame, in order:

    request:  magic b"PXD1", method (u8: 3 PullMany, 4 PushMany, packed), 3 zero bytes,
              deadline in seconds from now (f64; 0: none), body length (u64), body
    response: magic b"PXD1", status (u8: a gRPC status code, 0 OK), 3 zero bytes,
              body length (u64), body (the response message, or a UTF-8 error message)

Any frame the server cannot read (bad magic, unknown method, a body over the message limit)
is answered with an error and the connection is closed: a stream out of step is not reused.
"""
from __future__ import annotations

import socket
import ssl
import struct
import time

MAGIC = b"PXD1"
VERSION = 1  # the framing (the DataPlane answer's `packed` is always true)
HELLO = 0
METHODS = {3: "PullManyPacked", 4: "PushManyPacked"}  # 1 and 2, protobuf bodies: retired
CODES = {name: code for code, name in METHODS.items()}
PACKED = {"PullMany": "PullManyPacked", "PushMany": "PushManyPacked"}  # gRPC's: the plane's
SERVED = tuple(PACKED)  # the gRPC methods the data plane also carries
REQUEST = struct.Struct("<4sB3xdQ")   # magic, method, deadline (s), body length
RESPONSE = struct.Struct("<4sB3xQ")   # magic, status code, body length
SMALL_BODY = 64 * 1024  # bodies below this are sent in one piece with their header
SERVER_ID = struct.Struct("<Q")
PIECE = 1 << 20  # a body is read (and its buffer grown) this much at a time


class FrameError(Exception):
    """The peer sent something that is not a frame of this protocol."""


def recv_exact(sock: socket.socket, size: int, deadline: float | None = None) -> bytearray:
    """Exactly `size` bytes, received in place; EOFError if the peer closed first. Memory
    grows with what arrives (the buffer doubles from PIECE as it fills), not with what a
    header declares. With `deadline` (time.monotonic()), all of it must come by then (not
    just each read: socket.timeout otherwise)."""
    buffer = bytearray(min(size, PIECE))
    got = 0
    while got < size:
        if got == len(buffer):
            buffer.extend(bytes(min(len(buffer), size - got)))
        if deadline is not None:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
        with memoryview(buffer) as view:
            received = sock.recv_into(view[got:])
        if not received:
            raise EOFError(f"connection closed after {got} of {size} bytes")
        got += received
    return buffer


def response_header(code: int, body) -> bytes:
    """The header of an answer frame carrying `body` with status `code` (0: OK)."""
    return RESPONSE.pack(MAGIC, code, len(body))


def frame_pieces(tls: bool, header: bytes, body) -> list[memoryview]:
    """A frame as the pieces to send: header and body apart, for one gathering `sendmsg`
    (one system call, no copy of the body, no segment of a header alone); on TLS, which has
    no sendmsg, a small frame in one piece (one record and segment, no Nagle wait)."""
    if tls and len(body) < SMALL_BODY:
        return [memoryview(header + bytes(body))]
    return [memoryview(header), memoryview(body).cast("B")]


def send_frame(sock: socket.socket, header: bytes, body) -> None:
    """Header and body, sent whole (`frame_pieces`)."""
    tls = isinstance(sock, ssl.SSLSocket)
    pieces = frame_pieces(tls, header, body)
    if tls:
        for piece in pieces:
            sock.sendall(piece)
        return
    while pieces:
        consume(pieces, sock.sendmsg(pieces))


def consume(pieces: list[memoryview], sent: int) -> None:
    """Drop the first `sent` bytes of `pieces` (what a send took), in place."""
    while pieces and sent >= len(pieces[0]):
        sent -= len(pieces.pop(0))
    if pieces and sent:
        pieces[0] = pieces[0][sent:]


def read_header(sock: socket.socket, layout: struct.Struct,
                deadline: float | None = None) -> tuple:
    fields = layout.unpack(recv_exact(sock, layout.size, deadline))
    if fields[0] != MAGIC:
        raise FrameError(f"not a parallax data-plane frame (starts {fields[0]!r}, expected "
                         f"{MAGIC!r})")
    return fields[1:]


def tune(sock: socket.socket) -> socket.socket:
    """Small frames leave at once (no Nagle delay), and a dead peer is noticed."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    return sock
