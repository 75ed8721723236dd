"""Replicated shards (`ClientOptions.replicas=2`, `parallax run --replicas 2`): every shard
placed on server i has a copy on server i+1 (mod S), and a server's death loses no step.

The client keeps the copies equal. Every request that changes a shard (`WRITES`: create,
fill, push, import, delete) goes to each live copy at once and counts as done once every
live copy answered; every read (pull, export) goes to the first live copy. A step wait
(`WAITS`) goes to every live copy and answers the lowest step: a copy can be a push behind
the first (the push that closes its step still on its way from another worker), and what
follows a wait (a save, an assign, an export) needs the step applied on each copy. A sync
step is applied once every worker's push is in, in worker order, so copies that received
the same pushes hold the same rows, bit for bit. Restores go to every server and reload
every copy from the checkpoint, each from its own data directory: saves write every copy,
but servers sharing a data directory write a shard once (the first to claim it there;
`parallax_ps.checkpoint`). A server lost during a save makes the save start again without
it (`PSClient.save`), so that no checkpoint misses the shards it was writing.

A server is lost when a request to it fails UNAVAILABLE and it then answers no health check
(its process is gone: the connection is refused or reset), or after the connection's own
retries. From then on every `ReplicaSet` of
the client leaves it out: reads go to the copy, and a read that was in flight is sent to the
copy again; writes go to the copies left. No step is redone: the copy holds every push the
lost server held, since a push is done only once every live copy has it. Losing both copies
of a shard fails the request with the last server's error, as without copies.

Only sync tables are replicated: an async table applies pushes in arrival order, which
differs between copies (`check_replicable`).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Sequence

import grpc

from parallax.errors import ConfigError, ServerError
from parallax.protocol.refusals import STEP_AHEAD

log = logging.getLogger("parallax")
WRITES = frozenset({"CreateTable", "DeleteTable", "InitRows", "Push", "PushMany",
                    "ImportRows"})  # sent to every live copy; any other method reads one
WAITS = frozenset({"WaitStep"})  # waited for on every live copy (the lowest step answers)
MAX_REPLICAS = 2  # copies of a shard: the server it is placed on and the next one
GONE_CHECK_S = 2.0  # a health check's deadline, asked after a copy failed UNAVAILABLE
CATCH_UP_PAUSE_S = 0.001  # first pause before a write is sent again to a copy behind,
MAX_CATCH_UP_PAUSE_S = 0.05  # doubled up to this


def check_replicas(replicas: int, servers: int) -> None:
    """Raise unless `replicas` copies of a shard fit on `servers` servers."""
    if replicas not in range(1, MAX_REPLICAS + 1):
        raise ConfigError(f"replicas={replicas}: give 1 (no copies) or 2 (each shard also on "
                          f"the next server)")
    if replicas > servers:
        raise ConfigError(f"replicas={replicas} needs at least {replicas} servers, each copy "
                          f"of a shard on its own; the job has {servers}")


def check_flag(replicas: int, servers: int, sync: bool) -> None:
    """What `parallax run` and `parallax k8s` refuse of `--replicas` (with 1: nothing)."""
    if replicas == 1:
        return
    try:
        check_replicas(replicas, servers)
    except ConfigError as exc:
        raise ConfigError(f"--replicas {replicas}: {exc}") from None
    if not sync:
        raise ConfigError(f"--replicas {replicas} with --async: copies of a shard stay equal "
                          f"only in sync mode (an async shard applies pushes as they arrive); "
                          f"drop one of them")


def check_replicable(spec) -> None:
    """Raise for a table whose copies could not stay equal."""
    if spec.sync_mode != "sync":
        raise ConfigError(f"table {spec.name!r}: replicas=2 needs sync tables (an async table "
                          f"applies pushes as they arrive, in a different order on each copy); "
                          f"train in sync mode or run without replicas")


class Liveness:
    """The servers a client has lost, shared by all its `ReplicaSet`s."""

    def __init__(self) -> None:
        self._lost: set[str] = set()
        self._lock = threading.Lock()

    def alive(self, address: str) -> bool:
        return address not in self._lost

    def loses(self, address: str, err: ServerError) -> bool:
        """Whether `err` means the server at `address` is gone (UNAVAILABLE): then it is
        lost, left out from now on."""
        if err.code != grpc.StatusCode.UNAVAILABLE:
            return False
        self.lose(address, err)
        return True

    def gone(self, conn) -> bool:
        """What a copy's retries ask after an UNAVAILABLE: whether its server is lost
        already, or answers no health check (its process is gone: the connection is refused
        at once). A server that answers is retried as usual."""
        return not self.alive(conn.address) or not conn.healthy(GONE_CHECK_S)

    def lose(self, address: str, err: ServerError) -> None:
        with self._lock:
            if address in self._lost:
                return
            self._lost.add(address)
        log.warning("server %s is lost (%s); its shards continue on their copies", address,
                    err)

    @property
    def lost(self) -> frozenset[str]:
        return frozenset(self._lost)


class _Read:
    """A read in flight on one copy."""

    def __init__(self, conn, future) -> None:
        self.conn, self.future = conn, future

    def abandon(self) -> None:
        if hasattr(self.future, "abandon"):
            self.future.abandon()


class _Fanout:
    """A write in flight on every live copy."""

    def __init__(self, calls: list) -> None:
        self.calls = calls

    def abandon(self) -> None:
        for _, future in self.calls:
            if hasattr(future, "abandon"):
                future.abandon()


class ReplicaSet:
    """The copies of the shards placed on one server, as one connection (the interface of
    `ServerConnection` that tables use): the server itself first, then the next one."""

    def __init__(self, copies: Sequence, liveness: Liveness, holders: Sequence = ()) -> None:
        self.copies, self.liveness = list(copies), liveness
        self.holders = list(holders)  # the copies' `replica_push.CopyConnection`s
        self.options = self.copies[0].options

    def live(self) -> list:
        return [c for c in self.copies if self.liveness.alive(c.address)]

    def serving(self, err: ServerError | None = None):
        """The copy that answers reads: the first live one (none left: raise `err`)."""
        live = self.live()
        if not live:
            raise err or ServerError(f"every copy of the shards of server {self.address} is "
                                     f"lost ({', '.join(c.address for c in self.copies)})",
                                     address=self.address, table=None,
                                     code=grpc.StatusCode.UNAVAILABLE)
        return live[0]

    @property
    def address(self) -> str:
        live = self.live()
        return (live or self.copies)[0].address

    @property
    def data_plane(self) -> str | None:
        return self.serving().data_plane

    def _lost(self, conn, err: ServerError) -> bool:
        return self.liveness.loses(conn.address, err)

    def _gone(self, conn):
        """`Liveness.gone` for `conn`'s retries while another copy lives, else None."""
        if len(self.live()) < 2:
            return None
        return lambda: self.liveness.gone(conn)

    def future(self, method: str, request, timeout: float | None = None):
        if method in WRITES or method in WAITS:
            return _Fanout([(c, c.future(method, request, timeout)) for c in self.live()])
        conn = self.serving()
        return _Read(conn, conn.future(method, request, timeout))

    def result(self, future, method: str, request, table=None, timeout: float | None = None,
               done_on_retry: tuple = ()):
        if method in WRITES:
            return self._write(future, method, request, table, timeout, done_on_retry)
        if method in WAITS:
            return self._wait(future, method, request, table, timeout, done_on_retry)
        return self._read(future, method, request, table, timeout, done_on_retry)

    def call(self, method: str, request, table=None, timeout: float | None = None,
             done_on_retry: tuple = (), pending=None):
        return self.result(pending, method, request, table, timeout, done_on_retry)

    def _read(self, future, method, request, table, timeout, done_on_retry):
        conn, pending = (future.conn, future.future) if future is not None else \
            (self.serving(), None)
        while True:
            try:
                return conn.result(pending, method, request, table, timeout, done_on_retry,
                                   self._gone(conn))
            except ServerError as err:
                if not self._lost(conn, err):
                    raise
                conn, pending = self.serving(err), None  # the same read, on the copy

    def _wait(self, future, method, request, table, timeout, done_on_retry):
        """A step wait on every live copy; the answer of the copy furthest behind."""
        calls = future.calls if future is not None else [(c, None) for c in self.live()]
        replies, lost = [], None
        for conn, pending in calls:
            try:
                replies.append(conn.result(pending, method, request, table, timeout,
                                           done_on_retry, self._gone(conn)))
            except ServerError as err:
                if not self._lost(conn, err):
                    raise
                lost = err
        if not replies:
            return self._read(None, method, request, table, timeout, done_on_retry) \
                if self.serving(lost) else None  # (serving raises: no copy left)
        return min(replies, key=lambda reply: reply.step)

    def _write(self, future, method, request, table, timeout, done_on_retry):
        calls = future.calls if future is not None else self._start(method, request, timeout)
        replies, behind, refused, lost = [], [], None, None
        for conn, pending in calls:
            try:
                replies.append(conn.result(pending, method, request, table, timeout,
                                           done_on_retry, self._gone(conn)))
            except ServerError as err:
                if self._lost(conn, err):
                    lost = err
                elif is_behind(err):
                    behind.append((conn, err))
                else:
                    refused = refused or err
        if refused is not None:
            raise refused
        if behind and (replies or self.liveness.lost):
            for conn, err in behind:
                try:
                    replies.append(caught_up(conn, err, method, request, table, timeout,
                                             done_on_retry))
                except ServerError as again:  # (lost while it caught up: left out)
                    if not self._lost(conn, again):
                        raise
                    lost = again
        elif behind:
            raise behind[0][1]
        if not replies:
            raise lost or ServerError(f"{method}: no live copy of the shards of server "
                                      f"{self.address}", address=self.address, table=None,
                                      code=grpc.StatusCode.UNAVAILABLE)
        return replies[0]

    def _start(self, method: str, request, timeout: float | None) -> list:
        """A lone write: started on every copy but the last, which is called from here (a
        streamed request, given as a factory, is sent to each copy in turn)."""
        live = self.live()
        if callable(request):
            return [(c, None) for c in live]
        return [(c, c.future(method, request, timeout)) for c in live[:-1]] + \
            [(c, None) for c in live[-1:]]

    def healthy(self, timeout: float = 2.0) -> bool:
        return any(c.healthy(timeout) for c in self.live())

    def close(self) -> None:
        """The copies are the client's connections: it closes them."""


