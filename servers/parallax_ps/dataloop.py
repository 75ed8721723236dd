"""The data plane's event loop: one thread reads, answers and writes every greeted connection.

Why not a thread per connection: with W sync workers a server answers 2W requests a step,
and each woke its own thread, which then queued for the GIL behind the others; pulls parked
on a shard's condition were all woken at once when the step closed. Measured on a server held
to 1/8 of a core (`cpu.cfs_quota_us`), a PullMany of one row cost 292 us of its CPU with one
worker and 545 us with 8 concurrent workers: half of it was switching threads.

A connection carries one request at a time: its header, its body (read as it arrives, held
against --memory-mb before it is read), the handler's answer (written as the socket takes
it). Handlers run on this thread and may not wait here (`waits.not_here`):
- a pull whose step has not been applied yet is *parked* under the shard it waits for, its
  deadline on a timer heap; the shard's next change (a step applied, by a push this loop
  handles or one over gRPC; a restore; the shard closing) runs it again (`TableShard.watch`);
  at its deadline it is answered with the shard's explanation, as a waiting thread was;
- a request that must wait for memory or for a shard's lock another thread holds, a large
  one (its compiled work, with the GIL released, runs beside the loop's), and a frame to
  refuse move to a thread of their own (blocking reads and writes, as before), which hands
  the connection back when done.
So nothing on this thread blocks on another request, and a small request costs no thread
switch. Each turn serves at most one request, and reads at most `READ_PER_TURN` bytes, of
each connection, so a client that pipelines frames or streams a large body takes its turn.
"""
from __future__ import annotations

import collections
import heapq
import itertools
import logging
import selectors
import socket
import ssl
import threading
import time
from typing import Callable

from parallax.protocol import dataplane
from parallax.protocol.dataplane import FrameError
from parallax_ps import inflight, waits
from parallax_ps.errors import RequestError

log = logging.getLogger("parallax_ps")

SWEEP_S = 1.0  # how often idle and stalled connections are looked for
READ_PER_TURN = 4 * dataplane.PIECE  # bytes of one connection read before the others'
LARGE_PULL_BYTES = 128 << 10  # a pull of this many bytes of ids (16k rows) or more, and
LARGE_PUSH_BYTES = 1 << 20    # a push of this many bytes, are served on a thread
_WOULD_BLOCK = (BlockingIOError, InterruptedError, ssl.SSLWantReadError,
                ssl.SSLWantWriteError)
_PEER_GONE = (OSError, EOFError, FrameError, ssl.SSLError, ValueError)


class Connection:
    """One greeted connection and the request it carries (at most one at a time)."""

    def __init__(self, number: int, sock: socket.socket) -> None:
        self.number, self.sock = number, sock
        self.tls = isinstance(sock, ssl.SSLSocket)
        self.head = bytearray()  # the request header read so far
        self.body: bytearray | None = None  # the body read so far (None: reading the head)
        self.name, self.length, self.deadline_s = "", 0, 0.0
        self.scope: inflight.Scope | None = None  # its memory, from admission to answered
        self.context = None  # dataplane._Context, for the handler
        self.request = None  # decoded, until answered
        self.out: list[memoryview] = []  # the answer's bytes not sent yet
        self.since = time.monotonic()  # the last progress (idle and stall timeouts)
        self.events = 0  # what the selector watches for (0: not registered)
        self.parked = 0  # the token of its timer while parked (0: not parked)
        self.parked_on = None  # the shard it is parked under
        self.counted = False  # counted as a request in flight


