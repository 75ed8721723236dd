"""Replayed servers (`ClientOptions.replay_mb`, `parallax run --replay-mb N`): a server's
death costs no step and no copy of its shards.

Every worker keeps its own pushes to each server, as the encoded requests it sent (newest
last, up to its share of `replay_mb` MiB per server, the oldest dropped first). When a
server dies, the launcher starts it again on the same address, from the newest checkpoint
on disk in its data directory (`parallax_ps --restore-newest`; under `parallax k8s
--replay-mb` Kubernetes restarts its container, `--restore-newest-on-restart`): each shard
starts at that checkpoint's step and names it (`restored_from`). A worker tells the
replacement from the server before by its identity (`server_id`): every request asks for
the process its shards are on (`parallax.protocol.server_identity`), which the replacement
refuses; and a thread per server sleeps on an idle data-plane connection, which closes
when the server dies, so that a worker waiting elsewhere (for the chief in a collective,
whose save waits for this worker's pushes) rebuilds at once (`_Watch`). The worker then
creates its tables there again and sends again, in order, every push it kept of a step a
shard has not applied; then it sends the failed request again (a read), or counts it done
(a push: it was among those sent again). A sync step is applied once every worker's push
is in, summed in worker order, so the shards come back bit for bit as the lost server held
them, and the job goes on: no step redone, no worker restarted, no other server touched.

Costs: in steady state ~30 bytes of metadata per gRPC call, no request and no CPU (the
watching thread sleeps in recv); each worker's memory for its newest pushes (up to
`replay_mb`) and one idle data-plane connection per server; at a death, the replacement's
start, its restore and the replay.

Refused (ReplayError, DATA_LOSS, naming why; `--max-restarts` then restarts the job from
its checkpoint), rather than train on other rows: a shard not restored from a checkpoint;
one restored from a checkpoint the worker's pushes do not follow (`Timeline`); pushes that
do not reach back to its step (dropped for room, or the worker started after it); rows
written by InitRows or ImportRows since the last save on disk. Sync tables only (an async
shard applies pushes as they arrive). Without a data plane (gRPC only) nothing watches:
a death is found by the worker's next request to that server, so a death during the
chief's save ends the save (SAVE_WAIT_S) when the other workers already wait for the chief.
"""
from __future__ import annotations

import collections
import logging
import socket
import threading
import time

import grpc

from parallax.client.dataplane import close_quietly
from parallax.client.replicas import caught_up, is_behind
from parallax.errors import ConfigError, ServerError
from parallax.protocol import bulk_codec, checkpoint_names
from parallax.ps.v1 import ps_pb2

log = logging.getLogger("parallax")
PUSHES = frozenset({"Push", "PushMany"})  # the writes kept and sent again
REPLACEMENT_WAIT_S = 120.0  # how long a worker waits for a lost server to serve again
SAVE_WAIT_S = 10.0  # what a save waits for the other workers' pushes to a rebuilt server
MAX_SAVE_REBUILDS = 3  # a save that meets a server started again waits for its rebuild
NOT_CREATED_PAUSE_S = 0.05  # between asks for a shard another worker has yet to create
WATCH_RETRY_S, WATCH_RETRY_MAX_S = 0.2, 5.0  # a watch's pauses between failed connections
_REPEAT = (grpc.StatusCode.ALREADY_EXISTS,)  # a push the server holds already: done
_FINAL = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
          grpc.StatusCode.DATA_LOSS)  # a watch's rebuild that cannot succeed by waiting


class ReplayError(ServerError):
    """A lost server cannot be rebuilt from this worker's pushes."""


def check_replayable(spec) -> None:
    """Raise for a table whose pushes could not rebuild it in the same order."""
    if spec.sync_mode != "sync":
        raise ConfigError(f"table {spec.name!r}: replay_mb (--replay-mb) needs sync tables (an "
                          f"async table applies pushes as they arrive, an order no replay "
                          f"can repeat); train in sync mode or run without --replay-mb")


def _steps(method: str, request) -> list[tuple[str, int, int]]:
    """(table, shard, step) of every part of a kept push."""
    return [(t, shard, step) for t, shard, step, _ in _parts(method, request)]


def _parts(method: str, request) -> list[tuple[str, int, int, int]]:
    """(table, shard, step, chunk) of every part of a kept push."""
    if method == "Push":
        push = bulk_codec.decode_push_request(bytes(request))
        return [(push.table, push.shard_index, push.step, push.chunk_index)]
    return [(h.table, h.shard_index, h.step, h.chunk_index) for h, *_ in request.parts]