def caught_up(conn, err: ServerError, method: str, request, table, timeout: float | None,
              done_on_retry: tuple):
    """The write again, until `conn` takes it. A copy refuses a write as ahead of its open
    step (`STEP_AHEAD`) when it is behind the copy this worker read the step from: the push
    that closes its step is still on its way from another worker. So does the only copy left
    after a loss, for the pushes the lost one had. The refusal stands once `timeout` (the
    connection's own by default) has passed."""
    deadline = time.monotonic() + (timeout or conn.options.timeout)
    pause = CATCH_UP_PAUSE_S
    while time.monotonic() < deadline:
        time.sleep(pause)
        pause = min(2 * pause, MAX_CATCH_UP_PAUSE_S)
        try:
            return conn.call(method, request, table, timeout, done_on_retry)
        except ServerError as again:
            if not is_behind(again):
                raise
            err = again
    raise err


def is_behind(err: ServerError) -> bool:
    """Whether a write was refused as ahead of the shard's open step (`STEP_AHEAD`)."""
    return err.code == grpc.StatusCode.FAILED_PRECONDITION and STEP_AHEAD in str(err)


def replica_sets(servers: Sequence, replicas: int, liveness: Liveness,
                 holders: Sequence = ()) -> list:
    """Per server index, what its shards' requests go through: the server itself
    (replicas=1), or a `ReplicaSet` of it and the next server (`holders`: each server's
    `replica_push.CopyConnection`, in the same order)."""
    if replicas == 1:
        return list(servers)
    n = len(servers)
    return [ReplicaSet([servers[(i + k) % n] for k in range(replicas)], liveness,
                       [holders[(i + k) % n] for k in range(replicas)] if holders else ())
            for i in range(n)]


def survives(lost: set[int], servers: int, replicas: int) -> bool:
    """Whether every shard keeps a live copy once the servers numbered `lost` are gone: with
    copies on servers i and i+1 (mod `servers`), no two neighbours may both be lost."""
    if replicas == 1 or len(lost) >= servers:
        return not lost
    return not any((i + 1) % servers in lost for i in lost)