class DataLoop:
    """Serves greeted connections for `plane` (a DataPlaneServer: its `handle`, `service`,
    limits, counters) on one thread; `adopt` hands it a connection."""

    def __init__(self, plane) -> None:
        self.plane = plane
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        for end in (self._wake_r, self._wake_w):
            end.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._handed = collections.deque()  # (connection, keep) back from other threads
        self._changed = collections.deque()  # shards that changed (from any thread)
        self._again: list[Connection] = []  # TLS connections whose next frame may be read
        self._parked: dict[object, list[Connection]] = {}  # by shard
        self._timers: list[tuple[float, int, int]] = []  # (deadline, token, connection no.)
        self._tokens = itertools.count(1)
        self._conns: dict[int, Connection] = {}
        self._stopping = False
        self._next_sweep = time.monotonic() + SWEEP_S
        self._thread = threading.Thread(target=self._run, name="ps-data-loop", daemon=True)
        self._thread.start()

    # ---- from other threads -------------------------------------------------------------
    def adopt(self, conn: Connection) -> None:
        """Serve `conn`, greeted, from its first request."""
        self._handed.append((conn, True))
        self._wake()

    def stop(self, timeout: float = 5.0) -> None:
        """Close every connection it serves and end the loop."""
        self._stopping = True
        self._wake()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _wake(self) -> None:
        if threading.current_thread() is self._thread:
            return  # (it looks at its queues before it selects again)
        try:
            self._wake_w.send(b"x")
        except OSError:  # full (a wake is pending already) or closed (stopping)
            pass

    def _on_change(self, shard) -> None:
        """A watched shard changed (its lock is held: no blocking here)."""
        self._changed.append(shard)
        self._wake()

    # ---- the loop -----------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping:
            try:
                self._turn()
            except Exception:  # noqa: BLE001 - a bug must not stop the data plane
                log.exception("data plane: loop error; serving on")
        while self._handed:  # (greeted, or back from a thread: closed with the rest)
            conn, _ = self._handed.popleft()
            self._conns[conn.number] = conn
        for conn in list(self._conns.values()):
            self._close(conn)
        self._selector.close()
        for end in (self._wake_r, self._wake_w):
            end.close()

    def _turn(self) -> None:
        for key, events in self._selector.select(self._timeout()):
            conn = key.data
            if conn is None:
                self._drain_wake()
            else:
                self._guarded(conn, self._writable if events & selectors.EVENT_WRITE
                              else self._read)
        while self._handed:
            conn, keep = self._handed.popleft()
            self._guarded(conn, lambda conn: self._take_back(conn, keep))
        again, self._again = self._again, []
        for conn in again:
            if conn.events == selectors.EVENT_READ and conn.number in self._conns:
                self._guarded(conn, self._read)
        self._run_changed()
        now = time.monotonic()
        self._expire(now)
        if now >= self._next_sweep:
            self._sweep(now)

    def _timeout(self) -> float:
        if self._handed or self._changed or self._again:
            return 0.0
        until = self._next_sweep
        if self._timers:
            until = min(until, self._timers[0][0])
        return max(0.0, until - time.monotonic())

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except OSError:
            pass

    def _guarded(self, conn: Connection, step: Callable[[Connection], None]) -> None:
        """Run one step of a connection; one that fails closes that connection only."""
        try:
            step(conn)
        except _PEER_GONE:
            self._close(conn)  # the peer left, went quiet, or sent what this is not
        except Exception:  # noqa: BLE001 - a bug: this connection goes, the loop stays
            log.exception("data plane: connection %d failed", conn.number)
            self._close(conn)

    def _take_back(self, conn: Connection, keep: bool) -> None:
        self._conns[conn.number] = conn
        if not keep or self._stopping:
            self._close(conn)
            return
        conn.sock.setblocking(False)
        conn.head, conn.body, conn.since = bytearray(), None, time.monotonic()
        self._watch(conn, selectors.EVENT_READ)
        self._guarded(conn, self._read)  # (a TLS socket may hold the next frame already)

    def _watch(self, conn: Connection, events: int) -> None:
        if conn.events == events:
            return
        if not events:
            self._selector.unregister(conn.sock)
        elif conn.events:
            self._selector.modify(conn.sock, events, conn)
        else:
            self._selector.register(conn.sock, events, conn)
        conn.events = events

    # ---- reading ------------------------------------------------------------------------
    def _read(self, conn: Connection) -> None:
        """Read what has come of the connection's request, and serve it once whole: one
        request, and READ_PER_TURN bytes, at most (then the next turn, for the others)."""
        budget = READ_PER_TURN
        while conn.events == selectors.EVENT_READ and budget > 0:
            if conn.body is None:
                piece = _recv(conn, dataplane.REQUEST.size - len(conn.head))
                if piece is None:
                    return
                conn.head += piece
                if len(conn.head) == dataplane.REQUEST.size:
                    self._begin(conn)
            else:
                want = conn.length - len(conn.body)
                piece = _recv(conn, min(want, dataplane.PIECE)) if want else b""
                if piece is None:
                    return
                conn.body += piece
                if len(conn.body) == conn.length:
                    conn.since = time.monotonic()
                    self._handle(conn)
                    break
            conn.since = time.monotonic()
            budget -= len(piece)
        if conn.tls and conn.events == selectors.EVENT_READ and conn.sock.pending():
            self._again.append(conn)  # (TLS holds bytes that select does not see)

    def _begin(self, conn: Connection) -> None:
        """A header has come: its body's memory held (or the frame handed to a thread)."""
        magic, method, conn.deadline_s, conn.length = dataplane.REQUEST.unpack(conn.head)
        if magic != dataplane.MAGIC:
            raise FrameError(f"not a parallax data-plane frame (starts {magic!r})")
        conn.name = dataplane.METHODS.get(method)
        plane = self.plane
        if conn.name is None or conn.length > plane.max_message_bytes:
            def refuse() -> bool:
                plane.refuse_frame(conn.sock, conn.name, method, conn.length)
                return False  # (closed once the client has finished sending)
            self._hand_off(conn, refuse)
            return
        large = LARGE_PUSH_BYTES if conn.name.startswith("Push") else LARGE_PULL_BYTES
        if conn.length >= large:  # (its work runs beside the loop's)
            self._frame_on_thread(conn)
            return
        conn.context = plane.context(conn.deadline_s)
        scope = inflight.Scope(plane.service.budget)
        try:
            with inflight.using(scope), waits.not_here(), \
                    plane.service.admitted(conn.name, conn.length, conn.context.deadline):
                pass
        except (waits.WouldWait, RequestError):  # waits for room, or is refused: a thread
            scope.close()                      # serves it as before (reading past a refused
            self._frame_on_thread(conn)        # body: the connection stays)
            return
        conn.scope, conn.body = scope, bytearray()

    def _frame_on_thread(self, conn: Connection) -> None:
        """Serve the frame whose header has come on a thread, from its admission on."""
        self._hand_off(conn, lambda: self.plane.answer_frame(conn.sock, conn.name, conn.length,
                                                             conn.deadline_s))

    def _handle(self, conn: Connection) -> None:
        conn.request = self.plane.decode(conn.name, bytes(conn.body))
        conn.body = None
        conn.context.started = time.perf_counter()
        conn.counted = True
        self.plane.count_in_flight(+1)
        self._attempt(conn)

    def _attempt(self, conn: Connection) -> None:
        """Run the request's handler without waiting: answer it, park it, or hand it on."""
        try:
            with inflight.using(conn.scope), waits.not_here():
                code, body = self.plane.handle(conn.name, conn.request, conn.context)
        except waits.WouldWait as wait:
            if wait.shard is not None:
                self._park(conn, wait.shard, wait.deadline)
            else:
                self._hand_off(conn, lambda: self._finish_blocking(conn))
            return
        self._answer(conn, code, body)

    # ---- parked pulls -------------------------------------------------------------------
    def _park(self, conn: Connection, shard, deadline: float | None) -> None:
        self._watch(conn, 0)
        conn.parked, conn.parked_on = next(self._tokens), shard
        self._parked.setdefault(shard, []).append(conn)
        if deadline is not None:
            heapq.heappush(self._timers, (deadline, conn.parked, conn.number))
        if shard.watch(self._on_change):  # newly watched: a change just before is unseen
            self._changed.append(shard)
        if len(self._timers) > 1024 + 4 * sum(map(len, self._parked.values())):
            self._timers = [t for t in self._timers if self._parked_by(t[2], t[1])]
            heapq.heapify(self._timers)  # (the timers of answered pulls go)

    def _parked_by(self, number: int, token: int) -> Connection | None:
        conn = self._conns.get(number)
        return conn if conn is not None and conn.parked == token else None

    def _run_changed(self) -> None:
        while self._changed:
            for conn in self._parked.pop(self._changed.popleft(), ()):
                self._unpark(conn)

    def _unlist(self, conn: Connection) -> None:
        """Take a parked connection off its shard's list (if it is still on it)."""
        conns = self._parked.get(conn.parked_on)
        if conns and conn in conns:
            conns.remove(conn)

    def _unpark(self, conn: Connection) -> None:
        conn.parked, conn.parked_on = 0, None
        self._guarded(conn, self._attempt)
        if conn.tls and conn.events == selectors.EVENT_READ:
            self._guarded(conn, self._read)  # (TLS may hold the next frame already)

    def _expire(self, now: float) -> None:
        """Answer the parked pulls whose deadline has passed (the handler explains)."""
        while self._timers and self._timers[0][0] <= now:
            _, token, number = heapq.heappop(self._timers)
            conn = self._parked_by(number, token)
            if conn is None:
                continue  # answered, closed, or parked again since
            self._unlist(conn)
            conn.context.expire()  # (a re-run must not wait on, nor park again)
            self._unpark(conn)

    # ---- answers ------------------------------------------------------------------------
    def _answer(self, conn: Connection, code: int, body: bytes) -> None:
        conn.request = None
        conn.out = dataplane.frame_pieces(conn.tls, dataplane.response_header(code, body), body)
        conn.since = time.monotonic()
        self._write(conn)

    def _writable(self, conn: Connection) -> None:
        if self._write(conn):
            self._read(conn)  # (a TLS socket may hold the next frame already)

    def _write(self, conn: Connection) -> bool:
        """Send what the socket takes of the answer; True once all of it is sent (the
        connection then waits for its next request)."""
        out = conn.out
        while out:
            try:
                sent = conn.sock.send(out[0]) if conn.tls else conn.sock.sendmsg(out)
            except _WOULD_BLOCK:
                self._watch(conn, selectors.EVENT_WRITE)
                return False
            conn.since = time.monotonic()
            dataplane.consume(out, sent)
        self._done(conn)
        conn.head = bytearray()
        self._watch(conn, selectors.EVENT_READ)
        return True

    def _done(self, conn: Connection) -> None:
        """The request is over: its memory and its count given back (and its context: the
        shards it found, which a table deleted since must not stay alive by)."""
        conn.request, conn.out, conn.context = None, [], None
        if conn.scope is not None:
            conn.scope.close()
            conn.scope = None
        if conn.counted:
            conn.counted = False
            self.plane.count_in_flight(-1)

    # ---- threads and closing ------------------------------------------------------------
    def _hand_off(self, conn: Connection, serve: Callable[[], bool]) -> None:
        """Serve the rest of this request on a thread of its own with blocking waits;
        `serve()` says whether the connection stays open."""
        self._watch(conn, 0)
        self._conns.pop(conn.number, None)
        conn.sock.setblocking(True)
        conn.sock.settimeout(self.plane.frame_timeout_s)

        def run() -> None:
            keep = False
            try:
                keep = serve()
            except _PEER_GONE:
                pass
            except Exception:  # noqa: BLE001 - a bug: this connection goes
                log.exception("data plane: connection %d failed", conn.number)
            finally:
                self._done(conn)
            self._handed.append((conn, keep))
            self._wake()
        try:
            threading.Thread(target=run, name="ps-data", daemon=True).start()
        except RuntimeError:  # no thread to be had: this connection goes
            self._close(conn)

    def _finish_blocking(self, conn: Connection) -> bool:
        """The handler with its waits (on a hand-off thread), and the answer sent."""
        with inflight.using(conn.scope):
            code, body = self.plane.handle(conn.name, conn.request, conn.context)
        conn.request = None
        dataplane.send_frame(conn.sock, dataplane.response_header(code, body), body)
        return True

    def _close(self, conn: Connection) -> None:
        if conn.events:
            self._watch(conn, 0)
        if conn.parked:
            self._unlist(conn)
            conn.parked, conn.parked_on = 0, None
        self._done(conn)
        conn.head, conn.body = bytearray(), None
        self._conns.pop(conn.number, None)
        self.plane.forget(conn.number, conn.sock)

    def _sweep(self, now: float) -> None:
        """Close connections idle past the plane's idle timeout (between requests) or
        stalled past its frame timeout (within a frame or an answer)."""
        self._next_sweep = now + SWEEP_S
        for conn in list(self._conns.values()):
            if conn.parked or not conn.events:
                continue  # waiting for its step, or with a thread
            between = conn.body is None and not conn.out
            limit = self.plane.idle_timeout_s if between else self.plane.frame_timeout_s
            if now - conn.since > limit:
                self._close(conn)


def _recv(conn: Connection, size: int) -> bytes | None:
    """Up to `size` bytes; None when there are none yet; EOFError when the peer left."""
    try:
        piece = conn.sock.recv(size)
    except _WOULD_BLOCK:
        return None
    if not piece:
        raise EOFError("connection closed")
    return piece