def _size(method: str, request) -> int:
    return len(request) if method == "Push" else len(request.packed())


class PushLog:
    """One server's pushes from this worker, oldest first, up to `max_bytes`."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.entries: collections.deque = collections.deque()  # (method, request, bytes)
        self.bytes = 0
        self.dropped = 0  # pushes dropped for room: older steps cannot be sent again

    def keep(self, method: str, request):
        """`request`, settled (encoded now: its gradients may be reused), kept."""
        if method != "Push":
            request = request.settled()
        size = _size(method, request)
        self.entries.append((method, request, size))
        self.bytes += size
        while self.bytes > self.max_bytes and len(self.entries) > 1:
            _, _, dropped = self.entries.popleft()
            self.bytes -= dropped
            self.dropped += 1
        return request

    def clear(self) -> None:
        self.entries.clear()
        self.bytes = self.dropped = 0

    def tables(self) -> set[str]:
        """The tables of the kept pushes (read only after a failure)."""
        return {t for t, _ in self.last_steps()}

    def last_steps(self) -> dict[tuple[str, int], int]:
        """(table, shard) -> the step of its newest kept push (read only after a failure)."""
        return {(t, shard): step for method, request, _ in self.entries
                for t, shard, step in _steps(method, request)}

    def since(self, steps: dict[tuple[str, int], int], address: str,
              deleted: set[str] = frozenset()) -> list:
        """The kept pushes with a part of a step the server has not applied (`steps`: each
        shard's applied steps, as the replacement answered), in order, but for those only of
        `deleted` tables; raises ReplayError when the pushes kept do not reach back to a
        shard's step."""
        first: dict[tuple[str, int], int] = {}
        last: dict[tuple[str, int], tuple[int, int]] = {}
        out = []
        for method, request, _ in self.entries:
            parts = _parts(method, request)
            if any((step, chunk) <= last.get((t, shard), (-1, -1))
                   for t, shard, step, chunk in parts):
                first, out = {}, []  # the tables were rolled back (a restore): the pushes
                #                      before it are of steps taken again since
            for table, shard, step, chunk in parts:  # (a step whose first kept chunk is
                first.setdefault((table, shard), step + (chunk > 0))  # not its first: gone)
                last[(table, shard)] = (step, chunk)
            ahead = [step >= steps.get((t, shard), 0) for t, shard, step, _ in parts]
            if all(t in deleted for t, _, _, _ in parts):
                continue  # (of tables deleted since: never sent again)
            if all(ahead):
                out.append((method, request))
            elif any(ahead):
                raise ReplayError(f"server {address}: a kept push has parts of steps both "
                                  f"applied and not applied there; it cannot be sent again",
                                  address=address, table=None, code=grpc.StatusCode.DATA_LOSS)
        for key, step in steps.items():
            if key in first and first[key] > step:
                raise self._gap(address, key, step, first[key])
        return out

    def _gap(self, address: str, key: tuple[str, int], step: int, kept: int) -> ReplayError:
        table, shard = key
        why = (f"it dropped {self.dropped} older push(es) to stay within --replay-mb "
               f"({self.max_bytes >> 20} MiB for this server)" if self.dropped else
               "it started after that checkpoint (resumed from a newer one, held only in "
               "the lost server's memory)")
        return ReplayError(
            f"server {address} was started again from a checkpoint at step {step} of table "
            f"{table!r} shard {shard}, but this worker kept its pushes only from step {kept}: "
            f"{why}. Save checkpoints on disk more often, or raise --replay-mb "
            f"(ClientOptions.replay_mb); --max-restarts restarts the job from the checkpoint",
            address=address, table=table, code=grpc.StatusCode.DATA_LOSS)


class Timeline:
    """The checkpoints a client saved or restored since its pushes began to be kept (a
    restore starts it again): the only ones a replacement may restore its shards from, for
    the pushes kept to follow them. Shared by a client's `ReplayedConnection`s."""

    def __init__(self) -> None:
        self.started = checkpoint_names.new_name()  # (before any checkpoint this job makes)
        self.names: set[str] = set()
        self.saves = False  # this worker saves (the chief): it knows every checkpoint

    def saved(self, names) -> None:
        self.names.update(n for n in names if n)
        self.saves = True

    def restored(self, names) -> None:
        self.names = {n for n in names if n}

    def allows(self, name: str) -> str:
        """Why a replacement's shards may not come from checkpoint `name` ("": they may).
        The worker that saves knows every checkpoint of its timeline; another knows the one
        the job resumed from, and that the chief saves later ones."""
        if not name:
            return "it was not restored from a checkpoint (created anew)"
        if name in self.names:
            return ""
        if self.saves:
            return (f"it was restored from checkpoint {name}, which this worker neither saved "
                    f"nor restored (one of an abandoned timeline: saved before a restore to "
                    f"an older one, or by another run)")
        floor = max(self.names, default=self.started)
        if name < floor:
            return (f"it was restored from checkpoint {name}, older than "
                    + ("the one this job resumed from" if self.names else "this worker's start")
                    + " (another run's, or one of an abandoned timeline)")
        return ""


class ReplayedConnection:
    """One server, as every table's shards placed on it reach it (the interface of
    `ServerConnection` that tables and multi-table calls use). It keeps the pushes sent
    through it and the tables created through it, and rebuilds the server's shards on a
    replacement (`recover`): a server of another identity (`server_id`) than the one its
    shards were created or rebuilt on. Every call asks for that process
    (`ServerConnection.expected`), so the replacement refuses it (a gRPC channel reconnects
    to a new process without a word, and a read could then wait there for a step only this
    worker's pushes close); `_Watch` finds the death without a request."""

    def __init__(self, conn, max_bytes: int, timeline: Timeline) -> None:
        self.conn, self.timeline = conn, timeline
        self.address, self.options = conn.address, conn.options
        self.log = PushLog(max_bytes)
        self.created: dict[tuple[str, int], object] = {}  # (table, shard) -> CreateTable
        self.written: set[str] = set()  # tables given rows (InitRows, ImportRows) since the
        #                                 last save on disk: a replacement would lack them
        self.server_id = 0  # the server the shards are on (0: not asked yet)
        self._lock = threading.RLock()  # held while recovering: sends wait for the end
        self._rebuilder: int | None = None  # the thread rebuilding, asking for `_rebuilding`
        self._rebuilding = 0
        self.unreplayed = False  # rebuilt here, the other workers' pushes not seen applied
        self.rebuilds = 0  # rebuilds made (a wait for the pushes counts only if none ended)
        self._lost_at: float | None = None  # the first loss not recovered from (monotonic)
        self.deleted: set[str] = set()  # tables this worker deleted: never waited for again
        self._watch: _Watch | None = None
        conn.expected = self._expected

    def __getattr__(self, name):
        return getattr(self.conn, name)

    def _expected(self) -> int:
        """The server process a call of this thread asks for: the one the shards are on
        (a replacement refuses the call until they are rebuilt there, and the caller then
        waits for the rebuild); the replacement for the thread rebuilding them."""
        return self._rebuilding if self._rebuilder == threading.get_ident() else self.server_id

    def _sent(self, method: str, request, timeout: float | None):
        """(the push started, or None for any other request, made by the caller; the
        request as kept). A push is kept and started in one hold of the lock: a rebuild
        sends a kept push again only if it was started before, so to the server before
        (lost with it, or refused by the replacement: its retry then finds it landed)."""
        if method not in PUSHES:
            return None, self._kept(method, request)
        with self._lock:
            request = self.log.keep(method, request)
            return self.conn.future(method, request, timeout), request

    def _kept(self, method: str, request):
        if method == "CreateTable":
            self.created[(request.spec.name, request.shard_index)] = request
            self.deleted.discard(request.spec.name)
        elif method in ("InitRows", "ImportRows"):
            self.written.add(_table_of(request))
        elif method == "DeleteTable":
            for key in [k for k in self.created if k[0] == request.table]:
                del self.created[key]
            self.deleted.add(request.table)
        return request

    def future(self, method: str, request, timeout: float | None = None):
        started, request = self._sent(method, request, timeout)
        return started if started is not None else self.conn.future(method, request, timeout)

    def result(self, future, method: str, request, table=None, timeout: float | None = None,
               done_on_retry: tuple = ()):
        if future is None:  # (the call is made now: `many_calls._in_flight`'s last)
            future, request = self._sent(method, request, timeout)
        return self._answer(method, request, table, timeout, done_on_retry, future)

    def call(self, method: str, request, table=None, timeout: float | None = None,
             done_on_retry: tuple = (), pending=None):
        if pending is None:
            pending, request = self._sent(method, request, timeout)
        return self._answer(method, request, table, timeout, done_on_retry, pending)

    def _answer(self, method: str, request, table, timeout, done_on_retry, pending):
        while True:
            try:
                if pending is False:  # (sent before: a repeat counts as done)
                    return _again(self.conn, method, request, table, timeout, done_on_retry)
                return self.conn.call(method, request, table, timeout, done_on_retry,
                                      pending, gone=_gone)
            except ServerError as err:
                if not self.lost(err) or method == "DeleteTable":
                    raise
                if self.recover(err) and method in PUSHES:
                    return None  # sent again by `recover` (as a retry that found it landed)
            pending = False

    def lost(self, err: ServerError) -> bool:
        """Whether `err` may mean the server is gone or another now (`recover` tells): it did
        not answer (UNAVAILABLE), or it does not know a table this worker created or pushed
        to (NOT_FOUND)."""
        if err.code == grpc.StatusCode.UNAVAILABLE:
            return True
        if err.code != grpc.StatusCode.NOT_FOUND:
            return False
        known = {t for t, _ in self.created} | self.log.tables()
        return any(repr(name) in str(err) for name in known)

    def recover(self, err: ServerError, wait_s: float | None = None) -> bool:
        """Wait for the server to serve again; if it is another (a replacement), rebuild this
        worker's shards there: create the tables (a replacement restores each shard from its
        newest checkpoint and answers its step and checkpoint), send again every kept push
        of a step not applied there. Whether it rebuilt (False: the same server, only
        unreachable for a while or rebuilt already, or a NOT_FOUND of its own). A
        replacement lost in turn is waited for again, within REPLACEMENT_WAIT_S from the
        first loss not recovered from (whichever thread saw it: a server dead for good is
        not waited for once per thread)."""
        with self._lock:
            if self._lost_at is None:
                self._lost_at = time.monotonic()
            started = self._lost_at
            while True:
                try:
                    self.conn.wait_healthy(max(1.0, REPLACEMENT_WAIT_S - (time.monotonic()
                                                                          - started)))
                    identity = self.conn.identity()
                    if identity and identity == self.server_id:
                        self._lost_at = None
                        if err.code == grpc.StatusCode.NOT_FOUND:
                            raise err  # (the same server: a table deleted, not a restart)
                        return False
                    log.warning("server %s: %s; it serves again as another process: sending "
                                "it this worker's pushes since its checkpoint", self.address,
                                err)
                    sent = self._rebuild_on(identity, wait_s)
                    self._lost_at = None
                    break
                except ServerError as again:
                    if again.code != grpc.StatusCode.UNAVAILABLE or again is err or \
                            time.monotonic() - started > REPLACEMENT_WAIT_S:
                        raise
                    log.warning("server %s was lost again while this worker rebuilt its "
                                "shards there (%s); waiting for it again", self.address, again)
            log.warning("server %s serves again: %d push(es) of this worker sent again, "
                        "%.1fs after the loss was seen", self.address, sent,
                        time.monotonic() - started)
        return True

    def note_identity(self) -> None:
        """Ask the server's identity once, after this worker created its tables there, and
        watch it (`_Watch`; not without a data plane)."""
        if not self.server_id:
            self.server_id = self.conn.identity()
            if self.server_id and self.options.data_plane and self._watch is None:
                self._watch = _Watch(self)

    def _rebuild_on(self, identity: int, wait_s: float | None) -> int:
        """`_rebuild` on server process `identity`, which only this thread's calls ask for
        until it is done (the others' are refused there and wait for it). The data plane
        of the process before is forgotten; a save waits for the other workers' pushes
        first (`unreplayed`)."""
        self._rebuilder, self._rebuilding = threading.get_ident(), identity
        self.conn.forget_plane()
        try:
            sent = self._rebuild(wait_s)
        finally:
            self._rebuilder = None
        self.server_id, self.unreplayed = identity, True
        self.rebuilds += 1
        return sent

    def _rebuild(self, wait_s: float | None = None) -> int:
        """One try of `recover` on a replacement; the pushes sent again (`wait_s`: the most
        a push may wait for the other workers' pushes of the step before it)."""
        restored = {}
        for key, request in list(self.created.items()):
            reply = self.conn.call("CreateTable", request, key[0])
            restored[key] = reply.restored_from  # (also for a shard another worker created)
        steps = self._steps()
        self._check_restored(steps, restored)
        again = self.log.since(steps, self.address, self.deleted)
        for method, request in again:
            self._send_again(method, request, wait_s)
        return len(again)

    def wait_replayed(self, wait_s: float | None = None) -> None:
        """Wait until every step this worker pushed here is applied (every worker has sent
        its pushes again): a save must not catch the rebuilt shards behind the others."""
        rebuilds = self.rebuilds
        for (table, shard), step in sorted(self._last_steps().items()):
            self.conn.call("WaitStep", ps_pb2.StepRequest(table=table, shard_index=shard,
                                                          min_step=step + 1), table, wait_s)
        self.unreplayed = self.rebuilds != rebuilds  # (rebuilt again meanwhile: wait again)

    def _last_steps(self) -> dict[tuple[str, int], int]:
        """`PushLog.last_steps` but for the tables this worker deleted since."""
        return {k: v for k, v in self.log.last_steps().items() if k[0] not in self.deleted}

    def _check_restored(self, steps: dict[tuple[str, int], int],
                        restored: dict[tuple[str, int], str | None]) -> None:
        """Raise unless every shard this worker pushed to came back from a checkpoint its
        pushes follow (`Timeline.allows`; one at step 0 that this worker did not create
        again: created anew), and no rows written since the last save (InitRows, ImportRows)
        are missing: the replay would train on other rows."""
        pushed = self.log.tables()
        for (table, shard), step in sorted(steps.items()):
            if table in self.written:
                why = ("rows were written into it (initial values, a reshard, a restore from "
                       "a file) since the last checkpoint on disk")
            elif table not in pushed:
                continue
            else:
                name = restored.get((table, shard))
                why = self.timeline.allows(name) if name is not None else \
                    ("it is at step 0: created anew" if step == 0 else "")
            if why:
                raise ReplayError(
                    f"server {self.address} serves again, but table {table!r} shard {shard} "
                    f"there cannot be rebuilt from this worker's pushes: {why}. A lost server "
                    f"is started again with parallax_ps --restore-newest and its data "
                    f"directory (as `parallax run --replay-mb` does; `parallax k8s "
                    f"--replay-mb`: a container restarted in its pod, from a checkpoint saved "
                    f"since the pod started) from the newest checkpoint on disk; "
                    f"--max-restarts restarts the job from its checkpoint instead",
                    address=self.address, table=table, code=grpc.StatusCode.DATA_LOSS)

    def _steps(self) -> dict[tuple[str, int], int]:
        """The steps each shard this worker pushed to has applied there, once it exists (a
        table created by another worker: once that worker has created it again)."""
        shards = set(self._last_steps()) | set(self.created)
        return {(t, s): self._step(t, s) for t, s in sorted(shards)}

    def _step(self, table: str, shard: int) -> int:
        request = ps_pb2.StepRequest(table=table, shard_index=shard, min_step=0)
        deadline = time.monotonic() + REPLACEMENT_WAIT_S
        while True:
            try:
                return self.conn.call("WaitStep", request, table).step
            except ServerError as err:
                if err.code != grpc.StatusCode.NOT_FOUND or time.monotonic() > deadline:
                    raise
            time.sleep(NOT_CREATED_PAUSE_S)

    def _send_again(self, method: str, request, wait_s: float | None = None) -> None:
        try:
            self.conn.call(method, request, None, None, _REPEAT)
        except ServerError as err:
            if err.code in _REPEAT:
                return  # it holds this push already (it was never lost)
            if not is_behind(err):
                raise
            caught_up(self.conn, err, method, request, None, wait_s, _REPEAT)

    def forget(self) -> None:
        """After a restore (a rollback): the kept pushes and written tables are of steps
        taken again from it, never to be sent again."""
        with self._lock:
            self.log.clear()
            self.written.clear()

    def stop_watching(self) -> None:
        if self._watch is not None:
            self._watch.close()


class _Watch:
    """A thread that sleeps on an idle data-plane connection to the server the shards are
    on (in recv: no CPU, no request), for the life of the route. The server's death closes
    it: the thread then rebuilds this worker's shards on the replacement at once
    (`ReplayedConnection.recover`, its waits for the other workers bounded by
    SAVE_WAIT_S, tried again while they fail), not at this worker's next request there,
    which can wait for another worker that waits for these pushes (a save). A connection
    the server closed as idle, or a failed reconnection to the same server, is opened
    again (after WATCH_RETRY_S, growing). A host that vanishes without closing it is found
    by the next request instead."""

    def __init__(self, route: ReplayedConnection) -> None:
        self.route, self.closed = route, False
        self._sock = None
        self._unrebuilt: grpc.RpcError | None = None  # a loss whose rebuild failed: again
        self._lock = threading.Lock()
        threading.Thread(target=self._run, daemon=True,
                         name=f"parallax-replay-watch {route.address}").start()

    def _run(self) -> None:
        pause = WATCH_RETRY_S
        while not self.closed:
            sock = self._connected()
            if sock is not None:
                pause = WATCH_RETRY_S
                _sleep_until_closed(sock)
                continue
            if not self.closed:
                time.sleep(pause)
                pause = min(2 * pause, WATCH_RETRY_MAX_S)

    def _connected(self):
        """A connection to the route's server process to sleep on; None after a failure
        (a loss is recovered from first)."""
        if self._unrebuilt is not None:
            self._lost(self._unrebuilt)
            return None
        plane = self.route.conn.data_plane_of(self.route.server_id) if not self.closed \
            else None
        if plane is None:
            return None  # (being found by another thread, or none at the moment)
        try:
            sock = plane.connect()  # (to the same server process only)
        except grpc.RpcError as err:  # (the plane is forgotten by a rebuild, if one is due)
            self._lost(err)
            return None
        with self._lock:
            if self.closed:
                close_quietly(sock)
                return None
            self._sock = sock
        return sock

    def _lost(self, err: grpc.RpcError) -> None:
        if self.closed:
            return
        loss = ServerError(f"server {self.route.address} was lost ({err.details()})",
                           address=self.route.address, table=None,
                           code=grpc.StatusCode.UNAVAILABLE)
        try:
            self.route.recover(loss, SAVE_WAIT_S)
            self._unrebuilt = None
        except Exception as failed:  # noqa: BLE001 - the next request meets it, and raises
            first, self._unrebuilt = self._unrebuilt is None, err
            if self.closed:
                return
            if isinstance(failed, ReplayError) or getattr(failed, "code", None) in _FINAL:
                log.warning("server %s: this worker cannot rebuild its shards there (%s); "
                            "it stops watching it (its next request there fails so)",
                            self.route.address, failed)
                self.closed = True
            elif first:
                log.warning("server %s: this worker could not rebuild its shards there yet "
                            "(%s); trying again", self.route.address, failed)

    def close(self) -> None:
        with self._lock:
            self.closed = True
            sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # (wakes the thread's recv)
            except OSError:
                pass


def _sleep_until_closed(sock) -> None:
    """Return once the peer closed `sock` (or sent anything: it never answers unasked)."""
    try:
        sock.settimeout(None)
        sock.recv(1)
    except OSError:
        pass
    close_quietly(sock)


def _table_of(request) -> str:
    """The table an InitRows or ImportRows request (or its stream's first chunk) writes."""
    first = next(iter(request())) if callable(request) else request
    if isinstance(first, (list, tuple)):
        first = first[0]
    return getattr(first, "table", "") or getattr(first, "name", "")


def _again(conn, method: str, request, table, timeout, done_on_retry):
    """A request sent again after its server was found the same: an answer in
    `done_on_retry` (a push it holds, a step it closed) means the first attempt landed."""
    try:
        return conn.call(method, request, table, timeout, done_on_retry)
    except ServerError as err:
        if err.code in done_on_retry and not is_behind(err):
            return None
        raise


def _gone() -> bool:
    """After an UNAVAILABLE, no retries of the connection's own: `recover` waits for the
    server (a retry could reach its replacement before this worker's pushes did, and be
    held there for a step that only those pushes close)."""
    return True


def resumed(tables, checkpoint: str) -> None:
    """Every worker of a job resumed from `checkpoint` (the chief restored it): a
    replacement may restore it, and pushes kept before it are of abandoned steps. (Only the
    chief's client restores; the others learn it here.)"""
    conns = {id(c): c for table in tables for c in table.shards
             if isinstance(c, ReplayedConnection)}
    for conn in conns.values():
        conn.timeline.restored([checkpoint])
        conn.forget()


def replayed(servers: list, replay_mb: int, timeline: Timeline) -> list:
    """Per server, what its shards' requests go through (replay_mb > 0)."""
    share = (replay_mb << 20) // max(1, len(servers))
    log.info("keeping this worker's pushes, up to %d MiB per server, to send them again to a "
             "server started again from its newest checkpoint (replay_mb=%d)", share >> 20,
             replay_mb)
    return [ReplayedConnection(server, share, timeline) for server in servers]
